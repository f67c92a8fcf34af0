"""TensorRT backend: one deserialized engine per graph, behind the same Engine interface.

Device buffers are allocated once per engine with cuda-python (no torch); only the outputs
asked for (tokens, and logits when sampling) come back to the host. The KV cache is a device
store by default (runtime/trt_store.py: ``DeviceStore`` [slots, n_kv, S_max, hd] per past
input, a slot's ``DeviceKVCache``): its rows come to an engine as ``DeviceTensor`` feeds,
bound by address (a batch-B engine: the first B rows), and the engine leaves its present
outputs on the device for the store to append, row by row, with 2-D device copies. So no
cache-sized copy crosses the bus per run, and the fixed-shape step can be captured once as a
CUDA graph and replayed (its addresses never change). With ``EngineOptions(device_kv=False)``
the host cache is used instead and copied whole to the device on every run (correct, and slow
for long caches).

An engine only loads in the TensorRT version and on the GPU architecture that built it: the
manifest records both, and a mismatch is refused with the command that rebuilds the engines
from the ONNX graphs the directory keeps (`specexport build --from-onnx DIR`).
tensorrt and cuda-python are imported lazily, so this module imports on any machine.
"""

from __future__ import annotations

import ctypes
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from specexport import contract
from specexport.backends import BACKENDS, TENSORRT
from specexport.contract import EngineEntry, TensorSpec
from specexport.errors import BadInput, SpecexportError, missing_extra
from specexport.runtime.engine import EngineOptions

if TYPE_CHECKING:  # for annotations only: the package is imported lazily
    import tensorrt as trt

GPU_EXTRA = BACKENDS[TENSORRT].extra
PAST, PRESENT = f"{contract.PAST}.", f"{contract.PRESENT}."  # name prefixes: past_key_values.{i}.key


# -- imports and the device -----------------------------------------------------------------


def require_tensorrt() -> None:
    """Fail with the extra to install (exit code 2) unless the real tensorrt package imports."""
    try:
        import tensorrt
    except (ImportError, OSError):  # OSError: the wheel is there but libnvinfer is not
        raise missing_extra("tensorrt", GPU_EXTRA) from None
    # tensorrt-stubs installs a tensorrt/ folder of .pyi files only, which imports as an empty
    # namespace package: that is not TensorRT.
    if not hasattr(tensorrt, "Builder"):
        raise missing_extra("tensorrt", GPU_EXTRA)


def import_cudart() -> Any:
    """cuda-python's runtime API module (cuda.bindings.runtime; cuda.cudart before 12.6)."""
    try:
        from cuda.bindings import runtime
    except ImportError:
        try:
            from cuda import cudart as runtime
        except ImportError:
            raise missing_extra("cuda-python", GPU_EXTRA) from None
    return runtime


def cuda_call(cudart: Any, name: str, *args: Any) -> Any:
    """Call a cuda-python runtime function; raise on an error code, return its value(s)."""
    err, *values = getattr(cudart, name)(*args)
    if err != cudart.cudaError_t.cudaSuccess:
        raise SpecexportError(f"CUDA {name} failed: {_cuda_error(cudart, err)}")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def _cuda_error(cudart: Any, err: Any) -> str:
    _, text = cudart.cudaGetErrorString(err)
    return f"{getattr(err, 'name', err)}: {text.decode() if isinstance(text, bytes) else text}"


@dataclass(frozen=True)
class CudaDevice:
    index: int
    name: str
    compute_capability: str  # "9.0"


def cuda_device(index: int = 0) -> CudaDevice:
    """The GPU engines run on; a clear exit-code-2 error where there is none."""
    cudart = import_cudart()
    err, count = cudart.cudaGetDeviceCount()
    if err != cudart.cudaError_t.cudaSuccess or not count:
        why = _cuda_error(cudart, err) if err != cudart.cudaError_t.cudaSuccess else "no devices"
        raise BadInput(
            f"no CUDA GPU is usable here ({why}); the tensorrt backend needs an NVIDIA GPU with its "
            f"driver and pip install 'specexport[{GPU_EXTRA}]'"
        )
    if index >= count:
        raise BadInput(f"CUDA device {index} does not exist (this machine has {count})")
    props = cuda_call(cudart, "cudaGetDeviceProperties", index)
    name = props.name.split(b"\0", 1)[0].decode() if isinstance(props.name, bytes) else str(props.name)
    return CudaDevice(index, name, f"{props.major}.{props.minor}")


