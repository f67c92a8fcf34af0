"""Block heads (DFlash, DSpark) in the batched loop, on batched block graphs: what BlockDrafter
(runtime/block_drafter.py) does for one sequence, for every running row at once.

The head's cache of context rows is one [B_max, n_kv, S_max, hd] array per layer whose row r
follows the target's slot r; slot r keeps a single-sequence BlockDrafter over that row (its
pending target features, its cache length, its numpy heads), used as it is for what one call
cannot take. A round: every drafting row whose pending context fits a round's graph (C = 1+D:
the round's committed rows, after a round at depth 0 a few more) joins one call of the batched
block graph, each at its own ``cache_length`` with its own ``context_valid`` and anchor; the
call's presents are written into each row's cache for its real context rows only, and each row
drafts from its own slice of the outputs (DSpark's Markov and confidence heads per row, in
numpy). A row with more pending context (the prompt after a join, a row back from many rounds
at depth 0) proposes alone through its BlockDrafter, at batch 1, as ``generate`` would. Rows
that do not draft sit out the call. Sampled rows draw from the warped head distribution with
their own rng, so rejection sampling keeps every row exact.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from specexport.contract import (
    AUX_HIDDEN_STATES,
    BLOCK_HIDDEN,
    CACHE_LENGTH,
    CONTEXT_FEATURES,
    CONTEXT_VALID,
    INPUT_IDS,
    LOGITS,
    NEXT_TOKENS,
    EngineEntry,
    Manifest,
    Role,
    present_names,
)
from specexport.runtime.acceptance import EMPTY_DRAFT, Draft
from specexport.runtime.batch_chain import SlotRows
from specexport.runtime.batch_decode import DraftRow
from specexport.runtime.batched_model import append_rows, slot_cache
from specexport.runtime.block_drafter import BlockDrafter, BlockRunner, load_heads, over
from specexport.runtime.drafters import TargetOut
from specexport.runtime.engine import Engine, LazyEngine

if TYPE_CHECKING:
    from specexport.runtime.api import Pipeline


class BlockCall:
    """One batched block graph (B rows, C context rows each) with its feed buffers over the
    first B slots of the head cache; it writes each fed row's real context rows into that row."""

    def __init__(self, engine: Engine, batch: int, rows: int, cache: dict[str, np.ndarray]):
        self.engine, self.batch, self.rows = engine, batch, rows
        self.cache = cache
        self.feeds: dict[str, np.ndarray] = {name: array[:batch] for name, array in cache.items()}  # [B, n_kv, S_max, hd]
        width = engine.inputs[CONTEXT_FEATURES].shape[-1]
        self.anchors = self.feeds[INPUT_IDS] = np.zeros((batch, 1), dtype=np.int64)  # [B, 1]
        self.features = self.feeds[CONTEXT_FEATURES] = np.zeros((batch, rows, width), dtype=np.float32)  # [B, C, F]
        self.valid = self.feeds[CONTEXT_VALID] = np.zeros(batch, dtype=np.int64)  # [B]
        self.lengths = self.feeds[CACHE_LENGTH] = np.zeros(batch, dtype=np.int64)  # [B]
        self.extra = [BLOCK_HIDDEN] if BLOCK_HIDDEN in engine.outputs else []
        self.presents = present_names(len(cache) // 2)
        self.seconds = 0.0

    def run(self, rows: dict[int, tuple[int, int, np.ndarray]], want_logits: bool) -> dict[str, np.ndarray]:
        """rows: slot -> (cache length, anchor, context rows [n <= C, F]); the other rows idle."""
        self.anchors.fill(0)
        self.features.fill(0.0)
        self.valid.fill(0)
        self.lengths.fill(0)
        for r, (length, anchor, context) in rows.items():
            self.anchors[r, 0] = anchor
            self.features[r, : len(context)] = context
            self.valid[r] = len(context)
            self.lengths[r] = length
        wanted = [NEXT_TOKENS, *self.presents, *([LOGITS] if want_logits else []), *self.extra]
        start = time.perf_counter()
        out = self.engine.run(self.feeds, wanted)  # next_tokens [B, n], presents [B, n_kv, C, hd], logits [B, n, V_d]
        self.seconds += time.perf_counter() - start
        append_rows(self.cache, out, [(r, length, len(context)) for r, (length, _, context) in rows.items()])
        return out


class BatchedBlockDrafter:
    """A block head drafting for every running row at once (the module docstring says how)."""

    needs = (AUX_HIDDEN_STATES,)

    def __init__(self, name: str, calls: dict[int, BlockCall], slots: list[BlockDrafter]):
        self.name = name
        self.calls = calls  # batch size -> its block call (C = 1+D)
        self.slots = slots  # slot -> the single-sequence drafter over its cache row
        self.cache = next(iter(calls.values())).cache

    @property
    def engine_seconds(self) -> float:
        return sum(c.seconds for c in self.calls.values()) + sum(d.engine_seconds for d in self.slots)

    def join(self, slot: int, prompt: np.ndarray, target_out: TargetOut) -> None:
        self.slots[slot].reset(prompt, target_out)

    def accept(self, slot: int, n_accepted: int, next_token: int, target_out: TargetOut) -> None:
        self.slots[slot].accept(n_accepted, next_token, target_out)

    def move(self, src: int, dst: int) -> None:
        length = self.slots[src].runner.cache.length
        for array in self.cache.values():
            array[dst, :, :length] = array[src, :, :length]
        self.slots[dst].adopt(self.slots[src])

    def propose(self, rows: Sequence[DraftRow], ks: Sequence[int]) -> list[Draft]:
        n = len(rows)
        call = self.calls[min(b for b in self.calls if b >= n)]
        drafts = [EMPTY_DRAFT] * n
        together: dict[int, tuple[int, int, np.ndarray]] = {}
        for r in (r for r in range(n) if ks[r] > 0):
            drafter, row = self.slots[r], rows[r]
            if drafter.pending_rows > call.rows:  # more than one call takes: alone, as BlockDrafter does it
                drafts[r] = drafter.propose(row.context, ks[r], row.sampling, row.rng)
            else:
                together[r] = (drafter.runner.cache.length, int(row.context[-1]), drafter.take_pending())
        if not together:
            return drafts
        want_logits = any(self.slots[r].heads.serial or not rows[r].sampling.greedy for r in together)
        out = call.run(together, want_logits)
        for r, (_, anchor, context) in together.items():
            drafter, row = self.slots[r], rows[r]
            drafter.runner.cache.advance(len(context))
            mine = {name: array[r : r + 1] for name, array in out.items() if not name.startswith("present.")}
            drafts[r] = drafter.draft_from(mine, anchor, ks[r], row.sampling, row.rng)
        return drafts


def block_graphs(manifest: Manifest, model: str, batches: list[int]) -> dict[int, EngineEntry] | None:
    """batch -> its block entry of a round's C (the batch-1 drafter's smallest graph, 1+D) at
    every size of ``batches``, or None when the directory lacks one (built before batched
    block graphs: the per-slot form runs)."""
    sizes = [e.tokens for e in manifest.engines_of(model, "onnxruntime") if e.role == Role.BLOCK]
    found = {}
    for batch in batches:
        entries = [e for e in manifest.engines_of(model, "onnxruntime", batch=batch)
                   if e.role == Role.BLOCK and sizes and e.tokens == min(sizes)]
        if not entries:
            return None
        found[batch] = entries[0]
    return found


def make(pipe: Pipeline, name: str, batches: list[int]) -> BatchedBlockDrafter | None:
    """The batched block drafter of the pipeline's drafter ``name`` over ``batches`` (None
    without batched block graphs for each of them)."""
    entry = pipe.manifest.drafters[name]
    model = entry.model or name
    graphs = block_graphs(pipe.manifest, model, batches)
    if graphs is None:
        return None
    info = pipe.manifest.models[model]
    cache = slot_cache(info, max(batches))

    def engine(e) -> LazyEngine:
        return LazyEngine(e, pipe.manifest.root, pipe.options, None, pipe.sessions)

    calls = {b: BlockCall(engine(e), b, e.tokens, cache) for b, e in graphs.items()}
    singles = [e for e in pipe.manifest.engines_of(model, "onnxruntime") if e.role == Role.BLOCK]
    heads = load_heads(entry, pipe.manifest.root)  # read once, shared by the slots
    slots = [over(entry, BlockRunner(f"{model}[{slot}]", [engine(e) for e in singles],
                                     SlotRows(cache, slot, info.num_layers, info.max_seq_len),
                                     {e.name: e.tokens for e in singles}), heads.for_sequence())
             for slot in range(max(batches))]
    return BatchedBlockDrafter(name, calls, slots)
