"""TensorRT backend: one deserialized engine per graph, behind the same Engine interface.

Device buffers are allocated once per engine with cuda-python (no torch); one CUDA stream
per engine; only the outputs asked for (tokens, and logits when sampling) come back to the
host. The KV cache is a ``DeviceKVCache`` by default (``open_device_kv_cache``, the
tensorrt entry's device_cache in specexport/backends.py): engines bound to it (``TrtEngine.bind_kv_cache``)
read past K/V in place and append their present.* outputs with 2-D device copies, so no
cache-sized copy crosses the bus per run, and the fixed-shape step can be captured once as a
CUDA graph and replayed. With ``EngineOptions(device_kv=False)`` the host KVCache is used
instead and copied whole to the device on every run (correct, and slow for long caches).

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
from specexport.contract import EngineEntry, ModelEntry, TensorSpec
from specexport.errors import BadInput, SpecexportError, missing_extra
from specexport.runtime.engine import EngineOptions
from specexport.runtime.kv_cache import CacheLength

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


# -- KV on the device -----------------------------------------------------------------------


@dataclass(frozen=True)
class Copy2D:
    """One cudaMemcpy2DAsync, in bytes: ``height`` rows of ``width`` bytes."""

    dst_offset: int
    dpitch: int
    src_offset: int
    spitch: int
    width: int
    height: int


def append_copies(present_shape: tuple[int, ...], itemsize: int, max_seq_len: int,
                  cache_lengths: Sequence[int]) -> list[Copy2D]:
    """Copies that append a present [B, n_kv, T, hd] into a cache [B, n_kv, S_max, hd] at each
    row's cache length. All T positions are written (padding included: it lies past the length
    and is overwritten later), clipped at S_max."""
    batch, n_kv, tokens, head_dim = present_shape
    row = head_dim * itemsize  # one position of one head
    copies = []
    for b in range(batch):
        at = int(cache_lengths[b])
        count = min(tokens, max_seq_len - at)
        if count <= 0:
            continue
        copies.append(Copy2D(
            dst_offset=((b * n_kv) * max_seq_len + at) * row,
            dpitch=max_seq_len * row,
            src_offset=(b * n_kv) * tokens * row,
            spitch=tokens * row,
            width=count * row,
            height=n_kv,
        ))
    return copies


class DeviceKVCache(CacheLength):
    """The KVCache interface with its tensors on the GPU (one buffer per past input).

    Engines bound to it (``TrtEngine.bind_kv_cache``) read past K/V in place and append their
    present outputs themselves, so ``view()`` has nothing for the host to feed and ``write``
    only moves the length. Rewinding is moving the length back, as on the host.
    """

    host_resident = False

    def __init__(self, num_layers: int, batch: int, num_kv_heads: int, max_seq_len: int, head_dim: int,
                 dtype: str = "float32", device: int = 0):
        super().__init__(num_layers, max_seq_len)
        self._cudart = import_cudart()
        cuda_call(self._cudart, "cudaSetDevice", device)
        self.shape = (batch, num_kv_heads, max_seq_len, head_dim)  # [B, n_kv, S_max, hd]
        self.dtype = np.dtype(dtype)
        nbytes = int(np.prod(self.shape)) * self.dtype.itemsize
        self.pointers: dict[str, int] = {}
        for i in range(num_layers):
            for kind in ("key", "value"):
                ptr = cuda_call(self._cudart, "cudaMalloc", nbytes)
                cuda_call(self._cudart, "cudaMemset", ptr, 0, nbytes)
                self.pointers[f"{PAST}{i}.{kind}"] = int(ptr)

    def view(self) -> dict[str, np.ndarray]:
        return {}  # the past inputs are bound on the device

    def in_place_outputs(self) -> dict[str, np.ndarray]:
        return {}  # bound engines append on the device themselves

    def write(self, presents: dict[str, np.ndarray], count: int) -> None:
        """The bound engine already appended on the device; record the new length."""
        self.advance(count)

    def close(self) -> None:
        for ptr in self.pointers.values():
            self._cudart.cudaFree(ptr)
        self.pointers = {}


def open_device_kv_cache(model: ModelEntry, options: EngineOptions) -> DeviceKVCache:
    """A model's KV cache on the GPU (batch 1, like the rest of the runtime). TensorRT and the
    GPU are checked first, so a missing one is the usual one-line error naming the extra."""
    require_tensorrt()
    device = cuda_device()
    return DeviceKVCache(model.num_layers, 1, model.num_kv_heads, model.max_seq_len, model.head_dim,
                         model.kv_dtype, device.index)


# -- the engine -----------------------------------------------------------------------------


def _pinned(cudart: Any, spec: TensorSpec) -> tuple[int, np.ndarray]:
    """Page-locked host memory as a numpy array: copies from it can be captured in a graph."""
    dtype = np.dtype(spec.dtype)
    nbytes = max(1, int(np.prod(spec.shape)) * dtype.itemsize)
    ptr = int(cuda_call(cudart, "cudaMallocHost", nbytes))
    raw = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr))
    return ptr, raw.view(dtype)[: int(np.prod(spec.shape))].reshape(spec.shape)


class TrtEngine:
    def __init__(self, entry: EngineEntry, root: Path, options: EngineOptions, device: CudaDevice):
        require_tensorrt()
        import tensorrt as trt

        cudart = self._cudart = import_cudart()
        cuda_call(cudart, "cudaSetDevice", device.index)
        self.name = entry.name
        self.inputs = entry.inputs
        self.outputs = entry.outputs
        self._root = root
        self._logger = trt.Logger(trt.Logger.WARNING)
        self._runtime = trt.Runtime(self._logger)
        engine = self._runtime.deserialize_cuda_engine((root / entry.path).read_bytes())
        if engine is None:
            raise BadInput(f"{root / entry.path}: TensorRT could not load this engine; {rebuild_command(root)}")
        self._engine = engine
        self._check_io(engine)
        context = engine.create_execution_context()
        if context is None:
            raise SpecexportError(f"engine {self.name}: TensorRT could not create an execution context (GPU memory?)")
        self._context = context
        self._stream = cuda_call(cudart, "cudaStreamCreateWithFlags", cudart.cudaStreamNonBlocking)
        self._stream_handle = int(self._stream)
        # one device buffer per I/O tensor, for the engine's lifetime
        self._device: dict[str, int] = {}
        self._nbytes: dict[str, int] = {}
        for name, spec in [*self.inputs.items(), *self.outputs.items()]:
            nbytes = max(1, int(np.prod(spec.shape)) * np.dtype(spec.dtype).itemsize)
            self._nbytes[name] = nbytes
            self._device[name] = int(cuda_call(cudart, "cudaMalloc", nbytes))
            if not context.set_tensor_address(name, self._device[name]):
                raise SpecexportError(f"engine {self.name}: TensorRT refused the address of {name}")
        self._bound: DeviceKVCache | None = None
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

    # -- device-resident KV -------------------------------------------------------------------

    def bind_kv_cache(self, cache: DeviceKVCache) -> None:
        """Read past K/V from ``cache`` in place and append present K/V to it after each run."""
        past = [n for n in self.inputs if n.startswith(PAST)]
        if set(past) != set(cache.pointers):
            raise ValueError(f"engine {self.name}: its past inputs do not match the cache's tensors")
        for name in past:
            spec = self.inputs[name]
            if spec.shape != cache.shape or np.dtype(spec.dtype) != cache.dtype:
                raise ValueError(f"engine {self.name}: {name} is {spec.dtype}{list(spec.shape)}, the cache is "
                                 f"{cache.dtype.name}{list(cache.shape)}")
            self._cudart.cudaFree(self._device.pop(name))
            if not self._context.set_tensor_address(name, cache.pointers[name]):
                raise SpecexportError(f"engine {self.name}: TensorRT refused the cache address of {name}")
        self._bound = cache
        self._host_inputs = [n for n in self.inputs if not n.startswith(PAST)]
        self._graph_exec = None

    def _append_presents(self, cache_lengths: list[int]) -> None:
        assert self._bound is not None
        cudart, cache = self._cudart, self._bound
        for past_name, dst in cache.pointers.items():
            present = PRESENT + past_name[len(PAST):]
            spec = self.outputs[present]
            for c in append_copies(spec.shape, cache.dtype.itemsize, cache.max_seq_len, cache_lengths):
                cuda_call(cudart, "cudaMemcpy2DAsync", dst + c.dst_offset, c.dpitch,
                          self._device[present] + c.src_offset, c.spitch, c.width, c.height,
                          cudart.cudaMemcpyKind.cudaMemcpyDeviceToDevice, self._stream)

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

    def run(self, feeds: dict[str, np.ndarray], outputs: Sequence[str] | None = None,
            bound: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        if bound:
            raise BadInput(f"engine {self.name}: in-place KV graphs (attention: ort-gqa) are onnxruntime-only")
        if not self._checked:  # shapes are static: checking the first call checks them all
            self._check_feeds(feeds)
            self._checked = True
        cudart = self._cudart
        # A graph fixes every address, so only with the KV bound on the device; TensorRT wants
        # one ordinary run before capture.
        if self._graph_exec is not None:
            for name in self._host_inputs:
                self._staging[name][1][...] = feeds[name]
            cuda_call(cudart, "cudaGraphLaunch", self._graph_exec, self._stream)
        else:
            self._enqueue(feeds)
        if self._bound is not None:
            self._append_presents(np.asarray(feeds[contract.CACHE_LENGTH]).reshape(-1).tolist())
        names = list(outputs) if outputs is not None else list(self.outputs)
        if self._bound is not None:  # the present outputs are in the bound cache already
            names = [n for n in names if not n.startswith(PRESENT)]
        result = {}
        for name in names:  # fresh host arrays: callers keep views of earlier results
            spec = self.outputs[name]
            host = np.empty(spec.shape, dtype=spec.dtype)
            cuda_call(cudart, "cudaMemcpyAsync", host.ctypes.data, self._device[name], host.nbytes,
                      cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost, self._stream)
            result[name] = host
        cuda_call(cudart, "cudaStreamSynchronize", self._stream)
        if self._use_graph and self._bound is not None and self._graph_exec is None:
            self._capture()
        return result

    def close(self) -> None:
        cudart = self._cudart
        if self._graph_exec is not None:
            cudart.cudaGraphExecDestroy(self._graph_exec)
            self._graph_exec = None
        for ptr, _ in self._staging.values():
            cudart.cudaFreeHost(ptr)
        self._staging = {}
        for ptr in self._device.values():
            cudart.cudaFree(ptr)
        self._device = {}
        if self._stream is not None:
            cudart.cudaStreamDestroy(self._stream)
            self._stream = None


def open_trt_engine(entry: EngineEntry, root: Path, options: EngineOptions, shared: object = None) -> TrtEngine:
    """``shared`` is not used: a TensorRT plan is one static size, its own engine."""
    require_tensorrt()
    import tensorrt as trt

    device = cuda_device()
    check_compatible(entry, root, trt.__version__, device)
    return TrtEngine(entry, root, options, device)
