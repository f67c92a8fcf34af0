"""Chain heads (EAGLE-3, MTP) in the batched loop, on batched head graphs: what ChainDrafter
(runtime/chain_drafter.py) does for one sequence, for every running row at once.

The head's cache is one [B_max, n_kv, S_max, hd] array per layer whose row r follows the
target's slot r. Each slot keeps ChainDrafter's state: the committed rows in its cache (row p
pairs token x_{p+1} with the target's features of position p) and the target's features of
newly committed positions, pending until the row drafts again. A round:

- catch-up: one call of the batched catch-up graph (T = 1+D) feeds every drafting row its
  pending rows, right-padded, each at its own ``cache_length``; the last real row's output is
  its first draft. Rows with more pending rows than T (the prompt after a join, a row back from
  rounds at depth 0) feed the rest first alone, at batch 1, into their own cache row;
- steps: draft j+1 of every row that wants it comes from one call of the batched step graph
  (T = 1), fed draft j and the head's own hidden of the row before, at cache_length
  committed + j. A row that drafts fewer sits out the later calls.

The head graphs are append graphs (no valid_tokens): the runtime writes each row's first real
positions into its cache row and nothing for padding or idle rows, whose outputs are ignored.
Step positions lie past the committed rows and are simply overwritten by the next catch-up.
Sampled rows draw each draft from the warped head distribution with their own rng (the same
draws, in the same order, as ChainDrafter), so rejection sampling keeps every row exact.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from specexport.contract import (
    AUX_HIDDEN_STATES,
    CACHE_LENGTH,
    DRAFT_FEATURES,
    HIDDEN_OUT,
    INPUT_IDS,
    LOGITS,
    NEXT_TOKENS,
    Manifest,
    Role,
    present_names,
    present_of,
)
from specexport.runtime.acceptance import EMPTY_DRAFT, Draft, Kept, warp_row
from specexport.runtime.batch_decode import DraftRow
from specexport.runtime.batched_model import append_rows, slot_cache
from specexport.runtime.drafters import TargetOut
from specexport.runtime.engine import Engine, LazyEngine
from specexport.runtime.kv_cache import CacheLength, KVCache
from specexport.runtime.runner import PAD_ID, ModelRunner

if TYPE_CHECKING:
    from specexport.runtime.api import Pipeline

CATCHUP_ROLES = frozenset({Role.CATCHUP, Role.PREFILL})  # a slot's batch-1 catch-up (chain_drafter's)


class SlotRows(KVCache):
    """Slot ``slot`` of an append-written [B_max] cache seen as a batch-1 KVCache: a batch-1
    runner's writes land in that row."""

    def __init__(self, tensors: dict[str, np.ndarray], slot: int, num_layers: int, max_seq_len: int):
        CacheLength.__init__(self, num_layers, max_seq_len)
        self._tensors = {name: array[slot : slot + 1] for name, array in tensors.items()}  # [1, n_kv, S_max, hd] views
        self._present_names = {name: present_of(name) for name in self._tensors}

    def seek(self, length: int) -> None:
        """The row holds ``length`` positions (batched calls write it without counting here)."""
        if not 0 <= length <= self.max_seq_len:
            raise ValueError(f"a slot of {self.max_seq_len} positions cannot hold {length}")
        self.length = length


