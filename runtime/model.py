"""One way to open a model's engines: (manifest, model, roles, slots) -> a ``Model``.

A Model is one model's graphs over one cache with a row per slot (a running sequence):

- **one running row** runs through its slot's batch-1 runner (runtime/runner.py: chunked by
  cost, any length). Every kind of graph runs there: in-place (ort-gqa) and append (standard)
  graphs, a device-resident cache (TensorRT), a recurrent state (hybrid targets). A lone
  request, `generate`, is this case;
- **two or more rows** run through the batched graph of the smallest built batch size that
  holds them, and its smallest T that holds the longest row, right-padded. In-place graphs
  take each row's ``valid_tokens`` and write only those positions; for append graphs the
  runtime copies each row's real positions into its cache row. Rows that do not run idle.

Batched graphs share one cache store [slots, n_kv, S_max, hd]: in host memory (HostStore,
each slot's runner seeing its row through a ``SlotView``), or for TensorRT on the GPU
(trt_store.DeviceStore, a slot's runner over its row as a ``DeviceKVCache``; a batch-B engine
bound to the first B rows). A model without batched graphs at that size (a head of a directory
built before them) runs each row through its slot's runner in turn. A model with a recurrent
state (linear-attention layers) keeps it beside the K/V in a HostStateStore of ``slots`` rows:
each slot's runner sees its row (``RecurrentSlotView``), and a batched call feeds each row the
state after its committed tokens (a choice among the kept states, never a recomputation) and
keeps the states after each position it ran.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from specexport.contract import (
    CONTEXT_FEATURES,
    INPUT_IDS,
    LOGITS,
    NEXT_TOKENS,
    EngineEntry,
    KVUpdate,
    Manifest,
    ModelEntry,
    Role,
)
from specexport.errors import BadInput
from specexport.runtime.cache_store import HostStore, Store
from specexport.runtime.copy_counter import CopyCounter
from specexport.runtime.engine import (
    Engine,
    EngineOptions,
    LazyEngine,
    SharedGraphs,
    open_device_slots,
    open_kv_cache,
    open_row_store,
)
from specexport.runtime.graph_call import GraphCall
from specexport.runtime.kernel_probe import check_engine
from specexport.runtime.kv_cache import CacheLength, KVCache, RecurrentRows
from specexport.runtime.runner import PAD_ID, ModelRunner, StepOutput, time_interleaved
from specexport.runtime.state_store import HostStateStore

Row = tuple[int, np.ndarray, Mapping[str, np.ndarray]]  # (cache length, tokens [n], extra inputs name -> [n, F])


class SlotView(KVCache):
    """Row ``slot`` of a [slots] host cache seen as a batch-1 cache: its runner writes that row
    (in place or appended). Batched calls write the row without counting here: the caller says
    how long it is before each run (``set_length``)."""

    def __init__(self, store: Store, slot: int, num_layers: int, max_seq_len: int):
        CacheLength.__init__(self, num_layers, max_seq_len)
        self.rows_store = store.slot(slot)  # [1, n_kv, S_max, hd] views of the row

    def set_length(self, length: int) -> None:
        if not 0 <= length <= self.max_seq_len:
            raise ValueError(f"a slot of {self.max_seq_len} positions cannot hold {length}")
        self.length = length


class RecurrentSlotView(RecurrentRows, SlotView):
    """Row ``slot`` of a [slots] cache with a recurrent state, seen as a batch-1 cache: the K/V
    row as SlotView's, and the state row of ``states`` (HostStateStore.slot) kept and selected
    with it: setting the length selects the state after it."""

    def __init__(self, store: Store, states: HostStateStore, slot: int, num_layers: int, max_seq_len: int):
        super().__init__(store, slot, num_layers, max_seq_len)
        self.state_store = states.slot(slot)

    def set_length(self, length: int) -> None:
        super().set_length(length)
        self.state_store.set_length(0, length)


@dataclass
class SlotCaches:
    """A model's cache: one batch-1 cache per slot, and the [slots] store they are rows of (a
    HostStore, or TensorRT's DeviceStore on the GPU; None for one slot, whose cache may live on
    the device or keep a recurrent state). ``states``: a recurrent model's state rows beside the
    store (None: no linear-attention layers, or one slot, whose cache keeps its own)."""

    slots: list[CacheLength]
    store: Store | None
    states: HostStateStore | None = None


def host_store(info: ModelEntry, slots: int) -> HostStore:
    """The model's K/V of ``slots`` rows in host memory, written now (HostStore.allocate)."""
    return HostStore.allocate(info.num_layers, info.kv.shape(slots), info.kv_dtype, fill=True)


