"""The target's tree verify pass (Role.TREE) over the first B slots of its cache, and the cache
compaction after it.

A round feeds each row the root (its last committed token) and its tree's nodes, padded to the
graph's 1 + N rows (a pad is a leaf under the root that nobody reads), at the row's cache length
L; a batch's rows share the graph of the largest tree, and a slot that is not running idles
(length 0, nothing written). After acceptance a row's root and accepted path must sit at L,
L+1, ...: an in-place graph (ort-gqa) wrote row r at L + r, so the path's rows are copied down
within the row's cache (row p to L+1+j; p >= 1+j, so in increasing order nothing is
overwritten before it is read); an appending graph returned the rows' K/V as presents, and the
path's rows are written at L. Nothing else moves, and nothing cache-sized is allocated per round.

Adaptive tree size (runtime/tree_size.py) and the batch's tree width (runtime/policy.py) read
``cost``: the tuned costs (costs.json), else every tree size of a batch size timed once on first
ask. Fixed from then on, like adaptive depth's: a running average of the passes run ratcheted
trees down (a size timed slow on one noisy pass was no longer chosen, so never timed again), and
made a seeded run's trees depend on the clock.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from specexport.contract import (
    CACHE_LENGTH,
    INPUT_IDS,
    LOGITS,
    NEXT_TOKENS,
    TREE_MASK,
    TREE_OFFSETS,
    VALID_TOKENS,
    EngineEntry,
    KVUpdate,
)
from specexport.runtime.cache_store import Store
from specexport.runtime.graph_call import GraphCall, TimedCalls
from specexport.runtime.runner import PAD_ID, time_interleaved
from specexport.runtime.tree import DraftTree
from specexport.runtime.verifier import Verified, VerifyRow

TreeRow = tuple[int, int, DraftTree]  # (cache length, root token, tree) of one running slot


def tree_feeds(tree: DraftTree, root: int, length: int, valid_tokens: bool) -> dict[str, np.ndarray]:
    """A tree graph's feeds for one row besides the cache: root + nodes at cache length
    ``length`` (and the row count as VALID_TOKENS for an ort-gqa graph)."""
    offsets, mask = tree.verify_inputs()  # [1+N], [1+N, 1+N]
    feeds = {INPUT_IDS: np.concatenate(([root], tree.tokens))[None].astype(np.int64),  # [1, 1+N]
             CACHE_LENGTH: np.array([length], dtype=np.int64),  # [1]
             TREE_OFFSETS: offsets[None], TREE_MASK: mask[None]}  # [1, 1+N], [1, 1+N, 1+N]
    if valid_tokens:
        feeds[VALID_TOKENS] = np.array([1 + tree.size], dtype=np.int64)  # [1]
    return feeds


def batched_tree_feeds(rows: Mapping[int, TreeRow], batch: int, nodes: int, valid_tokens: bool) -> dict[str, np.ndarray]:
    """A tree graph's feeds besides the cache for ``batch`` rows: each slot in ``rows`` its root
    and tree (already ``nodes`` nodes) at its cache length, every other slot idle (length 0, pad
    leaves and, for an ort-gqa graph, no valid rows: nothing written). The verifier and the
    build's check of batched tree graphs both feed through here."""
    idle = (0, PAD_ID, _padded(DraftTree.chain(np.zeros(0, dtype=np.int64)), nodes))
    per_row = [tree_feeds(tree, root, length, valid_tokens) for length, root, tree in
               (rows.get(slot, idle) for slot in range(batch))]
    feeds = {name: np.concatenate([f[name] for f in per_row]) for name in per_row[0]}  # [B, ...]
    if valid_tokens:
        feeds[VALID_TOKENS][[slot for slot in range(batch) if slot not in rows]] = 0
    return feeds


