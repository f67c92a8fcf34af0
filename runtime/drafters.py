"""Drafters: propose k tokens after a context; only the target decides what is kept.

Every drafter has ``propose(context, k, sampling, rng) -> Draft`` and ``accept(n, next_token,
target_out)`` (told how many drafts the target kept, so it can resync its own state), and
``reset(prompt, target_out)``. A drafter that reads the target's hidden states names the target
outputs it needs (``needs``); the decode loop asks the target's graphs for them and hands the
drafter the rows of the positions just committed (runtime/api.py DRAFTER_FACTORIES maps a
manifest drafter kind to its factory).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from specexport.runtime.acceptance import EMPTY_DRAFT, Draft, Kept, Sampling, warp_row
from specexport.runtime.runner import ModelRunner

TargetOut = Mapping[str, np.ndarray]  # target output name -> [n, ...] rows of committed positions


@dataclass(frozen=True)
class DraftCost:
    """Which graphs a round that drafts k > 0 tokens runs, for the bench's prediction: the
    ``per_round`` graph once (a chain head's catch-up, a block head's block), which already
    gives ``first_drafts`` drafts, then the ``per_draft`` graph for each further draft.
    Each part is (runner, engine size); None: no such graph."""

    per_draft: tuple[Any, int] | None = None
    per_round: tuple[Any, int] | None = None
    first_drafts: int = 0

    def seconds(self, k: int, draft_s: float, round_s: float) -> float:
        """Engine time of drafting ``k`` tokens, given one run of each part."""
        if k <= 0:
            return 0.0
        further = max(k - self.first_drafts, 0) if self.per_draft else 0
        return (round_s if self.per_round else 0.0) + further * draft_s


NO_COST = DraftCost()


class Drafter(Protocol):
    name: str
    # target outputs this drafter reads (e.g. AUX_HIDDEN_STATES); empty for most drafters
    needs: tuple[str, ...]

    @property
    def engine_seconds(self) -> float:
        """Seconds inside the drafter's engines so far (0 without any): the rest is host work."""

    @property
    def draft_cost(self) -> DraftCost:
        """The graphs a round of drafting runs (NO_COST for drafters without engines)."""

    def reset(self, prompt: np.ndarray, target_out: TargetOut) -> None:
        """Start a new sequence (neural drafters prefill the prompt here). ``target_out``: the
        needed outputs of the target's prefill, rows for prompt[:-1] (the last prompt token
        opens round one). Arrays are valid during the call only: copy what you keep."""

    def propose(self, context: np.ndarray, k: int, sampling: Sampling, rng: np.random.Generator) -> Draft: ...

    def accept(self, n_accepted: int, next_token: int, target_out: TargetOut) -> None:
        """The target kept ``n_accepted`` drafts and chose ``next_token`` after them.
        ``target_out``: the needed outputs of the verify pass for the committed positions only,
        1 + n_accepted rows (the round's first token and the accepted drafts), never a
        rejected one."""


class NoDrafter:
    """The target alone: every round verifies one token. The baseline, through the same engines."""

    name = "none"
    needs: tuple[str, ...] = ()
    engine_seconds = 0.0
    draft_cost = NO_COST

    def reset(self, prompt: np.ndarray, target_out: TargetOut) -> None:
        pass

    def propose(self, context, k, sampling, rng) -> Draft:
        return EMPTY_DRAFT

    def accept(self, n_accepted: int, next_token: int, target_out: TargetOut) -> None:
        pass


class NgramDrafter:
    """Prompt lookup: find the context's last n tokens earlier in the context (longest n
    first, latest occurrence that still has k tokens after it) and propose what followed."""

    needs: tuple[str, ...] = ()
    engine_seconds = 0.0
    draft_cost = NO_COST

    def __init__(self, name: str = "ngram", max_ngram: int = 3, min_ngram: int = 1):
        self.name = name
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def reset(self, prompt: np.ndarray, target_out: TargetOut) -> None:
        pass

    def propose(self, context: np.ndarray, k: int, sampling, rng) -> Draft:
        size = len(context)
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if size <= n or k <= 0:
                continue
            suffix = context[size - n :]  # [n]
            # window i is context[i:i+n]; windows end before the last token, so each has a
            # continuation
            windows = sliding_window_view(context[: size - 1], n)  # [size-n, n]
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if hits.size == 0:
                continue
            full = hits[hits + n + k <= size]
            start = int(full[-1] if full.size else hits[0]) + n
            return Draft(np.array(context[start : start + k], dtype=np.int64), tag=f"{self.name}/n{n}")
        return EMPTY_DRAFT

    def accept(self, n_accepted: int, next_token: int, target_out: TargetOut) -> None:
        pass


class ModelDrafter:
    """A neural drafter (external draft model or the int4 copy of the target) with its own
    KV cache, kept in step with what the target accepted."""

    needs: tuple[str, ...] = ()

    def __init__(self, name: str, runner: ModelRunner):
        self.name = name
        self.runner = runner
        self._base = 0  # context length at the last proposal
        self._k = 0

    @property
    def engine_seconds(self) -> float:
        return self.runner.seconds

    @property
    def draft_cost(self) -> DraftCost:
        return DraftCost(per_draft=(self.runner, self.runner.engine_size(1)))  # one step per draft

    def reset(self, prompt: np.ndarray, target_out: TargetOut) -> None:
        self.runner.rewind(0)
        self.runner.forward(prompt[:-1])  # as the target: all but the last token
        self._base = self._k = 0

    def propose(self, context: np.ndarray, k: int, sampling: Sampling, rng: np.random.Generator) -> Draft:
        if k <= 0:
            self._k = 0
            return EMPTY_DRAFT
        want_logits = not sampling.greedy
        # Tokens the cache lacks: the last committed token, plus the last draft when every
        # draft was accepted, or the whole prompt at the start.
        out = self.runner.forward(context[self.runner.length :], want_logits)
        tokens = np.empty(k, dtype=np.int64)  # [k]
        probs: list[Kept] = []  # k rows: q for each draft, only the tokens it keeps (never [k, V])
        for j in range(k):
            if want_logits:
                probs.append(warp_row(out.logits[-1], sampling))
                tokens[j] = probs[-1].draw(rng)
            else:
                tokens[j] = out.next_tokens[-1]
            if j < k - 1:
                out = self.runner.forward(tokens[j : j + 1], want_logits)
        self._base, self._k = len(context), k
        return Draft(tokens, probs if want_logits else None, self.name)

    def accept(self, n_accepted: int, next_token: int, target_out: TargetOut) -> None:
        # The cache holds the context and drafts 1..k-1; keep those the target accepted.
        if self._k == 0:
            return  # nothing was drafted since the last accept: the cache is still a prefix
        self.runner.rewind(self._base + min(n_accepted, self._k - 1))
        self._k = 0

