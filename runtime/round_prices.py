"""What a round costs, checked against the clock while decoding.

Adaptive depth chooses a round's depth by its price: the verify graph that runs 1 + k tokens plus
the drafter's round at depth k (``Drafter.round_cost``), from costs measured at build or by
``specexport tune``. Those can be wrong here and now: tuned on a busy machine, a drafter whose
host work the graphs' costs leave out, a server whose load changed. So the loop tells the prices
what each round took, by its kind (batch size, depth; one drafter per loop). Once ``window``
rounds of a kind ran, a price off the median of the last ``window`` by more than ``margin``
(either way) is replaced by that median; it goes back to the price only when the two agree
within ``settle`` (hysteresis, so a choice does not thrash around the margin). The median of a
few recent rounds follows a machine that gets busier or quieter within a few rounds, and one
slow round (a page fault, another process) does not move it.

A drafting kind not yet run is priced as the nearest drafting kind that was measured at that
batch size says: its price times that kind's measured over priced where that price was
replaced, else the price as it is (a drafter slower than its price is slower at every depth, and
one measured right at a depth is right at the next). Before any drafting kind is measured there,
the target alone's measured over priced scales them down where it is under 1 (a price too high
is never run, so never corrected; one too low is run and measured): engines built on a busy machine
priced every round of SmolLM2 with its int4 copy 1.5x too high, the target alone's was replaced
within a few plain rounds, and its drafting rounds, priced as built against it, were never run,
so never measured (E[L] 1.02 on the demo's code edit, where the copy keeps 3 drafts a round).
Depth 0, the target alone, is measured by
the rounds that choose it and by adaptive depth's occasional plain rounds, so drafting is
compared with what the target alone does now, not with what it did at build.

A replaced price that no round has refreshed for ``expire`` rounds (of any kind) is forgotten: a
kind priced out of use is never run, so without that, a machine that got quieter since (or a
measurement taken in a bad moment) would keep its rounds out of use for good. Prices kept across
requests (a pipeline's loops share them) forget sooner: a new request starts without replaced
prices older than ``fresh`` rounds (``forget_stale``). A plain round measured at 38 ms while
another process ran, then never run again because drafting looked a clear win against it, would
otherwise have opened every later request as if the target alone were four times slower.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

Kind = tuple[int, int]  # (built batch size, depth: drafts per row, the round's widest)


@dataclass
class _Measured:
    last: deque[float]  # seconds of the last rounds of this kind
    rounds: int = 0
    replaced: bool = False  # the measurement stands in for the price
    at: int = 0  # the prices' round count when this kind was last measured

    @property
    def seconds(self) -> float:
        # the median of a few floats, read several times a round: sorted() is ~20x np.median's speed
        ordered = sorted(self.last)
        mid = len(ordered) // 2
        return ordered[mid] if len(ordered) % 2 else 0.5 * (ordered[mid - 1] + ordered[mid])


@dataclass
class RoundPrices:
    priced: Callable[[int, int], float | None]  # (batch, depth) -> seconds from the engines' costs
    # replace a price off the clock by more than this factor (the floor compares rates a few
    # percent apart: a build's costs timed over a half-full cache overprice a short context's
    # rounds by 20-30% on ort-gqa graphs), and return to it within the other
    margin: float = 1.1
    settle: float = 1.05
    window: int = 3  # rounds of a kind whose median is its measurement
    expire: int = 128  # rounds after which a replaced price no round refreshed is forgotten
    fresh: int = 32  # ... and after which a new request no longer starts from it (forget_stale)
    _kinds: dict[Kind, _Measured] = field(default_factory=dict)
    _clock: int = 0  # rounds observed, of every kind

    def seconds(self, batch: int, depth: int) -> float | None:
        """The price of a round of this kind: the measured time where the price was off, else
        the price, scaled for an unmeasured drafting kind (None: neither is known)."""
        measured = self._kinds.get((batch, depth))
        if measured is not None and measured.replaced:
            return measured.seconds
        priced = self.priced(batch, depth)
        if priced is None or depth == 0 or measured is not None and measured.rounds >= self.window:
            return priced
        return priced * self._drafting_ratio(batch, depth)

    def _drafting_ratio(self, batch: int, depth: int) -> float:
        """Measured over priced of the nearest drafting kind at ``batch`` measured a window's
        worth, where its price was replaced (1: priced right); with none measured, the target
        alone's at ``batch`` where its price was replaced (1: priced right or not measured)."""
        measured = [(abs(k - depth), k) for (b, k), m in self._kinds.items()
                    if b == batch and k > 0 and m.rounds >= self.window]
        nearest = min(measured)[1] if measured else 0
        kind = self._kinds.get((batch, nearest))
        priced = self.priced(batch, nearest)
        ratio = kind.seconds / priced if kind is not None and kind.replaced and priced else 1.0
        # the target alone's correction only lowers them: a drafting price too high is never run,
        # so never corrected; one too low is run, and measured
        return ratio if measured else min(ratio, 1.0)

    @property
    def checked(self) -> bool:
        """Whether a measurement can replace a price (an infinite margin: the prices are fixed)."""
        return self.margin != float("inf")

    def forget_stale(self) -> None:
        """Drop the replaced prices no round refreshed in the last ``fresh`` rounds (a new
        request starts: they are priced again until its own rounds measure them)."""
        self._drop_replaced(self.fresh)

    def _drop_replaced(self, older_than: int) -> None:
        """Forget the replaced prices no round refreshed in the last ``older_than`` rounds."""
        for kind in [kind for kind, m in self._kinds.items() if m.replaced and self._clock - m.at > older_than]:
            del self._kinds[kind]

    def rounds(self, batch: int, depth: int) -> int:
        """Rounds of this kind measured so far."""
        measured = self._kinds.get((batch, depth))
        return 0 if measured is None else measured.rounds

    def observe(self, batch: int, depth: int, seconds: float) -> None:
        """A round of this kind took ``seconds`` of wall time."""
        measured = self._kinds.setdefault((batch, depth), _Measured(deque(maxlen=self.window)))
        measured.last.append(seconds)
        measured.rounds += 1
        self._clock += 1
        measured.at = self._clock
        self._drop_replaced(self.expire)  # stale: priced again, so a round can measure it anew
        priced = self.priced(batch, depth)
        if not priced or measured.rounds < self.window:
            return
        ratio = measured.seconds / priced
        off = max(ratio, 1.0 / ratio)
        if off > self.margin:
            measured.replaced = True
        elif off <= self.settle:
            measured.replaced = False
