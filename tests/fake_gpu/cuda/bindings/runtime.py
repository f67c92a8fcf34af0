"""Fake ``cuda.bindings.runtime``: the calls trt_engine makes, on host memory.

Every call returns ``(cudaError_t, *values)`` like cuda-python. ``TRAFFIC`` records each copy
(kind, bytes) so tests can see what crosses the "bus"; a stream being captured records its
work into a graph instead of running it, and ``cudaGraphLaunch`` replays it.
"""

from __future__ import annotations

import ctypes
import enum
from types import SimpleNamespace

import numpy as np


class cudaError_t(enum.IntEnum):  # noqa: N801 - cuda-python's names
    cudaSuccess = 0
    cudaErrorInvalidValue = 1


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

# The fake device's state (a driver is process-global by nature).
MEMORY: dict[int, np.ndarray] = {}  # pointer -> the buffer that keeps it alive
TRAFFIC: list[tuple[str, int]] = []  # (kind name, bytes) per copy
CAPTURING: dict[int, list] = {}  # stream -> work recorded while capturing
STREAMS = [0]


def capturing(stream) -> list | None:
    return CAPTURING.get(int(stream))


def _do(stream, work) -> None:
    recorded = capturing(stream)
    if recorded is not None:
        recorded.append(work)
    else:
        work()


def cudaGetErrorString(err):
    return OK, str(err).encode()


def cudaGetDeviceCount():
    return OK, 1


def cudaSetDevice(index):
    return (OK,) if index == 0 else (cudaError_t.cudaErrorInvalidValue,)


def cudaGetDeviceProperties(index):
    return OK, SimpleNamespace(name=b"NVIDIA H200\0\0\0", major=9, minor=0)


def cudaMalloc(nbytes):
    buffer = np.zeros(int(nbytes) + 64, np.uint8)
    ptr = buffer.ctypes.data
    MEMORY[ptr] = buffer
    return OK, ptr


cudaMallocHost = cudaMalloc


def cudaFree(ptr):
    MEMORY.pop(int(ptr), None)
    return (OK,)


cudaFreeHost = cudaFree


def cudaMemset(ptr, value, nbytes):
    ctypes.memset(int(ptr), int(value), int(nbytes))
    return (OK,)


def cudaMemcpyAsync(dst, src, nbytes, kind, stream):
    def work():
        TRAFFIC.append((cudaMemcpyKind(kind).name, int(nbytes)))
        ctypes.memmove(int(dst), int(src), int(nbytes))
    _do(stream, work)
    return (OK,)


def cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, height, kind, stream):
    def work():
        TRAFFIC.append((cudaMemcpyKind(kind).name, int(width) * int(height)))
        for row in range(int(height)):
            ctypes.memmove(int(dst) + row * int(dpitch), int(src) + row * int(spitch), int(width))
    _do(stream, work)
    return (OK,)


def cudaStreamCreateWithFlags(flags):
    STREAMS[0] += 1
    return OK, STREAMS[0]


def cudaStreamSynchronize(stream):
    return (OK,)


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
    for work in graph_exec:
        work()
    return (OK,)
