"""Acceptance rules, pure numpy: what the target keeps of a draft.

- ``greedy``: keep drafts while they equal the target's argmax; the target's own choice at the
  first mismatch (or after the last draft: the bonus token) comes next. The output is exactly
  target-only greedy decoding.
- ``rejection``: speculative sampling. Draft token x drawn from q is kept with probability
  min(1, p(x)/q(x)); on rejection the next token is drawn from norm(max(0, p − q)); when all
  k drafts are kept a bonus token is drawn from p at position k. Every emitted token is then
  distributed exactly as the target's p. A drafter without probabilities (n-gram) is a point
  mass: q = one-hot(x).

p and q are the *warped* distributions (temperature, min-p, top-k, top-p, in vLLM's order): the output follows the
target's distribution under those settings. ``warp_reference`` states the warp in a few dense
lines; ``warp_row`` computes the same distribution as a ``Kept`` (the tokens that can be drawn
and their probabilities) without float64 or sorting work over the whole vocabulary, and the
sampler works on those kept tokens only. Ties, in both: top-k keeps every token tied with the
k-th largest logit; top-p ranks tokens by logit, equal logits by token id, and keeps the
shortest such prefix whose mass reaches top_p, where a mass within ``TOP_P_SLACK`` (relative)
of top_p counts as reaching it, so float rounding never decides a case like p = 0.5 at top_p 0.5.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from specexport.errors import BadInput
from specexport.runtime.tree import ROOT, DraftTree

TOP_P_SLACK = 1e-6  # relative; far above float32 rounding of the mass, far below any real choice


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    min_p: float = 0.0  # 0: off; keeps tokens with p >= min_p · (the most likely token's p)

    def __post_init__(self) -> None:
        if not np.isfinite(self.temperature) or self.temperature < 0:
            raise BadInput(f"--temperature must be >= 0 (got {self.temperature})")
        if self.top_k < 0:
            raise BadInput(f"--top-k must be >= 0 (got {self.top_k})")
        if not 0 < self.top_p <= 1:
            raise BadInput(f"--top-p must be in (0, 1] (got {self.top_p})")
        if not 0 <= self.min_p <= 1:
            raise BadInput(f"--min-p must be in [0, 1] (got {self.min_p})")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class Kept:
    """One warped distribution as the tokens it can draw; every other token has p = 0."""

    ids: np.ndarray | None  # [m] int64 ascending; None: the whole vocabulary, in order
    probs: np.ndarray  # [m] (or [V]) summing to 1

    def index(self, token: int) -> int | None:
        if self.ids is None:
            return token
        i = int(np.searchsorted(self.ids, token))
        return i if i < len(self.ids) and self.ids[i] == token else None

    def prob(self, token: int) -> float:
        i = self.index(token)
        return 0.0 if i is None else float(self.probs[i])

    def at(self, ids: np.ndarray | None, vocab: int) -> np.ndarray:
        """p at ``ids`` [m] (None: at every token of the vocabulary, [V])."""
        if self.ids is None:
            return self.probs if ids is None else self.probs[ids]
        if ids is None:
            return self.dense(vocab)
        i = np.minimum(np.searchsorted(self.ids, ids), len(self.ids) - 1)  # [m]
        return np.where(self.ids[i] == ids, self.probs[i], 0.0)

    def token(self, i: int) -> int:
        return i if self.ids is None else int(self.ids[i])

    def draw(self, rng: np.random.Generator) -> int:
        return self.token(_inverse_cdf(self.probs, rng))

    def dense(self, vocab: int) -> np.ndarray:
        out = np.zeros(vocab)  # [V]
        out[slice(None) if self.ids is None else self.ids] = self.probs
        return out


def as_kept(row: Kept | np.ndarray) -> Kept:
    """A dense row of probabilities [V] (need not be normalised) or a Kept, as a Kept."""
    return row if isinstance(row, Kept) else Kept(None, np.asarray(row))


@dataclass(frozen=True)
class Draft:
    """Where drafting meets verifying: k proposed tokens and the distributions they came from."""

    tokens: np.ndarray  # [k] int64
    probs: Sequence[Kept] | np.ndarray | None = None  # k rows: q each token was drawn from; None: point mass
    tag: str = ""  # what kind of guess this is (drafter, n-gram length): acceptance is tracked per tag

    @property
    def size(self) -> int:
        return len(self.tokens)

    def trimmed(self, keep: int) -> Draft:
        """The first ``keep`` drafts (a prefix of a draft is a draft: acceptance reads left to right)."""
        if keep >= self.size:
            return self
        return Draft(self.tokens[:keep], None if self.probs is None else self.probs[:keep], self.tag)


EMPTY_DRAFT = Draft(np.zeros(0, dtype=np.int64))


def warp_reference(logits: np.ndarray, sampling: Sampling) -> np.ndarray:
    """Logits [n, V] -> probabilities [n, V]: the definition, dense and in float64."""
    scaled = logits.astype(np.float64) / sampling.temperature  # [n, V]
    vocab = scaled.shape[-1]
    if sampling.min_p > 0:  # p / p_max >= min_p, in logits: scaled >= max + log(min_p)
        scaled = np.where(scaled < scaled.max(axis=-1, keepdims=True) + np.log(sampling.min_p), -np.inf, scaled)
    if 0 < sampling.top_k < vocab:
        kth = np.partition(scaled, vocab - sampling.top_k, axis=-1)[:, vocab - sampling.top_k, None]  # [n, 1]
        scaled = np.where(scaled < kth, -np.inf, scaled)
    probs = np.exp(scaled - scaled.max(axis=-1, keepdims=True))  # [n, V]
    probs /= probs.sum(axis=-1, keepdims=True)
    if sampling.top_p < 1.0:
        order = np.argsort(-probs, axis=-1, kind="stable")  # [n, V] most likely first, ties by id
        sorted_probs = np.take_along_axis(probs, order, axis=-1)
        before = np.cumsum(sorted_probs, axis=-1) - sorted_probs  # mass strictly before each
        drop_sorted = before >= sampling.top_p * (1 - TOP_P_SLACK)  # keeps the shortest prefix reaching top_p
        drop = np.zeros_like(drop_sorted)
        np.put_along_axis(drop, order, drop_sorted, axis=-1)
        probs = np.where(drop, 0.0, probs)
        probs /= probs.sum(axis=-1, keepdims=True)
    return probs


# Top-p looks for its prefix among the tokens within this many (temperature-scaled) logits of
# the max, widening until they hold the mass (past ~104, float32 exp is 0: everything counts).
# Steps of 2x: on SmolLM2's rows at T = 0.8, p = 0.95 the set that holds the mass is a few
# hundred tokens where one step of 4x would sort thousands.
_TOP_P_GAPS = (4.0, 8.0, 16.0, 128.0, np.inf)


def warp_row(logits: np.ndarray, sampling: Sampling) -> Kept:
    """Logits [V] -> the warped distribution as a Kept: warp_reference's, to float rounding
    (float32 where the whole vocabulary is touched: a probability under ~1e-38 becomes 0)."""
    x = np.asarray(logits, dtype=np.float32)  # [V]
    vocab = x.shape[-1]
    ids = None  # [m] the tokens still in play, ascending; None: all of them
    t = sampling.temperature
    floor = -np.inf  # min-p and top-k are both a lowest logit kept: the higher one applies
    if sampling.min_p > 0:
        floor = float(x.max()) + t * float(np.log(sampling.min_p))
    if 0 < sampling.top_k < vocab:
        floor = max(floor, float(np.partition(x, vocab - sampling.top_k)[vocab - sampling.top_k]))
    if floor > -np.inf:
        ids = np.flatnonzero(x >= floor)  # [m] ties with the lowest kept are all kept
        x = x[ids]
    top = float(x.max())
    if sampling.top_p < 1.0:
        # the mass to reach, over the tokens in play, from float32 exps (the kept probabilities
        # are recomputed in float64 below)
        e = _scaled_exp(x, top, t)  # [m] <= 1
        need = sampling.top_p * float(e.sum(dtype=np.float64)) * (1 - TOP_P_SLACK)
        for gap in _TOP_P_GAPS:
            # every token within the gap: a prefix of the ranking, ties included
            candidates = np.flatnonzero(x >= top - gap * t)  # [c] ascending
            everything = len(candidates) == len(x)
            if not everything and e[candidates].sum(dtype=np.float64) < need:
                continue  # too few: widen before paying for a sort
            order = candidates[np.argsort(-x[candidates], kind="stable")]  # [c] by logit, ties by id
            mass = np.cumsum(e[order], dtype=np.float64)  # [c]
            if mass[-1] >= need or everything:
                break
        before = np.concatenate(([0.0], mass[:-1]))  # [c] mass strictly before each
        keep = np.sort(order[: int(np.searchsorted(before, need, side="left"))])  # [n] ascending
        ids = keep if ids is None else ids[keep]
        x = x[keep]
    if ids is None:  # temperature only: the whole vocabulary
        e = _scaled_exp(x, top, t)  # [V]
        e /= np.float32(e.sum(dtype=np.float64))
        return Kept(None, e)
    probs = np.exp((x.astype(np.float64) - top) / t)  # [m]
    return Kept(ids, probs / probs.sum())


def _scaled_exp(x: np.ndarray, top: float, temperature: float) -> np.ndarray:
    """exp((x − top) / T) in float32, in one buffer: a fresh vocabulary-sized array per
    operation costs more than the arithmetic (page faults)."""
    e = x - np.float32(top)  # [m]
    e *= np.float32(min(1.0 / temperature, 1e30))  # a tiny T: the max alone, not 0 · inf
    return np.exp(e, out=e)


class Warped:
    """Rows of logits [n, V], each warped when it is read: rejection stops at the first
    rejected draft, so the rows after it are never paid for."""

    def __init__(self, logits: np.ndarray, sampling: Sampling):
        self.logits = logits  # [n, V]
        self.sampling = sampling

    def __len__(self) -> int:
        return len(self.logits)

    def __getitem__(self, i: int) -> Kept:
        return warp_row(self.logits[i], self.sampling)


def _inverse_cdf(weights: np.ndarray, rng: np.random.Generator) -> int:
    """Index of one draw from weights [m] (need not be normalised)."""
    cdf = np.cumsum(weights, dtype=np.float64)  # [m]
    i = int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))
    # u · total can round up to the total: then the last index that can be drawn
    return i if i < len(cdf) else int(np.flatnonzero(weights)[-1])


def greedy(draft_tokens: np.ndarray, target_choice: np.ndarray) -> tuple[int, int]:
    """draft_tokens [k]; target_choice [k+1], the target's argmax after each prefix.

    Returns (accepted drafts, next token)."""
    k = len(draft_tokens)
    mismatch = np.flatnonzero(draft_tokens != target_choice[:k])
    n = int(mismatch[0]) if mismatch.size else k
    return n, int(target_choice[n])


def rejection(draft: Draft, target: Sequence, rng: np.random.Generator) -> tuple[int, int]:
    """draft: k tokens (+ q per token); target: k+1 rows, the warped p after each prefix (Kept
    rows, e.g. ``Warped``, or dense [V] arrays). Only the rows up to the first rejection are read.

    Returns (accepted drafts, next token)."""
    for i, token in enumerate(draft.tokens.tolist()):
        p = as_kept(target[i])
        q = None if draft.probs is None else as_kept(draft.probs[i])
        q_token = 1.0 if q is None else q.prob(token)
        # accept with probability min(1, p/q); u in [0, 1) so p = 0 is always rejected
        if rng.random() * q_token < p.prob(token):
            continue
        # the residual max(0, p − q) is 0 wherever p is: work on p's kept tokens only
        if q is None:
            residual = p.probs.copy()  # [m] max(0, p − onehot) is p without the token
            at = p.index(token)
            if at is not None:
                residual[at] = 0.0
        else:
            residual = np.maximum(p.probs - q.at(p.ids, len(p.probs)), 0.0)  # [m]
        if residual.sum() <= 0.0:  # p ≤ q everywhere only when p == q: rejection had probability 0
            residual = p.probs
        return i, p.token(_inverse_cdf(residual, rng))
    return draft.size, as_kept(target[draft.size]).draw(rng)


def tree_greedy(tree: DraftTree, choice: Callable[[int], int]) -> tuple[list[int], int]:
    """``choice(r)``: the target's argmax at row r (0: the root, 1+i: node i), read lazily.
    Returns (the accepted nodes, root to leaf; the next token)."""
    node, path = ROOT, []
    while True:
        chosen = choice(node + 1)
        match = next((c for c in tree.children(node) if int(tree.tokens[c]) == chosen), None)
        if match is None:
            return path, chosen
        node = match
        path.append(node)


def tree_rejection(tree: DraftTree, target: Callable[[int], Kept | np.ndarray],
                   rng: np.random.Generator) -> tuple[list[int], int]:
    """``target(r)``: the warped p at row r (a Kept or a dense [V] row), read lazily. The
    module docstring states the rule. Returns (the accepted nodes, the next token)."""
    node, path = ROOT, []
    while True:
        p = as_kept(target(node + 1))
        probs = np.array(p.probs, dtype=np.float64)  # [m] what is left of p at this node
        for child in tree.children(node):
            at = p.index(int(tree.tokens[child]))
            mass = probs.sum()
            # one draw per child tried, even one p cannot draw (accepted with probability 0):
            # so on a chain this is the chain rule, draw for draw (acceptance.rejection)
            u = rng.random()
            if at is not None and u * mass < probs[at]:
                break  # accepted: descend
            if at is not None:
                probs[at] = 0.0  # rejected: the residual norm(max(0, p − δ_x)) is p without x
        else:
            return path, p.token(_inverse_cdf(probs, rng))
        node = child
        path.append(node)


class ScoredRows(Protocol):
    """A verify pass's rows for one proposal (row 0 the root, 1+i node i) after the logits stage
    (runtime/target_rows.py): the target's choice and its warped distribution at each row."""

    def argmax(self, r: int) -> int:
        """The target's greedy choice at row r."""

    def argmaxes(self, n: int) -> np.ndarray | None:
        """[n] the choices at rows 0..n-1 at once where no rule changes them (None: read each)."""

    def __getitem__(self, r: int) -> Kept:
        """The target's warped p at row r."""


