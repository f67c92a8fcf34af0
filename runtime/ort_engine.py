"""onnxruntime backend: one InferenceSession per graph file, CPU by default.

An ort-gqa model has one graph with a symbolic token count; each manifest entry is one static
size of it, and all of them run on one session (``SharedGraphs``), which holds and pre-packs
the weights once. Measured on the 2-core VM, SmolLM2-135M, one session over the shared graph
against three static graphs (1, 6, 64 tokens), 2 threads, interleaved runs: peak RSS 710 MB
against 1963 MB, session load 0.6 s against 1.7-2.4 s, per-run time the same (decode 20.3-21.7
against 22.5-23.8 ms, verify of 6 25.2-26.0 against 25.3-27.8 ms, prefill of 64 136 against
130-139 ms).

CUDA and TensorRT execution providers are selectable with ``EngineOptions.device`` when the
installed onnxruntime has them (onnxruntime-gpu).

Threads: every session of the process runs on ONE intra-op pool, onnxruntime's global pool
(``set_global_thread_pool_sizes`` + ``use_per_session_threads = False``), sized once from the
first ``threads`` asked for (default: the physical cores this process may run on). Before, each
session made its own machine-sized pool (eight sessions, eight pools), and their spinning
threads stole the cores from each other (2.4x slower steps on 2 cores) unless spinning was
stopped after every run.

Spinning: the global pool spins between operators and between runs (onnxruntime's default;
its Python API sizes the global pool but cannot turn spinning off). Measured on the 2-core VM,
SmolLM2 decode step, 2 threads, blocks of steps interleaved in one process, median ms:

    cores              global pool  old: own pool +      own pool,   own pool,     1 thread
                       (spins)      force_spinning_stop  never spins spins 50 us
    idle (load 1.4)    24.3         28.9                 32.5        26.0          40.0
    busy (load 5-6)    122          127                  71          82            69

Spinning pays for itself whenever the cores are ours (19% faster than the old setting), so the
one pool keeps it; on oversubscribed cores any spinning loses to sleeping threads, and
``threads=1`` (no pool at all) is then the fastest setting.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from specexport.backends import BACKENDS, ONNXRUNTIME
from specexport.contract import INPUT_IDS, EngineEntry, TensorSpec, chain_tree_feeds
from specexport.errors import BadInput, MissingDependency, missing_extra
from specexport.runtime.copy_counter import CopyCounter
from specexport.runtime.device_binding import (
    DeviceBinding,
    count_host_run,
    over_device_store,
    store_device,
    with_cuda_graphs,
)
from specexport.runtime.engine import EngineOptions, SharedGraphs, check_feeds
from specexport.runtime.placement import PROVIDERS, open_session, require_device_placement

# onnxruntime-gpu installs the same module as the CPU onnxruntime: the `cuda` extra instead of `cpu`
ONNXRUNTIME_GPU_SWAP = "pip uninstall -y onnxruntime && pip install 'specexport[cuda]'"
# onnxruntime's CUDA GroupQueryAttention takes an attention bias only on its unfused path (it
# refused one before microsoft/onnxruntime#29525), and a target built with trees gives every call one
FOLDED_ON_GPU = ("this target's ort-gqa graph also verifies token trees (draft.tree), so every call gives "
                 "GroupQueryAttention a bias, which onnxruntime's CUDA kernel runs unfused or refuses; for a GPU "
                 "build without draft.tree, or use attention: standard with TensorRT")
# EngineOptions.device -> providers (runtime/placement.py). TensorRT is a backend of its own
# (specexport/backends.py), not a provider here: one path to it
_PROVIDERS = PROVIDERS


def _onnxruntime():
    try:
        import onnxruntime
    except ImportError:
        raise missing_extra(ONNXRUNTIME, BACKENDS[ONNXRUNTIME].extra) from None
    return onnxruntime


def physical_cores(cpus: set[int] | None = None) -> int:
    """Physical cores among the CPUs this process may run on (hyperthread siblings count once).
    Two threads on one core's siblings only share its execution units: for memory-bound
    matmuls that is a slowdown, which is why onnxruntime's own default is one per core."""
    cpus = os.sched_getaffinity(0) if cpus is None else cpus
    cores = set()
    for cpu in cpus:
        topo = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            cores.add((topo / "physical_package_id").read_text().strip() + ":" + (topo / "core_id").read_text().strip())
        except OSError:  # no sysfs (containers, other systems): count logical CPUs
            cores.add(f"cpu{cpu}")
    return max(1, len(cores))


