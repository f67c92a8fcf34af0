"""The Engine interface, and opening one engine or cache of a backend (specexport/backends.py).

An engine is one compiled graph with fixed shapes. Backends are imported lazily: asking for
one whose package is missing raises an error naming the extra to install.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from specexport.backends import BACKENDS
from specexport.contract import EngineEntry, ModelEntry, TensorSpec
from specexport.errors import BadInput
from specexport.runtime.copy_counter import CopyCounter
from specexport.runtime.kv_cache import KVCache, open_host_cache


@dataclass(frozen=True)
class EngineOptions:
    threads: int | None = None  # intra-op threads; None lets the backend choose
    device: str = "cpu"  # cpu | cuda: onnxruntime's execution provider
    # tensorrt: the KV cache lives on the GPU (trt_store.DeviceStore), read in place and
    # appended by the engines. False keeps it in host memory, copied whole to the GPU on every
    # run (load(..., device_kv=False), --host-kv). Backends without a device cache ignore it.
    device_kv: bool = True
    # tensorrt: replay each fixed-shape step as a CUDA graph (needs device_kv); onnxruntime on
    # cuda: capture each static shape once (enable_cuda_graph, a gpu_graph_id per shape), replay it
    cuda_graphs: bool = False
    # onnxruntime: keep the caches in a device store (runtime/device_store.py), OrtValues bound by
    # address; always on with device "cuda", on the CPU when asked (load(..., device_store=True))
    device_store: bool = False


class Engine(Protocol):
    name: str
    inputs: dict[str, TensorSpec]
    outputs: dict[str, TensorSpec]

    def run(self, feeds: dict[str, np.ndarray], outputs: Sequence[str] | None = None,
            bound: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        """Run once; return the requested outputs (all when None) as host arrays. ``bound``
        maps outputs to arrays the engine writes into directly (an in-place KV cache)."""
        ...


class SharedGraphs:
    """The graph sessions of one load, by file: engines whose entries point at the same graph
    file (an ort-gqa model's one graph with a symbolic token count) share one backend session,
    so its weights are loaded and pre-packed once however many sizes the manifest lists."""

    def __init__(self) -> None:
        self._sessions: dict[tuple, Any] = {}
        self._graph_ids: dict[tuple, int] = {}  # session key -> CUDA graphs captured on it
        self.copies = CopyCounter()  # bytes copied between host and device by this load's engines

    def graph_id(self, key: tuple) -> int:
        """A new CUDA graph id on the session of ``key`` (one per static shape bound on it)."""
        self._graph_ids[key] = self._graph_ids.get(key, 0) + 1
        return self._graph_ids[key]

    def get(self, key: tuple, make: Callable[[], Any]) -> Any:
        """The session of ``key`` (backend, file, ...), made by ``make`` on first use."""
        if key not in self._sessions:
            self._sessions[key] = make()
        return self._sessions[key]

    def __len__(self) -> int:
        return len(self._sessions)


def import_factory(target: str) -> Any:
    """The function a registry names as "module:factory" (a backend's engine, a drafter kind's
    drafter), its module imported now: a backend or drafter never used is never imported."""
    module_name, factory = target.split(":")
    return getattr(importlib.import_module(module_name), factory)


def open_engine(entry: EngineEntry, root: Path, options: EngineOptions, shared: SharedGraphs | None = None) -> Engine:
    """``shared``: the load's sessions by file; engines of one file share a session (None: its own)."""
    if entry.backend not in BACKENDS:
        raise BadInput(f"engine {entry.name}: unknown backend '{entry.backend}' (known: {', '.join(BACKENDS)})")
    return import_factory(BACKENDS[entry.backend].engine)(entry, root, options, shared)


def open_row_store(backend: str, num_layers: int, shape: tuple[int, ...], dtype: str, options: EngineOptions,
                   counter: CopyCounter | None = None):
    """The backend's store of cache rows ``shape`` [slots, n_kv, S_max, hd] on its engines' device
    (BACKENDS' row_store), or None: host arrays (cache_store.HostStore)."""
    target = BACKENDS[backend].row_store if backend in BACKENDS else None
    return None if target is None else import_factory(target)(num_layers, shape, dtype, options, counter)


def open_kv_cache(backend: str, model: ModelEntry, options: EngineOptions, largest_graph: int = 64,
                  counter: CopyCounter | None = None) -> KVCache:
    """One model's cache for engines of ``backend``: on the device where the backend keeps one
    (and device_kv is on), else the host KVCache. Both have the KVCache interface.
    ``largest_graph``: the most tokens one of the model's graphs takes (a recurrent state keeps
    that many positions, so any one run can be rewound)."""
    target = BACKENDS[backend].device_cache if backend in BACKENDS else None
    if target is not None and options.device_kv and model.state is not None:
        raise BadInput(f"model {model.name}: a device-resident cache has no recurrent state (linear-attention "
                       "layers) yet; load with device_kv=False (--host-kv)")
    if target is not None and options.device_kv:
        return import_factory(target)(model, options)
    store = open_row_store(backend, model.num_layers, model.kv.shape(1), model.kv_dtype, options, counter)
    return open_host_cache(model.num_layers, 1, model.num_kv_heads, model.max_seq_len, model.head_dim,
                           model.kv_dtype, model.state, keep=max(64, largest_graph), store=store)


def open_device_slots(backend: str, model: ModelEntry, options: EngineOptions, slots: int) -> tuple[Any, list] | None:
    """A model's cache of ``slots`` rows on the device, where the backend keeps one (and
    device_kv is on): (its store, one cache per slot); None: the caller's host store."""
    target = BACKENDS[backend].device_slots if backend in BACKENDS else None
    if target is None or not options.device_kv:
        return None
    return import_factory(target)(model, options, slots)


def device_resident(cache: object) -> bool:
    """A cache whose tensors live with the engines: they bind it and append to it themselves."""
    return getattr(cache, "host_resident", True) is False


class LazyEngine:
    """Opens its backend engine on first use: a graph a run never needs (a probe size, a
    static graph's own session with its own copy of the weights) costs no memory."""

    def __init__(self, entry: EngineEntry, root: Path, options: EngineOptions, kv_cache: object | None = None,
                 shared: SharedGraphs | None = None):
        self.name = entry.name
        self.inputs = entry.inputs
        self.outputs = entry.outputs
        self._open = lambda: open_engine(entry, root, options, shared)
        # a device-resident cache is bound when the engine opens (TrtEngine.bind_kv_cache)
        self._bind_to = kv_cache if device_resident(kv_cache) else None
        self._engine: Engine | None = None

    @property
    def opened(self) -> bool:
        return self._engine is not None

    def open(self) -> Engine:
        if self._engine is None:
            engine = self._open()
            if self._bind_to is not None:
                engine.bind_kv_cache(self._bind_to)  # type: ignore[attr-defined]
            self._engine = engine
        return self._engine

    def run(self, feeds: dict[str, np.ndarray], outputs: Sequence[str] | None = None,
            bound: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        if bound:
            return self.open().run(feeds, outputs, bound)
        return self.open().run(feeds, outputs)


def check_feeds(engine: Engine, feeds: dict[str, np.ndarray]) -> None:
    """Compare feeds with the recorded input specs; raise one clear line on a mismatch."""
    missing = set(engine.inputs) - set(feeds)
    if missing:
        raise BadInput(f"engine {engine.name}: missing inputs {sorted(missing)}")
    for name, spec in engine.inputs.items():
        value = feeds[name]
        if value.dtype.name != spec.dtype or tuple(value.shape) != spec.shape:
            raise BadInput(
                f"engine {engine.name}: input {name} is {value.dtype.name}{list(value.shape)}, "
                f"the engine was built for {spec.dtype}{list(spec.shape)}"
            )
