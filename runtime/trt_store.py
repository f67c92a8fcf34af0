"""A model's K/V on the GPU for TensorRT engines: HostStore's verbs (runtime/cache_store.py)
over device memory, every one a device-to-device copy, so no cache byte crosses the bus.

One [slots, n_kv, S_max, hd] allocation per past input. ``rows(B)`` hands an engine the first B
rows as DeviceTensors (base address, shape [B, ...]), which it binds by address (a batch-1
runner's slot: ``slot(s)``, a store of that one row); the engine leaves its present outputs
on the device, and ``write`` copies each fed row's real positions into its row with one
cudaMemcpy2DAsync per tensor (n_kv lines of count x hd), idle and padding rows never.
``move``, ``compact``, ``save`` and ``restore`` are 2-D copies of the same kind. Everything runs
on the store's one stream, which the engines bound to it adopt: copies and runs stay in order
without a synchronization of their own. Lengths are not kept here (each slot's CacheLength).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from specexport.contract import ModelEntry, past_names, present_of
from specexport.runtime.cache_store import NamedTensors, Written
from specexport.runtime.engine import EngineOptions
from specexport.runtime.kv_cache import CacheLength
from specexport.runtime.trt_engine import (
    DeviceTensor,
    cuda_call,
    cuda_device,
    import_cudart,
    require_tensorrt,
)


@dataclass(frozen=True)
class Copy2D:
    """One cudaMemcpy2DAsync, in bytes: ``height`` lines of ``width`` bytes."""

    dst_offset: int
    dpitch: int
    src_offset: int
    spitch: int
    width: int
    height: int


def append_copies(present_shape: tuple[int, ...], itemsize: int, max_seq_len: int, written: Written) -> list[Copy2D]:
    """Copies that append a present [B, n_kv, T, hd] into a cache [B', n_kv, S_max, hd] (B' >= B):
    for each (row, cache length, count) of ``written``, that row's first ``count`` positions at
    its length; rows not in ``written`` are not touched."""
    _, n_kv, tokens, head_dim = present_shape
    line = head_dim * itemsize  # one position of one head
    copies = []
    for row, at, count in written:
        if count <= 0:
            continue
        if at + count > max_seq_len:
            raise ValueError(f"row {row}: {count} positions at {at} run past the cache's {max_seq_len}")
        copies.append(Copy2D(dst_offset=(row * n_kv * max_seq_len + at) * line, dpitch=max_seq_len * line,
                             src_offset=row * n_kv * tokens * line, spitch=tokens * line,
                             width=count * line, height=n_kv))
    return copies


def runs(pairs: Sequence[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(source, destination) positions as (source, destination, count) runs of consecutive pairs."""
    merged: list[tuple[int, int, int]] = []
    for src, dst in pairs:
        if merged and merged[-1][0] + merged[-1][2] == src and merged[-1][1] + merged[-1][2] == dst:
            merged[-1] = (merged[-1][0], merged[-1][1], merged[-1][2] + 1)
        else:
            merged.append((src, dst, 1))
    return merged