def providers_of(ort, device: str) -> list[str]:
    """onnxruntime's providers for ``device``, or one line saying what is missing: an unknown
    device, or onnxruntime without the device's provider (the CPU wheel asked for cuda)."""
    providers = _PROVIDERS.get(device)
    if providers is None:
        raise BadInput(f"device '{device}' is unknown; choose one of {', '.join(_PROVIDERS)}")
    if providers[0] not in ort.get_available_providers():
        raise MissingDependency(f"onnxruntime with {providers[0]} is not installed: {ONNXRUNTIME_GPU_SWAP}")
    return list(providers)


class SharedPool:
    """The process's one onnxruntime intra-op thread pool (owned here, created lazily once).

    onnxruntime makes its global pools once per process and cannot resize them, and once they
    exist every session must use them. So the first session fixes the size; a later one asking
    for another size runs on the same pool, with a warning.
    """

    def __init__(self) -> None:
        self.size: int | None = None  # threads of the global pool, once made

    def threads_for(self, ort, threads: int) -> int:
        """The threads a session wanting ``threads`` will run on (the pool is made on first use)."""
        if self.size is None:
            ort.set_global_thread_pool_sizes(threads, 1)  # inter-op: 1 (graphs run sequentially)
            self.size = threads
        elif threads != self.size:
            warnings.warn(f"onnxruntime's thread pool was made with {self.size} threads and cannot be resized; "
                          f"this session runs on it, not on {threads}", RuntimeWarning, stacklevel=3)
        return self.size


SHARED_POOL = SharedPool()


def session_options(ort, threads: int | None, pool: SharedPool = SHARED_POOL):
    """SessionOptions for one of our graphs, on the shared pool. Its threads spin between runs
    (onnxruntime's default for a global pool; the Python API cannot turn it off): with one pool
    nothing competes with them, and a step wakes them at once."""
    pool.threads_for(ort, threads or physical_cores())
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.log_severity_level = 3
    so.use_per_session_threads = False
    return so