def accept(proposal: DraftTree, rows: ScoredRows, sampling: Sampling, rng: np.random.Generator) -> tuple[list[int], int]:
    """The one acceptance entry point: what the target keeps of a proposal, given its scored
    rows. Greedy: the drafts the target's argmax follows. Sampled: rejection sampling against
    the q a chain was drawn from (point masses where it was chosen, not drawn), or the tree
    rule over siblings. Returns (the accepted nodes, root to leaf; the next token)."""
    if sampling.greedy:
        if proposal.is_chain:
            n, token = chain_greedy(proposal.tokens, rows)
            return list(range(n)), token
        return tree_greedy(proposal, rows.argmax)
    if proposal.is_chain:
        n, token = rejection(Draft(proposal.tokens, proposal.probs), rows, rng)
        return list(range(n)), token
    return tree_rejection(proposal, rows.__getitem__, rng)


def chain_greedy(tokens: np.ndarray, rows: ScoredRows) -> tuple[int, int]:
    """Greedy over a chain: the graph's argmax rows at once where no rule changes them, else
    row by row (a rule's rows after the first mismatch are never paid for)."""
    choices = rows.argmaxes(len(tokens) + 1)  # [k+1]
    if choices is not None:
        return greedy(tokens, choices)
    for i, token in enumerate(tokens.tolist()):
        choice = rows.argmax(i)
        if choice != token:
            return i, choice
    return len(tokens), rows.argmax(len(tokens))