def rows_store(info: ModelEntry, slots: int, backend: str, options: EngineOptions,
               counter: CopyCounter | None = None) -> Store:
    """The model's K/V of ``slots`` rows: on the engines' device where the options put it
    (runtime/device_store.py), else in host memory."""
    store = open_row_store(backend, info.num_layers, info.kv.shape(slots), info.kv_dtype, options, counter)
    return store if store is not None else host_store(info, slots)


def open_caches(info: ModelEntry, backend: str, options: EngineOptions, slots: int, largest_graph: int,
                counter: CopyCounter | None = None) -> SlotCaches:
    """``counter``: the load's host <-> device byte counter, which a device store's copies add to."""
    if slots == 1:  # host, device or recurrent: runtime/engine.py chooses
        return SlotCaches([open_kv_cache(backend, info, options, largest_graph, counter)], None)
    if info.state is not None:  # the K/V rows where the backend keeps them, the states on the host
        store = rows_store(info, slots, backend, options, counter)
        # each row reaches back over any one run (keep >= the largest graph), as a batch-1 cache
        states = HostStateStore.allocate(info.state, slots, keep=max(64, largest_graph))
        return SlotCaches([RecurrentSlotView(store, states, s, info.num_layers, info.max_seq_len)
                           for s in range(slots)], store, states)
    device = open_device_slots(backend, info, options, slots)  # TensorRT's store on the GPU (trt_store.py)
    if device is not None:
        return SlotCaches(device[1], device[0])
    store = rows_store(info, slots, backend, options, counter)
    return SlotCaches([SlotView(store, s, info.num_layers, info.max_seq_len) for s in range(slots)], store)


def slots_refusal(manifest: Manifest, model: str, backend: str, batches: Sequence[int],
                  roles: frozenset[Role] | None = None, need_graphs: bool = False) -> str | None:
    """Why ``model`` cannot run ``batches`` rows at once (None when it can): ``need_graphs``:
    it needs batched graphs of the roles at every batch size above 1 (else its rows run one
    after another)."""
    if max(batches) == 1 or not need_graphs:
        return None
    built = {e.batch for e in manifest.engines_of(model, backend, batch=None)
             if e.batch > 1 and (roles is None or e.role in roles) and e.role.decoding}
    missing = [b for b in batches if b > 1 and b not in built]
    if missing:
        return (f"model '{model}' has batched graphs for batch sizes {sorted({1, *built})}, not {missing}: rebuild "
                "with shapes.batch listing them (or lower the maximum batch)")
    return None


