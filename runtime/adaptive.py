"""Adaptive draft depth: draft only as deep as the measured costs and acceptance pay for.

For each draft tag (the drafter's name, or the n-gram match length for prompt lookup) the
policy keeps the acceptance rate at each draft position, alpha_i = P(draft i kept | drafts
before it kept), as an exponential moving average. Depth k is then worth

    E(k) / (T_verify(1+k) + k · t_draft),   E(k) = 1 + sum_{i<=k} prod_{j<=i} alpha_j,

with T_verify the time of the verify engine that holds 1+k tokens and t_draft the time per
draft token, both measured at build time and recorded in the manifest (so a seeded run makes
the same choices every time). k = 0 (plain decoding) wins when drafts are too often wrong for
what they cost, so a poor drafter never makes decoding much slower than the target alone;
every ``probe_every`` rounds that chose 0 for a tag, the full draft is verified anyway so the
estimate can recover. A policy lives for one generation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from specexport.runtime.acceptance import Draft


@dataclass
class _TagStats:
    alpha: np.ndarray  # [D] conditional acceptance per position; NaN where never drafted
    skipped: int = 0  # rounds in a row that chose depth 0

    def estimate(self, prior: float) -> np.ndarray:
        """Per-position acceptance; a position never drafted borrows its predecessor's."""
        filled = self.alpha.copy()
        previous = prior
        for i, value in enumerate(filled):
            if np.isnan(value):
                filled[i] = previous
            previous = filled[i]
        return filled


@dataclass
class DepthPolicy:
    max_depth: int
    verify_cost: Callable[[int], float | None]  # tokens -> seconds of that verify (None: unknown)
    draft_cost: float = 0.0  # seconds per draft token
    decay: float = 0.8  # weight of the past in the moving averages
    prior: float = 0.8  # optimistic start: draft until measured otherwise
    probe_every: int = 8
    _tags: dict[str, _TagStats] = field(default_factory=dict)

    def _stats(self, tag: str) -> _TagStats:
        if tag not in self._tags:
            self._tags[tag] = _TagStats(np.full(self.max_depth, np.nan))
        return self._tags[tag]

    def best_depth(self, tag: str, limit: int, sunk: bool = False) -> int:
        """The depth <= limit with the best expected tokens per second. ``sunk``: the drafts
        already exist, so only the verify cost counts."""
        if limit <= 0:
            return 0
        base = self.verify_cost(1)
        if not base:
            return limit
        stats = self._stats(tag)
        expected = 1.0 + np.cumsum(np.cumprod(stats.estimate(self.prior)[:limit]))  # E(k), k = 1..limit
        best_k, best_rate = 0, 1.0 / base
        for k in range(1, limit + 1):
            cost = self.verify_cost(1 + k)
            if not cost:
                return limit  # no measurement: draft as asked
            cost += 0.0 if sunk else k * self.draft_cost
            rate = expected[k - 1] / cost
            if rate > best_rate:
                best_k, best_rate = k, rate
        if best_k == 0:
            stats.skipped += 1
            if stats.skipped >= self.probe_every:
                stats.skipped = 0
                return limit
        else:
            stats.skipped = 0
        return best_k

    def trim(self, draft: Draft, planned_tag: str) -> Draft:
        """Keep the best prefix of a draft that already exists, when its tag says more than
        the one its depth was planned with (prompt lookup: the match length it found)."""
        if not draft.tag or draft.tag == planned_tag:
            return draft
        keep = self.best_depth(draft.tag, draft.size, sunk=True)
        if keep >= draft.size:
            return draft
        return Draft(draft.tokens[:keep], None if draft.probs is None else draft.probs[:keep], draft.tag)

    def update(self, tag: str, proposed: int, accepted: int) -> None:
        if proposed == 0:
            return
        stats = self._stats(tag)
        reached = min(accepted + 1, proposed)  # positions whose fate was decided
        kept = (np.arange(reached) < accepted).astype(float)  # [reached] 1 for the accepted ones
        seen = stats.alpha[:reached]
        # a first observation moves the prior like any other: one rejection is not a verdict
        start = np.where(np.isnan(seen), self.prior, seen)
        stats.alpha[:reached] = self.decay * start + (1 - self.decay) * kept
