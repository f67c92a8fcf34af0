"""Drafters in the batched loop (runtime/batch_decode.py): which can run there, and the batched
form of the drafters with a model of their own (the int4 copy of the target, draft models). The
hidden-state heads' batched forms live in runtime/batch_chain.py (EAGLE-3, MTP) and
runtime/batch_block.py (DFlash, DSpark); ``PerSlotHead`` runs a head of a directory built
without batched head graphs per row. ``BATCHED_FORMS`` maps a kind to its maker.

``batched_refusal`` is the one question ``Pipeline.batch_loop`` and ``specexport serve`` ask:
why a drafter cannot run batched (None when it can). ``batch_drafter`` makes the one that runs.

``BatchedModelDrafter`` does what ``ModelDrafter`` (runtime/drafters.py) does for one sequence,
for every running row at once, in one [B_max] cache of the draft model whose rows are the
target's slots. Each round: one batched call feeds every drafting row what its cache lacks (the
last committed token, plus the last draft after a fully accepted round: right-padded, each row
with its own ``cache_length`` and ``valid_tokens``), then k-1 batched single-token steps; a row
that drafts fewer (its own depth: budget, cache) sits idle in the later steps (valid_tokens 0:
nothing is computed into its cache). On accept each row's cache goes back to base +
min(n_accepted, k-1), as ModelDrafter's. A row that drafts nothing in a round keeps its cache, a
prefix of its context; its gap grows by the round's token, and a gap wider than the catch-up
graph is fed at batch 1 through the slot's own runner first (after rounds at depth 0). Sampled
rows draw each draft from the warped drafter distribution with their own rng and hand it to
rejection sampling, so every row's output is distributed exactly as the target's.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from specexport.contract import AUX_HIDDEN_STATES, LOGITS, NEXT_TOKENS, KVUpdate, Manifest, Role
from specexport.errors import BadInput
from specexport.runtime import batch_block, batch_chain
from specexport.runtime.acceptance import EMPTY_DRAFT, Draft, Kept, warp_row
from specexport.runtime.batch_decode import BatchDrafter, DraftRow, PerRow
from specexport.runtime.batched_model import BatchedModel, BatchedTarget, target_batches
from specexport.runtime.drafters import Drafter, TargetOut

if TYPE_CHECKING:
    from specexport.runtime.api import Pipeline

STATELESS_KINDS = ("ngram",)  # no engine state: PerRow
MODEL_KINDS = ("model", "quantized-self")  # a model with its own cache: BatchedModelDrafter
HEAD_KINDS = ("eagle3", "mtp", "dflash", "dspark")  # read the target's hidden states
CHAIN_KINDS = ("eagle3", "mtp")  # on batched head graphs: BatchedChainDrafter (without them: PerSlotHead)
BLOCK_KINDS = ("dflash", "dspark")  # on batched block graphs: BatchedBlockDrafter (without them: PerSlotHead)

_NOTHING = np.zeros(0, dtype=np.int64)  # an idle row's tokens


def batched_refusal(manifest: Manifest, drafter: str, max_batch: int | None = None) -> str | None:
    """Why ``drafter`` cannot run in the batched loop of this directory with at most
    ``max_batch`` rows; None when it can ("none" always can). An unknown name is the caller's
    to report (Pipeline.drafter, the server's own message)."""
    entry = manifest.drafters.get(drafter)
    if drafter == "none" or entry is None or entry.kind in STATELESS_KINDS:
        return None
    if entry.kind in HEAD_KINDS:
        return _head_refusal(manifest, entry.model or entry.name)
    if entry.kind not in MODEL_KINDS:
        return f"kind '{entry.kind}' has no batched form"
    model = entry.model or entry.name
    info = manifest.models[model]
    if info.attention != "ort-gqa":
        return f"its model '{model}' was built with attention: {info.attention}; batched drafting needs ort-gqa"
    steps = {e.batch for e in manifest.engines_of(model, "onnxruntime", batch=None)
             if e.role == Role.DECODE and e.tokens == 1 and e.kv_update == KVUpdate.IN_PLACE}
    need = target_batches(manifest, max_batch)
    missing = [b for b in need if b not in steps]
    if missing:
        return (f"its model '{model}' has batched graphs for batch sizes {sorted(steps)}, the target runs "
                f"{need}: rebuild with shapes.batch listing {missing} (or lower the maximum batch)")
    return None


def _head_refusal(manifest: Manifest, model: str) -> str | None:
    """A head needs its graphs (batched ones at each of the target's sizes, else its batch-1
    graphs run per slot) and the target's taps."""
    if model not in manifest.models or not manifest.engines_of(model, "onnxruntime"):
        return f"its model '{model}' has no onnxruntime graphs in this directory; rebuild it"
    if not manifest.models["target"].taps:
        return "the target's graphs output no aux_hidden_states for it; rebuild with the head in the recipe"
    return None


def batch_drafter(pipe: Pipeline, name: str, target: BatchedTarget) -> BatchDrafter:
    """The batched form of the pipeline's drafter ``name`` over ``target``'s slots, made once
    per target (BadInput when it cannot run batched)."""
    if name not in target.drafters:
        entry = pipe.manifest.drafters.get(name)
        if entry is None or entry.kind in STATELESS_KINDS:  # none, ngram (or the unknown-drafter error)
            target.drafters[name] = PerRow(pipe.drafter(name))
        else:
            reason = batched_refusal(pipe.manifest, name, target.slots)
            if reason is not None:
                raise BadInput(f"drafter '{name}' ({entry.kind}) cannot run batched: {reason}")
            target.drafters[name] = BATCHED_FORMS[entry.kind](pipe, name, target)
    return target.drafters[name]


def _batched_model(pipe: Pipeline, name: str, target: BatchedTarget) -> BatchDrafter:
    entry = pipe.manifest.drafters[name]
    model = entry.model or entry.name
    return BatchedModelDrafter(name, BatchedModel(pipe.manifest, model, pipe.backend_of(model), pipe.options,
                                                  pipe.sessions, target.batches, pipe.cost_ms))


def _chain_head(pipe: Pipeline, name: str, target: BatchedTarget) -> BatchDrafter:
    # batched head graphs when the directory has them at every batch size, else per slot
    return batch_chain.make(pipe, name, target.batches) or _per_slot_head(pipe, name, target)


def _block_head(pipe: Pipeline, name: str, target: BatchedTarget) -> BatchDrafter:
    # batched block graphs when the directory has them at every batch size, else per slot
    return batch_block.make(pipe, name, target.batches) or _per_slot_head(pipe, name, target)


def _per_slot_head(pipe: Pipeline, name: str, target: BatchedTarget) -> BatchDrafter:
    # one single-sequence head drafter per slot, each over a head cache of its own
    return PerSlotHead(name, [pipe.with_own_caches().drafter(name) for _ in range(target.slots)])


class BatchedModelDrafter:
    """A draft model (or the int4 copy) drafting for every running row at once: its cache's row
    r follows the target's slot r."""

    needs: tuple[str, ...] = ()

    def __init__(self, name: str, model: BatchedModel):
        self.name = name
        self.model = model
        self._length = [0] * model.slots  # positions each slot's row holds: its context's first ones
        self._base = [0] * model.slots  # context length at the slot's last proposal
        self._k = [0] * model.slots  # drafts of that proposal (0: none since the last accept)

    @property
    def engine_seconds(self) -> float:
        return self.model.seconds + sum(runner.seconds for runner in self.model.prefill)

    def join(self, slot: int, prompt: np.ndarray, target_out: TargetOut) -> None:
        runner = self.model.prefill[slot]
        runner.rewind(0)
        if len(prompt) <= self.model.max_seq_len:  # else the row never drafts (propose caps its depth)
            runner.forward(prompt[:-1])  # as the target: all but the last token
        self._length[slot], self._k[slot] = runner.length, 0

    def propose(self, rows: Sequence[DraftRow], ks: Sequence[int]) -> list[Draft]:
        n = len(rows)
        # within the draft cache too: the context, then k-1 drafts (and a row of padding at worst)
        ks = [max(0, min(k, self.model.max_seq_len - len(row.context))) for row, k in zip(rows, ks)]
        active = [r for r in range(n) if ks[r] > 0]
        drafts = [EMPTY_DRAFT] * n
        for r in range(n):
            self._k[r] = 0
        if not active:
            return drafts
        sampled = any(not rows[r].sampling.greedy for r in active)
        # Catch up: what each drafting row's cache lacks, in one call (T = the widest gap).
        widest = self.model.widths(n)[-1]
        feed = [_NOTHING] * n
        for r in active:
            context = rows[r].context
            # always feed the last token (its output is the first draft); what lies past it in the
            # row (a rejected draft) is overwritten
            self._length[r] = min(self._length[r], len(context) - 1)
            if len(context) - self._length[r] > widest:  # after rounds at depth 0: the rest alone, at batch 1
                self._forward_alone(r, context[self._length[r] : len(context) - widest])
            feed[r] = context[self._length[r] :]
        out = self._run(n, feed, sampled)
        at = [len(tokens) - 1 for tokens in feed]  # each row's last fed token: its first draft
        depth = max(ks)
        tokens = np.zeros((n, depth), dtype=np.int64)  # [n, k_max]
        probs: list[list[Kept]] = [[] for _ in range(n)]  # per sampled row, q of each draft
        for j in range(depth):
            for r in active:
                if j >= ks[r]:
                    continue
                row = rows[r]
                if row.sampling.greedy:
                    tokens[r, j] = out[NEXT_TOKENS][r, at[r]]
                else:
                    probs[r].append(warp_row(out[LOGITS][r, at[r]], row.sampling))
                    tokens[r, j] = probs[r][-1].draw(row.rng)
            stepping = [r for r in active if ks[r] > j + 1]  # rows that want draft j+2
            if not stepping:
                break
            feed = [tokens[r, j : j + 1] if r in stepping else _NOTHING for r in range(n)]
            out = self._run(n, feed, sampled)
            at = [0] * n
        for r in active:
            self._base[r], self._k[r] = len(rows[r].context), ks[r]
            drafts[r] = Draft(tokens[r, : ks[r]].copy(), None if rows[r].sampling.greedy else probs[r], self.name)
        return drafts

    def accept(self, slot: int, n_accepted: int, next_token: int, target_out: TargetOut) -> None:
        # The row holds the context and drafts 1..k-1; keep those the target accepted.
        if self._k[slot] == 0:
            return  # nothing drafted this round: the row is still a prefix of the context
        self._length[slot] = self._base[slot] + min(n_accepted, self._k[slot] - 1)
        self._k[slot] = 0

    def move(self, src: int, dst: int) -> None:
        self.model.move(src, dst, self._length[src])
        self._length[dst], self._base[dst], self._k[dst] = self._length[src], self._base[src], self._k[src]

    def _run(self, n: int, feed: list[np.ndarray], want_logits: bool) -> dict[str, np.ndarray]:
        """One batched call over the first ``n`` slots, each row's tokens at its own length (an
        empty row idles); the rows' lengths advance by what they were fed."""
        call = self.model.call_for(n, max(len(tokens) for tokens in feed))
        rows = [(self._length[r] if len(tokens) else 0, tokens) for r, tokens in enumerate(feed)]
        start = time.perf_counter()
        out = call.run(rows, want_logits)  # next_tokens [B, T], logits [B, T, V]
        self.model.seconds += time.perf_counter() - start
        for r, tokens in enumerate(feed):
            self._length[r] += len(tokens)
        return out

    def _forward_alone(self, slot: int, tokens: np.ndarray) -> None:
        runner = self.model.prefill[slot]
        runner.cache.seek(self._length[slot])  # type: ignore[attr-defined]  # a SlotCache
        runner.forward(tokens)
        self._length[slot] = runner.length


class PerSlotHead:
    """A hidden-state head (EAGLE-3, MTP, DFlash, DSpark) in the batched loop, per row: slot r
    runs its own single-sequence head drafter (runtime/chain_drafter.py, block_drafter.py) over
    a head cache of its own, fed its row's target features: the prefill's rows at join, then
    each round the batched verify pass's aux_hidden_states of the positions the row committed.
    A row proposes only when it drafts (k > 0), as ``decode()`` does; its committed rows wait
    as pending features until it drafts again, so a row at depth 0 catches up later. Each row
    draws from the warped head distribution with its own rng, then rejection sampling.

    The per-row adapter for a directory built before batched head graphs (batch_chain.py,
    batch_block.py run those): the head graphs are the build's batch-1 graphs, called once per
    drafting row; the target's verify pass is batched. Moving a row moves its drafter: the
    states are objects, not cache rows."""

    needs = (AUX_HIDDEN_STATES,)

    def __init__(self, name: str, drafters: list[Drafter]):
        self.name = name
        self.slots = drafters  # slot -> its sequence's head drafter

    @property
    def engine_seconds(self) -> float:
        return sum(drafter.engine_seconds for drafter in self.slots)

    def join(self, slot: int, prompt: np.ndarray, target_out: TargetOut) -> None:
        self.slots[slot].reset(prompt, target_out)

    def propose(self, rows: Sequence[DraftRow], ks: Sequence[int]) -> list[Draft]:
        return [self.slots[r].propose(row.context, k, row.sampling, row.rng) if k > 0 else EMPTY_DRAFT
                for r, (row, k) in enumerate(zip(rows, ks))]

    def accept(self, slot: int, n_accepted: int, next_token: int, target_out: TargetOut) -> None:
        self.slots[slot].accept(n_accepted, next_token, target_out)

    def move(self, src: int, dst: int) -> None:
        # the freed slot's drafter is reset when a sequence joins it
        self.slots[dst], self.slots[src] = self.slots[src], self.slots[dst]


# manifest drafter kind -> its batched form over the target's slots (none, ngram: PerRow)
BATCHED_FORMS = {**dict.fromkeys(MODEL_KINDS, _batched_model), **dict.fromkeys(CHAIN_KINDS, _chain_head),
                 **dict.fromkeys(BLOCK_KINDS, _block_head)}
