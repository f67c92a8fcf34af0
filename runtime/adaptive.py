"""Adaptive draft depth: draft only as deep as the measured costs and acceptance pay for.

Depth k of a tag's chain (the drafter's name, or the n-gram match length for prompt lookup) is
worth

    E(k) / T_round(k),   E(k) = 1 + p_1 + ... + p_k,

with E(k) from the acceptance estimate (runtime/acceptance_estimate.py) and T_round(k) the price
of a round at depth k at this batch size (runtime/round_prices.py): the verify engine that holds
1+k tokens plus the drafter's own round (``Drafter.round_cost``: a chain head's catch-up and
steps, a block head's one call, a draft model's steps; k = 0 what skipping costs it, a later
catch-up), from costs measured at build or by ``specexport tune``, and replaced by the clock's
measurement where the two disagree. k = 0 (plain decoding) wins when drafts are too often wrong
for what they cost, or when drafting is slower than the prices said: the floor that keeps
speculation from being much slower than the target alone. Every ``probe_every`` rounds that
chose 0 for a tag, a draft is verified anyway so the estimate can recover, the gap doubling after
each probe that did not bring drafting back (up to ``max_probe_gap``). A probe is as deep as
costs at most ``probe_budget`` plain rounds more than a plain round (at least one draft): a
drafter cheap to run is probed at full depth, a draft model whose every step costs half a target
step one or two drafts deep, for it pays for a probe with its catch-up of everything it skipped
as well. That catch-up also makes a probe's time no price of its kind of round, so a probe of a
drafter whose skipping costs something is not measured (``probed``). Every ``plain_every``
rounds that drafted while drafting wins by less than ``close``, one plain round measures what
the target alone costs now (a clear win needs no such check, and pays for none). A policy lives
for one generation; the prices it reads are shared by the loop's sequences.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from specexport.runtime.acceptance_estimate import AcceptanceEstimate
from specexport.runtime.round_prices import RoundPrices


@dataclass
class DepthPolicy:
    verify_cost: Callable[[int], float | None]  # tokens -> seconds of that verify (None: unknown)
    # depth -> seconds of the drafter's round (Drafter.round_cost); at 0 what skipping costs it
    round_cost: Callable[[int], float] = lambda k: 0.0
    probe_every: int = 8
    max_probe_gap: int = 32
    probe_budget: float = 1.0  # a probe costs at most this many plain rounds more than a plain round
    # a plain round after this many drafting rounds, while depth 0's measurement is young (then
    # eight times as seldom): what the target alone costs now
    plain_every: int = 4
    close: float = 1.5  # drafting's expected rate within this factor of plain decoding's: check it
    estimate: AcceptanceEstimate = field(default_factory=AcceptanceEstimate)
    prices: RoundPrices | None = None  # None: priced from the costs above, checked by this sequence alone
    checked: bool = True  # check the prices against the clock (False: fixed, a seeded run's choices repeat)
    _skipped: dict[str, int] = field(default_factory=dict)  # per tag: rounds in a row that chose depth 0
    _gap: dict[str, int] = field(default_factory=dict)  # per tag: rounds of 0 before the next probe
    _drafted: int = 0  # rounds that drafted since the last plain one
    probed: bool = False  # the last depth chosen was a probe's

    def __post_init__(self) -> None:
        if self.prices is None:
            self.prices = RoundPrices(self.priced) if self.checked else RoundPrices(self.priced, margin=float("inf"))

    def priced(self, batch: int, depth: int) -> float | None:
        """A round's price from the engines' costs: the verify of 1+depth tokens and the drafter's
        round (batch 1's, whatever the batch: a batched loop prices its own, runtime/policy.py)."""
        verify = self.verify_cost(1 + depth)
        return verify + self.round_cost(depth) if verify else None

    def best_depth(self, tag: str, limit: int, batch: int = 1, sunk: bool = False) -> int:
        """The depth <= limit with the best expected tokens per second in a round at ``batch``.
        ``sunk``: the drafts already exist, so only the verify cost counts."""
        self.probed = self.probed and sunk  # a probe's chain trimmed (sunk) is still the probe's
        if limit <= 0:
            return 0
        assert self.prices is not None
        price = (lambda k: self.verify_cost(1 + k)) if sunk else (lambda k: self.prices.seconds(batch, k))
        base = price(0)
        if not base:
            return limit
        expected = self.estimate.chain_lengths(tag, limit)  # [limit] E(k), k = 1..limit
        best_k, best_rate = 0, 1.0 / base
        for k in range(1, limit + 1):
            cost = price(k)
            if not cost:
                return limit  # no measurement: draft as asked
            rate = expected[k - 1] / cost
            if rate > best_rate:
                best_k, best_rate = k, rate
        if sunk:
            return best_k

        def probe() -> int:
            return max([1] + [k for k in range(1, limit + 1) if price(k) <= (1 + self.probe_budget) * base])
        return self._explore(tag, best_k, probe, batch, best_rate * base < self.close)

    def _explore(self, tag: str, best_k: int, probe: Callable[[], int], batch: int, close: bool = True) -> int:
        """The chosen depth, or now and then a probe (of depth ``probe()``) after ``probe_every``
        rounds of 0, or a plain round after ``plain_every`` rounds that drafted."""
        if best_k == 0:
            self._drafted = 0
            self._skipped[tag] = self._skipped.get(tag, 0) + 1
            gap = self._gap.get(tag, self.probe_every)
            if self._skipped[tag] >= gap:
                self._skipped[tag] = 0
                self._gap[tag] = min(2 * gap, self.max_probe_gap)  # if this probe does not pay either
                self.probed = True
                return probe()
            return 0
        self._skipped[tag] = 0
        self._gap.pop(tag, None)  # drafting pays again: probe soon if it stops
        self._drafted += 1
        assert self.prices is not None
        if not self.prices.checked:
            return best_k
        young = self.prices.rounds(batch, 0) < self.prices.window
        if close and self._drafted >= self.plain_every * (1 if young else 8):
            self._drafted = 0
            return 0
        return best_k