class BatchedCall:
    """One batched graph (B rows, T tokens) over the first B rows of the host cache store (a
    GraphCall). ``rows``: slot -> (cache length, tokens, extra inputs); the other rows idle. A
    row writes one cache position per token, or for a block head's graph per context row (its
    ``input_ids`` is the anchor alone); ``valid_tokens`` / ``context_valid`` count them."""

    def __init__(self, engine: Engine, batch: int, tokens: int, store: Store, in_place: bool,
                 per_context_row: bool = False, full_rows: bool = False, states: HostStateStore | None = None):
        """``full_rows``: a fed row counts all T tokens as real where its cache has room (its
        padding's K/V lands past its length, never read), as ModelRunner's ``full_rows``.
        ``states``: a recurrent model's state rows, fed and kept beside the K/V."""
        self.engine, self.batch, self.tokens, self.in_place = engine, batch, tokens, in_place
        self.full_rows = full_rows
        self.max_seq_len = store.max_seq_len
        self.states = states
        self.call = GraphCall.over(engine, store, batch, in_place, states.rows(batch) if states else None)
        # what counts a row's cache positions: its tokens, or a block graph's context rows
        self.positions = CONTEXT_FEATURES if per_context_row else INPUT_IDS

    @property
    def seconds(self) -> float:
        return self.call.seconds

    def run(self, rows: Mapping[int, Row], want_logits: bool, want: Sequence[str] = ()) -> dict[str, np.ndarray]:
        if self.states is not None:  # each fed row's state after its committed tokens: a kept one chosen
            for r, (length, _, _) in rows.items():
                self.states.set_length(r, length)
        out, written = self._run(rows, want_logits, want)
        if self.states is not None:  # the states after each real position (padding and idle rows: none)
            self.states.write(out, written, select=False)  # each chosen when next fed (set_length)
        return out

    def _run(self, rows: Mapping[int, Row], want_logits: bool, want: Sequence[str]):
        """One run on ``rows`` (the K/V written, the states fed as they are): (outputs, written)."""
        self.call.clear()
        written = []
        for r, (length, tokens, inputs) in rows.items():
            count = len(inputs[self.positions]) if self.positions in inputs else len(tokens)
            full = self.full_rows and length + self.tokens <= self.max_seq_len
            # the row's real positions, the only ones written
            self.call.feed_row(r, length, tokens, inputs, self.tokens if full else count)
            written.append((r, length, count))
        states = self.states.presents if self.states is not None else []  # present_state.* [B, T, ...]
        # next_tokens [B, T], logits [B, T, V]; an append graph's rows copied into the store
        return self.call.run([NEXT_TOKENS, *([LOGITS] if want_logits else []), *states, *want], written), written

    def time_run(self, want_logits: bool = False) -> float:
        """One run with every row full at half the cache (before any sequence runs: it writes)."""
        middle = (self.max_seq_len - self.tokens) // 2
        rows = dict.fromkeys(range(self.batch), (middle, np.full(self.tokens, PAD_ID, dtype=np.int64), {}))
        start = time.perf_counter()
        self._run(rows, want_logits, ())  # a recurrent state neither chosen nor kept
        return time.perf_counter() - start


def as_batch(out: StepOutput) -> dict[str, np.ndarray]:
    """A runner's outputs [n, ...] as a batched call's of one row [1, n, ...]."""
    batched = {NEXT_TOKENS: out.next_tokens[None]}
    if out.logits is not None:
        batched[LOGITS] = out.logits[None]
    return batched | {name: rows[None] for name, rows in out.extras.items()}


