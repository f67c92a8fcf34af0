"""Block drafters (DFlash, DSpark): one graph call drafts a whole block from the target's features.

The drafter keeps its own KV cache of the *context*: the target's tapped features of every
committed position but the last (the anchor, which the target has not seen yet). After the
prefill and after each verify pass the committed rows wait as pending context; ``propose``
hands them to the block graph of the right size (C = 1+D each round, the prefill chunk for a
prompt), which appends them to the cache and drafts the block after the anchor. The block's own
positions are never cached, so nothing is rewound when drafts are rejected.

DSpark adds two small heads that run here in numpy after the graph (the block graph gives their
inputs, ``block_hidden``): a Markov head that refines the block serially (slot k's logits get a
low-rank bias from the token drafted before it) and a confidence head whose running product
predicts how far the drafts will be accepted; with ``confidence_threshold`` > 0 the draft is cut
where the product falls below it (a depth signal on top of the adaptive depth's own choice).
Sampling stays exact: each draft's q is the warped distribution it was drawn from, over target
ids (a reduced draft vocabulary is mapped back through d2t).

A tree (``BlockSlot.tree``) branches where the block is unsure: the greedy block is
the spine, each position's top-k hang under the spine node before it as leaves, and the nodes
of highest joint draft probability are verified (runtime/tree.py ``spine_tree``). A block's
positions are drafted together (DSpark's serial head conditions each on the spine's token
before it), so only the spine can be extended; nothing is cached for the block's positions, so
nothing changes for the cache.

Rows of a batch: each slot keeps a ``BlockSlot`` (its pending features, its cache row, its
numpy heads). One running row proposes through its slot alone, at batch 1. With more, every
drafting row whose pending context fits a round's graph (C = 1+D) joins one call of the
batched block graph, each at its own ``cache_length`` with its own ``context_valid`` and
anchor; the runtime writes each row's real context rows into its cache row, and each row drafts
from its own slice of the outputs (a chain, or for a tree budget its tree). A row with more
pending context (the prompt after a join, a row back from rounds at depth 0) proposes alone
through its slot.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from specexport.contract import (
    AUX_HIDDEN_STATES,
    BLOCK_HIDDEN,
    CACHE_LENGTH,
    CONTEXT_FEATURES,
    CONTEXT_VALID,
    LOGITS,
    NEXT_TOKENS,
    PRESENT,
    Role,
    present_names,
)
from specexport.runtime.acceptance import EMPTY_DRAFT, Draft, Kept, Sampling, warp_row
from specexport.runtime.cache_store import Store
from specexport.runtime.drafters import ChainsAndTrees, DraftBudget, DraftRow, PartCosts, TargetOut
from specexport.runtime.engine import Engine
from specexport.runtime.graph_call import GraphCall, TimedCalls
from specexport.runtime.kv_cache import CacheLength
from specexport.runtime.model import BatchedCall
from specexport.runtime.tree import DraftTree, SizeHint, grow_spine, top_candidates

PAD_ID = 0  # the anchor of a call whose drafts are thrown away (a prompt chunk)


class BlockRunner(TimedCalls):
    """A block head's graphs, one per context size C, over its own KV cache (a GraphCall each).
    Also what the build's interleaved timing runs (``sizes``, ``time_run``, ``end_timing``,
    ``engine_at``)."""

    def __init__(self, name: str, engines: Sequence[Engine], cache, tokens_of: dict[str, int]):
        self.name = name
        self.cache = cache
        self._by_size = dict(sorted(((tokens_of[e.name], e) for e in engines), key=lambda pair: pair[0]))
        # the presents come back and are appended by the cache (``write``), which counts its length
        self._calls = {size: GraphCall(engine, cache.view(), presents=present_names(cache.num_layers))
                       for size, engine in self._by_size.items()}

    @property
    def sizes(self) -> list[int]:
        return list(self._by_size)

    def engine_at(self, size: int) -> str:
        return self._by_size[size].name

    def feeds(self, size: int) -> dict[str, np.ndarray]:
        """The feed buffers of the graph of ``size`` context rows (a cost script fills them)."""
        return self._calls[size].feeds

    def fitting(self, rows: int) -> int:
        """The smallest graph that takes ``rows`` context rows (the largest when none does)."""
        return next((s for s in self._by_size if s >= rows), self.sizes[-1])

    def _wanted(self, size: int, want_logits: bool) -> list[str]:
        extra = [BLOCK_HIDDEN] if BLOCK_HIDDEN in self._by_size[size].outputs else []
        return [NEXT_TOKENS, *([LOGITS] if want_logits else []), *extra]

    def run(self, size: int, anchor: int, rows: np.ndarray, want_logits: bool = False) -> dict[str, np.ndarray]:
        """Append ``rows`` [n <= size, F] to the cache and draft the block after ``anchor``."""
        count = len(rows)
        if count > self.cache.free:
            raise ValueError(f"{self.name}: {count} context rows do not fit in {self.cache.free} free cache slots")
        call = self._calls[size]
        call.feed_row(0, self.cache.length, np.array([anchor]), {CONTEXT_FEATURES: rows}, count)
        out = call.run(self._wanted(size, want_logits))
        self.cache.write(out, count)
        return out

    def time_run(self, size: int, want_logits: bool = False) -> float:
        """Seconds of one run of the graph of ``size`` rows over a half-full cache (nothing written)."""
        feeds = self._calls[size].feeds
        feeds[CACHE_LENGTH][0] = (self.cache.max_seq_len - size) // 2
        feeds[CONTEXT_VALID][0] = size
        return self._calls[size].time(self._wanted(size, want_logits))

    def end_timing(self, sizes: Sequence[int]) -> None:
        pass  # append graphs only read the cache while timed


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


class BlockHeads:
    """DSpark's Markov and confidence heads (and a reduced vocabulary's d2t), in numpy.
    The math, per drafting slot k with prev_0 = the anchor and prev_k = the token drafted at
    slot k-1 (target ids), h_k = block_hidden[k], e = W1[prev_k] (rank r):

        vanilla  bias = W2 e
        gated    bias = W2 (sigmoid(G [h; e] + g) * e)
        rnn      (a, c, o) = J [s; e; h] + j;  s <- sig(a) s + (1 - sig(a)) tanh(c);  bias = W2 tanh(o)
        logits_k = base_k + bias                                   (draft vocabulary)
        conf_k   = sigmoid(w . [h; e] + b)   (w . h + b without the Markov features)
    """

    def __init__(self, arrays: dict[str, np.ndarray], markov: str | None, with_markov: bool):
        self.d2t = arrays.get("d2t")  # [V_draft] target ids, or None
        self.markov = markov
        self.w1, self.w2 = arrays.get("markov_w1"), arrays.get("markov_w2")  # [V_t, r], [V_d, r]
        self.gate_w, self.gate_b = arrays.get("markov_gate_w"), arrays.get("markov_gate_b")  # [r, H+r], [r]
        self.joint_w, self.joint_b = arrays.get("markov_joint_w"), arrays.get("markov_joint_b")  # [3r, 2r+H], [3r]
        self.conf_w, self.conf_b = arrays.get("confidence_w"), arrays.get("confidence_b")  # [H(+r)], [1]
        self.with_markov = with_markov
        self._state: np.ndarray | None = None  # the rnn head's state [r]

    @property
    def serial(self) -> bool:
        """Whether slots depend on the drafts before them (a Markov head), or a confidence head reads them."""
        return self.markov is not None or self.conf_w is not None

    def start(self) -> None:
        self._state = None if self.w1 is None else np.zeros(self.w1.shape[1], dtype=np.float32)

    def for_sequence(self) -> BlockHeads:
        """Heads for one more sequence over the same arrays (read only; a Markov head's are tens of
        MB): only the rnn state is a sequence's own."""
        heads = copy.copy(self)
        heads._state = None
        return heads

    def step(self, base: np.ndarray, hidden: np.ndarray, prev: int) -> tuple[np.ndarray, float | None]:
        """Slot k: (corrected logits [V_d], confidence or None) given the token before it."""
        emb = self.w1[prev] if self.w1 is not None else None  # [r]
        logits = base if self.markov is None else base + self.w2 @ MARKOV_FEATURES[self.markov](self, hidden, emb)
        confidence = None
        if self.conf_w is not None:
            feats = np.concatenate((hidden, emb)) if self.with_markov else hidden
            confidence = float(_sigmoid(self.conf_w @ feats + self.conf_b[0]))
        return logits, confidence

    def target_id(self, draft_id: int) -> int:
        return int(self.d2t[draft_id]) if self.d2t is not None else int(draft_id)

    def kept(self, row: Kept) -> Kept:
        """A warped row over the draft vocabulary as one over target ids (ascending)."""
        if self.d2t is None:
            return row
        ids = self.d2t if row.ids is None else self.d2t[row.ids]
        order = np.argsort(ids, kind="stable")
        return Kept(ids[order], np.asarray(row.probs)[order])


