"""The cache store on the engines' device: the K/V as onnxruntime OrtValues, bound by address.

Each past input is one OrtValue [slots, n_kv, S_max, hd] allocated once on the session's
device ("cuda", or "cpu" where a test or ``load(..., device_store=True)`` asks for it), zeroed.
Graphs bind it by address (``DeviceTensor``): the first B rows of a [slots, ...] tensor are a
contiguous prefix, row r starts at ``ptr + r * row_bytes``, so a graph over B rows reads and,
in place, writes them where they are; a call moves only its small inputs in and the outputs it
reads out (runtime/ort_engine.py's ``DeviceBinding``). A rewind stays a length (CacheLength).

Everything else the runtime does to a cache is a copy of positions within the device: an append
graph's presents written into the rows, a row handed to another slot, a tree's accepted path
compacted, what a timing run overwrites saved and put back. onnxruntime's Python API has no
device memcpy, so these run a graph of GatherND/ScatterND per tensor (runtime/onnx_bytes.py)
on the same device, its tensors bound by address and only the [m, 3] position indices sent in.
The verbs are cache_store.HostStore's, so the graph calls, runners and tree code do not ask
where the cache is.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from specexport.contract import past_names, present_of
from specexport.runtime.cache_store import NamedTensors, Written
from specexport.runtime.copy_counter import CopyCounter
from specexport.runtime.onnx_bytes import copy_positions_graph


@dataclass(frozen=True)
class DeviceTensor:
    """A tensor in an OrtValue's memory (or a prefix of rows of one): what a graph binds by address."""

    owner: Any  # the OrtValue that owns the memory (kept alive by this reference)
    ptr: int
    shape: tuple[int, ...]
    dtype: np.dtype
    device: str  # "cpu" | "cuda"
    device_id: int = 0

    @classmethod
    def zeros(cls, ort, shape: tuple[int, ...], dtype: str | np.dtype, device: str, device_id: int = 0) -> DeviceTensor:
        """A new zeroed tensor on ``device`` (positions never written are read as zeros, as a
        host cache's: a masked position times NaN garbage would not be zero)."""
        dtype = np.dtype(dtype)
        value = ort.OrtValue.ortvalue_from_shape_and_type(list(shape), dtype, device, device_id)
        value.update_inplace(np.zeros(shape, dtype=dtype))
        return cls(value, value.data_ptr(), tuple(shape), dtype, device, device_id)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * self.dtype.itemsize

    def rows(self, start: int, count: int) -> DeviceTensor:
        """Rows [start, start + count) of the first dim: a contiguous piece of the same memory."""
        row_bytes = self.nbytes // self.shape[0]
        return DeviceTensor(self.owner, self.ptr + start * row_bytes, (count, *self.shape[1:]), self.dtype,
                            self.device, self.device_id)

    def bind_input(self, binding, name: str) -> None:
        binding.bind_input(name, self.device, self.device_id, self.dtype, list(self.shape), self.ptr)

    def bind_output(self, binding, name: str) -> None:
        binding.bind_output(name, self.device, self.device_id, self.dtype, list(self.shape), self.ptr)


def _onnxruntime():
    from specexport.runtime.ort_engine import _onnxruntime as ort

    return ort()


COPY_PROVIDERS = {"cpu": ["CPUExecutionProvider"], "cuda": ["CUDAExecutionProvider"]}  # device -> the copy graph's


class PositionCopier:
    """Copies of K/V positions between device tensors, one run of the copy graph (onnx_bytes.
    copy_positions_graph) over every tensor at once; its sessions made on first use, one per
    tensor count and dtype. The indices [m, 3] are the only bytes sent in (counted)."""

    def __init__(self, device: str, counter: CopyCounter | None = None, device_id: int = 0):
        self.device, self.device_id, self.counter = device, device_id, counter
        self._sessions: dict[tuple[int, str], Any] = {}
        self._bindings: dict[tuple, Any] = {}  # the tensors' addresses and shapes -> their binding (indices rebound)

    def _session(self, count: int, dtype: np.dtype):
        key = (count, dtype.name)
        if key not in self._sessions:
            from specexport.runtime.ort_engine import session_options

            ort = _onnxruntime()
            so = session_options(ort, None)
            self._sessions[key] = ort.InferenceSession(copy_positions_graph(count, dtype.name), so,
                                                       providers=COPY_PROVIDERS[self.device])
        return self._sessions[key]

    def copy(self, into: Sequence[DeviceTensor], sources: Sequence[DeviceTensor], src: np.ndarray,
             dst: np.ndarray) -> None:
        """into[i][dst[j]] = sources[i][src[j]] for every position j: src, dst [m, 3] (row, head,
        position) index the first three dims; the last (hd) moves whole."""
        if len(src) == 0:
            return
        session = self._session(len(into), into[0].dtype)
        key = tuple((t.ptr, t.shape) for t in (*into, *sources))
        binding = self._bindings.get(key)
        if binding is None:
            binding = self._bindings[key] = session.io_binding()
            for i, (target, source) in enumerate(zip(into, sources)):
                target.bind_input(binding, f"into.{i}")
                source.bind_input(binding, f"from.{i}")
                target.bind_output(binding, f"out.{i}")  # at into.i's address: written in place
        for name, index in (("src", src), ("dst", dst)):
            binding.bind_cpu_input(name, np.ascontiguousarray(index, dtype=np.int64))
            if self.counter is not None:
                self.counter.to_device(name, index.nbytes)
        session.run_with_iobinding(binding)