class DeviceStore(NamedTensors):
    """The cache tensors on the GPU: past name -> [slots, n_kv, S_max, hd] at ``pointers[name]``."""

    host_resident = False

    def __init__(self, cudart: Any, pointers: dict[str, int], shape: tuple[int, ...], dtype: np.dtype,
                 stream: Any, owner: bool):
        """``owner``: this store allocated the memory and the stream (``slot`` views do not)."""
        self._cudart = cudart
        self.pointers = pointers
        self._tensors = pointers  # NamedTensors' names and presents: the addresses stand for the tensors
        self.shape = shape  # [slots, n_kv, S_max, hd]
        self.dtype = dtype
        self.stream = stream
        self._owner = owner
        self._line = shape[3] * dtype.itemsize  # bytes of one position of one head
        self._rows: dict[int, dict[str, DeviceTensor]] = {}  # B -> the first B rows, made once

    @classmethod
    def allocate(cls, num_layers: int, shape: tuple[int, ...], dtype: str, device: int = 0) -> DeviceStore:
        """Zeros of ``shape`` [slots, n_kv, S_max, hd] per past input, and the store's stream."""
        cudart = import_cudart()
        cuda_call(cudart, "cudaSetDevice", device)
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        pointers = {}
        for name in past_names(num_layers):
            pointers[name] = int(cuda_call(cudart, "cudaMalloc", nbytes))
            cuda_call(cudart, "cudaMemset", pointers[name], 0, nbytes)
        stream = cuda_call(cudart, "cudaStreamCreateWithFlags", cudart.cudaStreamNonBlocking)
        return cls(cudart, pointers, tuple(shape), np.dtype(dtype), stream, owner=True)

    @property
    def _shape(self) -> tuple[int, ...]:
        return self.shape

    def _at(self, name: str, row: int, position: int = 0) -> int:
        """Address of ``position`` of head 0 of ``row`` in tensor ``name``."""
        return self.pointers[name] + (row * self.shape[1] * self.max_seq_len + position) * self._line

    def rows(self, batch: int | None = None) -> dict[str, DeviceTensor]:
        """The first ``batch`` rows (None: all) as an engine's past inputs, bound by address; the
        same dict each time."""
        batch = self.slots if batch is None else batch
        if batch not in self._rows:
            shape = (batch, *self.shape[1:])  # [B, n_kv, S_max, hd]
            self._rows[batch] = {name: DeviceTensor(ptr, shape, self.dtype, self.stream)
                                 for name, ptr in self.pointers.items()}
        return self._rows[batch]

    def bound(self, batch: int | None = None) -> dict[str, np.ndarray]:
        """Nothing: no in-place graph runs on TensorRT (ort-gqa is onnxruntime's), the engines append."""
        return {}

    def slot(self, slot: int) -> DeviceStore:
        """Row ``slot`` as a store of one row (same memory, same stream)."""
        pointers = {name: self._at(name, slot) for name in self.pointers}
        return DeviceStore(self._cudart, pointers, (1, *self.shape[1:]), self.dtype, self.stream, owner=False)

    def _copy(self, dst: int, dpitch: int, src: int, spitch: int, width: int, height: int) -> None:
        cudart = self._cudart
        cuda_call(cudart, "cudaMemcpy2DAsync", dst, dpitch, src, spitch, width, height,
                  cudart.cudaMemcpyKind.cudaMemcpyDeviceToDevice, self.stream)

    def write(self, out: Mapping[str, Any], written: Written) -> None:
        """Append what an engine computed for each fed row, ``written``: (row, cache length,
        count), from its present.* DeviceTensors [B, n_kv, T, hd]; padding and idle rows never."""
        for name in self.pointers:
            present = out[present_of(name)]
            if not isinstance(present, DeviceTensor):
                raise TypeError(f"{present_of(name)} came back to the host: the engine is not bound to this store")
            for c in append_copies(present.shape, self.dtype.itemsize, self.max_seq_len, written):
                self._copy(self.pointers[name] + c.dst_offset, c.dpitch, present.ptr + c.src_offset, c.spitch,
                           c.width, c.height)

    def move(self, src: int, dst: int, length: int) -> None:
        """Row ``dst`` takes row ``src``'s first ``length`` positions."""
        if length <= 0 or src == dst:
            return
        pitch = self.max_seq_len * self._line
        for name in self.pointers:
            self._copy(self._at(name, dst), pitch, self._at(name, src), pitch, length * self._line, self.shape[1])

    def take(self, source: DeviceStore, start: int, count: int) -> None:
        """Positions [start, start + count) of every row from the same rows of ``source`` (a
        store of the same layout)."""
        pitch = self.max_seq_len * self._line
        for name in self.pointers:
            for row in range(self.slots if count > 0 else 0):
                self._copy(self._at(name, row, start), pitch, source._at(name, row, start), pitch,
                           count * self._line, self.shape[1])

    def compact(self, slot: int, length: int, rows: Sequence[int], presents: Mapping[str, Any] | None = None) -> None:
        """A tree pass's ``rows`` (increasing) of the slot into its cache at ``length``,
        ``length`` + 1, ...: from the pass's present DeviceTensors [B, n_kv, T, hd], or (None)
        gathered within the row from ``length`` + row. Within the row a row p goes to j <= p, in
        increasing order, one position a copy, so nothing is overwritten before it is read."""
        pitch = self.max_seq_len * self._line
        if presents is None:
            for p, j in ((p, j) for j, p in enumerate(rows) if p != j):
                for name in self.pointers:
                    self._copy(self._at(name, slot, length + j), pitch, self._at(name, slot, length + p), pitch,
                               self._line, self.shape[1])
            return
        for name in self.pointers:
            present = presents[present_of(name)]
            tokens = present.shape[2]
            for src, dst, count in runs([(p, j) for j, p in enumerate(rows)]):
                source = present.ptr + (slot * self.shape[1] * tokens + src) * self._line
                self._copy(self._at(name, slot, length + dst), pitch, source, tokens * self._line,
                           count * self._line, self.shape[1])

    def save(self, batch: int, start: int, count: int | None = None) -> dict[str, DeviceTensor]:
        """A device copy of the first ``batch`` rows from position ``start`` on (what a timing
        run overwrites); ``count``: only that many positions (None: to the end)."""
        count = self.max_seq_len - start if count is None else count
        lines = batch * self.shape[1]  # [B, n_kv] lines of S_max positions
        saved = {}
        for name in self.pointers:
            ptr = int(cuda_call(self._cudart, "cudaMalloc", max(1, lines * count * self._line)))
            if count:
                self._copy(ptr, count * self._line, self._at(name, 0, start), self.max_seq_len * self._line,
                           count * self._line, lines)
            saved[name] = DeviceTensor(ptr, (batch, self.shape[1], count, self.shape[3]), self.dtype, self.stream)
        return saved

    def restore(self, saved: Mapping[str, DeviceTensor], batch: int, start: int) -> None:
        """Put back what ``save`` copied, and free its copy."""
        for name, values in saved.items():  # [batch, n_kv, count, hd]
            count = values.shape[2]
            if count:
                self._copy(self._at(name, 0, start), self.max_seq_len * self._line, values.ptr, count * self._line,
                           count * self._line, batch * self.shape[1])
        cuda_call(self._cudart, "cudaStreamSynchronize", self.stream)  # the copies read the saved memory
        for values in saved.values():
            self._cudart.cudaFree(values.ptr)

    def read(self) -> dict[str, np.ndarray]:
        """The whole cache copied to the host (tests and debugging only: it crosses the bus)."""
        out = {}
        for name, ptr in self.pointers.items():
            host = np.empty(self.shape, self.dtype)
            cuda_call(self._cudart, "cudaMemcpyAsync", host.ctypes.data, ptr, host.nbytes,
                      self._cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost, self.stream)
            out[name] = host
        cuda_call(self._cudart, "cudaStreamSynchronize", self.stream)
        return out

    def close(self) -> None:
        if not self._owner:
            return
        for ptr in self.pointers.values():
            self._cudart.cudaFree(ptr)
        self.pointers = self._tensors = {}
        self._cudart.cudaStreamDestroy(self.stream)