def _vanilla(heads: BlockHeads, hidden: np.ndarray, emb: np.ndarray) -> np.ndarray:
    return emb  # [r]


def _gated(heads: BlockHeads, hidden: np.ndarray, emb: np.ndarray) -> np.ndarray:
    gate = _sigmoid(heads.gate_w @ np.concatenate((hidden, emb)) + heads.gate_b)  # [r]
    return gate * emb


def _rnn(heads: BlockHeads, hidden: np.ndarray, emb: np.ndarray) -> np.ndarray:
    a, c, o = np.split(heads.joint_w @ np.concatenate((heads._state, emb, hidden)) + heads.joint_b, 3)  # [r] x3
    heads._state = _sigmoid(a) * heads._state + (1 - _sigmoid(a)) * np.tanh(c)
    return np.tanh(o)


# Markov head kind -> the rank-r features W2 turns into the slot's logit bias
MARKOV_FEATURES = {"vanilla": _vanilla, "gated": _gated, "rnn": _rnn}


class BlockSlot:
    """One sequence's block drafting over its BlockRunner (its cache row)."""

    def __init__(self, name: str, runner: BlockRunner, heads: BlockHeads, drafts: int, round_rows: int,
                 confidence_threshold: float = 0.0):
        self.name = name
        self.runner = runner
        self.heads = heads
        self.drafts = drafts  # drafting slots per block
        self.round_rows = round_rows  # C of a round's graph (1+D)
        self.threshold = confidence_threshold
        self._pending: list[np.ndarray] = []  # committed rows not yet in the cache: [n, F] each
        self.last_confidence: np.ndarray | None = None  # the last proposal's running products

    def reset(self, prompt: np.ndarray, target_out) -> None:
        self.runner.cache.set_length(0)
        self._pending = [np.array(target_out[AUX_HIDDEN_STATES], dtype=np.float32)]  # rows of prompt[:-1]

    def accept(self, n_accepted: int, next_token: int, target_out) -> None:
        # the round's first token and the accepted drafts (next_token is the next anchor); a
        # round without a proposal leaves its rows pending too
        self._pending.append(np.array(target_out[AUX_HIDDEN_STATES], dtype=np.float32))

    @property
    def pending_rows(self) -> int:
        """Committed rows not yet in the cache."""
        return sum(len(rows) for rows in self._pending)

    def take_pending(self) -> np.ndarray:
        """The pending rows [n, F], handed to a caller that feeds them (a batched block call)."""
        rows = np.concatenate(self._pending) if len(self._pending) > 1 else self._pending[0]  # [n, F]
        self._pending = []
        return rows

    def adopt(self, other: BlockSlot) -> None:
        """Take over ``other``'s sequence: its pending rows and its cache length (the caller
        copies the cache rows; a batched loop's row moving to another slot)."""
        self._pending, other._pending = other._pending, []
        self.runner.cache.set_length(0)
        self.runner.cache.advance(other.runner.cache.length)

    def _flush(self, anchor: int, want_logits: bool) -> dict[str, np.ndarray]:
        """Feed every pending row (whole prompt chunks first), the last call drafting after ``anchor``."""
        rows = self.take_pending()
        largest = self.runner.sizes[-1]
        while len(rows) > largest:  # a long prompt: whole chunks, their drafts unused
            self.runner.run(largest, PAD_ID, rows[:largest])
            rows = rows[largest:]
        size = self.round_rows if len(rows) <= self.round_rows else self.runner.fitting(len(rows))
        return self.runner.run(size, anchor, rows, want_logits)

    def chain(self, context: np.ndarray, k: int, sampling: Sampling, rng: np.random.Generator) -> Draft:
        serial = self.heads.serial
        out = self._flush(int(context[-1]), serial or not sampling.greedy)
        return self.draft_from(out, int(context[-1]), k, sampling, rng)

    def draft_from(self, out: dict[str, np.ndarray], anchor: int, k: int, sampling: Sampling,
                   rng: np.random.Generator) -> Draft:
        """Up to ``k`` drafts from a block call's outputs (row 0 of each: [1, n, ...]) after ``anchor``."""
        k = min(k, self.drafts)
        if k <= 0:
            return EMPTY_DRAFT
        if self.heads.serial:
            return self._serial(out, anchor, k, sampling, rng)
        return self._parallel(out, k, sampling, rng)

    def tree(self, context: np.ndarray, k: int, nodes: int, top_k: int, hint: SizeHint | None = None) -> DraftTree:
        """Up to ``nodes`` of the block's top-k per position over its greedy spine of up to ``k``
        (runtime/tree.py grow_spine; DSpark's serial head conditions each position on the spine's
        token before it)."""
        anchor = int(context[-1])
        return self.tree_from(self._flush(anchor, True), anchor, k, nodes, top_k, hint)

    def tree_from(self, out: dict[str, np.ndarray], anchor: int, k: int, nodes: int, top_k: int,
                  hint: SizeHint | None = None) -> DraftTree:
        """``tree`` from a block call's outputs (row 0 of each: [1, n, ...]) after ``anchor``."""
        base = out[LOGITS][0]  # [n, V_d]
        hidden = out[BLOCK_HIDDEN][0] if self.heads.serial else None  # [n, H]
        if hidden is not None:
            self.heads.start()
        position = iter(range(len(base)))

        def next_logits(token: int | None) -> np.ndarray:  # [V_d] the next position's
            j = next(position)
            return self.heads.step(base[j], hidden[j], anchor if token is None else token)[0] \
                if hidden is not None else base[j]

        def top(logits: np.ndarray, count: int) -> tuple[np.ndarray, np.ndarray]:  # over target ids
            ids, logp = top_candidates(logits, count)
            return np.array([self.heads.target_id(int(i)) for i in ids], dtype=np.int64), logp

        return grow_spine(next_logits, min(k, self.drafts), nodes, top_k, f"{self.name}/tree", top, hint)

    def _parallel(self, out, k, sampling, rng) -> Draft:
        """DFlash: every slot's distribution is fixed by the block; each is drawn on its own."""
        if sampling.greedy:
            return Draft(out[NEXT_TOKENS][0, :k].astype(np.int64), None, self.name)
        probs = [self.heads.kept(warp_row(out[LOGITS][0, j], sampling)) for j in range(k)]
        return Draft(np.array([p.draw(rng) for p in probs], dtype=np.int64), probs, self.name)

    def _serial(self, out, anchor, k, sampling, rng) -> Draft:
        """DSpark: slot by slot, each conditioned on the token drafted before it."""
        heads = self.heads
        base, hidden = out[LOGITS][0], out[BLOCK_HIDDEN][0]  # [n, V_d], [n, H]
        heads.start()
        tokens, probs, products = [], [], []
        running, prev = 1.0, anchor
        for j in range(k):
            logits, confidence = heads.step(base[j], hidden[j], prev)  # [V_d]
            if confidence is not None:
                running *= confidence
                if self.threshold > 0 and running < self.threshold and j > 0:
                    break  # the drafts from here on are predicted to be rejected
                products.append(running)
            if sampling.greedy:
                token = heads.target_id(int(np.argmax(logits)))
            else:
                probs.append(heads.kept(warp_row(logits, sampling)))
                token = probs[-1].draw(rng)
            tokens.append(token)
            prev = token
        self.last_confidence = np.array(products) if products else None
        return Draft(np.array(tokens, dtype=np.int64), probs if not sampling.greedy else None, self.name)


