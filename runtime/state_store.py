"""Where a linear-attention model's recurrent state lives: the one place that slices a state array.

A recurrent state (contract.StateLayout: per linear layer a conv window and a recurrent matrix)
has no positions: a graph reads the state after a row's committed tokens (past_state.*) and
returns the state after each of its T positions (present_state.* [B, T, ...]). So the store
keeps, per row, the states after the last ``keep`` committed positions, and a row's length is
set by selecting one of them (a verify pass's rejected drafts, a drafter's own steps undone);
further back only to 0, the empty state. The same verbs as the K/V store (cache_store.HostStore):
``rows`` feeds a graph, ``write`` commits what it computed, ``set_length`` and ``move`` act on a
row. This is the host implementation (numpy, fed to onnxruntime as they are).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from specexport.contract import StateLayout, state_present_of
from specexport.runtime.cache_store import Written

Kept = dict[int, dict[str, np.ndarray]]  # position p -> past_state name -> [...] the row's state after p tokens


@dataclass
class RowStates:
    """One row's kept states, and the length whose state its feed arrays hold (None: none of
    the kept ones, a newer write made it stale): shared by the store and a slot's view of it."""

    kept: Kept = field(default_factory=dict)
    held: int | None = 0  # a new row holds the empty state


class HostStateStore:
    """The states in host memory: past_state name -> [rows, ...], and per row its kept states
    (views into the graphs' outputs, never copied: an engine returns new arrays every run)."""

    def __init__(self, states: dict[str, np.ndarray], keep: int, rows: list[RowStates] | None = None):
        """``rows``: each row's kept states, shared with the store this is a slot of (``slot``)."""
        self._states = states
        self.keep = keep
        self._presents = {name: state_present_of(name) for name in states}
        self._row: list[RowStates] = rows if rows is not None else [RowStates() for _ in range(self.slots)]
        self._rows: dict[int, dict[str, np.ndarray]] = {}  # B -> views of the first B rows, made once

    @classmethod
    def allocate(cls, layout: StateLayout, slots: int, keep: int) -> HostStateStore:
        """The empty state of ``slots`` rows, reaching back ``keep`` positions."""
        return cls({name: np.zeros(shape, dtype=layout.dtype) for name, shape in layout.shapes(slots).items()}, keep)

    @property
    def slots(self) -> int:
        return next(iter(self._states.values())).shape[0] if self._states else 0

    @property
    def presents(self) -> list[str]:
        """The present_state.* outputs every graph run over these rows must return."""
        return list(self._presents.values())

    def slot(self, slot: int) -> HostStateStore:
        """Row ``slot`` as a store of one row: views of this store's arrays and the same kept
        states (a slot's batch-1 runner and the batched calls see one row)."""
        return HostStateStore({name: array[slot : slot + 1] for name, array in self._states.items()},  # [1, ...]
                              self.keep, [self._row[slot]])

    def rows(self, batch: int | None = None) -> dict[str, np.ndarray]:
        """The past_state.* feeds of a graph over the first ``batch`` rows (None: all): views, the
        same dict each time, updated in place when a row's length is set."""
        batch = self.slots if batch is None else batch
        if batch not in self._rows:
            self._rows[batch] = {name: array[:batch] for name, array in self._states.items()}  # [B, ...]
        return self._rows[batch]

    def write(self, out: Mapping[str, np.ndarray], written: Written, select: bool = True) -> None:
        """Commit what a graph computed for each fed row, ``written``: (row, cache length, count):
        the states after its ``count`` positions (present_state.* [B, T, ...]) are kept, and
        those more than ``keep`` positions back are dropped. ``select``: the row's feed is set
        to the last now (a batch-1 runner feeds it next as it is); else at the next
        ``set_length`` (a batched call's rows: each is set to its length before it runs)."""
        for row, length, count in written:
            state = self._row[row]
            kept = state.kept
            for t in range(count):
                kept[length + t + 1] = {past: out[present][row, t] for past, present in self._presents.items()}
            end = length + count
            # those past the end are another path's (a row fed from a shorter length)
            for position in [p for p in kept if p < end - self.keep or p > end]:
                del kept[position]
            if state.held is not None and state.held > length:  # another path's state
                state.held = None
            if select:
                self._select(row, end)

    def reaches(self, row: int, length: int) -> bool:
        """Can row ``row`` be set to ``length`` (a kept position, or 0)?"""
        return length == 0 or length in self._row[row].kept

    def set_length(self, row: int, length: int) -> None:
        """Row ``row`` holds the state after its first ``length`` tokens from now on (only ever
        fewer than were written); the states after later positions are forgotten."""
        self._check(row, length)
        kept = self._row[row].kept  # in place: a slot's view shares the dict
        for position in [p for p in kept if p > length]:
            del kept[position]
        if self._row[row].held != length:  # else its feed holds that state already
            self._select(row, length)

    def move(self, src: int, dst: int, length: int) -> None:
        """Row ``dst`` takes row ``src``'s state after ``length`` tokens, and the states kept
        before it (a row left: the last moves in)."""
        self._check(src, length)
        taken = {p: s for p, s in self._row[src].kept.items() if p <= length}
        self._row[dst].kept.clear()  # in place: a slot's view shares the dict
        self._row[dst].kept.update(taken)
        self._select(dst, length)

    def _check(self, row: int, length: int) -> None:
        if not self.reaches(row, length):
            raise ValueError(f"row {row} keeps no recurrent state after {length} tokens (only the last "
                             f"{self.keep} positions are kept)")

    def _select(self, row: int, length: int) -> None:
        """Make row ``row`` of the past_state.* feeds the state after ``length`` tokens (in place:
        the graph calls' feed dicts hold these arrays)."""
        kept = self._row[row].kept.get(length)
        for name, array in self._states.items():  # [slots, ...]
            if kept is None:  # length 0: the empty state
                array[row].fill(0.0)
            else:
                array[row] = kept[name]
        self._row[row].held = length