class DeviceKVCache(CacheLength):
    """One slot's cache over a row of a DeviceStore (``rows_store``, a store of one row): its
    runner's engines read the row by address and leave their presents on the device; ``write``
    appends the real positions there. Rewinding moves the length, as on the host. ``shared``: the
    row is one of several slots, whose batched calls write it without counting here, so the
    loop sets its length before each run (as model.SlotView's)."""

    host_resident = False

    def __init__(self, rows: DeviceStore, num_layers: int, shared: bool = False):
        super().__init__(num_layers, rows.max_seq_len)
        self.rows_store = rows  # [1, n_kv, S_max, hd] on the device
        self._shared = shared

    @property
    def pointers(self) -> dict[str, int]:
        return self.rows_store.pointers

    def view(self) -> dict[str, DeviceTensor]:
        """The row as the engines' past inputs: device addresses, never host arrays."""
        return self.rows_store.rows(1)

    def in_place_outputs(self) -> dict[str, np.ndarray]:
        return {}  # no in-place graph on TensorRT

    def write(self, presents: dict[str, Any], count: int) -> None:
        """Append the first ``count`` positions of each present DeviceTensor at ``length``."""
        if count > self.free:
            raise ValueError(f"KV cache overflow: {count} tokens with {self.free} slots free")
        self.rows_store.write(presents, [(0, self.length, count)])
        self.advance(count)

    def set_length(self, length: int) -> None:
        if not self._shared:
            super().set_length(length)
            return
        if not 0 <= length <= self.max_seq_len:
            raise ValueError(f"a slot of {self.max_seq_len} positions cannot hold {length}")
        self.length = length

    def close(self) -> None:
        self.rows_store.close()


def open_device_store(model: ModelEntry, options: EngineOptions, slots: int) -> DeviceStore:
    """A model's K/V of ``slots`` rows on the GPU. TensorRT and the GPU are checked first, so a
    missing one is the usual one-line error naming the extra."""
    require_tensorrt()
    device = cuda_device()
    return DeviceStore.allocate(model.num_layers, model.kv.shape(slots), model.kv_dtype, device.index)


def open_device_kv_cache(model: ModelEntry, options: EngineOptions) -> DeviceKVCache:
    """A lone sequence's cache on the GPU: the one row of a store of one slot."""
    return DeviceKVCache(open_device_store(model, options, 1), model.num_layers)


def open_device_slots(model: ModelEntry, options: EngineOptions, slots: int) -> tuple[DeviceStore, list[DeviceKVCache]]:
    """A model's K/V of ``slots`` rows on the GPU, and one cache per row (their lengths set by
    the loop): what the batched graphs and the slots' runners share."""
    store = open_device_store(model, options, slots)
    return store, [DeviceKVCache(store.slot(s), model.num_layers, shared=True) for s in range(slots)]
