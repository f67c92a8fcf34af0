"""Fake TensorRT runtime API (see tests/fake_gpu/README.md): the calls trt_engine makes.

A plan file holds ``fake-trt:<path of an ONNX graph>``; the engine's I/O are the graph's, and
``execute_async_v3`` runs it with onnxruntime on the tensors at the addresses it was given.
"""

from __future__ import annotations

import ctypes

import numpy as np
import onnxruntime as ort
from cuda.bindings import runtime as _cuda

__version__ = "10.13.0.35"
PLAN_PREFIX = b"fake-trt:"
_ORT_TYPES = {"tensor(float)": np.dtype("float32"), "tensor(int64)": np.dtype("int64"),
              "tensor(float16)": np.dtype("float16"), "tensor(int32)": np.dtype("int32")}


class Builder:  # require_tensorrt() looks for it
    pass


class Logger:
    WARNING = 2

    def __init__(self, severity=WARNING):
        self.severity = severity


class TensorIOMode:
    INPUT = "input"
    OUTPUT = "output"


def nptype(dtype):
    return dtype  # the fake engine's dtypes are numpy dtypes already


def _view(ptr: int, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    nbytes = int(np.prod(shape)) * dtype.itemsize
    raw = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr))
    return raw.view(dtype).reshape(shape)


class ICudaEngine:
    def __init__(self, onnx_path: str):
        so = ort.SessionOptions()
        try:
            self.session = ort.InferenceSession(onnx_path, so, providers=["CPUExecutionProvider"])
        except RuntimeError:  # the process made onnxruntime's global thread pool: sessions must use it
            so.use_per_session_threads = False
            self.session = ort.InferenceSession(onnx_path, so, providers=["CPUExecutionProvider"])
        self.io = {}  # name -> (mode, dtype, shape)
        for mode, values in ((TensorIOMode.INPUT, self.session.get_inputs()),
                             (TensorIOMode.OUTPUT, self.session.get_outputs())):
            for v in values:
                self.io[v.name] = (mode, _ORT_TYPES[v.type], tuple(int(d) for d in v.shape))
        self.names = list(self.io)

    @property
    def num_io_tensors(self) -> int:
        return len(self.names)

    def get_tensor_name(self, i: int) -> str:
        return self.names[i]

    def get_tensor_mode(self, name: str):
        return self.io[name][0]

    def get_tensor_dtype(self, name: str):
        return self.io[name][1]

    def get_tensor_shape(self, name: str):
        return self.io[name][2]

    def create_execution_context(self):
        return IExecutionContext(self)


class IExecutionContext:
    def __init__(self, engine: ICudaEngine):
        self.engine = engine
        self.addresses: dict[str, int] = {}
        self.runs = 0

    def set_tensor_address(self, name: str, ptr: int) -> bool:
        self.addresses[name] = int(ptr)
        return True

    def _execute(self) -> None:
        feeds, outputs = {}, []
        for name, (mode, dtype, shape) in self.engine.io.items():
            if mode == TensorIOMode.INPUT:
                feeds[name] = _view(self.addresses[name], dtype, shape).copy()
            else:
                outputs.append(name)
        for name, value in zip(outputs, self.engine.session.run(outputs, feeds)):
            _, dtype, shape = self.engine.io[name]
            _view(self.addresses[name], dtype, shape)[...] = value
        self.runs += 1

    def execute_async_v3(self, stream_handle: int) -> bool:
        _cuda._do(stream_handle, self._execute)
        return True


class Runtime:
    def __init__(self, logger: Logger):
        self.logger = logger

    def deserialize_cuda_engine(self, data: bytes):
        if not data.startswith(PLAN_PREFIX):
            return None
        return ICudaEngine(data[len(PLAN_PREFIX):].decode())
