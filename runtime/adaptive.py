"""Adaptive draft depth: draft only as deep as the measured costs and acceptance pay for.

For each draft tag (the drafter's name, or the n-gram match length for prompt lookup) the
policy estimates alpha = P(a draft is kept | the drafts before it were), with exponential
forgetting. Depth k is then worth

    E(k) / (T_verify(1+k) + T_draft(k)),   E(k) = 1 + alpha + alpha² + ... + alpha^k,

with T_verify the time of the verify engine that holds 1+k tokens and T_draft(k) the
drafter's own cost of a round of depth k (``Drafter.round_cost``: a chain head's catch-up and
steps, a block head's one call, a draft model's steps; k = 0 what skipping costs it, a later
catch-up), all from costs measured at build time or by ``specexport tune`` (so a seeded run
makes the same choices every time). k = 0 (plain decoding) wins when drafts are too often wrong for
what they cost, so a poor drafter never makes decoding much slower than the target alone;
every ``probe_every`` rounds that chose 0 for a tag, the full draft is verified anyway so the
estimate can recover. A policy lives for one generation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from specexport.runtime.goodput import expected_lengths


@dataclass
class _TagStats:
    """Acceptance of one tag's drafts: each position a draft reaches is a trial; a geometric
    model (every draft kept with the same probability alpha) turns it into E(k). Every round
    updates it whatever its depth, so a depth it stopped trying is not stuck with an old
    estimate."""

    kept: float = 0.0  # exponentially forgotten counts
    trials: float = 0.0
    skipped: int = 0  # rounds in a row that chose depth 0

    def alpha(self, prior: float, prior_weight: float = 1.0) -> float:
        return (self.kept + prior * prior_weight) / (self.trials + prior_weight)


@dataclass
class DepthPolicy:
    verify_cost: Callable[[int], float | None]  # tokens -> seconds of that verify (None: unknown)
    # depth -> seconds of the drafter's round (Drafter.round_cost); at 0 what skipping costs it
    round_cost: Callable[[int], float] = lambda k: 0.0
    decay: float = 0.9  # per round: the last ten rounds or so count
    prior: float = 0.8  # optimistic start: draft until measured otherwise
    probe_every: int = 8
    _tags: dict[str, _TagStats] = field(default_factory=dict)

    def _stats(self, tag: str) -> _TagStats:
        if tag not in self._tags:
            self._tags[tag] = _TagStats()
        return self._tags[tag]

    def alpha(self, tag: str) -> float:
        """The estimated probability that a draft of ``tag`` is kept (given the ones before it were)."""
        return self._stats(tag).alpha(self.prior)

    def best_depth(self, tag: str, limit: int, sunk: bool = False) -> int:
        """The depth <= limit with the best expected tokens per second. ``sunk``: the drafts
        already exist, so only the verify cost counts."""
        if limit <= 0:
            return 0
        base = self.verify_cost(1)
        if not base:
            return limit
        stats = self._stats(tag)
        expected = expected_lengths(stats.alpha(self.prior), limit)  # E(k), k = 1..limit
        best_k, best_rate = 0, 1.0 / (base + (0.0 if sunk else self.round_cost(0)))
        for k in range(1, limit + 1):
            cost = self.verify_cost(1 + k)
            if not cost:
                return limit  # no measurement: draft as asked
            cost += 0.0 if sunk else self.round_cost(k)
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

    def update(self, tag: str, proposed: int, accepted: int) -> None:
        if proposed == 0:
            return
        stats = self._stats(tag)
        reached = min(accepted + 1, proposed)  # positions whose fate was decided
        stats.kept = self.decay * stats.kept + accepted
        stats.trials = self.decay * stats.trials + reached
