"""Where a model's K/V lives: the one place that slices a cache array.

A store holds one [slots, n_kv, S_max, hd] array per past input. Graph calls feed the first B
rows (``rows``) and, when they write in place, bind them as their present outputs
(``bound``); everything else the runtime does to a cache goes through the store's verbs:
append what an append graph computed (``write``), hand a row to another slot (``move``), keep a
tree's accepted path (``compact``), save and put back what a timing run overwrites. This is the
host implementation (numpy, the arrays fed to onnxruntime as they are); a store that keeps its
arrays on a device implements the same verbs. Lengths are not kept here: each slot's
CacheLength counts its row.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from specexport.contract import past_names, present_of

Written = Sequence[tuple[int, int, int]]  # (row, cache length, count) of each fed row an append graph wrote


class Store(Protocol):
    """What the runtime asks of a cache store, wherever its tensors live: HostStore (numpy) or
    device_store.DeviceStore (OrtValues bound by address). Tensors are what an engine binds:
    numpy arrays, or DeviceTensors; ``save`` returns whatever ``restore`` takes back."""

    @property
    def slots(self) -> int: ...
    @property
    def max_seq_len(self) -> int: ...
    @property
    def names(self) -> list[str]: ...
    @property
    def presents(self) -> list[str]: ...
    def rows(self, batch: int | None = None) -> Mapping[str, Any]: ...
    def bound(self, batch: int | None = None) -> Mapping[str, Any]: ...
    def slot(self, slot: int) -> Store: ...
    def write(self, out: Mapping[str, Any], written: Written) -> None: ...
    def move(self, src: int, dst: int, length: int) -> None: ...
    def take(self, source: Store, start: int, count: int) -> None: ...
    def compact(self, slot: int, length: int, rows: Sequence[int], presents: Mapping[str, Any] | None = None
                ) -> None: ...
    def save(self, batch: int, start: int, count: int | None = None) -> Mapping[str, Any]: ...
    def restore(self, saved: Mapping[str, Any], batch: int, start: int) -> None: ...


class NamedTensors:
    """What a store's tensors say of it, wherever they live: past name -> a tensor of shape
    [slots, n_kv, S_max, hd] (numpy arrays here, device tensors in runtime/device_store.py)."""

    _tensors: Mapping[str, Any]

    @property
    def _shape(self) -> tuple[int, ...]:
        """[slots, n_kv, S_max, hd], read off the first tensor (a store of addresses says it)."""
        return tuple(next(iter(self._tensors.values())).shape) if self._tensors else (0, 0, 0, 0)

    @property
    def slots(self) -> int:
        return self._shape[0]

    @property
    def max_seq_len(self) -> int:
        return self._shape[2]

    @property
    def names(self) -> list[str]:
        """The past input names, in the cache's order."""
        return list(self._tensors)

    @property
    def presents(self) -> list[str]:
        """The present outputs an append graph returns for this cache."""
        return [present_of(name) for name in self._tensors]


class HostStore(NamedTensors):
    """The cache arrays in host memory: past name -> [slots, n_kv, S_max, hd]."""

    def __init__(self, tensors: dict[str, np.ndarray]):
        self._tensors = tensors
        self._rows: dict[int, dict[str, np.ndarray]] = {}  # B -> views of the first B rows, made once
        self._bound: dict[int, dict[str, np.ndarray]] = {}  # B -> present name -> those views

    @classmethod
    def allocate(cls, num_layers: int, shape: tuple[int, ...], dtype: str, fill: bool = False) -> HostStore:
        """Zeros of ``shape`` [slots, n_kv, S_max, hd] per past input. ``fill``: written now
        (np.full, not the lazily mapped np.zeros), so pages are faulted in at load, not inside
        the first rounds that reach a row."""
        make = (lambda: np.full(shape, 0, dtype=dtype)) if fill else (lambda: np.zeros(shape, dtype=dtype))
        return cls({name: make() for name in past_names(num_layers)})


    def rows(self, batch: int | None = None) -> dict[str, np.ndarray]:
        """The feeds of a graph over the first ``batch`` rows (None: all): views, not copies,
        the same dict each time (an engine's I/O binding over them is made once)."""
        batch = self.slots if batch is None else batch
        if batch not in self._rows:
            self._rows[batch] = {name: array[:batch] for name, array in self._tensors.items()}  # [B, n_kv, S_max, hd]
        return self._rows[batch]

    def bound(self, batch: int | None = None) -> dict[str, np.ndarray]:
        """present name -> the rows it updates, for a graph over the first ``batch`` rows that
        writes the cache in place."""
        batch = self.slots if batch is None else batch
        if batch not in self._bound:
            self._bound[batch] = {present_of(name): array for name, array in self.rows(batch).items()}
        return self._bound[batch]

    def slot(self, slot: int) -> HostStore:
        """Row ``slot`` as a store of one row (its arrays are views of this store's)."""
        return HostStore({name: array[slot : slot + 1] for name, array in self._tensors.items()})  # [1, n_kv, S_max, hd]

    def write(self, out: Mapping[str, np.ndarray], written: Written) -> None:
        """Write what an append graph computed for each fed row, ``written``: (row, cache length,
        count), from its present.* [B, n_kv, T, hd] into the cache; padding and idle rows never."""
        for past, array in self._tensors.items():
            new = out[present_of(past)]  # [B, n_kv, T, hd]
            for row, length, count in written:
                array[row, :, length : length + count] = new[row, :, :count]

    def move(self, src: int, dst: int, length: int) -> None:
        """Row ``dst`` takes row ``src``'s first ``length`` positions (a row left: the last moves in)."""
        for array in self._tensors.values():
            array[dst, :, :length] = array[src, :, :length]

    def take(self, source: Store, start: int, count: int) -> None:
        """Positions [start, start + count) of every row from the same rows of ``source``, a store
        of the same layout (the int4 copy's cache taking what its target computed)."""
        theirs = source.rows(self.slots)
        for name, array in self._tensors.items():  # [slots, n_kv, S_max, hd]
            array[:, :, start : start + count] = theirs[name][:, :, start : start + count]

    def compact(self, slot: int, length: int, rows: Sequence[int], presents: Mapping[str, np.ndarray] | None = None
                ) -> None:
        """A tree pass's ``rows`` (increasing) of the slot into its cache at ``length``,
        ``length`` + 1, ...: gathered within the row where the graph wrote them in place (at
        ``length`` + row), else taken from the pass's ``presents`` [B, n_kv, T, hd]."""
        if presents is None:
            source = length + np.asarray(rows)  # [1+len(path)] slots the pass wrote them at
        for name, array in self._tensors.items():  # [slots, n_kv, S_max, hd]
            if presents is None:  # one gather per tensor (it copies before the slots are overwritten)
                array[slot, :, length : length + len(rows)] = array[slot][:, source]  # [n_kv, 1+len(path), hd]
            else:
                array[slot, :, length : length + len(rows)] = presents[present_of(name)][slot][:, rows]

    def save(self, batch: int, start: int, count: int | None = None) -> dict[str, np.ndarray]:
        """A copy of the first ``batch`` rows from position ``start`` on (what a timing run
        overwrites); ``count``: only that many positions (None: to the end)."""
        end = None if count is None else start + count
        return {name: array[:batch, :, start:end].copy() for name, array in self._tensors.items()}

    def restore(self, saved: Mapping[str, np.ndarray], batch: int, start: int) -> None:
        """Put back what ``save`` copied."""
        for name, values in saved.items():  # [batch, n_kv, count, hd]
            self._tensors[name][:batch, :, start : start + values.shape[2]] = values