# -- the manifest's promise -----------------------------------------------------------------


def rebuild_command(root: Path) -> str:
    return f"specexport build --from-onnx {shlex.quote(str(root))}"


def check_compatible(entry: EngineEntry, root: Path, trt_version: str, device: CudaDevice) -> None:
    """Refuse an engine built by another TensorRT version or for another GPU architecture."""
    extra = entry.extra
    built_version, built_cc = extra.get("tensorrt_version"), extra.get("compute_capability")
    fix = f"rebuild the engines on this machine from the ONNX graphs the directory keeps: {rebuild_command(root)}"
    if built_version != trt_version:
        raise BadInput(
            f"{root}: engine {entry.name} was built with TensorRT {built_version}, this machine has "
            f"TensorRT {trt_version}, and an engine only loads in the version that built it; {fix}"
        )
    if built_cc != device.compute_capability:
        raise BadInput(
            f"{root}: engine {entry.name} was built for compute capability {built_cc} "
            f"({extra.get('device_name', 'unknown GPU')}), this GPU ({device.name}) is "
            f"{device.compute_capability}; {fix}"
        )


# -- tensors that stay on the device -------------------------------------------------------


@dataclass(frozen=True)
class DeviceTensor:
    """A tensor in device memory, by address: a cache store's rows fed to an engine (bound by
    address, never copied), or an engine's present output left on the device for the store to
    copy from. ``stream``: the stream whose work produces and reads it (the store's)."""

    ptr: int
    shape: tuple[int, ...]
    dtype: np.dtype
    stream: Any = None

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * self.dtype.itemsize


# -- the engine -----------------------------------------------------------------------------


def _pinned(cudart: Any, spec: TensorSpec) -> tuple[int, np.ndarray]:
    """Page-locked host memory as a numpy array: copies from it can be captured in a graph."""
    dtype = np.dtype(spec.dtype)
    nbytes = max(1, int(np.prod(spec.shape)) * dtype.itemsize)
    ptr = int(cuda_call(cudart, "cudaMallocHost", nbytes))
    raw = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr))
    return ptr, raw.view(dtype)[: int(np.prod(spec.shape))].reshape(spec.shape)


