"""The target's tree verify pass (Role.TREE, batch 1) over the first slot's cache, and the
cache compaction after it.

A round feeds the root (the last committed token) and the tree's nodes, padded to the graph's
1 + N rows (a pad is a leaf under the root that nobody reads), at the cache's length L. After
acceptance the root's and the accepted path's K/V must sit at L, L+1, ...: an in-place graph
(ort-gqa) wrote row r at L + r, so the path's rows are copied down within the cache (row p to
L+1+j; p >= 1+j, so in increasing order nothing is overwritten before it is read); an
appending graph returned the rows' K/V as presents, and the path's rows are written at L.
Nothing else moves, and nothing cache-sized is allocated per round.

Adaptive tree size (runtime/tree_size.py) reads ``cost``: every tree size timed once, then a
running average of the passes run.
"""

from __future__ import annotations

import time

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
    present_of,
)
from specexport.runtime.goodput import observed
from specexport.runtime.runner import PAD_ID, time_interleaved
from specexport.runtime.tree import DraftTree


def tree_feeds(tree: DraftTree, root: int, length: int, valid_tokens: bool) -> dict[str, np.ndarray]:
    """A tree graph's feeds besides the cache: root + nodes at cache length ``length`` (and the
    row count as VALID_TOKENS for an ort-gqa graph)."""
    offsets, mask = tree.verify_inputs()  # [1+N], [1+N, 1+N]
    feeds = {INPUT_IDS: np.concatenate(([root], tree.tokens))[None].astype(np.int64),  # [1, 1+N]
             CACHE_LENGTH: np.array([length], dtype=np.int64),  # [1]
             TREE_OFFSETS: offsets[None], TREE_MASK: mask[None]}  # [1, 1+N], [1, 1+N, 1+N]
    if valid_tokens:
        feeds[VALID_TOKENS] = np.array([1 + tree.size], dtype=np.int64)  # [1]
    return feeds


class TreeVerifier:
    """``engines``: rows (1 + nodes) -> its engine (LazyEngines; an ort-gqa graph has an entry
    per tree size, a standard one a single size that smaller trees are padded to)."""

    def __init__(self, engines: dict[int, object], entry: EngineEntry, cache):
        self.engines, self.cache = engines, cache  # the target's first slot's cache (batch 1)
        self.rows = max(engines)  # 1 + N: the root and up to N nodes
        self.in_place = entry.kv_update == KVUpdate.IN_PLACE
        self.seconds = 0.0
        self._presents: dict[str, np.ndarray] = {}  # an appending graph's K/V of the last run
        self._costs: dict[int, float] = {}  # rows -> seconds of one pass (empty: not timed yet)

    @property
    def nodes(self) -> int:
        return self.rows - 1

    def fits(self, length: int, nodes: int) -> bool:
        """Can a tree of ``nodes`` run at cache length ``length`` (the graph writes all its rows)?"""
        return nodes <= self.nodes and length + self._size(nodes) <= self.cache.max_seq_len

    def _size(self, nodes: int) -> int:
        return min(rows for rows in self.engines if rows >= 1 + nodes)

    def cost(self, rows: int) -> float | None:
        """Seconds of a pass over ``rows`` rows (root + nodes; the graph that holds them); the
        first ask times every size (about a second for SmolLM2's 12 on 2 cores)."""
        if not self._costs:
            self._costs = time_interleaved({"tree": (self, sorted(self.engines))}, rounds=2)["tree"]
        return self._costs.get(self._size(rows - 1)) if rows - 1 <= self.nodes else None

    def time_run(self, rows: int, want_logits: bool = False) -> float:
        """Seconds of one pass over a chain of ``rows`` rows at the cache's far end, where
        nothing committed lies (time_interleaved's runner protocol); the cache is not moved."""
        start = time.perf_counter()
        self._call(DraftTree.chain(np.full(rows - 1, PAD_ID, dtype=np.int64)), PAD_ID,
                   self.cache.max_seq_len - rows, want_logits, ())
        return time.perf_counter() - start

    def end_timing(self, sizes) -> None:
        pass

    def run(self, length: int, root: int, tree: DraftTree, want_logits: bool,
            want: tuple[str, ...] = ()) -> dict[str, np.ndarray]:
        """Verify ``tree`` under ``root`` at cache length ``length``: each output's rows [1+n, ...]
        (row 0 the root, 1+i node i)."""
        n = tree.size
        if not self.fits(length, n):
            raise ValueError(f"a tree of {n} nodes at length {length} does not fit the tree graph")
        rows = self._size(n)
        padded = DraftTree(np.concatenate((tree.tokens, np.full(rows - 1 - n, PAD_ID, dtype=np.int64))),
                           np.concatenate((tree.parents, np.full(rows - 1 - n, -1, dtype=np.int64))))
        self.cache.set_length(min(length, self.cache.length))
        start = time.perf_counter()
        out = self._call(padded, root, length, want_logits, want)
        elapsed = time.perf_counter() - start
        self.seconds += elapsed
        if self._costs:
            self._costs[rows] = observed(self._costs.get(rows), elapsed)
        self._presents = {p: out.pop(present_of(p)) for p in self.cache.view()} if not self.in_place else {}
        return {name: value[0, : 1 + n] for name, value in out.items()}

    def _call(self, tree: DraftTree, root: int, length: int, want_logits: bool,
              want: tuple[str, ...]) -> dict[str, np.ndarray]:
        """One pass of the graph holding ``tree`` (already padded to its rows) at ``length``."""
        engine = self.engines[1 + tree.size]
        feeds = {**self.cache.view(), **tree_feeds(tree, root, length, VALID_TOKENS in engine.inputs)}
        names = [NEXT_TOKENS, *([LOGITS] if want_logits else []), *want]
        if not self.in_place:
            names += [present_of(p) for p in self.cache.view()]
        return engine.run(feeds, names, self.cache.in_place_outputs() if self.in_place else None)

    def commit(self, length: int, path: list[int]) -> None:
        """Keep the root and the accepted nodes ``path`` (root to leaf) at ``length``, ``length``+1, ...:
        the cache then holds ``length`` + 1 + len(path) positions."""
        rows = [0, *(1 + p for p in path)]  # graph rows, increasing
        for name, array in self.cache.view().items():  # [1, n_kv, S_max, hd]
            if self.in_place:
                for j, r in enumerate(rows):
                    if r != j:
                        array[:, :, length + j] = array[:, :, length + r]
            else:
                array[:, :, length : length + len(rows)] = self._presents[name][:, :, rows]
        self.cache.set_length(min(length, self.cache.length))
        self.cache.advance(length + len(rows) - self.cache.length)
