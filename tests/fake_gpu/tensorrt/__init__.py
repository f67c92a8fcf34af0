"""Fake TensorRT runtime API (see tests/fake_gpu/README.md): the calls trt_engine makes.

A plan file holds ``fake-trt:<path of an ONNX graph>``; the engine's I/O are the graph's, and
``execute_async_v3`` runs it with onnxruntime on the tensors at the addresses it was given.

It keeps TensorRT 10's contract where a runtime's binding mistake would show on a GPU:
- tensors are bound by name: ``set_tensor_address`` refuses a name the engine does not have
  and an address that is not 256-byte aligned (False, and an error on the logger);
- the engine lists its I/O in an order of its own (each group reversed against the ONNX
  graph), so a runtime that pairs tensors by position rather than by name binds them wrong;
- ``get_tensor_dtype`` is a ``DataType`` that ``nptype`` maps as TensorRT does (no bf16);
- ``set_input_shape`` takes only shapes the engine's profile holds (a static engine: its own),
  and a dynamic input whose shape was never set fails the run, as does an I/O tensor without
  an address (``execute_async_v3`` returns False);
- each tensor is read from, or written to, exactly the address bound for its name, as the
  engine's dtype and shape: a buffer too small for it is an illegal address on the fake CUDA
  (sticky, as on a GPU), a buffer of another dtype gives other numbers.
"""

from __future__ import annotations

import ctypes
import enum
import sys

import numpy as np
import onnxruntime as ort
from cuda.bindings import runtime as _cuda

__version__ = "10.13.0.35"
PLAN_PREFIX = b"fake-trt:"
ERRORS: list[str] = []  # what the engines logged as errors, for tests to read


class DataType(enum.IntEnum):  # TensorRT's values
    FLOAT = 0
    HALF = 1
    INT8 = 2
    INT32 = 3
    BOOL = 4
    UINT8 = 5
    BF16 = 7
    INT64 = 8


_ONNX_TYPES = {"tensor(float)": DataType.FLOAT, "tensor(float16)": DataType.HALF, "tensor(int8)": DataType.INT8,
               "tensor(int32)": DataType.INT32, "tensor(bool)": DataType.BOOL, "tensor(uint8)": DataType.UINT8,
               "tensor(bfloat16)": DataType.BF16, "tensor(int64)": DataType.INT64}
_NUMPY = {DataType.FLOAT: np.float32, DataType.HALF: np.float16, DataType.INT8: np.int8, DataType.INT32: np.int32,
          DataType.BOOL: np.bool_, DataType.UINT8: np.uint8, DataType.INT64: np.int64}


def nptype(trt_type: DataType):
    """TensorRT's mapping: numpy has no bf16, so neither has nptype."""
    if trt_type not in _NUMPY:
        raise TypeError("Could not resolve TensorRT datatype to an equivalent numpy datatype.")
    return _NUMPY[trt_type]


class Builder:  # require_tensorrt() looks for it
    pass


class Logger:
    INTERNAL_ERROR, ERROR, WARNING, INFO, VERBOSE = range(5)

    def __init__(self, severity=WARNING):
        self.severity = severity

    def log(self, severity: int, message: str) -> None:
        if severity <= self.ERROR:
            ERRORS.append(message)
        if severity <= self.severity:
            print(f"[TRT] {message}", file=sys.stderr)


class TensorIOMode(enum.IntEnum):
    NONE = 0
    INPUT = 1
    OUTPUT = 2


class ICudaEngine:
    def __init__(self, onnx_path: str, logger: Logger):
        self.logger = logger
        so = ort.SessionOptions()
        try:
            self.session = ort.InferenceSession(onnx_path, so, providers=["CPUExecutionProvider"])
        except RuntimeError:  # the process made onnxruntime's global thread pool: sessions must use it
            so.use_per_session_threads = False
            self.session = ort.InferenceSession(onnx_path, so, providers=["CPUExecutionProvider"])
        self.io: dict[str, tuple[TensorIOMode, DataType, tuple[int, ...]]] = {}  # name -> (mode, dtype, shape)
        for mode, values in ((TensorIOMode.INPUT, self.session.get_inputs()),
                             (TensorIOMode.OUTPUT, self.session.get_outputs())):
            for v in reversed(values):  # not the ONNX order: only names pair tensors with buffers
                dims = tuple(d if isinstance(d, int) else -1 for d in v.shape)  # -1: dynamic
                self.io[v.name] = (mode, _ONNX_TYPES[v.type], dims)
        self.names = list(self.io)

    @property
    def num_io_tensors(self) -> int:
        return len(self.names)

    def get_tensor_name(self, i: int) -> str:
        return self.names[i]

    def get_tensor_mode(self, name: str) -> TensorIOMode:
        return self.io[name][0] if name in self.io else TensorIOMode.NONE

    def get_tensor_dtype(self, name: str) -> DataType:
        return self.io[name][1]

    def get_tensor_shape(self, name: str) -> tuple[int, ...]:
        return self.io[name][2]

    def create_execution_context(self):
        return IExecutionContext(self)