class Model:
    """One model's graphs over one cache of ``slots`` rows (the module docstring says how)."""

    def __init__(self, name: str, runners: list, calls: dict[tuple[int, int], BatchedCall], caches: SlotCaches,
                 max_seq_len: int):
        self.name = name
        self.caches = caches
        self.runners = runners  # slot -> its batch-1 runner over its cache row
        self.calls = calls  # (B, T) -> a batched graph, B >= 2
        self.batches = sorted({1, *(b for b, _ in calls)})
        self.slots = len(runners)
        self.max_seq_len = max_seq_len
        self.costs: dict[tuple[int, int], float] = {}  # (B, T) -> seconds, from measure_costs

    @property
    def seconds(self) -> float:
        """Seconds inside this model's engines so far."""
        return sum(r.seconds for r in self.runners) + sum(c.seconds for c in self.calls.values())

    def batch_for(self, rows: int) -> int:
        """The smallest built batch size that holds ``rows`` (1: its rows run one by one)."""
        return min((b for b in self.batches if b >= rows), default=1)

    def widths(self, rows: int) -> list[int]:
        """The token counts T one call over ``rows`` rows can run (one row: the runner's graphs)."""
        if self.batch_for(rows) == 1:
            return self.runners[0].decoding_sizes
        batch = self.batch_for(rows)
        return sorted(t for b, t in self.calls if b == batch)

    def graph(self, rows: int, tokens: int, verify: bool = False) -> tuple[int, int]:
        """(B, T) of the graph a run of ``tokens`` per row over ``rows`` rows calls: the smallest
        holding them, else the largest (one row: its runner's, which chunks a longer input, or
        for a ``verify`` past every verify entry runs it in a long size, runtime/runner.py)."""
        if verify and self.batch_for(rows) == 1:
            return 1, self.runners[0].verify_size(tokens)
        widths = self.widths(rows)
        return self.batch_for(rows), next((t for t in widths if t >= tokens), widths[-1])

    @property
    def long_depth(self) -> int:
        """The most drafts one row alone can verify in one call: its runner's widest long size
        minus the root (0: no long size; runtime/runner.py)."""
        sizes = self.runners[0].long_sizes
        return sizes[-1] - 1 if sizes else 0

    def holds(self, rows: int, tokens: int) -> int:
        """How many of ``tokens`` per row one run over ``rows`` rows takes (one row: all, its
        runner chunks them)."""
        return tokens if self.batch_for(rows) == 1 else min(tokens, self.graph(rows, tokens)[1])

    def run(self, rows: int, feed: Mapping[int, Row], want_logits: bool, want: Sequence[str] = (),
            verify: bool = False) -> dict[str, np.ndarray]:
        """One step over the first ``rows`` slots, the slots in ``feed`` fed their tokens at
        their cache lengths (the rest idle): name -> [B, T, ...], row r valid for its tokens.
        ``verify``: a verify pass (a row alone may run a long size, runtime/runner.py)."""
        if self.batch_for(rows) == 1:
            return self._row_by_row(rows, feed, want_logits, want, verify)
        longest = max(len(tokens) for _, tokens, _ in feed.values())
        return self.calls[self.graph(rows, longest)].run(feed, want_logits, want)

    def run_slot(self, slot: int, row: Row, want_logits: bool, want: Sequence[str] = ()) -> dict[str, np.ndarray]:
        """One slot alone through its runner: name -> [1, n, ...] (a tree round's drafter calls)."""
        length, tokens, inputs = row
        runner = self.runners[slot]
        runner.cache.set_length(length)
        return as_batch(runner.forward(tokens, want_logits, inputs, want))

    def _row_by_row(self, rows: int, feed: Mapping[int, Row], want_logits: bool,
                    want: Sequence[str], verify: bool = False) -> dict[str, np.ndarray]:
        """Each fed row through its slot's runner: one row as it is, more stacked into [rows, T, ...]."""
        outs = {}
        for slot, (length, tokens, inputs) in feed.items():
            runner = self.runners[slot]
            runner.cache.set_length(length)
            outs[slot] = as_batch(runner.forward(tokens, want_logits, inputs, want, verify))
        if rows == 1:
            return outs[0]
        longest = max(out[NEXT_TOKENS].shape[1] for out in outs.values())
        stacked = {}
        for name, first in next(iter(outs.values())).items():
            stacked[name] = np.zeros((rows, longest, *first.shape[2:]), dtype=first.dtype)  # [rows, T, ...]
            for slot, out in outs.items():
                stacked[name][slot, : out[name].shape[1]] = out[name][0]
        return stacked

    def move(self, src: int, dst: int, length: int) -> None:
        """Slot ``dst`` takes slot ``src``'s first ``length`` positions (a row left: the last moves in)."""
        if self.caches.store is not None:
            self.caches.store.move(src, dst, length)
        if self.caches.states is not None:
            self.caches.states.move(src, dst, length)

    def time_run(self, key: tuple[int, int], want_logits: bool = False) -> float:
        """One run of the graph (B, T): a batched call, else the runner's graph of T tokens."""
        if key in self.calls:
            return self.calls[key].time_run(want_logits)
        return self.runners[0].time_run(key[1], want_logits)

    def end_timing(self, keys: Sequence[tuple[int, int]]) -> None:
        self.runners[0].end_timing([t for b, t in keys if b == 1])

    def measure_costs(self, rounds: int = 3) -> dict[tuple[int, int], float]:
        """Median seconds of every (B, T) the loop can run, all rows full, interleaved (before any
        sequence runs: batched graphs write into every slot)."""
        keys = [(1, t) for t in self.widths(1)] + sorted(self.calls)
        self.costs = time_interleaved({self.name: (self, keys)}, rounds)[self.name]
        return self.costs