def positions(rows: Sequence[int], heads: int, starts: Sequence[int], counts: Sequence[int]) -> np.ndarray:
    """(row, head, position) [m, 3] of ``counts[k]`` positions from ``starts[k]`` of every head of
    ``rows[k]``, row by row, head by head, position by position."""
    parts = []
    for row, start, count in zip(rows, starts, counts):
        head, position = np.meshgrid(np.arange(heads), start + np.arange(count), indexing="ij")  # [n_kv, count]
        parts.append(np.stack([np.full(head.size, row), head.ravel(), position.ravel()], axis=1))
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros((0, 3), dtype=np.int64)


class DeviceStore(NamedTensors):
    """The cache's tensors on the device: past name -> DeviceTensor [slots, n_kv, S_max, hd];
    cache_store.HostStore's verbs."""

    def __init__(self, tensors: dict[str, DeviceTensor], copier: PositionCopier):
        self._tensors = tensors
        self.copier = copier
        self._rows: dict[int, dict[str, DeviceTensor]] = {}  # B -> the first B rows, made once
        self._bound: dict[int, dict[str, DeviceTensor]] = {}  # B -> present name -> those rows

    @classmethod
    def allocate(cls, num_layers: int, shape: tuple[int, ...], dtype: str, device: str,
                 counter: CopyCounter | None = None) -> DeviceStore:
        """Zeros of ``shape`` [slots, n_kv, S_max, hd] per past input on ``device``."""
        ort = _onnxruntime()
        return cls({name: DeviceTensor.zeros(ort, shape, dtype, device) for name in past_names(num_layers)},
                   PositionCopier(device, counter))

    @property
    def heads(self) -> int:
        return next(iter(self._tensors.values())).shape[1]

    def rows(self, batch: int | None = None) -> dict[str, DeviceTensor]:
        """The first ``batch`` rows (None: all) of each tensor, the same dict each time."""
        batch = self.slots if batch is None else batch
        if batch not in self._rows:
            self._rows[batch] = {name: t.rows(0, batch) for name, t in self._tensors.items()}  # [B, n_kv, S_max, hd]
        return self._rows[batch]

    def bound(self, batch: int | None = None) -> dict[str, DeviceTensor]:
        """present name -> the rows it updates, for an in-place graph over the first ``batch`` rows."""
        batch = self.slots if batch is None else batch
        if batch not in self._bound:
            self._bound[batch] = {present_of(name): t for name, t in self.rows(batch).items()}
        return self._bound[batch]

    def slot(self, slot: int) -> DeviceStore:
        """Row ``slot`` as a store of one row (the same memory)."""
        return DeviceStore({name: t.rows(slot, 1) for name, t in self._tensors.items()}, self.copier)

    def _copy(self, sources: Sequence[DeviceTensor], src: np.ndarray, dst: np.ndarray) -> None:
        self.copier.copy(list(self._tensors.values()), sources, src, dst)

    def write(self, out: Mapping[str, DeviceTensor], written: Written) -> None:
        """Each fed row's ``count`` positions of an append graph's present.* [B, n_kv, T, hd]
        (device tensors: ort_engine keeps them there) into its row at its cache length."""
        rows = [row for row, _, _ in written]
        counts = [count for _, _, count in written]
        src = positions(rows, self.heads, [0] * len(rows), counts)
        dst = positions(rows, self.heads, [length for _, length, _ in written], counts)
        self._copy([out[present_of(name)] for name in self._tensors], src, dst)

    def move(self, src: int, dst: int, length: int) -> None:
        """Row ``dst`` takes row ``src``'s first ``length`` positions."""
        self._copy(list(self._tensors.values()), positions([src], self.heads, [0], [length]),
                   positions([dst], self.heads, [0], [length]))

    def take(self, source: NamedTensors, start: int, count: int) -> None:
        """Positions [start, start + count) of every row from the same rows of ``source`` (a
        store of the same layout on the same device)."""
        index = positions(range(self.slots), self.heads, [start] * self.slots, [count] * self.slots)
        theirs = source.rows(self.slots)  # type: ignore[attr-defined]
        self._copy([theirs[name] for name in self._tensors], index, index)

    def compact(self, slot: int, length: int, rows: Sequence[int],
                presents: Mapping[str, DeviceTensor] | None = None) -> None:
        """A tree pass's ``rows`` (increasing) of the slot into its cache at ``length``, ...:
        from where an in-place graph wrote them (``length`` + row), else from the pass's
        ``presents`` [B, n_kv, T, hd]. Gathered before written: overlaps copy correctly."""
        heads = np.repeat(np.arange(self.heads), len(rows))  # [n_kv * k]
        picked = np.tile(np.asarray(rows, dtype=np.int64), self.heads)
        first = length if presents is None else 0
        src = np.stack([np.full(heads.size, slot), heads, first + picked], axis=1)
        dst = positions([slot], self.heads, [length], [len(rows)])
        sources = list(self._tensors.values()) if presents is None else [presents[p] for p in self.presents]
        self._copy(sources, src.astype(np.int64), dst)

    def save(self, batch: int, start: int, count: int | None = None) -> dict[str, DeviceTensor]:
        """A device copy of the first ``batch`` rows from position ``start`` on (``count``:
        that many positions): name -> DeviceTensor [batch, n_kv, count, hd]."""
        count = self.max_seq_len - start if count is None else count
        ort = _onnxruntime()
        first = next(iter(self._tensors.values()))
        saved = {name: DeviceTensor.zeros(ort, (batch, self.heads, count, t.shape[3]), t.dtype, first.device,
                                          first.device_id) for name, t in self._tensors.items()}
        rows = list(range(batch))
        self.copier.copy(list(saved.values()), list(self._tensors.values()),
                         positions(rows, self.heads, [start] * batch, [count] * batch),
                         positions(rows, self.heads, [0] * batch, [count] * batch))
        return saved

    def restore(self, saved: Mapping[str, DeviceTensor], batch: int, start: int) -> None:
        """Put back what ``save`` copied."""
        count = next(iter(saved.values())).shape[2] if saved else 0
        rows = list(range(batch))
        self._copy([saved[name] for name in self._tensors],
                   positions(rows, self.heads, [0] * batch, [count] * batch),
                   positions(rows, self.heads, [start] * batch, [count] * batch))

    def host_copy(self) -> dict[str, np.ndarray]:
        """The tensors read back to host arrays (tests; not counted)."""
        return {name: _host(t) for name, t in self._tensors.items()}


