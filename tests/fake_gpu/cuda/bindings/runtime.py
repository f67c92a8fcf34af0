"""Fake ``cuda.bindings.runtime``: the calls trt_engine makes, on host memory.

Every call returns ``(cudaError_t, *values)`` like cuda-python. ``TRAFFIC`` records each copy
(kind, bytes) so tests can see what crosses the "bus", and ``COPIES`` its addresses too (kind,
destination, source, bytes), so they can see whose memory it was; a stream being captured records its
work into a graph instead of running it, and ``cudaGraphLaunch`` replays it.

As strict as CUDA where a runtime's mistake would show on a GPU: device and pinned host
allocations are kept apart and sized exactly (256-byte aligned, as cudaMalloc's are); a copy
whose device side does not lie inside one live allocation of the right kind is refused
(cudaErrorInvalidValue); work that touches memory outside one at run time (a captured copy
after a free, an engine bound to a buffer too small) is an illegal address, which, as on a
GPU, every later call reports until ``cudaDeviceReset``.
"""

from __future__ import annotations

import bisect
import ctypes
import enum
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np


class cudaError_t(enum.IntEnum):  # noqa: N801 - cuda-python's names
    cudaSuccess = 0
    cudaErrorInvalidValue = 1
    cudaErrorInvalidPitchValue = 12
    cudaErrorIllegalAddress = 700


class cudaMemcpyKind(enum.IntEnum):  # noqa: N801
    cudaMemcpyHostToHost = 0
    cudaMemcpyHostToDevice = 1
    cudaMemcpyDeviceToHost = 2
    cudaMemcpyDeviceToDevice = 3


class cudaStreamCaptureMode(enum.IntEnum):  # noqa: N801
    cudaStreamCaptureModeGlobal = 0
    cudaStreamCaptureModeThreadLocal = 1


cudaStreamNonBlocking = 1
OK = cudaError_t.cudaSuccess
ALIGNMENT = 256  # what cudaMalloc guarantees, and what TensorRT asks of a tensor's address
_MESSAGES = {OK: "no error", cudaError_t.cudaErrorInvalidValue: "invalid argument",
             cudaError_t.cudaErrorInvalidPitchValue: "invalid pitch argument",
             cudaError_t.cudaErrorIllegalAddress: "an illegal memory access was encountered"}


@dataclass
class Allocation:
    buffer: np.ndarray  # keeps the memory alive
    nbytes: int  # what was asked for: the bytes past it belong to nobody
    device: bool  # cudaMalloc (device) or cudaMallocHost (pinned host)


# The fake device's state (a driver is process-global by nature).
MEMORY: dict[int, Allocation] = {}  # pointer -> its allocation
_STARTS: list[int] = []  # MEMORY's pointers, sorted: which allocation holds an address
TRAFFIC: list[tuple[str, int]] = []  # (kind name, bytes) per copy
COPIES: list[tuple[str, int, int, int]] = []  # (kind name, destination, source, bytes) per copy
CAPTURING: dict[int, list] = {}  # stream -> work recorded while capturing
STREAMS = [0]
FAULTS: list[str] = []  # illegal accesses so far: sticky, as a GPU's context is after one
_DETAIL: dict[cudaError_t, str] = {}  # the latest problem behind each error code, for cudaGetErrorString


# -- memory checks ---------------------------------------------------------------------------


def _holding(ptr: int) -> tuple[int, Allocation] | None:
    """The live allocation ``ptr`` points into, with its start."""
    i = bisect.bisect_right(_STARTS, ptr) - 1
    if i >= 0 and ptr < _STARTS[i] + max(MEMORY[_STARTS[i]].nbytes, 1):
        return _STARTS[i], MEMORY[_STARTS[i]]
    return None


def outside(ptr: int, nbytes: int, device: bool = True) -> str | None:
    """Why [ptr, ptr + nbytes) is not inside one live allocation of that kind (None if it is)."""
    where = "device" if device else "pinned host"
    if (held := _holding(ptr)) is None:
        return f"{ptr:#x} is not in any live {where} allocation"
    start, alloc = held
    if alloc.device != device:
        return f"{ptr:#x} is {'device' if alloc.device else 'pinned host'} memory, not {where} memory"
    if ptr + nbytes > start + alloc.nbytes:
        return (f"{nbytes} bytes at {ptr:#x} run {ptr + nbytes - start - alloc.nbytes} bytes past "
                f"its {where} allocation of {alloc.nbytes} bytes")
    return None


def fault(problem: str) -> None:
    """An illegal access by work on a stream: reported by this and every later call."""
    FAULTS.append(problem)


def _error(code: cudaError_t, problem: str) -> cudaError_t:
    _DETAIL[code] = problem
    return code


def _sticky():
    return _error(cudaError_t.cudaErrorIllegalAddress, FAULTS[0]) if FAULTS else None


def _copy_problem(dst: int, src: int, span_dst: int, span_src: int, kind) -> str | None:
    """The device (or pinned) sides of a copy must lie inside their allocations; pageable host
    memory cannot be checked (numpy arrays), as a GPU cannot either."""
    kind = cudaMemcpyKind(kind)
    dst_device = kind in (cudaMemcpyKind.cudaMemcpyHostToDevice, cudaMemcpyKind.cudaMemcpyDeviceToDevice)
    src_device = kind in (cudaMemcpyKind.cudaMemcpyDeviceToHost, cudaMemcpyKind.cudaMemcpyDeviceToDevice)
    for side, ptr, span, device in (("destination", dst, span_dst, dst_device), ("source", src, span_src, src_device)):
        problem = outside(ptr, span, True) if device else (outside(ptr, span, False) if _holding(ptr) else None)
        if problem:
            return f"{kind.name} {side}: {problem}"
    return None