def open_model(manifest: Manifest, model: str, backend: str, options: EngineOptions, sessions: SharedGraphs,
               caches: SlotCaches, roles: frozenset[Role] | None = None,
               cost_ms: Callable[[EngineEntry], float | None] | None = None, make_runner=None) -> Model:
    """The model's graphs of ``roles`` (None: every role) over ``caches``: a batch-1 runner per
    slot, and the batched graphs of those roles at every built batch size up to the slots.
    ``make_runner(name, engines, cache, entries)``: the runner class for these graphs (a block
    head's); default ModelRunner."""
    info = manifest.models[model]
    slots = len(caches.slots)
    singles = [e for e in manifest.engines_of(model, backend) if roles is None or e.role in roles]
    if not singles:
        raise BadInput(f"{manifest.root}: model '{model}' has no {backend} graphs"
                       + (f" of roles {sorted(r.value for r in roles)}" if roles else ""))
    if backend == "onnxruntime" and options.device == "cpu":  # are this CPU's kernels as exact as the build's?
        refusal = check_engine(info.exactness, options.threads,
                               f"{manifest.root}: model '{model}'")
        if refusal is not None:
            raise BadInput(refusal)
    runners = []
    for slot, cache in enumerate(caches.slots):
        engines = [LazyEngine(e, manifest.root, options, cache, sessions) for e in singles]
        if slot == 0:  # no session is created inside a timed round: open the decoding graphs now
            for entry, engine in zip(singles, engines):
                if entry.role.decoding or entry.role is Role.FILL:
                    engine.open()
        label = model if slots == 1 else f"{model}[{slot}]"
        if make_runner is not None:
            runners.append(make_runner(label, engines, cache, singles))
            continue
        fills = [e.role is Role.FILL for e in singles]  # their costs apart: they share sizes with others
        runners.append(ModelRunner(label, engines, cache, {e.name: e.tokens for e in singles},
                                   {e.tokens: cost_ms(e) for e, f in zip(singles, fills) if not f} if cost_ms else None,
                                   frozenset(e.name for e in singles if e.kv_update == KVUpdate.IN_PLACE),
                                   roles={e.name: e.role for e in singles}, full_rows=info.full_rows,
                                   fill_cost_ms={e.tokens: cost_ms(e) for e, f in zip(singles, fills) if f}
                                   if cost_ms else None))
    calls = {}
    if caches.store is not None:
        for entry in manifest.engines_of(model, backend, batch=None):
            if 1 < entry.batch <= slots and (roles is None or entry.role in roles) and entry.role.decoding:
                engine = LazyEngine(entry, manifest.root, options, None, sessions)
                calls[(entry.batch, entry.tokens)] = BatchedCall(engine, entry.batch, entry.tokens, caches.store,
                                                                 entry.kv_update == KVUpdate.IN_PLACE,
                                                                 per_context_row=entry.role == Role.BLOCK,
                                                                 full_rows=info.full_rows, states=caches.states)
    return Model(model, runners, calls, caches, info.max_seq_len)
