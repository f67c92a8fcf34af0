"""A model's batched engines over one [B_max] cache: the target's for the batched loop
(runtime/batch_decode.py), a draft model's for the batched drafter (runtime/batch_drafter.py).

Each slot is one row of the cache; a joining sequence is prefilled alone, at batch 1, into its
row (``SlotCache``: the row seen as a batch-1 cache, written in place). A round calls the
smallest built batch size holding the running rows, and its smallest graph holding the longest
row, right-padded; VALID_TOKENS gives each row's real count and CACHE_LENGTH its position, so
padding is neither attended to nor written.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from specexport.contract import (
    BATCHED_ROLES,
    CACHE_LENGTH,
    INPUT_IDS,
    LOGITS,
    NEXT_TOKENS,
    VALID_TOKENS,
    KVUpdate,
    Manifest,
    ModelEntry,
    past_names,
    present_of,
)
from specexport.errors import BadInput
from specexport.runtime.engine import Engine, EngineOptions, LazyEngine, SharedGraphs
from specexport.runtime.kv_cache import CacheLength
from specexport.runtime.runner import PAD_ID, ModelRunner

if TYPE_CHECKING:  # the loop's module imports this one
    from specexport.runtime.batch_decode import BatchDrafter


class SlotCache(CacheLength):
    """One slot (row) of the batch cache, seen as a batch-1 cache: the prefill runner of that
    slot writes into the row in place."""

    def __init__(self, tensors: dict[str, np.ndarray], slot: int, num_layers: int, max_seq_len: int):
        super().__init__(num_layers, max_seq_len)
        self._view = {name: array[slot : slot + 1] for name, array in tensors.items()}  # [1, n_kv, S_max, hd] views
        self._present = {present_of(name): array for name, array in self._view.items()}

    def seek(self, length: int) -> None:
        """The row holds ``length`` positions (written by batched calls, which count outside)."""
        if not 0 <= length <= self.max_seq_len:
            raise ValueError(f"a slot of {self.max_seq_len} positions cannot hold {length}")
        self.length = length

    def view(self) -> dict[str, np.ndarray]:
        return self._view

    def in_place_outputs(self) -> dict[str, np.ndarray]:
        return self._present

    def write(self, presents, count: int) -> None:
        raise ValueError("a slot of the batch cache is written in place only (ort-gqa graphs)")


class BatchedCall:
    """One batched engine (B rows, T tokens) with its feed buffers over the first B slots."""

    def __init__(self, engine: Engine, batch: int, tokens: int, cache: dict[str, np.ndarray]):
        self.engine, self.batch, self.tokens = engine, batch, tokens
        self.feeds = {name: array[:batch] for name, array in cache.items()}  # [B, n_kv, S_max, hd] views
        self.ids = self.feeds[INPUT_IDS] = np.full((batch, tokens), PAD_ID, dtype=np.int64)  # [B, T]
        self.lengths = self.feeds[CACHE_LENGTH] = np.zeros(batch, dtype=np.int64)  # [B]
        self.valid = self.feeds[VALID_TOKENS] = np.zeros(batch, dtype=np.int64)  # [B]
        self.bound = {present_of(name): array[:batch] for name, array in cache.items()}

    def run(self, rows: list[tuple[int, np.ndarray]], want_logits: bool,
            want: tuple[str, ...] = ()) -> dict[str, np.ndarray]:
        """rows: (cache length, tokens) for the first slots (no tokens: the row idles, and
        nothing is written into its cache); the rest of the B rows idle. ``want``: extra
        outputs (a head's aux_hidden_states [B, T, F]), per row valid for its tokens only."""
        self.ids.fill(PAD_ID)
        self.lengths.fill(0)
        self.valid.fill(0)
        for r, (length, tokens) in enumerate(rows):
            self.ids[r, : len(tokens)] = tokens
            self.lengths[r] = length
            self.valid[r] = len(tokens)
        outputs = [NEXT_TOKENS, LOGITS, *want] if want_logits else [NEXT_TOKENS, *want]
        return self.engine.run(self.feeds, outputs, self.bound)  # next_tokens [B, T], logits [B, T, V]


def slot_cache(info: ModelEntry, slots: int) -> dict[str, np.ndarray]:
    """A model's cache with one row per slot: past name -> [B_max, n_kv, S_max, hd]. Written now
    (np.full, not the lazily mapped np.zeros): the pages are faulted in at load, not inside the
    first rounds that reach each row (a server's first requests, a bench's first mode at a batch
    size)."""
    shape = info.kv.shape(slots)  # [B_max, n_kv, S_max, hd]
    return {name: np.full(shape, 0, dtype=info.kv_dtype) for name in past_names(info.num_layers)}


def append_rows(cache: dict[str, np.ndarray], out: dict[str, np.ndarray], written: list[tuple[int, int, int]]) -> None:
    """Write the new positions an append graph computed for each fed row, ``written``: (slot,
    cache length, count), from its present.* outputs [B, n_kv, T, hd] into the slot cache;
    padding past a row's count and idle rows are never written."""
    for past, array in cache.items():
        new = out[present_of(past)]  # [B, n_kv, T, hd]
        for slot, length, count in written:
            array[slot, :, length : length + count] = new[slot, :, :count]


def target_batches(manifest: Manifest, max_batch: int | None = None) -> list[int]:
    """The batch sizes the batched loop runs: those built for the target, up to ``max_batch``."""
    built = manifest.batch_sizes("target")
    return [b for b in built if max_batch is None or b <= max_batch] or [1]


class BatchedModel:
    """One model's batched engines (its decode, catchup and verify graphs at each of ``batches``)
    over one [B_max] cache, and a batch-1 runner per slot that writes into that slot's row (a
    joining sequence's prefill; a long catch-up). The target's, and a model drafter's."""

    def __init__(self, manifest: Manifest, model: str, backend: str, options: EngineOptions, shared: SharedGraphs,
                 batches: list[int], cost_ms: Callable | None = None):
        info = manifest.models[model]
        if info.attention != "ort-gqa" or backend != "onnxruntime":
            raise BadInput(f"{manifest.root}: batched decoding needs onnxruntime engines built with attention: ort-gqa"
                           + ("" if model == "target" else f" (model '{model}')"))
        built = manifest.batch_sizes(model)
        missing = [b for b in batches if b not in built]
        if missing:
            raise BadInput(f"{manifest.root}: model '{model}' has batched graphs for batch sizes {built}, not "
                           f"{missing}; rebuild with shapes.batch listing them (or lower the maximum batch)")
        self.model = model
        self.batches = batches
        self.slots = max(batches)
        self.max_seq_len = info.max_seq_len
        self.cache = slot_cache(info, self.slots)
        self.calls: dict[tuple[int, int], BatchedCall] = {}  # (B, T) -> the call
        for batch in batches:
            for entry in manifest.engines_of(model, backend, batch=batch):
                if entry.role in BATCHED_ROLES and entry.kv_update == KVUpdate.IN_PLACE:
                    engine = LazyEngine(entry, manifest.root, options, None, shared)
                    self.calls[(batch, entry.tokens)] = BatchedCall(engine, batch, entry.tokens, self.cache)
        singles = [e for e in manifest.engines_of(model, backend) if e.role.decoding]
        self.prefill = [ModelRunner(f"{model}[{slot}]", [LazyEngine(e, manifest.root, options, None, shared) for e in singles],
                                    SlotCache(self.cache, slot, info.num_layers, info.max_seq_len),
                                    {e.name: e.tokens for e in singles},
                                    {e.tokens: cost_ms(e) for e in singles} if cost_ms else None,
                                    frozenset(e.name for e in singles), roles={e.name: e.role for e in singles})
                        for slot in range(self.slots)]
        self.seconds = 0.0  # inside batched engines

    def call_for(self, rows: int, tokens: int) -> BatchedCall:
        """The smallest built batch holding ``rows``, and its smallest graph holding ``tokens``
        (or its largest, when none does: the caller trims the drafts)."""
        sizes = self.widths(rows)
        fitting = [t for t in sizes if t >= tokens]
        return self.calls[(self.batch_for(rows), fitting[0] if fitting else sizes[-1])]

    def batch_for(self, rows: int) -> int:
        """The smallest built batch size that holds ``rows``."""
        return min(b for b in self.batches if b >= rows)

    def widths(self, rows: int) -> list[int]:
        """The token counts T built at the batch size that holds ``rows``."""
        batch = self.batch_for(rows)
        return sorted(t for b, t in self.calls if b == batch)

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy slot ``src``'s first ``length`` cache positions into slot ``dst``."""
        for array in self.cache.values():
            array[dst, :, :length] = array[src, :, :length]


class BatchedTarget(BatchedModel):
    """The target's batched engines over one [B_max] cache, and a batch-1 prefill runner per slot."""

    def __init__(self, manifest: Manifest, backend: str, options: EngineOptions, shared: SharedGraphs,
                 max_batch: int | None = None, cost_ms: Callable | None = None):
        super().__init__(manifest, "target", backend, options, shared, target_batches(manifest, max_batch), cost_ms)
        self.costs: dict[tuple[int, int], float] = {}  # (B, T) -> seconds, from measure_costs
        self.drafters: dict[str, BatchDrafter] = {}  # the batched drafters over these slots, by name (made once)

    def measure_costs(self, rounds: int = 3) -> dict[tuple[int, int], float]:
        """Median seconds of every batched call (B, T), all rows full, taken in turn round after
        round. Writes into every slot: only before any sequence runs."""
        times: dict[tuple[int, int], list[float]] = {key: [] for key in self.calls}
        middle = self.max_seq_len // 2
        for round_ in range(rounds + 1):
            for (batch, tokens), call in self.calls.items():
                rows = [(middle, np.full(tokens, PAD_ID, dtype=np.int64))] * batch
                start = time.perf_counter()
                call.run(rows, want_logits=False)
                if round_:  # round 0 opens the sessions and warms up
                    times[(batch, tokens)].append(time.perf_counter() - start)
        self.costs = {key: float(np.median(v)) for key, v in times.items()}
        return self.costs