# -- the API ---------------------------------------------------------------------------------


def capturing(stream) -> list | None:
    return CAPTURING.get(int(stream))


def _do(stream, work) -> None:
    recorded = capturing(stream)
    if recorded is not None:
        recorded.append(work)
    else:
        work()


def cudaGetErrorString(err):
    text = _MESSAGES.get(err, str(err))
    return OK, (f"{text} ({_DETAIL[err]})" if err in _DETAIL else text).encode()


def cudaGetDeviceCount():
    return OK, 1


def cudaSetDevice(index):
    return (_sticky() or OK,) if index == 0 else (cudaError_t.cudaErrorInvalidValue,)


def cudaGetDeviceProperties(index):
    return OK, SimpleNamespace(name=b"NVIDIA H200\0\0\0", major=9, minor=0)


def cudaDeviceReset():
    """Frees everything and clears a sticky fault, as on a GPU."""
    MEMORY.clear()
    _STARTS.clear()
    _DETAIL.clear()
    CAPTURING.clear()
    FAULTS.clear()
    return (OK,)


def _allocate(nbytes, device: bool):
    if err := _sticky():
        return err, None
    nbytes = int(nbytes)
    buffer = np.zeros(nbytes + ALIGNMENT, np.uint8)
    ptr = buffer.ctypes.data + (-buffer.ctypes.data) % ALIGNMENT
    MEMORY[ptr] = Allocation(buffer, nbytes, device)
    bisect.insort(_STARTS, ptr)
    return OK, ptr


def cudaMalloc(nbytes):
    return _allocate(nbytes, device=True)


def cudaMallocHost(nbytes):
    return _allocate(nbytes, device=False)


def _free(ptr, device: bool):
    alloc = MEMORY.get(int(ptr))
    if alloc is None or alloc.device != device:
        return (_error(cudaError_t.cudaErrorInvalidValue, f"{int(ptr):#x} was not allocated by "
                       f"{'cudaMalloc' if device else 'cudaMallocHost'}"),)
    del MEMORY[int(ptr)]
    _STARTS.remove(int(ptr))
    return (OK,)


def cudaFree(ptr):
    return _free(ptr, device=True)


def cudaFreeHost(ptr):
    return _free(ptr, device=False)


def cudaMemset(ptr, value, nbytes):
    if err := _sticky():
        return (err,)
    if problem := outside(int(ptr), int(nbytes)):
        return (_error(cudaError_t.cudaErrorInvalidValue, f"cudaMemset: {problem}"),)
    ctypes.memset(int(ptr), int(value), int(nbytes))
    return (OK,)


def cudaMemcpyAsync(dst, src, nbytes, kind, stream):
    dst, src, nbytes = int(dst), int(src), int(nbytes)
    if err := _sticky():
        return (err,)
    if problem := _copy_problem(dst, src, nbytes, nbytes, kind):
        return (_error(cudaError_t.cudaErrorInvalidValue, f"cudaMemcpyAsync {problem}"),)

    def work():
        if problem := _copy_problem(dst, src, nbytes, nbytes, kind):  # freed since it was captured
            fault(f"cudaMemcpyAsync {problem}")
            return
        TRAFFIC.append((cudaMemcpyKind(kind).name, nbytes))
        COPIES.append((cudaMemcpyKind(kind).name, dst, src, nbytes))
        ctypes.memmove(dst, src, nbytes)
    _do(stream, work)
    return (OK,)


def cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, height, kind, stream):
    dst, dpitch, src, spitch, width, height = map(int, (dst, dpitch, src, spitch, width, height))
    if err := _sticky():
        return (err,)
    if width > dpitch or width > spitch:
        return (_error(cudaError_t.cudaErrorInvalidPitchValue, f"width {width} > pitch {min(dpitch, spitch)}"),)
    span_dst, span_src = (height - 1) * dpitch + width, (height - 1) * spitch + width
    if height and (problem := _copy_problem(dst, src, span_dst, span_src, kind)):
        return (_error(cudaError_t.cudaErrorInvalidValue, f"cudaMemcpy2DAsync {problem}"),)

    def work():
        if height and (problem := _copy_problem(dst, src, span_dst, span_src, kind)):
            fault(f"cudaMemcpy2DAsync {problem}")
            return
        TRAFFIC.append((cudaMemcpyKind(kind).name, width * height))
        COPIES.append((cudaMemcpyKind(kind).name, dst, src, width * height))
        for row in range(height):
            ctypes.memmove(dst + row * dpitch, src + row * spitch, width)
    _do(stream, work)
    return (OK,)


def cudaStreamCreateWithFlags(flags):
    STREAMS[0] += 1
    return OK, STREAMS[0]


def cudaStreamSynchronize(stream):
    return (_sticky() or OK,)


def cudaStreamDestroy(stream):
    return (OK,)


def cudaStreamBeginCapture(stream, mode):
    CAPTURING[int(stream)] = []
    return (OK,)


def cudaStreamEndCapture(stream):
    return OK, CAPTURING.pop(int(stream))


def cudaGraphInstantiate(graph, flags):
    return OK, list(graph)


def cudaGraphDestroy(graph):
    return (OK,)


def cudaGraphExecDestroy(graph_exec):
    return (OK,)


def cudaGraphLaunch(graph_exec, stream):
    if err := _sticky():
        return (err,)
    for work in graph_exec:
        work()
    return (OK,)