class OrtEngine:
    def __init__(self, name: str, path: Path, inputs: dict[str, TensorSpec], outputs: dict[str, TensorSpec],
                 options: EngineOptions, shared: SharedGraphs | None = None):
        """One static size of a graph: ``inputs``/``outputs`` are this engine's shapes. With
        ``shared``, engines of the same file (a graph with a symbolic token count) run on one
        session; each keeps its own feeds and bindings."""
        ort = _onnxruntime()
        providers = providers_of(ort, options.device)
        so = session_options(ort, options.threads)
        require_device_placement(so, options.device)  # cuda: a computation on the CPU is refused
        self.name = name
        self.inputs = inputs
        self.outputs = outputs
        self.threads = SHARED_POOL.size
        providers = with_cuda_graphs(providers, options.cuda_graphs and options.device == "cuda")

        def make():
            return open_session(ort, path, so, options.device, providers)

        key = (ONNXRUNTIME, str(Path(path).resolve()), options.device)
        self._session = make() if shared is None else shared.get(key, make)
        # A chain entry of a graph that also verifies trees lacks the tree inputs: fed a chain's
        extra = {i.name for i in self._session.get_inputs()} - set(inputs)
        self._constant = chain_tree_feeds(extra, inputs.get(INPUT_IDS)) if extra else {}
        if self._constant and options.device != "cpu":
            warnings.warn(FOLDED_ON_GPU, RuntimeWarning, stacklevel=2)
        self._ortvalue = ort.OrtValue.ortvalue_from_numpy
        self._checked = False
        self._bindings: dict[tuple, tuple] = {}  # outputs -> (feeds, bound, binding, output buffers)
        # the device store: every feed and output at a fixed address on this device (None: host arrays)
        self._ort, self._store_device = ort, store_device(options)
        self._device_bindings: dict[tuple, DeviceBinding] = {}  # outputs -> the binding over the call's feeds
        self._copies = shared.copies if shared is not None else None  # host <-> device bytes
        self._host_traffic: dict[tuple, tuple] = {}  # outputs -> (feeds, bound, one run's bytes)
        use_graphs = options.cuda_graphs and self._store_device == "cuda"
        self._graph_ids = (lambda: shared.graph_id(key)) if use_graphs and shared is not None else None

    def run(self, feeds: dict[str, np.ndarray], outputs: Sequence[str] | None = None,
            bound: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        if not self._checked:  # shapes are static: checking the first call checks them all
            check_feeds(self, feeds)
            self._checked = True
        names = list(outputs) if outputs is not None else list(self.outputs)
        if self._store_device is not None:
            binding = self._device_binding(feeds, names, bound or {})
            if binding is not None:
                return binding.run(self._session)
        if not bound:
            values = self._session.run(names, {**feeds, **self._constant} if self._constant else feeds)
            out = dict(zip(names, values))
        else:
            binding, buffers = self._binding(feeds, names, bound)
            self._session.run_with_iobinding(binding)
            # The binding and its output buffers are reused: the next run overwrites them, so hand
            # out copies (the tokens, the taps, and the logits when sampling: small next to a step).
            out = {name: buffer.copy() for name, buffer in buffers.items()}
        if self._copies is not None:
            self._count_host_run(feeds, names, out, bound)
        return out

    def _count_host_run(self, feeds: dict, names: list[str], out: dict, bound: dict | None) -> None:
        """Add a host-array run's traffic to the counter, tallied once per feeds dict (shapes are static)."""
        key = tuple(names)
        cached = self._host_traffic.get(key)
        if cached is None or cached[0] is not feeds or cached[1] is not bound:
            tally = CopyCounter()
            count_host_run(tally, feeds, out, bound)
            cached = self._host_traffic[key] = (feeds, bound, tally)
        if self._copies is not None:
            self._copies.add(cached[2])

    def _device_binding(self, feeds: dict, names: list[str], bound: dict) -> DeviceBinding | None:
        """The binding over the call's feeds (device tensors and small host buffers), made once
        per feeds dict and outputs (runtime/device_binding.py); None for feeds over a host
        cache (the exporter's checks hold their own numpy caches): those run as on the host."""
        key = tuple(names)
        cached = self._device_bindings.get(key)
        if cached is None or cached.feeds is not feeds:
            if not over_device_store(feeds, bound):
                return None
            graph_id = self._graph_ids() if self._graph_ids is not None else None
            cached = self._device_bindings[key] = DeviceBinding(
                self._ort, self._session, self._store_device, feeds, list(self.inputs), self._constant,
                self.outputs, names, bound, self._copies, graph_id)
        return cached

    def _binding(self, feeds: dict[str, np.ndarray], names: list[str], bound: dict[str, np.ndarray]):
        """An I/O binding over the caller's arrays, made once per feeds dict, and the buffers
        its asked-for outputs are written into: the runner keeps one dict per engine and updates
        its arrays in place, so the same binding serves every call (the dict and arrays must not
        be replaced). Bound outputs (the in-place KV cache) are written straight into the
        caller's buffers; the asked-for ones into buffers made here from the entry's static
        shapes (reading them back through ``get_outputs`` wrapped every output, the 60 cache
        tensors included: about 0.3 ms, 1% of a SmolLM2 step)."""
        key = tuple(names)
        cached = self._bindings.get(key)
        if cached is not None and cached[0] is feeds and cached[1] is bound:
            return cached[2], cached[3]
        binding = self._session.io_binding()
        for name in self.inputs:
            binding.bind_ortvalue_input(name, self._ortvalue(feeds[name]))  # shares the memory
        for name, value in self._constant.items():
            binding.bind_ortvalue_input(name, self._ortvalue(value))
        buffers = {name: np.empty(self.outputs[name].shape, dtype=self.outputs[name].dtype) for name in names}
        for name, array in {**buffers, **bound}.items():
            binding.bind_ortvalue_output(name, self._ortvalue(array))
        self._bindings[key] = (feeds, bound, binding, buffers)
        return binding, buffers


def open_ort_engine(entry: EngineEntry, root: Path, options: EngineOptions,
                    shared: SharedGraphs | None = None) -> OrtEngine:
    return OrtEngine(entry.name, root / entry.path, entry.inputs, entry.outputs, options, shared)
