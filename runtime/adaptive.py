"""Adaptive draft depth: draft only as deep as the measured costs and acceptance pay for.

Depth k of a tag's chain (the drafter's name, or the n-gram match length for prompt lookup) is
worth

    E(k) / T_round(k),   E(k) = 1 + p_1 + ... + p_k,

with E(k) from the acceptance estimate (runtime/acceptance_estimate.py) and T_round(k) the price
of a round at depth k at this batch size (runtime/round_prices.py): the verify engine that holds
1+k tokens plus the drafter's own round (``Drafter.round_cost``: a chain head's catch-up and
steps, a block head's one call, a draft model's steps), from costs measured at build or by
``specexport tune``, and replaced by the clock's measurement where the two disagree. k = 0 is
the verify of one token alone (priced as two where the graph pads a one-token call to two rows,
``one_token_rows``: depth 1 is then free against it and depth 0 wins only for a drafter whose
own round costs more than its drafts bring): skipping costs a drafter nothing until it drafts again, and then
its round also feeds it every token it skipped (``Drafter.catchup_cost``: a draft model's
catch-up, a few ms a token), which is added to every drafting depth's price while rounds at
depth 0 pile up. So a draft model that stopped for long comes back only for a clear win, and
the round that resumes, catching up, is no measure of its kind of round (``resumed``: the loop
does not check the prices with it), nor is a drafter's first drafting round, which feeds it the
prompt. k = 0 wins when drafts are too often wrong for what they
cost, or when drafting is slower than the prices said: the floor that keeps speculation from
being much slower than the target alone. A depth wins over 0 only by ``min_gain`` (3%): at a
break-even estimate, drafting's expected gain is nothing and its spread is a loss.

Probes: every ``probe_every`` rounds at depth 0 for a tag (the gap doubling after each probe that
did not bring drafting back, up to ``max_probe_gap``), a draft is verified anyway so the estimate
can recover, as deep as costs at most ``probe_share`` of the rounds at depth 0 before it, catch-up
included. A cheap drafter is probed at full depth; a draft model, whose catch-up alone costs more
than that share of every round it skipped, is probed once (a tag's first probe is exempt: what
stopped it may be a miss or two on little evidence) and then not again: a probe would pay for
the whole gap before it, as much as drafting all along. A drafter measured slower than it pays comes back
when its replaced price expires (RoundPrices.expire) and a round measures it anew. Every
``plain_every`` rounds that drafted while drafting wins by less than ``close``, a plain check
measures what the target alone costs now (a clear win needs no such check, and pays for none):
every 8 × ``plain_every`` rounds once depth 0 is measured, every ``plain_every`` while drafting
wins by less than ``thin`` (there a plain round costs next to nothing, and a machine that sped up
turns the thin win into a loss). A check is ``plain_run`` plain rounds: the first after drafting
ones is not measured (runtime/policy.py ``price_round``: it pays for the caches they left cold).
A policy lives for one generation; the prices it reads are shared by the loop's sequences.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from specexport.runtime.acceptance_estimate import AcceptanceEstimate
from specexport.runtime.round_prices import RoundPrices


@dataclass
class DepthPolicy:
    verify_cost: Callable[[int], float | None]  # tokens -> seconds of that verify (None: unknown)
    # depth -> seconds of the drafter's round (Drafter.round_cost; depth 0 is not read: a skip
    # costs the drafter nothing until it drafts again, catchup_cost)
    round_cost: Callable[[int], float] = lambda k: 0.0
    # rounds skipped -> seconds the next drafting round spends catching up on them (Drafter.catchup_cost)
    catchup_cost: Callable[[int], float] = lambda skipped: 0.0
    probe_every: int = 8
    max_probe_gap: int = 32
    # a probe costs at most this share of the rounds at depth 0 before it: the floor is 0.95x the
    # target alone, and probes are what a drafter that keeps losing still costs. They are also
    # how a good drafter stopped by an unlucky start comes back: at 2% SmolLM2's int4 copy stayed
    # off on code edits it keeps 5 drafts a round of (make bench: 1.12x against 1.61x)
    probe_share: float = 0.03
    # drafting must beat depth 0's expected rate by this factor: a gain of a few percent is inside
    # the estimate's error and what the prices leave out, while the loss when it is wrong is not
    min_gain: float = 1.03
    # a plain round after this many drafting rounds, while depth 0's measurement is young (then
    # eight times as seldom): what the target alone costs now
    plain_every: int = 4
    # rounds such a check runs: the first plain round after drafting ones also pays for the
    # caches they left cold (not measured, runtime/policy.py ``price_round``), the next measures
    plain_run: int = 2
    close: float = 1.5  # drafting's expected rate within this factor of plain decoding's: check it
    # ... and within this one, check it every ``plain_every`` rounds however old depth 0's
    # measurement: there a plain round costs almost nothing, and a machine that sped up since
    # (this VM's steps move between 10.5 and 15 ms within seconds) turns the thin win into a loss
    thin: float = 1.15
    estimate: AcceptanceEstimate = field(default_factory=AcceptanceEstimate)
    prices: RoundPrices | None = None  # None: priced from the costs above, checked by this sequence alone
    checked: bool = True  # check the prices against the clock (False: fixed, a seeded run's choices repeat)
    # rows a one-token verify runs (ModelEntry.one_token_rows): at 2 the graph pads it, so depth 1's
    # verify costs no more than depth 0's and its draft rides in the row the pad would idle
    one_token_rows: int = 1
    _skipped: dict[str, int] = field(default_factory=dict)  # per tag: rounds in a row that chose depth 0
    _gap: dict[str, int] = field(default_factory=dict)  # per tag: rounds of 0 before the next probe
    _probes: dict[str, int] = field(default_factory=dict)  # per tag: probes made
    _drafted: int = 0  # rounds that drafted since the last plain one
    _plain_left: int = 0  # plain rounds a check still runs
    _since_draft: int = 0  # rounds in a row at depth 0: what the drafter catches up on when it drafts
    resumed: bool = False  # the last depth chosen drafts after rounds at depth 0, catching up on them
    _started: bool = False  # a round has drafted: the drafter has been fed the prompt
    # seconds the drafter's first draft spends on the prompt (``Drafter.catchup_cost`` of it: a
    # draft model's prefill, a head's prompt rows), spread over the tokens that could repay it
    start_cost: float = 0.0
    # depth -> its price from the engines' costs, once known: they are fixed once measured, and
    # every round asks for every depth's, each a walk through the runner's plan and the
    # drafter's entries (12 of the 22 us a round's choice took with SmolLM2's EAGLE-3 head)
    _priced: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.prices is None:
            self.prices = RoundPrices(self.priced) if self.checked else RoundPrices(self.priced, margin=float("inf"))

    def priced(self, batch: int, depth: int) -> float | None:
        """A round's price from the engines' costs: the verify of 1+depth tokens and the drafter's
        round (batch 1's, whatever the batch: a batched loop prices its own, runtime/policy.py);
        at depth 0 the verify alone (a skip's cost is the catch-up of the round that drafts next)."""
        known = self._priced.get(depth)
        if known is not None:
            return known
        verify = self._verify(1 + depth)
        if not verify:
            return None
        self._priced[depth] = verify + (self.round_cost(depth) if depth > 0 else 0.0)
        return self._priced[depth]

    def _verify(self, tokens: int) -> float | None:
        """A verify of ``tokens``, priced at the rows it runs (a padded one-token call: two)."""
        return self.verify_cost(max(tokens, self.one_token_rows))

    def _sunk_price(self, batch: int, depth: int) -> float | None:
        """A round's price when its drafts exist: the checked price less the drafter's own round
        (already paid), so prompt lookup's trimmed chains follow what the clock says too."""
        assert self.prices is not None
        price = self.prices.seconds(batch, depth)
        return max(price - self.round_cost(depth), 1e-6) if price and depth > 0 else price

    def best_depth(self, tag: str, limit: int, batch: int = 1, sunk: bool = False, remaining: int = 0) -> int:
        """The depth <= limit with the best expected tokens per second in a round at ``batch``.
        ``sunk``: the drafts already exist, so only the verify (the round less the drafter's)
        counts. ``remaining``: tokens the request may still make; until the drafter first drafts,
        its ``start_cost`` is spread over them (0: not charged)."""
        if not sunk:  # a chain trimmed (sunk) keeps what its round was chosen as
            self.resumed = False
        if limit <= 0:
            return 0
        assert self.prices is not None
        price = (lambda k: self._sunk_price(batch, k)) if sunk else (lambda k: self.prices.seconds(batch, k))
        base = price(0)
        if not base:
            return limit
        expected = self.estimate.chain_lengths(tag, limit)  # [limit] E(k), k = 1..limit
        # drafting now also feeds the drafter what it skipped (a draft model's catch-up)
        catchup = self.catchup_cost(self._since_draft) if self._since_draft and not sunk else 0.0
        # a drafter not yet started pays for the prompt first: a share of it per token the
        # request may still make (an int4 copy of SmolLM2 spent 170 ms on a 170-token prompt,
        # more than drafting then saved over a 75-token answer)
        start = self.start_cost / remaining if self.start_cost and remaining > 0 and not self._started \
            and not sunk else 0.0
        best_k, best_rate = 0, self.min_gain / base
        for k in range(1, limit + 1):
            cost = price(k)
            if not cost:
                return limit  # no measurement: draft as asked
            rate = expected[k - 1] / (cost + catchup + start * expected[k - 1])
            if rate > best_rate:
                best_k, best_rate = k, rate
        if sunk:
            return best_k

        def probe() -> int:
            """The deepest probe costing at most ``probe_share`` of the skipped rounds, catch-up
            included (0: none does; a drafter whose catch-up costs that share is not probed). A
            tag's first probe is the exception: what stopped it may be a round or two of misses
            on little evidence, so it is probed once whatever its catch-up, as deep as costs half a
            plain round more than a plain round (one draft at least)."""
            if not self._probes.get(tag) and not start:
                return max([1] + [k for k in range(1, limit + 1) if price(k) <= 1.5 * base])
            budget = self.probe_share * self._since_draft * base
            prompt = self.start_cost if start else 0.0  # a drafter never started: its probe feeds it the prompt
            return max((k for k in range(1, limit + 1) if price(k) - base + catchup + prompt <= budget), default=0)

        chosen = self._explore(tag, best_k, probe, batch, best_rate * base < self.close, best_rate * base < self.thin)
        # the first drafting round feeds a drafter with catch-up the whole prompt (a head's
        # taps, a draft model's prefill): no measure of its kind either (SmolLM2's EAGLE-3 head:
        # 37 ms for a depth-5 round that costs 23)
        first = not self._started and self.start_cost > 0
        self.resumed = chosen > 0 and (catchup > 0 or first)
        self._started = self._started or chosen > 0
        self._since_draft = 0 if chosen > 0 else self._since_draft + 1
        return chosen

    def _explore(self, tag: str, best_k: int, probe: Callable[[], int], batch: int, close: bool = True,
                 thin: bool = False) -> int:
        """The chosen depth, or now and then a probe (of depth ``probe()``, when one is worth its
        cost) after ``probe_every`` rounds of 0, or a plain round after ``plain_every`` rounds
        that drafted."""
        if best_k == 0:
            self._drafted = 0
            self._skipped[tag] = self._skipped.get(tag, 0) + 1
            gap = self._gap.get(tag, self.probe_every)
            depth = probe() if self._skipped[tag] >= gap else 0
            if depth:
                self._probes[tag] = self._probes.get(tag, 0) + 1
                self._skipped[tag] = 0
                self._gap[tag] = min(2 * gap, self.max_probe_gap)  # if this probe does not pay either
            return depth
        self._skipped[tag] = 0
        self._gap.pop(tag, None)  # drafting pays again: probe soon if it stops
        if self._plain_left > 0:  # a check's later plain rounds
            self._plain_left -= 1
            return 0
        self._drafted += 1
        assert self.prices is not None
        if not self.prices.checked:
            return best_k
        often = thin or self.prices.rounds(batch, 0) < self.prices.window  # or depth 0 is young
        if close and self._drafted >= self.plain_every * (1 if often else 8):
            self._drafted, self._plain_left = 0, self.plain_run - 1
            return 0
        return best_k
