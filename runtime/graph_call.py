"""One graph call: how every part of the runtime runs an engine over cache rows.

A GraphCall is one engine (B rows, T tokens) over the cache arrays it reads. It owns the
call's feed buffers, allocated once and updated in place (an engine's I/O binding over them is
then made once, not per call), writes each row's tokens, cache length, extra inputs and
valid-token counts (``valid_tokens`` for attention graphs, ``context_valid`` for a block
head's), asks for the outputs wanted plus what the cache needs, and times the engine. Writes to
the cache are one of two kinds: in place, the graph's present outputs are bound to the cache
rows (``bound``); appended, the graph returns them and ``run`` copies each row's real positions
into the store (or, for a cache that counts its own length, the caller commits them).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

import numpy as np

from specexport.contract import CACHE_LENGTH, CONTEXT_VALID, INPUT_IDS, VALID_TOKENS
from specexport.runtime.cache_store import Store, Written

PAD_ID = 0  # any id works: padded positions are never read back


class TimedCalls:
    """Engine seconds and runs summed over a holder's graph calls (``_calls``: key -> GraphCall):
    what a runner, a block head's runner and the tree verifier report to the stats."""

    _calls: Mapping[object, GraphCall]

    @property
    def seconds(self) -> float:
        return sum(call.seconds for call in self._calls.values())

    @property
    def calls(self) -> int:
        return sum(call.calls for call in self._calls.values())


class GraphCall:
    """``cache``: the past inputs fed as they are (views of the store's rows; empty for a cache
    on the device); ``in_place``: the graph writes the cache itself, into ``bound`` (present
    name -> the rows it updates; empty where the engine holds the cache); else it returns
    ``presents`` and ``run`` writes them into ``store`` (None: the caller commits them)."""

    def __init__(self, engine, cache: Mapping[str, np.ndarray], in_place: bool = False,
                 bound: Mapping[str, np.ndarray] | None = None, presents: Sequence[str] = (),
                 store: Store | None = None, tokens: int = 1):
        """``tokens``: T, for an engine that records no input shapes (a test's fake)."""
        self.engine = engine
        self.in_place = in_place
        self.bound = bound if in_place else None
        self.presents = [] if in_place else list(presents)
        self.store = store
        self.feeds = dict(cache)
        self.cache_names = frozenset(cache)
        specs = getattr(engine, "inputs", {})
        for name, spec in specs.items():
            if name not in self.feeds:  # input_ids [B, T], cache_length [B], valid counts [B], features [B, T, F]
                self.feeds[name] = np.zeros(spec.shape, dtype=spec.dtype)
        if INPUT_IDS not in specs:  # what every graph takes
            self.feeds[INPUT_IDS] = np.full((1, tokens), PAD_ID, dtype=np.int64)  # [B, T]
        if CACHE_LENGTH not in specs:
            self.feeds[CACHE_LENGTH] = np.zeros(1, dtype=np.int64)  # [B]
        self.seconds = 0.0  # inside the engine, for the stats
        self.calls = 0

    @classmethod
    def over(cls, engine, store: Store, batch: int, in_place: bool,
             beside: Mapping[str, np.ndarray] | None = None) -> GraphCall:
        """A graph over the first ``batch`` rows of ``store``, in place or appending into it.
        ``beside``: more cache feeds of those rows, fed as they are (a recurrent state's)."""
        return cls(engine, {**store.rows(batch), **(beside or {})}, in_place, store.bound(batch), store.presents,
                   store)

    def clear(self) -> None:
        """Zero every feed but the cache (rows not fed this call idle: length 0, nothing valid)."""
        for name, array in self.feeds.items():
            if name not in self.cache_names:
                array.fill(0)

    def feed_row(self, row: int, length: int, tokens: np.ndarray, inputs: Mapping[str, np.ndarray] | None = None,
                 valid: int | None = None) -> None:
        """Row ``row`` runs ``tokens`` [n] at cache length ``length``, with extra inputs name ->
        [n, F] rows (padded with zeros); ``valid``: its valid-token count, where the graph takes one."""
        ids = self.feeds[INPUT_IDS]  # [B, T]
        ids[row, : len(tokens)] = tokens
        ids[row, len(tokens) :] = PAD_ID
        self.feeds[CACHE_LENGTH][row] = length
        for name, values in (inputs or {}).items():
            buffer = self.feeds.get(name)
            if buffer is None:
                raise ValueError(f"{self.engine.name} has no input {name!r}")
            buffer[row, : len(values)] = values  # [T, F]
            buffer[row, len(values) :] = 0
        if valid is not None:
            for name in (VALID_TOKENS, CONTEXT_VALID):  # the row's real positions, the only ones written
                if name in self.feeds:
                    self.feeds[name][row] = valid

    def set(self, feeds: Mapping[str, np.ndarray]) -> None:
        """Copy whole feeds in (a tree's arrays), into the buffers so the binding stays valid."""
        for name, value in feeds.items():
            if name in self.feeds:
                self.feeds[name][...] = value
            else:  # an input the engine records no spec of: fed as given from now on
                self.feeds[name] = np.array(value)

    def run(self, outputs: Sequence[str], written: Written | None = None) -> dict[str, np.ndarray]:
        """One run: ``outputs`` and an appending graph's presents. ``written``: the fed rows'
        (row, cache length, count), copied from the presents into the store."""
        start = time.perf_counter()
        out = self._run(outputs)
        self.seconds += time.perf_counter() - start
        self.calls += 1
        if written is not None and not self.in_place and self.store is not None:
            self.store.write(out, written)
        return out

    def time(self, outputs: Sequence[str]) -> float:
        """Seconds of one run on the feeds as they are (a cost measurement; not in ``seconds``)."""
        start = time.perf_counter()
        self._run(outputs)
        return time.perf_counter() - start

    def _run(self, outputs: Sequence[str]) -> dict[str, np.ndarray]:
        names = [*outputs, *self.presents]
        if self.in_place:
            return self.engine.run(self.feeds, names, self.bound)
        return self.engine.run(self.feeds, names)
