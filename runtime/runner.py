"""ModelRunner: one neural model's engines (one per token count) over its own KV cache.

``forward(tokens)`` feeds tokens at the cache's current length through engines (padding a
short piece), appends their K/V to the cache and returns the model's outputs for each real
token. Which engines: only those whose manifest role is a decoding role (decode, catchup,
verify, prefill; never a probe, which only ``time_engines`` runs), and among them the sequence
of pieces that costs least by the build's measured costs (a long prompt: prefill chunks; a
verify: the one engine that holds it), or without costs the smallest engine that holds the
input. Feed buffers are allocated once per engine and updated in place.

A verify longer than every verify entry (a drafter that drafts past D at batch 1, a long
suffix-decoding match: ``forward(..., verify=True)``) runs in one call of the smallest probe
entry that holds it, padded as a short verify is, where one does and it fits the cache: its
*long* sizes. Prefill and everything else never run a probe, so they cost and compute exactly as
before.

Some graphs take or give more than tokens: a chain drafter's graphs take a feature row per token
(``inputs={DRAFT_FEATURES: [n, F]}``), and a target that feeds a hidden-state drafter returns its
tapped hidden states when asked (``want=(AUX_HIDDEN_STATES,)``): rows are padded and sliced
like the tokens, and the extra outputs come back in ``StepOutput.extras``.

Rows whose outputs nobody reads (a drafter's prompt, rows fed ahead of a catch-up) go through
``fill``: over the model's fill entries (Role.FILL: its graph with only the cache outputs, so no
logits are computed), planned by their own costs; a model without them runs its decoding entries
as ``forward`` does. ``fill_ms`` prices what it runs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from specexport.contract import (
    CACHE_LENGTH,
    LOGITS,
    NEXT_TOKENS,
    VALID_TOKENS,
    Role,
    present_names,
)
from specexport.runtime.engine import Engine
from specexport.runtime.graph_call import PAD_ID as PAD_ID  # where the exporter imports it from
from specexport.runtime.graph_call import GraphCall, TimedCalls
from specexport.runtime.kv_cache import KVCache


@dataclass
class StepOutput:
    next_tokens: np.ndarray  # [n] int64, the argmax at each position
    logits: np.ndarray | None  # [n, V] float32, when asked for
    extras: dict[str, np.ndarray] = field(default_factory=dict)  # name -> [n, ...] outputs asked for by `want`


class ModelRunner(TimedCalls):
    def __init__(self, name: str, engines: Sequence[Engine], cache: KVCache, tokens_of: dict[str, int],
                 cost_ms: dict[int, float] | None = None, in_place: frozenset[str] = frozenset(),
                 roles: Mapping[str, Role] | None = None, full_rows: bool = False,
                 fill_cost_ms: dict[int, float | None] | None = None):
        """``roles``: engine name -> its manifest role; engines of a non-decoding role (probes)
        are only timed, never chosen by ``forward`` but for a long verify. None: every engine
        decodes. ``cost_ms``: tokens -> ms of the engines (probes too: a long verify's price). ``full_rows``:
        a call's padding rows count as tokens (``valid_tokens`` = T; ModelEntry.full_rows), so
        that a row's result does not depend on how many rows were real. Engines of role fill are
        kept apart: only ``fill`` runs them, planned by ``fill_cost_ms`` (tokens -> ms)."""
        self.name = name
        self.cache = cache
        self.full_rows = full_rows
        fills = [e for e in engines if roles is not None and Role(roles[e.name]) is Role.FILL]
        engines = [e for e in engines if roles is None or Role(roles[e.name]) is not Role.FILL]
        # token count -> engine, smallest first: every engine, and those forward may choose
        everything = sorted(((tokens_of[e.name], e) for e in engines), key=lambda pair: pair[0])
        self._by_size = dict(everything)
        self._engines = [(t, e) for t, e in everything if roles is None or Role(roles[e.name]).decoding]
        if not self._engines:
            raise ValueError(f"model {name} has no engines to decode with")
        # the widest verify entry (decode, verify, catchup; not prefill), and the probes wider than it
        # that a longer verify runs in (runtime/policy.py drafts that deep only for a long drafter)
        short = [t for t, e in everything if roles is None or Role(roles[e.name]) in _VERIFY_ROLES]
        self.verify_limit = max(short, default=self._engines[0][0])
        self._long = [(t, e) for t, e in everything
                      if roles is not None and Role(roles[e.name]) is Role.PROBE and t > self.verify_limit]
        self._long_ms = {t: (cost_ms or {}).get(t) for t, _ in self._long}
        # for every input length, the engine size to run first so that the whole input costs
        # least, and tokens -> ms of those cheapest pieces (the plan's own figures); None: no costs
        decoding = {t for t, _ in self._engines}
        planned = plan_pieces(monotone_costs({t: ms for t, ms in (cost_ms or {}).items() if t in decoding}),
                              cache.max_seq_len)
        self._first_piece, self._planned_ms = planned or (None, None)
        # the fill entries (token count -> engine) and their plan, as the decoding entries'
        self._fill = dict(sorted(((tokens_of[e.name], e) for e in fills), key=lambda pair: pair[0]))
        fill_planned = plan_pieces(monotone_costs({t: ms for t, ms in (fill_cost_ms or {}).items()
                                                   if t in self._fill}), cache.max_seq_len)
        self._fill_first, self._fill_planned_ms = fill_planned or (None, None)
        # engines that update the cache in place (attention: ort-gqa) get it bound as their
        # present outputs and return only tokens (and logits); the others return the new K/V
        self._in_place = in_place
        presents = present_names(cache.num_layers)
        bound = cache.in_place_outputs()
        # token count -> its call over the cache (a block drafter's graph takes one anchor token)
        self._calls: dict[object, GraphCall] = {
            tokens: GraphCall(engine, cache.view(), engine.name in in_place, bound, presents, tokens=tokens)
            for tokens, engine in self._by_size.items()}
        for tokens, engine in self._fill.items():  # keyed apart: a fill entry shares its size with another
            self._calls[(Role.FILL, tokens)] = GraphCall(engine, cache.view(), engine.name in in_place, bound,
                                                         presents, tokens=tokens)
        self._states = cache.state_outputs  # a linear-attention model's state after each position

    @property
    def length(self) -> int:
        return self.cache.length

    @property
    def sizes(self) -> list[int]:
        """Every engine's token count, probes included (the bench's cost curve times them)."""
        return sorted(self._by_size)

    @property
    def decoding_sizes(self) -> list[int]:
        """The token counts ``forward`` chooses from."""
        return [t for t, _ in self._engines]

    @property
    def long_sizes(self) -> list[int]:
        """The probe sizes wider than every verify entry that a longer verify runs in (smallest first)."""
        return [t for t, _ in self._long]

    @property
    def calls_by_engine(self) -> dict[str, int]:
        """Runs of each engine so far, by name (a fill entry's apart from the entry of its size)."""
        return {call.engine.name: call.calls for call in self._calls.values()}

    @property
    def fill_sizes(self) -> list[int]:
        """The token counts of the fill entries (none: ``fill`` runs the decoding entries)."""
        return list(self._fill)

    def fill_ms(self, tokens: int) -> float | None:
        """ms of ``fill(tokens)`` as it plans them (its fill entries by their costs, else the
        decoding entries as ``planned_ms``), None without costs; 0 for no tokens."""
        if tokens < 1:
            return 0.0
        if not self._fill:
            return self.planned_ms(tokens)
        if self._fill_planned_ms is None:
            return None
        return self._fill_planned_ms[min(tokens, len(self._fill_planned_ms) - 1)]

    def catchup_ms(self, tokens: int, widest: int | None = None) -> float | None:
        """ms of a drafter feeding ``tokens`` rows of which it reads the last ones: the last
        ``widest`` (default: the widest decoding entry's) run through ``forward``, the rows before
        them through ``fill`` (ModelDrafter._gap, ChainDrafter._catch_up), None without costs."""
        read = min(tokens, widest or self.decoding_sizes[-1])
        fed, filled = self.planned_ms(read), self.fill_ms(tokens - read)
        return None if fed is None or filled is None else fed + filled

    def verify_size(self, tokens: int) -> int:
        """Token count of the engine a verify of ``tokens`` runs first (``forward(verify=True)``),
        whatever the cache holds now."""
        long = self._long_entry(tokens)
        return long[0] if long is not None else self.engine_size(tokens)

    def verify_ms(self, tokens: int) -> float | None:
        """ms of a verify of ``tokens`` as ``forward(verify=True)`` runs it: ``planned_ms`` up to
        the widest verify entry, past it the probe entry that holds it (None: unmeasured)."""
        long = self._long_entry(tokens)
        return self._long_ms[long[0]] if long is not None else self.planned_ms(tokens)

    def is_open(self, size: int) -> bool:
        """Whether the engine of ``size`` tokens holds a session (lazy engines open on first use)."""
        return bool(getattr(self._by_size[size], "opened", True))

    def engine_at(self, size: int, fill: bool = False) -> str:
        """The name of the engine of ``size`` tokens (``fill``: the fill entry's)."""
        return (self._fill if fill else self._by_size)[size].name

    def engine_size(self, tokens: int) -> int:
        """Token count of the engine that runs ``tokens`` tokens in one call (or the largest),
        whatever the cache holds now."""
        return self._plan(tokens)[0]

    def planned_ms(self, tokens: int) -> float | None:
        """ms of running ``tokens`` tokens as ``forward`` plans them (the engines it picks, by
        the costs it picks them by), None without costs: what adaptive depth prices a verify of
        ``tokens`` at, so that it never prices an entry other than the one that runs."""
        if self._planned_ms is None or tokens < 1:
            return None
        return self._planned_ms[min(tokens, len(self._planned_ms) - 1)]

    def time_engines(self, sizes: Sequence[int], rounds: int, want_logits: bool = False) -> dict[int, float]:
        """Median seconds of one run of each engine, the sizes taken in turn round after round
        (so a drift of the machine hits them all alike), over a half-full cache. The cache is
        read, not written, except by in-place engines, after which it is rewound to empty.
        ``want_logits``: time the runs as sampled decoding makes them, logits copied out."""
        return time_interleaved({self.name: (self, sizes)}, rounds, want_logits)[self.name]

    def time_run(self, size: int, want_logits: bool = False) -> float:
        """Seconds of one run of the engine of ``size`` tokens over a half-full cache."""
        return self._time(size, self._calls[size], self._outputs(want_logits))

    def time_fill(self, size: int) -> float:
        """Seconds of one run of the fill entry of ``size`` tokens over a half-full cache, asked
        for the cache alone (``FillTiming``). Apart from ``time_run``, whose (size, want_logits)
        every timed schedule member shares (TreeVerifier, BatchedCalls, test fakes)."""
        return self._time(size, self._calls[(Role.FILL, size)], self._states)

    def _time(self, size: int, call: GraphCall, outputs: Sequence[str]) -> float:
        call.feeds[CACHE_LENGTH][0] = (self.cache.max_seq_len - size) // 2
        if VALID_TOKENS in call.feeds:
            call.feeds[VALID_TOKENS][0] = size
        return call.time(outputs)

    def end_timing(self, sizes: Sequence[int]) -> None:
        """After timing: in-place engines wrote into the cache, so it is rewound to empty."""
        if self._in_place:
            self.cache.set_length(0)

    def _plan(self, remaining: int) -> tuple[int, Engine]:
        """The engine to run first for ``remaining`` tokens: cheapest by cost, else the fit rule."""
        if self._first_piece is not None:
            size = self._first_piece[min(remaining, len(self._first_piece) - 1)]
            return size, self._by_size[size]
        return next(((t, e) for t, e in self._engines if t >= remaining), self._engines[-1])

    def _long_entry(self, tokens: int) -> tuple[int, Engine] | None:
        """The smallest long size holding ``tokens``, for a verify wider than every verify entry."""
        if tokens <= self.verify_limit:
            return None
        return next(((t, e) for t, e in self._long if t >= tokens), None)

    def _pick(self, remaining: int, verify: bool = False) -> tuple[int, Engine]:
        long = self._long_entry(remaining) if verify else None
        if long is not None and (long[1].name not in self._in_place or long[0] <= self.cache.free):
            return long  # one call; an in-place graph whose padding the cache cannot hold chunks instead
        choice = self._plan(remaining)
        if choice[1].name in self._in_place and choice[0] > self.cache.free:
            # an in-place (GroupQueryAttention) graph checks the padded length against the cache: take one that fits
            choice = max(((t, e) for t, e in self._engines if t <= self.cache.free), key=lambda te: te[0])
        return choice

    def _run(self, size: int, want_logits: bool, want: Sequence[str] = ()) -> dict[str, np.ndarray]:
        """One run of the engine of ``size`` tokens on its feeds (counted in ``seconds``)."""
        return self._calls[size].run(self._outputs(want_logits, want))

    def _outputs(self, want_logits: bool, want: Sequence[str] = ()) -> list[str]:
        """What to ask a run for besides an appending graph's presents (the call adds those)."""
        return [NEXT_TOKENS, *([LOGITS] if want_logits else []), *self._states, *want]

    def fill(self, tokens: Sequence[int], inputs: Mapping[str, np.ndarray] | None = None) -> None:
        """Feed ``tokens`` whose outputs nobody reads (``inputs`` as ``forward``'s): only the
        cache is written, by the fill entries where the model has them (the module docstring),
        chunked as their costs say; without them, ``forward``."""
        if not self._fill:
            self.forward(tokens, inputs=inputs)
            return
        n = len(tokens)
        if n > self.cache.free:
            raise ValueError(f"{self.name}: {n} tokens do not fit in the {self.cache.free} free cache slots")
        done = 0
        while done < n:
            size = self._pick_fill(n - done)
            count = min(size, n - done)
            call = self._calls[(Role.FILL, size)]
            self._feed(call, size, tokens, inputs, done, count)
            result = call.run(self._states)  # the cache alone (presents, states)
            self.cache.store(result, count, in_place=self._fill[size].name in self._in_place)
            done += count

    def _feed(self, call: GraphCall, size: int, tokens: Sequence[int], inputs: Mapping[str, np.ndarray] | None,
              done: int, count: int) -> None:
        """Row 0 of ``call`` (``size`` tokens) takes ``count`` tokens from ``done`` on at the
        cache's length, with their extra input rows; full rows: the padding's K/V lands past the
        length, never read."""
        call.feed_row(0, self.cache.length, tokens[done : done + count],
                      {name: rows[done : done + count] for name, rows in (inputs or {}).items()},
                      size if self.full_rows else count)  # [1, T], extra inputs [1, T, F]

    def _pick_fill(self, remaining: int) -> int:
        """The fill entry to run first for ``remaining`` tokens: cheapest by cost, else the fit
        rule; an in-place one that the cache holds (as ``_pick``)."""
        if self._fill_first is not None:
            size = self._fill_first[min(remaining, len(self._fill_first) - 1)]
        else:
            size = next((t for t in self._fill if t >= remaining), max(self._fill))
        if self._fill[size].name in self._in_place and size > self.cache.free:
            size = max(t for t in self._fill if t <= self.cache.free)
        return size

    def forward(self, tokens: Sequence[int], want_logits: bool = False,
                inputs: Mapping[str, np.ndarray] | None = None, want: Sequence[str] = (),
                verify: bool = False) -> StepOutput:
        """``inputs``: extra per-token inputs, name -> [n, F] rows (padded with zeros);
        ``want``: extra outputs to return in ``extras``, name -> [n, ...]; ``verify``: a verify
        pass, which may run a long size (the module docstring)."""
        n = len(tokens)
        if n > self.cache.free:
            raise ValueError(f"{self.name}: {n} tokens do not fit in the {self.cache.free} free cache slots")
        if n == 0:  # e.g. the prefill of a one-token prompt (all but its last token): nothing to run
            outputs = self._engines[0][1].outputs
            vocab = outputs[LOGITS].shape[-1]
            logits = np.empty((0, vocab), dtype=np.float32) if want_logits else None  # [0, V]
            extras = {name: np.empty((0, *outputs[name].shape[2:]), dtype=outputs[name].dtype) for name in want}
            return StepOutput(np.empty(0, dtype=np.int64), logits, extras)
        next_parts, logit_parts = [], []
        extra_parts: dict[str, list[np.ndarray]] = {name: [] for name in want}
        done = 0
        while done < n:
            size, engine = self._pick(n - done, verify)
            count = min(size, n - done)
            self._feed(self._calls[size], size, tokens, inputs, done, count)
            result = self._run(size, want_logits, want)
            # in place: the engine wrote its positions into the cache; else they are copied in
            self.cache.store(result, count, in_place=engine.name in self._in_place)
            next_parts.append(result[NEXT_TOKENS][0, :count])  # [count]
            if want_logits:
                logit_parts.append(result[LOGITS][0, :count])  # [count, V]
            for name in want:
                extra_parts[name].append(result[name][0, :count])  # [count, ...]
            done += count
        next_tokens = _joined(next_parts)
        logits = _joined(logit_parts) if want_logits else None
        return StepOutput(next_tokens, logits, {name: _joined(parts) for name, parts in extra_parts.items()})


_VERIFY_ROLES = frozenset({Role.DECODE, Role.VERIFY, Role.CATCHUP})  # the graphs a verify pass runs today


def plan_pieces(cost_ms: Mapping[int, float | None], longest: int) -> tuple[list[int], list[float]] | None:
    """For every input length up to ``longest``, the engine size to run first so that the whole
    input costs least over the sizes with a measured cost, and that least cost: (first, total).
    None: no costs (the fit rule applies)."""
    sizes = sorted(t for t, ms in cost_ms.items() if ms)
    if not sizes:
        return None
    costs = {t: float(cost_ms[t] or 0.0) for t in sizes}
    total = [0.0] * (longest + 1)  # total[r]: cheapest cost of r tokens
    first = [sizes[0]] * (longest + 1)
    for r in range(1, longest + 1):  # a tie goes to the smaller graph (less padding)
        total[r], first[r] = min((costs[t] + total[max(r - t, 0)], t) for t in sizes)
    return first, total


class FillTiming:
    """A runner's fill entries as a timing schedule sees a runner (``time_interleaved``): the
    build times them with the others (their cost_ms)."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner

    @property
    def sizes(self) -> list[int]:
        return self.runner.fill_sizes

    def engine_at(self, size: int) -> str:
        return self.runner.engine_at(size, fill=True)

    def time_run(self, size: int, want_logits: bool = False) -> float:
        return self.runner.time_fill(size)

    def end_timing(self, sizes: Sequence[int]) -> None:
        self.runner.end_timing(sizes)


def monotone_costs(cost_ms: Mapping[int, float | None]) -> dict[int, float | None]:
    """Token count -> cost, each capped by the cheapest larger graph's: a graph of fewer tokens
    runs a part of a larger one's work, so when it measured dearer the figure is noise (a busy
    moment while it was timed). Uncapped, one such figure made every decode step run the 2-token
    graph with a padded row (a tuned SmolLM2 directory: 1 token 36.3 ms, 2 tokens 28.9 ms; the
    bench's curve on the same machine: 22.7 and 25.5 ms), 13% slower than the 1-token graph, and
    told adaptive depth that drafting one token was cheaper than drafting none."""
    capped: dict[int, float | None] = {}
    cheapest_larger: float | None = None
    for tokens in sorted(cost_ms, reverse=True):
        ms = cost_ms[tokens]
        if ms and cheapest_larger is not None and cheapest_larger < ms:
            ms = cheapest_larger
        capped[tokens] = ms
        if ms and (cheapest_larger is None or ms < cheapest_larger):
            cheapest_larger = ms
    return {tokens: capped[tokens] for tokens in sorted(capped)}


def _joined(parts: list[np.ndarray]) -> np.ndarray:
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def time_interleaved(runners: Mapping[str, tuple[ModelRunner, Sequence[int]]], rounds: int,
                     want_logits: bool = False) -> dict[str, dict[int, float]]:
    """Median seconds of one run of every (model, size), taken as ``time_rounds`` takes them:
    name -> size -> seconds. Build, tune and bench time through this (tune and calibration
    through ``time_rounds``, to check the rounds' spread first)."""
    samples = time_rounds(runners, rounds, want_logits)
    return {name: {size: float(np.median(v)) for size, v in by_size.items()} for name, by_size in samples.items()}


def time_rounds(runners: Mapping[str, tuple[ModelRunner, Sequence[int]]], rounds: int,
                want_logits: bool = False) -> dict[str, dict[int, list[float]]]:
    """Seconds of each round's run of every (model, size), all of them taken in turn round after
    round (round 0 warms up and opens lazy engines; each round starts one graph later), so a
    drift of the machine hits every model's graphs alike: name -> size -> [seconds] a round."""
    times: dict[str, dict[int, list[float]]] = {name: {size: [] for size in sizes}
                                                for name, (_, sizes) in runners.items()}
    schedule = [(name, runner, size) for name, (runner, sizes) in runners.items() for size in sizes]
    for round_ in range(rounds + 1):
        # each round starts one graph later, so no graph is always timed first (after the
        # round's largest, or after whatever the machine did between rounds)
        shift = round_ % len(schedule) if schedule else 0
        for name, runner, size in schedule[shift:] + schedule[:shift]:
            seconds = runner.time_run(size, want_logits)
            if round_:
                times[name][size].append(seconds)
    for runner, sizes in runners.values():
        runner.end_timing(sizes)
    return times