class HeadCall:
    """One batched head graph (B rows, T tokens) with its feed buffers over the first B slots of
    the head cache; it writes each fed row's new positions into that row."""

    def __init__(self, engine: Engine, batch: int, tokens: int, cache: dict[str, np.ndarray]):
        self.engine, self.batch, self.tokens = engine, batch, tokens
        self.cache = cache
        self.feeds: dict[str, np.ndarray] = {name: array[:batch] for name, array in cache.items()}  # [B, n_kv, S_max, hd]
        width = engine.inputs[DRAFT_FEATURES].shape[-1]
        self.ids = self.feeds[INPUT_IDS] = np.full((batch, tokens), PAD_ID, dtype=np.int64)  # [B, T]
        self.features = self.feeds[DRAFT_FEATURES] = np.zeros((batch, tokens, width), dtype=np.float32)  # [B, T, F]
        self.lengths = self.feeds[CACHE_LENGTH] = np.zeros(batch, dtype=np.int64)  # [B]
        self.presents = present_names(len(cache) // 2)
        self.seconds = 0.0

    def run(self, rows: dict[int, tuple[int, np.ndarray, np.ndarray]], want_logits: bool) -> dict[str, np.ndarray]:
        """rows: slot -> (cache length, tokens [n], features [n, F]), n <= T; the other rows idle."""
        self.ids.fill(PAD_ID)
        self.features.fill(0.0)
        self.lengths.fill(0)
        for r, (length, tokens, features) in rows.items():
            self.ids[r, : len(tokens)] = tokens
            self.features[r, : len(tokens)] = features
            self.lengths[r] = length
        wanted = [NEXT_TOKENS, HIDDEN_OUT, *self.presents, *([LOGITS] if want_logits else [])]
        start = time.perf_counter()
        out = self.engine.run(self.feeds, wanted)  # next_tokens [B, T], hidden_out [B, T, H], presents [B, n_kv, T, hd]
        self.seconds += time.perf_counter() - start
        append_rows(self.cache, out, [(r, length, len(tokens)) for r, (length, tokens, _) in rows.items()])
        return out


class BatchedChainDrafter:
    """A chain head drafting for every running row at once (the module docstring says how)."""

    needs = (AUX_HIDDEN_STATES,)

    def __init__(self, name: str, catchup: dict[int, HeadCall], step: dict[int, HeadCall], alone: list[ModelRunner],
                 max_seq_len: int):
        self.name = name
        self.catchup, self.step = catchup, step  # batch size -> its call
        self.alone = alone  # slot -> a batch-1 catch-up runner over its cache row
        self.cache = next(iter(catchup.values())).cache
        self.max_seq_len = max_seq_len
        self.width = next(iter(catchup.values())).tokens  # T of the catch-up graphs (1+D)
        self._committed = [0] * len(alone)  # committed rows in each slot's cache row
        self._pending: list[list[np.ndarray]] = [[] for _ in alone]  # [n, F] features not yet fed, per slot

    @property
    def engine_seconds(self) -> float:
        calls = [*self.catchup.values(), *self.step.values()]
        return sum(c.seconds for c in calls) + sum(runner.seconds for runner in self.alone)

    def join(self, slot: int, prompt: np.ndarray, target_out: TargetOut) -> None:
        self._committed[slot] = 0
        rows = target_out.get(AUX_HIDDEN_STATES)
        self._pending[slot] = [] if rows is None or not len(rows) else [np.array(rows, dtype=np.float32)]

    def accept(self, slot: int, n_accepted: int, next_token: int, target_out: TargetOut) -> None:
        rows = target_out.get(AUX_HIDDEN_STATES)
        if rows is not None and len(rows):
            self._pending[slot].append(np.array(rows, dtype=np.float32))  # copied: valid during the call only

    def move(self, src: int, dst: int) -> None:
        for array in self.cache.values():
            array[dst, :, : self._committed[src]] = array[src, :, : self._committed[src]]
        self._committed[dst], self._pending[dst] = self._committed[src], self._pending[src]
        self._pending[src] = []

    def propose(self, rows: Sequence[DraftRow], ks: Sequence[int]) -> list[Draft]:
        n = len(rows)
        batch = min(b for b in self.catchup if b >= n)
        # as ChainDrafter: a row drafts when asked to and it has committed rows to feed
        active = [r for r in range(n) if ks[r] > 0 and self._pending[r]]
        drafts = [EMPTY_DRAFT] * n
        if not active:
            return drafts
        sampled = any(not rows[r].sampling.greedy for r in active)
        feed = {r: self._catch_up(r, rows[r].context) for r in active}  # slot -> (cache length, tokens, features)
        out = self.catchup[batch].run(feed, sampled)
        at = {r: len(feed[r][1]) - 1 for r in active}  # each row's last fed row: its first draft
        depth = {r: min(ks[r], self.max_seq_len - self._committed[r] + 1) for r in active}  # step rows fit the cache
        tokens = np.zeros((n, max(depth.values())), dtype=np.int64)  # [n, k_max]
        probs: dict[int, list[Kept]] = {r: [] for r in active}
        for j in range(tokens.shape[1]):
            for r in (r for r in active if j < depth[r]):
                tokens[r, j] = self._draw(out, r, at[r], rows[r], probs[r])
            stepping = [r for r in active if depth[r] > j + 1]  # rows that want draft j+2
            if not stepping:
                break
            out = self.step[batch].run({r: (self._committed[r] + j, tokens[r, j : j + 1],
                                            out[HIDDEN_OUT][r, at[r] : at[r] + 1]) for r in stepping}, sampled)
            at = dict.fromkeys(stepping, 0)
        for r in active:
            drafts[r] = Draft(tokens[r, : depth[r]].copy(), None if rows[r].sampling.greedy else probs[r], self.name)
        return drafts

    def _catch_up(self, slot: int, context: np.ndarray) -> tuple[int, np.ndarray, np.ndarray]:
        """The slot's pending rows as one row of the batched catch-up call: (cache length,
        tokens, features); what the call cannot take goes first, alone, through the slot's
        batch-1 runner. The rows count as committed from here on."""
        features = np.concatenate(self._pending[slot])  # [m, F]
        self._pending[slot] = []
        start = self._committed[slot]
        tokens = context[start + 1 : start + 1 + len(features)]  # row p: token x_{p+1}
        extra = len(features) - self.width
        if extra > 0:  # the prompt after a join, a row back from rounds at depth 0
            runner = self.alone[slot]
            runner.cache.seek(start)  # type: ignore[attr-defined]  # a SlotRows
            runner.forward(tokens[:extra], inputs={DRAFT_FEATURES: features[:extra]})
            start, tokens, features = start + extra, tokens[extra:], features[extra:]
        self._committed[slot] = start + len(tokens)
        return start, tokens, features

    @staticmethod
    def _draw(out: dict[str, np.ndarray], r: int, at: int, row: DraftRow, probs: list[Kept]) -> int:
        """Row r's draft from its output at ``at``: the argmax, or drawn with the row's rng from
        the warped head distribution (kept for rejection sampling)."""
        if row.sampling.greedy:
            return int(out[NEXT_TOKENS][r, at])
        probs.append(warp_row(out[LOGITS][r, at], row.sampling))  # over target ids (-inf outside the draft vocabulary)
        return int(probs[-1].draw(row.rng))


def chain_graphs(manifest: Manifest, model: str, batches: list[int]) -> dict[int, tuple] | None:
    """batch -> (its catch-up entry, its step entry) at every size of ``batches``, or None when
    the directory lacks one (built before batched head graphs: the per-slot form runs)."""
    found = {}
    for batch in batches:
        entries = manifest.engines_of(model, "onnxruntime", batch=batch)
        catchup = [e for e in entries if e.role == Role.CATCHUP]
        step = [e for e in entries if e.role == Role.STEP]
        if not catchup or not step:
            return None
        found[batch] = (catchup[0], step[0])
    return found


def make(pipe: Pipeline, name: str, batches: list[int]) -> BatchedChainDrafter | None:
    """The batched chain drafter of the pipeline's drafter ``name`` over ``batches`` (None
    without batched head graphs for each of them)."""
    model = pipe.manifest.drafters[name].model or name
    graphs = chain_graphs(pipe.manifest, model, batches)
    if graphs is None:
        return None
    info = pipe.manifest.models[model]
    slots = max(batches)
    cache = slot_cache(info, slots)

    def call(entry) -> HeadCall:
        return HeadCall(LazyEngine(entry, pipe.manifest.root, pipe.options, None, pipe.sessions), entry.batch,
                        entry.tokens, cache)

    catchup = {b: call(c) for b, (c, _) in graphs.items()}
    step = {b: call(s) for b, (_, s) in graphs.items()}
    singles = [e for e in pipe.manifest.engines_of(model, "onnxruntime") if e.role in CATCHUP_ROLES]
    alone = [ModelRunner(f"{model}[{slot}]", [LazyEngine(e, pipe.manifest.root, pipe.options, None, pipe.sessions)
                                             for e in singles],
                         SlotRows(cache, slot, info.num_layers, info.max_seq_len), {e.name: e.tokens for e in singles},
                         {e.tokens: pipe.cost_ms(e) for e in singles}, roles={e.name: e.role for e in singles})
             for slot in range(slots)]
    return BatchedChainDrafter(name, catchup, step, alone, info.max_seq_len)