def _padded(tree: DraftTree, nodes: int) -> DraftTree:
    """``tree`` with pad leaves under the root up to ``nodes`` nodes."""
    extra = nodes - tree.size
    return DraftTree(np.concatenate((tree.tokens, np.full(extra, PAD_ID, dtype=np.int64))),
                     np.concatenate((tree.parents, np.full(extra, -1, dtype=np.int64))))


class TreeVerifier(TimedCalls):
    """``engines``: (batch, rows) -> its engine, rows = 1 + nodes (LazyEngines; an ort-gqa graph
    has an entry per tree size at each batch size, a standard one a single size per batch size
    that smaller trees are padded to). ``caches``: the target's slot caches (their lengths);
    ``store``: the K/V store [slots, n_kv, S_max, hd] they are rows of."""

    def __init__(self, engines: Mapping[tuple[int, int], object], entry: EngineEntry, caches: list,
                 store: Store, costs: Mapping[tuple[int, int], float] | None = None):
        """``costs``: (batch, rows) -> seconds of a pass measured before (specexport tune); a
        batch size all of whose graphs have one is not timed on first use."""
        self.engines, self.caches, self.store = dict(engines), caches, store
        self.batches = sorted({b for b, _ in self.engines if b <= len(caches)})
        self.rows = max(t for _, t in self.engines)  # 1 + N: the root and up to N nodes
        self.max_seq_len = store.max_seq_len
        self.in_place = entry.kv_update == KVUpdate.IN_PLACE
        self._presents: dict[str, np.ndarray] | None = None  # an appending graph's K/V of the last run [B, n_kv, T, hd]
        self._costs: dict[int, dict[int, float]] = {}  # batch -> rows -> seconds of one pass (absent: not timed)
        self._sizes: dict[tuple[int, int], int] = {}  # (batch, nodes) -> rows of the graph that holds them
        for batch in self.batches:
            known = {rows: (costs or {}).get((b, rows)) for b, rows in self.engines if b == batch}
            if all(known.values()):
                self._costs[batch] = {rows: float(s) for rows, s in known.items() if s}
        # (batch, rows) -> that graph's call (its feeds updated in place: one I/O binding per
        # graph, not one per pass)
        self._calls: dict[tuple[int, int], GraphCall] = {}

    @property
    def nodes(self) -> int:
        return self.rows - 1

    def batch_for(self, running: int) -> int | None:
        """The smallest built batch size holding ``running`` rows (None: none does)."""
        return next((b for b in self.batches if b >= running), None)

    def fits(self, length: int, nodes: int, batch: int = 1) -> bool:
        """Can a tree of ``nodes`` run at cache length ``length`` (the graph writes all its rows)?"""
        return nodes <= self.nodes and length + self._size(batch, nodes) <= self.max_seq_len

    def _size(self, batch: int, nodes: int) -> int:
        """The rows of the smallest graph at ``batch`` that holds a tree of ``nodes`` (asked for
        every size of every adaptive round: looked up once)."""
        key = (batch, nodes)
        if key not in self._sizes:
            self._sizes[key] = min(rows for b, rows in self.engines if b == batch and rows >= 1 + nodes)
        return self._sizes[key]

    def cost(self, rows: int, batch: int = 1) -> float | None:
        """Seconds of a pass over ``rows`` rows (root + nodes; the graph that holds them) at
        ``batch``: tuned, or the first ask at a batch size times its every size (about a second
        for SmolLM2's 12 on 2 cores at batch 1)."""
        if rows - 1 > self.nodes:
            return None
        if batch not in self._costs:
            keys = sorted(k for k in self.engines if k[0] == batch)
            self._costs[batch] = {rows: s for (_, rows), s in
                                  time_interleaved({"tree": (self, keys)}, rounds=2)["tree"].items()}
        return self._costs[batch].get(self._size(batch, rows - 1))

    def time_run(self, key: tuple[int, int], want_logits: bool = False) -> float:
        """Seconds of one pass of the graph ``key`` (batch, rows), every row a chain of pads at
        the cache's far end (time_interleaved's runner protocol); what it writes there is put back."""
        batch, rows = key
        start = self.max_seq_len - rows
        saved = self.store.save(batch, start)
        pads = DraftTree.chain(np.full(rows - 1, PAD_ID, dtype=np.int64))
        call, names = self._call(batch, dict.fromkeys(range(batch), (start, PAD_ID, pads)), want_logits, ())
        elapsed = call.time(names)
        self.store.restore(saved, batch, start)
        return elapsed

    def end_timing(self, sizes) -> None:
        pass

    def verify(self, rows: Sequence[VerifyRow], proposals: Sequence[DraftTree], want_logits: bool,
               want: tuple[str, ...] = ()) -> Verified:
        """One pass over the first len(rows) slots (runtime/verifier.py's Verifier), at the
        smallest batch size built that holds them."""
        batch = self.batch_for(len(rows))
        assert batch is not None, "the policy plans tree rounds at built batch sizes only"
        before = self.seconds
        outs = self.run_rows(batch, {r: (length, root, tree) for r, ((length, root), tree) in
                                     enumerate(zip(rows, proposals))}, want_logits, want)
        return Verified([outs[r] for r in range(len(rows))], batch, 1 + max(tree.size for tree in proposals),
                        self.seconds - before)

    def run_rows(self, batch: int, rows: Mapping[int, TreeRow], want_logits: bool,
                 want: tuple[str, ...] = ()) -> dict[int, dict[str, np.ndarray]]:
        """One pass of the graph of ``batch`` rows over the slots in ``rows`` (the others idle):
        slot -> each output's rows [1+n, ...] of its tree (row 0 the root, 1+i node i)."""
        nodes = max(tree.size for _, _, tree in rows.values())
        for length, _, tree in rows.values():
            if not self.fits(length, tree.size, batch):
                raise ValueError(f"a tree of {tree.size} nodes at length {length} does not fit the tree graph")
        size = self._size(batch, nodes)
        padded = {slot: (length, root, _padded(tree, size - 1)) for slot, (length, root, tree) in rows.items()}
        call, names = self._call(batch, padded, want_logits, want)
        out = call.run(names)
        self._presents = {p: out.pop(p) for p in self.store.presents} if not self.in_place else None
        return {slot: {name: value[slot, : 1 + tree.size] for name, value in out.items()}
                for slot, (_, _, tree) in rows.items()}

    def _call(self, batch: int, rows: Mapping[int, TreeRow], want_logits: bool,
              want: tuple[str, ...]) -> tuple[GraphCall, list[str]]:
        """The graph (batch, rows) fed trees already padded to its rows, and the outputs to ask
        for; a slot not in ``rows`` idles (length 0, no valid rows: nothing written)."""
        nodes = next(iter(rows.values()))[2].size
        engine = self.engines[(batch, 1 + nodes)]
        call = self._calls.get((batch, 1 + nodes))
        if call is None:  # the first pass of this graph: the feeds every later pass updates
            call = self._calls[(batch, 1 + nodes)] = GraphCall.over(engine, self.store, batch, self.in_place)
        call.set(batched_tree_feeds(rows, batch, nodes, VALID_TOKENS in engine.inputs))
        return call, [NEXT_TOKENS, *([LOGITS] if want_logits else []), *want]

    def commit(self, length: int, path: list[int], slot: int = 0) -> None:
        """Keep the slot's root and accepted nodes ``path`` (root to leaf) at ``length``,
        ``length``+1, ...: the slot's cache then holds ``length`` + 1 + len(path) positions."""
        rows = [0, *(1 + p for p in path)]  # graph rows, increasing
        # an in-place pass already wrote a path of the tree's first rows (a chain-shaped one) in place
        if not (self.in_place and rows[-1] == len(rows) - 1):
            self.store.compact(slot, length, rows, self._presents)
        cache = self.caches[slot]
        cache.set_length(min(length, cache.length))
        cache.advance(length + len(rows) - cache.length)