def load_heads(entry, root) -> BlockHeads:
    """The entry's numpy heads (DSpark's Markov and confidence heads, a reduced vocabulary's d2t)."""
    params = entry.settings
    arrays: dict[str, np.ndarray] = {}
    if params.heads_file:
        with np.load(Path(root) / params.heads_file, allow_pickle=False) as data:
            arrays = {key: data[key] for key in data.files}
    return BlockHeads(arrays, params.markov, params.confidence_with_markov)


class BlockDrafter(ChainsAndTrees):
    """A block head drafting for every running row (the module docstring says how)."""

    needs = (AUX_HIDDEN_STATES,)

    def __init__(self, name: str, calls: dict[int, BatchedCall], slots: list[BlockSlot], round_ms: float,
                 store: Store | None):
        self.name = name
        self.store = store  # the head cache [slots, n_kv, S_max, hd] (None: one slot)
        self.calls = calls  # batch size (>= 2) -> its block graph (C = 1+D context rows)
        self.slots = slots  # slot -> the sequence's drafting over its cache row
        self.round_ms = round_ms  # one block call of a round's C, batch 1

    @property
    def engine_seconds(self) -> float:
        return sum(c.seconds for c in self.calls.values()) + sum(s.runner.seconds for s in self.slots)

    def round_cost(self, k: int, costs: PartCosts | None = None) -> float:
        """One block call per round whatever its depth (a skipped round's rows wait for the next)."""
        ms = costs["block"].get(self.slots[0].round_rows, 0.0) if costs else self.round_ms
        return ms / 1e3 if k > 0 else 0.0

    def cost_graphs(self) -> dict[str, tuple[object, list[int]]]:
        return {"block": (self.slots[0].runner, [self.slots[0].round_rows])}

    def join(self, slot: int, prompt: np.ndarray, target_out: TargetOut) -> None:
        self.slots[slot].reset(prompt, target_out)

    def accept(self, slot: int, n_accepted: int, next_token: int, target_out: TargetOut) -> None:
        self.slots[slot].accept(n_accepted, next_token, target_out)

    def move(self, src: int, dst: int) -> None:
        length = self.slots[src].runner.cache.length
        if self.store is not None:
            self.store.move(src, dst, length)
        self.slots[dst].adopt(self.slots[src])

    def trees(self, rows: Sequence[DraftRow], budget: DraftBudget) -> list[DraftTree | None]:
        """Each drafting row's tree (BlockSlot.tree): rows whose pending context fits a round's
        graph from one call of the batched block graph, as ``chains``; the others alone."""
        depths, nodes, top_k = budget.depths, budget.nodes, budget.top_k
        trees: list[DraftTree | None] = [None] * len(rows)
        drafting = [r for r, slot in enumerate(self.slots[: len(rows)])
                    if slot.pending_rows and min(depths[r], slot.drafts) > 0]
        call, together = self._together(rows, drafting)
        for r in (r for r in drafting if r not in together):
            trees[r] = self.slots[r].tree(rows[r].context, depths[r], nodes, top_k, rows[r].tree_size)
        if call is not None and together:
            for r, (out, anchor) in self._run_together(call, together, True).items():
                trees[r] = self.slots[r].tree_from(out, anchor, depths[r], nodes, top_k, rows[r].tree_size)
        return trees

    def chains(self, rows: Sequence[DraftRow], ks: Sequence[int]) -> list[Draft]:
        drafts = [EMPTY_DRAFT] * len(rows)
        drafting = [r for r in range(len(rows)) if ks[r] > 0]
        call, together = self._together(rows, drafting)
        for r in (r for r in drafting if r not in together):  # alone, at batch 1
            drafts[r] = self.slots[r].chain(rows[r].context, ks[r], rows[r].sampling, rows[r].rng)
        if call is not None and together:
            want_logits = any(self.slots[r].heads.serial or not rows[r].sampling.greedy for r in together)
            for r, (out, anchor) in self._run_together(call, together, want_logits).items():
                drafts[r] = self.slots[r].draft_from(out, anchor, ks[r], rows[r].sampling, rows[r].rng)
        return drafts

    def _together(self, rows: Sequence[DraftRow], drafting: list[int]) -> tuple[BatchedCall | None, dict[int, tuple]]:
        """The batched block graph for the rows (None at one row or without one) and the
        drafting rows whose pending context fits it: slot -> (its cache length, [anchor], its
        context rows), taken from the slots; the others draft alone."""
        n = len(rows)
        call = self.calls[min(b for b in self.calls if b >= n)] if n > 1 and self.calls else None
        if call is None:
            return None, {}
        return call, {r: (self.slots[r].runner.cache.length, rows[r].context[-1:],
                          {CONTEXT_FEATURES: self.slots[r].take_pending()})
                      for r in drafting if self.slots[r].pending_rows <= call.tokens}

    def _run_together(self, call: BatchedCall, together: dict[int, tuple], want_logits: bool
                      ) -> dict[int, tuple[dict[str, np.ndarray], int]]:
        """One call of the batched block graph for ``together``: slot -> (its outputs as a
        batch-1 call's, [1, n, ...], and its anchor)."""
        extra = [BLOCK_HIDDEN] if BLOCK_HIDDEN in call.engine.outputs else []
        out = call.run(together, want_logits, extra)  # next_tokens [B, n], logits [B, n, V_d], block_hidden [B, n, H]
        mine = {}
        for r, (_, anchor, context) in together.items():
            self.slots[r].runner.cache.advance(len(context[CONTEXT_FEATURES]))
            mine[r] = ({name: array[r : r + 1] for name, array in out.items() if not name.startswith(PRESENT)},
                       int(anchor[0]))
        return mine


def make(pipe, entry, slots: int) -> BlockDrafter:
    """The drafter of a manifest entry of kind dflash or dspark over ``slots`` rows: a slot's
    smallest graph takes a round's rows (C = 1+D), its largest a prompt's chunks."""
    model = entry.model or entry.name
    head = pipe.model(model, frozenset({Role.BLOCK}), slots, make_runner=_block_runner)
    heads = load_heads(entry, pipe.manifest.root)  # read once, shared by the slots
    states = [BlockSlot(entry.name, runner, heads.for_sequence(), entry.settings.drafts, runner.sizes[0],
                        entry.settings.confidence_threshold) for runner in head.runners]
    round_rows = states[0].round_rows
    calls = {b: call for (b, t), call in head.calls.items() if t == round_rows}  # B -> the block graph of a round
    round_ms = pipe.costs_by_role(model).get(Role.BLOCK, {}).get(round_rows, 0.0)
    return BlockDrafter(entry.name, calls, states, round_ms, head.caches.store)


def _block_runner(name: str, engines: list, cache: CacheLength, entries: list) -> BlockRunner:
    return BlockRunner(name, engines, cache, {e.name: e.tokens for e in entries})
