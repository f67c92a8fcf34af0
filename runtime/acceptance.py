"""Acceptance rules, pure numpy: what the target keeps of a draft.

- ``greedy``: keep drafts while they equal the target's argmax; the target's own choice at the
  first mismatch (or after the last draft: the bonus token) comes next. The output is exactly
  target-only greedy decoding.
- ``rejection``: speculative sampling. Draft token x drawn from q is kept with probability
  min(1, p(x)/q(x)); on rejection the next token is drawn from norm(max(0, p − q)); when all
  k drafts are kept a bonus token is drawn from p at position k. Every emitted token is then
  distributed exactly as the target's p. A drafter without probabilities (n-gram) is a point
  mass: q = one-hot(x).

p and q are the *warped* distributions (temperature, top-k, top-p applied by ``warp``): the
output follows the target's distribution under those settings.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specexport.errors import BadInput


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off

    def __post_init__(self) -> None:
        if not np.isfinite(self.temperature) or self.temperature < 0:
            raise BadInput(f"--temperature must be >= 0 (got {self.temperature})")
        if self.top_k < 0:
            raise BadInput(f"--top-k must be >= 0 (got {self.top_k})")
        if not 0 < self.top_p <= 1:
            raise BadInput(f"--top-p must be in (0, 1] (got {self.top_p})")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class Draft:
    """Where drafting meets verifying: k proposed tokens and the distributions they came from."""

    tokens: np.ndarray  # [k] int64
    probs: np.ndarray | None = None  # [k, V] q that each token was sampled from; None: point mass
    tag: str = ""  # what kind of guess this is (drafter, n-gram length): acceptance is tracked per tag

    @property
    def size(self) -> int:
        return len(self.tokens)


EMPTY_DRAFT = Draft(np.zeros(0, dtype=np.int64))


def warp(logits: np.ndarray, sampling: Sampling) -> np.ndarray:
    """Logits [n, V] -> probabilities [n, V] after temperature, top-k and top-p."""
    scaled = logits.astype(np.float64) / sampling.temperature  # [n, V]
    vocab = scaled.shape[-1]
    if 0 < sampling.top_k < vocab:
        kth = np.partition(scaled, vocab - sampling.top_k, axis=-1)[:, vocab - sampling.top_k, None]  # [n, 1]
        scaled = np.where(scaled < kth, -np.inf, scaled)
    probs = np.exp(scaled - scaled.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    if sampling.top_p < 1.0:
        order = np.argsort(-probs, axis=-1, kind="stable")  # [n, V] most likely first
        sorted_probs = np.take_along_axis(probs, order, axis=-1)
        before = np.cumsum(sorted_probs, axis=-1) - sorted_probs  # mass strictly before each
        drop_sorted = before >= sampling.top_p  # keeps the smallest prefix reaching top_p
        drop = np.zeros_like(drop_sorted)
        np.put_along_axis(drop, order, drop_sorted, axis=-1)
        probs = np.where(drop, 0.0, probs)
        probs /= probs.sum(axis=-1, keepdims=True)
    return probs


def sample(probs: np.ndarray, rng: np.random.Generator) -> int:
    """One draw from a distribution [V] (need not be normalised) by inverse CDF."""
    cdf = np.cumsum(probs)
    index = int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))
    return min(index, len(probs) - 1)


def greedy(draft_tokens: np.ndarray, target_choice: np.ndarray) -> tuple[int, int]:
    """draft_tokens [k]; target_choice [k+1], the target's argmax after each prefix.

    Returns (accepted drafts, next token)."""
    k = len(draft_tokens)
    mismatch = np.flatnonzero(draft_tokens != target_choice[:k])
    n = int(mismatch[0]) if mismatch.size else k
    return n, int(target_choice[n])


def rejection(draft: Draft, target_probs: np.ndarray, rng: np.random.Generator) -> tuple[int, int]:
    """draft: k tokens (+ q [k, V]); target_probs [k+1, V], warped p after each prefix.

    Returns (accepted drafts, next token)."""
    for i, token in enumerate(draft.tokens):
        p = target_probs[i]  # [V]
        q_token = 1.0 if draft.probs is None else float(draft.probs[i, token])
        # accept with probability min(1, p/q); u in [0, 1) so p = 0 is always rejected
        if rng.random() * q_token < p[token]:
            continue
        if draft.probs is None:
            residual = p.copy()
            residual[token] = 0.0  # max(0, p − onehot) is p without the token
        else:
            residual = np.maximum(p - draft.probs[i], 0.0)
        if residual.sum() <= 0.0:  # p ≤ q everywhere only when p == q: rejection had probability 0
            residual = p
        return i, sample(residual, rng)
    return draft.size, sample(target_probs[draft.size], rng)