def _view(ptr: int, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    nbytes = int(np.prod(shape)) * dtype.itemsize
    raw = np.ctypeslib.as_array((ctypes.c_uint8 * max(nbytes, 1)).from_address(ptr))
    return raw[:nbytes].view(dtype).reshape(shape)


class IExecutionContext:
    def __init__(self, engine: ICudaEngine):
        self.engine = engine
        self.addresses: dict[str, int] = {}
        self.shapes = {name: shape for name, (mode, _, shape) in engine.io.items() if mode == TensorIOMode.INPUT}
        self.runs = 0

    def _error(self, message: str) -> bool:
        self.engine.logger.log(Logger.ERROR, message)
        return False

    # -- binding ----------------------------------------------------------------------------

    def set_tensor_address(self, name: str, memory: int) -> bool:
        if name not in self.engine.io:
            return self._error(f"setTensorAddress: {name} is not an input or output tensor of this engine")
        if int(memory) % _cuda.ALIGNMENT:
            return self._error(f"setTensorAddress: the address of {name} ({int(memory):#x}) is not "
                               f"{_cuda.ALIGNMENT}-byte aligned")
        self.addresses[name] = int(memory)
        return True

    def get_tensor_address(self, name: str) -> int:
        return self.addresses.get(name, 0)

    def set_input_shape(self, name: str, shape) -> bool:
        mode, _, profile = self.engine.io.get(name, (TensorIOMode.NONE, None, ()))
        shape = tuple(int(d) for d in shape)
        if mode != TensorIOMode.INPUT:
            return self._error(f"setInputShape: {name} is not an input of this engine")
        fits = len(shape) == len(profile) and all(p in (-1, d) and d > 0 for p, d in zip(profile, shape))
        if not fits:
            return self._error(f"setInputShape: {list(shape)} for {name} is outside the engine's profile {list(profile)}")
        self.shapes[name] = shape
        return True

    def get_tensor_shape(self, name: str) -> tuple[int, ...]:
        return self.shapes.get(name, self.engine.get_tensor_shape(name))

    def infer_shapes(self) -> list[str]:
        return [name for name, shape in self.shapes.items() if -1 in shape]

    # -- running ----------------------------------------------------------------------------

    def _unready(self) -> str | None:
        """What TensorRT's enqueue refuses: a dynamic shape never set, a tensor without an address."""
        if unset := self.infer_shapes():
            return f"the shapes of {', '.join(unset)} were never set (set_input_shape)"
        if missing := [n for n in self.engine.names if not self.addresses.get(n)]:
            return f"no address was set for {', '.join(missing)}"
        return None

    def _tensor(self, name: str, shape: tuple[int, ...]) -> np.ndarray | None:
        """The tensor at its bound address, as the engine's dtype, or None (an illegal access)."""
        dtype = np.dtype(nptype(self.engine.io[name][1]))
        ptr, nbytes = self.addresses[name], int(np.prod(shape)) * dtype.itemsize
        if problem := _cuda.outside(ptr, nbytes):
            _cuda.fault(f"engine tensor {name} ({dtype.name}{list(shape)}, {nbytes} bytes): {problem}")
            return None
        return _view(ptr, dtype, shape)

    def _execute(self) -> None:
        feeds, outputs = {}, []
        for name, (mode, _, _) in self.engine.io.items():
            if mode == TensorIOMode.INPUT:
                if (value := self._tensor(name, self.shapes[name])) is None:
                    return
                feeds[name] = value.copy()
            else:
                outputs.append(name)
        for name, value in zip(outputs, self.engine.session.run(outputs, feeds)):
            if (out := self._tensor(name, value.shape)) is None:
                return
            out[...] = value
        self.runs += 1

    def execute_async_v3(self, stream_handle: int) -> bool:
        if problem := self._unready():
            return self._error(f"enqueueV3: {problem}")
        _cuda._do(stream_handle, self._execute)
        return True


class Runtime:
    def __init__(self, logger: Logger):
        self.logger = logger

    def deserialize_cuda_engine(self, data: bytes):
        if not data.startswith(PLAN_PREFIX):
            return None
        return ICudaEngine(data[len(PLAN_PREFIX):].decode(), self.logger)