def _host(tensor: DeviceTensor) -> np.ndarray:
    """A host copy of a device tensor (a prefix view reads its own rows)."""
    ort = _onnxruntime()
    value = ort.OrtValue.ortvalue_from_shape_and_type(list(tensor.shape), tensor.dtype, "cpu", 0)
    copier = PositionCopier(tensor.device)
    target = DeviceTensor(value, value.data_ptr(), tensor.shape, tensor.dtype, "cpu")
    n, heads, s, _ = tensor.shape
    every = positions(range(n), heads, [0] * n, [s] * n)
    copier.copy([target], [tensor], every, every)
    return value.numpy().copy()


def open_row_store(num_layers: int, shape: tuple[int, ...], dtype: str, options,
                   counter: CopyCounter | None = None) -> DeviceStore | None:
    """The onnxruntime backend's cache rows: on the device where the options put the store
    (device_binding.store_device: --device cuda, or device_store on the CPU), else None."""
    from specexport.runtime.device_binding import store_device

    device = store_device(options)
    if device is None:
        return None
    from specexport.runtime.ort_engine import _onnxruntime, providers_of

    providers_of(_onnxruntime(), options.device)  # before allocating on a device onnxruntime cannot reach
    return DeviceStore.allocate(num_layers, shape, dtype, device, counter)