class TrtEngine:
    """One execution context of a deserialized engine (``plan``: shared by the contexts of one
    plan file, so the slots' batch-1 runners hold its weights once), with a device buffer per
    I/O tensor. Inputs fed as ``DeviceTensor`` (a cache store's rows) are bound by address
    instead; their engine then runs on the store's stream and leaves its present outputs on the
    device (returned as DeviceTensors for the store's ``write``)."""

    def __init__(self, entry: EngineEntry, root: Path, options: EngineOptions, device: CudaDevice,
                 plan: Plan | None = None):
        """``plan``: the deserialized plan file, shared (None: deserialized here)."""
        require_tensorrt()
        cudart = self._cudart = import_cudart()
        cuda_call(cudart, "cudaSetDevice", device.index)
        plan = plan if plan is not None else deserialize(entry, root)
        self.name = entry.name
        self.inputs = entry.inputs
        self.outputs = entry.outputs
        self._root = root
        self._plan = plan
        self._engine = plan.engine
        self._check_io(plan.engine)
        context = plan.engine.create_execution_context()
        if context is None:
            raise SpecexportError(f"engine {self.name}: TensorRT could not create an execution context (GPU memory?)")
        self._context = context
        self._own_stream = cuda_call(cudart, "cudaStreamCreateWithFlags", cudart.cudaStreamNonBlocking)
        self._stream: Any = self._own_stream
        self._stream_handle = int(self._stream)
        # one device buffer per I/O tensor, for the engine's lifetime (a past input's is freed
        # when a store's rows are bound in its place)
        self._device: dict[str, int] = {}
        self._nbytes: dict[str, int] = {}
        for name, spec in [*self.inputs.items(), *self.outputs.items()]:
            nbytes = max(1, int(np.prod(spec.shape)) * np.dtype(spec.dtype).itemsize)
            self._nbytes[name] = nbytes
            self._device[name] = int(cuda_call(cudart, "cudaMalloc", nbytes))
            if not context.set_tensor_address(name, self._device[name]):
                raise SpecexportError(f"engine {self.name}: TensorRT refused the address of {name}")
        self._views: dict[str, int] = {}  # input name -> the device address bound in its place
        self._host_inputs = list(self.inputs)
        self._use_graph = bool(getattr(options, "cuda_graphs", False))
        self._graph_exec: Any = None
        self._staging: dict[str, tuple[int, np.ndarray]] = {}
        self._checked = False

    def _check_io(self, engine: trt.ICudaEngine) -> None:
        """The engine's own I/O must be what the manifest says (static shapes, same dtypes)."""
        import tensorrt as trt

        found = {}
        for i in range(engine.num_io_tensors):
            name = engine.get_tensor_name(i)
            is_input = engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT
            dtype = np.dtype(trt.nptype(engine.get_tensor_dtype(name))).name
            dims = engine.get_tensor_shape(name)
            found[name] = (is_input, TensorSpec(dtype, tuple(dims[d] for d in range(len(dims)))))
        expected = {n: (True, s) for n, s in self.inputs.items()} | {n: (False, s) for n, s in self.outputs.items()}
        if found != expected:
            differ = sorted(set(found.items()) ^ set(expected.items()))[:1]
            raise BadInput(
                f"{self._root}: engine {self.name} does not match its manifest entry (first difference "
                f"{differ[0][0] if differ else '?'}); {rebuild_command(self._root)}"
            )

    # -- inputs that live on the device -------------------------------------------------------

    def bind_kv_cache(self, cache: Any) -> None:
        """Run on a device cache's stream (LazyEngine binds a slot's cache as it opens). Its rows
        come with each call's feeds, bound at the first run: a tree or batched engine opened
        with a slot's cache reads the first B rows of the store, not that slot's row."""
        stream = cache.rows_store.stream
        self._stream, self._stream_handle = stream, int(stream)

    def _bind_views(self, feeds: dict[str, Any]) -> None:
        """Bind every DeviceTensor among ``feeds`` by address (once per address: a graph call's
        feeds are made once, so a captured CUDA graph stays valid); the engine then runs on
        their stream, so the store's copies and its runs are in order."""
        changed = False
        for name, value in feeds.items():
            if not isinstance(value, DeviceTensor) or self._views.get(name) == value.ptr:
                continue
            spec = self.inputs.get(name)
            if spec is None or value.shape != spec.shape or value.dtype != np.dtype(spec.dtype):
                have = "no such input" if spec is None else f"{spec.dtype}{list(spec.shape)}"
                raise ValueError(f"engine {self.name}: {name} is {have}, the device rows fed are "
                                 f"{value.dtype.name}{list(value.shape)}")
            if name in self._device:  # its own buffer is not needed any more
                self._cudart.cudaFree(self._device.pop(name))
            if not self._context.set_tensor_address(name, value.ptr):
                raise SpecexportError(f"engine {self.name}: TensorRT refused the device address of {name}")
            self._views[name] = value.ptr
            if value.stream is not None:
                self._stream, self._stream_handle = value.stream, int(value.stream)
            changed = True
        if changed:
            self._host_inputs = [n for n in self.inputs if n not in self._views]
            self._drop_graph()

    def _drop_graph(self) -> None:
        if self._graph_exec is not None:
            self._cudart.cudaGraphExecDestroy(self._graph_exec)
            self._graph_exec = None

    # -- running ------------------------------------------------------------------------------

    def _check_feeds(self, feeds: dict[str, np.ndarray]) -> None:
        for name in self._host_inputs:
            spec, value = self.inputs[name], feeds.get(name)
            if value is None:
                raise BadInput(f"engine {self.name}: missing input {name}")
            if value.dtype.name != spec.dtype or tuple(value.shape) != spec.shape:
                raise BadInput(
                    f"engine {self.name}: input {name} is {value.dtype.name}{list(value.shape)}, "
                    f"the engine was built for {spec.dtype}{list(spec.shape)}"
                )

    def _enqueue(self, feeds: dict[str, np.ndarray]) -> None:
        cudart = self._cudart
        for name in self._host_inputs:
            host = np.ascontiguousarray(feeds[name])
            cuda_call(cudart, "cudaMemcpyAsync", self._device[name], host.ctypes.data, host.nbytes,
                      cudart.cudaMemcpyKind.cudaMemcpyHostToDevice, self._stream)
        if not self._context.execute_async_v3(self._stream_handle):
            raise SpecexportError(f"engine {self.name}: TensorRT execution failed")

    def _capture(self) -> None:
        """Record host-to-device input copies (from pinned staging) and the engine as a graph."""
        cudart = self._cudart
        for name in self._host_inputs:
            if name not in self._staging:
                self._staging[name] = _pinned(cudart, self.inputs[name])
        cuda_call(cudart, "cudaStreamBeginCapture", self._stream,
                  cudart.cudaStreamCaptureMode.cudaStreamCaptureModeThreadLocal)
        for name in self._host_inputs:
            ptr, _ = self._staging[name]
            cuda_call(cudart, "cudaMemcpyAsync", self._device[name], ptr, self._nbytes[name],
                      cudart.cudaMemcpyKind.cudaMemcpyHostToDevice, self._stream)
        launched = self._context.execute_async_v3(self._stream_handle)
        graph = cuda_call(cudart, "cudaStreamEndCapture", self._stream)
        if not launched:
            raise SpecexportError(f"engine {self.name}: TensorRT execution failed while capturing a CUDA graph")
        self._graph_exec = cuda_call(cudart, "cudaGraphInstantiate", graph, 0)
        cuda_call(cudart, "cudaGraphDestroy", graph)

    def run(self, feeds: dict[str, Any], outputs: Sequence[str] | None = None,
            bound: dict[str, np.ndarray] | None = None) -> dict[str, Any]:
        """Outputs as fresh host arrays, except an engine over device rows' present outputs:
        DeviceTensors of its own buffers, valid until its next run (what the store copies)."""
        if bound:
            raise BadInput(f"engine {self.name}: in-place KV graphs (attention: ort-gqa) are onnxruntime-only")
        self._bind_views(feeds)
        if not self._checked:  # shapes are static: checking the first call checks them all
            self._check_feeds(feeds)
            self._checked = True
        cudart = self._cudart
        # A graph fixes every address, so only with the cache bound on the device; TensorRT
        # wants one ordinary run before capture.
        if self._graph_exec is not None:
            for name in self._host_inputs:
                self._staging[name][1][...] = feeds[name]
            cuda_call(cudart, "cudaGraphLaunch", self._graph_exec, self._stream)
        else:
            self._enqueue(feeds)
        names = list(outputs) if outputs is not None else list(self.outputs)
        result: dict[str, Any] = {}
        for name in names:
            spec = self.outputs[name]
            if self._views and name.startswith(PRESENT):  # stays on the device: the store appends it
                result[name] = DeviceTensor(self._device[name], spec.shape, np.dtype(spec.dtype), self._stream)
                continue
            host = np.empty(spec.shape, dtype=spec.dtype)  # fresh: callers keep views of earlier results
            cuda_call(cudart, "cudaMemcpyAsync", host.ctypes.data, self._device[name], host.nbytes,
                      cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost, self._stream)
            result[name] = host
        cuda_call(cudart, "cudaStreamSynchronize", self._stream)
        if self._use_graph and self._views and self._graph_exec is None:
            self._capture()
        return result

    def close(self) -> None:
        cudart = self._cudart
        self._drop_graph()
        for ptr, _ in self._staging.values():
            cudart.cudaFreeHost(ptr)
        self._staging = {}
        for ptr in self._device.values():
            cudart.cudaFree(ptr)
        self._device = {}
        if self._own_stream is not None:
            cudart.cudaStreamDestroy(self._own_stream)
            self._own_stream = None


@dataclass(frozen=True)
class Plan:
    """A deserialized engine with the runtime that made it (which must outlive it)."""

    runtime: trt.Runtime
    engine: trt.ICudaEngine


def deserialize(entry: EngineEntry, root: Path) -> Plan:
    """The engine of ``entry``'s plan file."""
    import tensorrt as trt

    loader = trt.Runtime(trt.Logger(trt.Logger.WARNING))
    engine = loader.deserialize_cuda_engine((root / entry.path).read_bytes())
    if engine is None:
        raise BadInput(f"{root / entry.path}: TensorRT could not load this engine; {rebuild_command(root)}")
    return Plan(loader, engine)


def open_trt_engine(entry: EngineEntry, root: Path, options: EngineOptions, shared: Any = None) -> TrtEngine:
    """An execution context of ``entry``'s plan; ``shared`` (the load's SharedGraphs): the plan
    is deserialized once, however many slots' runners run it."""
    require_tensorrt()
    import tensorrt as trt

    device = cuda_device()
    check_compatible(entry, root, trt.__version__, device)
    plan = None if shared is None else shared.get((TENSORRT, str(root / entry.path)), lambda: deserialize(entry, root))
    return TrtEngine(entry, root, options, device, plan)
