"""An engine's I/O binding over a device store (runtime/device_store.py), and CUDA graphs.

Everything the session reads or writes sits at a fixed address on its device: the cache
tensors where the store keeps them (bound by address), and a staging buffer per small input
(tokens, cache length, valid counts, masks, features) and per output, allocated once per
binding. Before each run the host feed arrays (the graph call's buffers, updated in place) are
copied into their staging buffers, and after it the outputs asked for are copied out; an
append graph's presents stay on the device (returned as DeviceTensors for the store's
``write``). The copies are counted (runtime/copy_counter.py). On the CPU the same code runs
with every buffer on "cpu".

Fixed addresses are what onnxruntime's CUDA graphs need: with ``EngineOptions.cuda_graphs`` the
CUDA provider gets ``enable_cuda_graph`` and each binding (one static shape of a session that
serves several token counts) runs under its own ``gpu_graph_id``, captured on its first runs
and replayed after.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from specexport.contract import is_present
from specexport.runtime.copy_counter import CopyCounter
from specexport.runtime.device_store import DeviceTensor

CUDA = "CUDAExecutionProvider"
GRAPH_ID = "gpu_graph_id"  # onnxruntime's run config entry choosing which captured graph a run replays


def store_device(options) -> str | None:
    """Where an onnxruntime load keeps its caches: "cuda" with --device cuda (always), "cpu"
    when the device store is asked for on the CPU (load(..., device_store=True)), else None:
    host arrays (cache_store.HostStore)."""
    if options.device == "cuda":
        return "cuda"
    return "cpu" if getattr(options, "device_store", False) else None


def over_device_store(feeds: Mapping[str, Any], bound: Mapping[str, Any]) -> bool:
    """Feeds over a device store: its cache tensors are DeviceTensors, and so is every bound
    output (a host numpy cache bound in place cannot be written by address on a device)."""
    return (any(isinstance(v, DeviceTensor) for v in feeds.values())
            and all(isinstance(v, DeviceTensor) for v in bound.values()))


def with_cuda_graphs(providers: Sequence[Any], cuda_graphs: bool) -> list[Any]:
    """The providers, the CUDA one with ``enable_cuda_graph`` when ``cuda_graphs``."""
    if not cuda_graphs:
        return list(providers)
    return [(CUDA, {"enable_cuda_graph": "1"}) if p == CUDA else p for p in providers]


def graph_run_options(ort, graph_id: int | None):
    """RunOptions replaying (or capturing) graph ``graph_id``; None: plain runs."""
    if graph_id is None:
        return None
    run_options = ort.RunOptions()
    run_options.add_run_config_entry(GRAPH_ID, str(graph_id))
    return run_options


class DeviceBinding:
    """One binding of an engine over ``feeds`` (the graph call's dict: DeviceTensors for the
    cache, host arrays for the rest), ``names`` the outputs read and ``bound`` the in-place
    presents (DeviceTensors)."""

    def __init__(self, ort, session, device: str, feeds: Mapping[str, Any], inputs: Sequence[str],
                 constant: Mapping[str, np.ndarray], outputs: Mapping[str, Any], names: Sequence[str],
                 bound: Mapping[str, DeviceTensor], counter: CopyCounter | None, graph_id: int | None):
        self.device, self.counter, self.feeds = device, counter, feeds
        self.binding = session.io_binding()
        self.staged: dict[str, Any] = {}  # input name -> its staging OrtValue on the device
        for name in inputs:
            value = feeds[name]
            if isinstance(value, DeviceTensor):
                value.bind_input(self.binding, name)
            else:
                self.staged[name] = self._buffer(ort, value.shape, value.dtype)
                self.binding.bind_ortvalue_input(name, self.staged[name])
        self._constants = []  # a tree graph's chain feeds: staged once
        for name, value in constant.items():
            staged = self._buffer(ort, value.shape, value.dtype)
            staged.update_inplace(np.ascontiguousarray(value))
            self.binding.bind_ortvalue_input(name, staged)
            self._constants.append(staged)
        self.read: dict[str, Any] = {}  # output name -> the OrtValue it is written into, copied out
        self.kept: dict[str, DeviceTensor] = {}  # an append graph's presents: stay on the device
        for name in names:
            spec = outputs[name]
            if is_present(name):
                self.kept[name] = DeviceTensor.zeros(ort, tuple(spec.shape), spec.dtype, device)
                self.kept[name].bind_output(self.binding, name)
            else:
                self.read[name] = self._buffer(ort, spec.shape, spec.dtype)
                self.binding.bind_ortvalue_output(name, self.read[name])
        for name, tensor in bound.items():
            tensor.bind_output(self.binding, name)
        self.run_options = graph_run_options(ort, graph_id)

    def _buffer(self, ort, shape, dtype):
        return ort.OrtValue.ortvalue_from_shape_and_type(list(shape), np.dtype(dtype), self.device, 0)

    def run(self, session) -> dict[str, Any]:
        """Stage the feeds in, run, copy the asked-for outputs out."""
        for name, staged in self.staged.items():
            host = self.feeds[name]
            staged.update_inplace(host)
            if self.counter is not None:
                self.counter.to_device(name, host.nbytes)
        session.run_with_iobinding(self.binding, self.run_options)
        out: dict[str, Any] = {}
        for name, value in self.read.items():
            array = value.numpy()
            # on the CPU numpy() is a view of the buffer the next run overwrites: copy; from a GPU it is a copy
            out[name] = array.copy() if self.device == "cpu" else array
            if self.counter is not None:
                self.counter.to_host(name, array.nbytes)
        return out | self.kept


def count_host_run(counter: CopyCounter, feeds: Mapping[str, np.ndarray], returned: Mapping[str, np.ndarray],
                   bound: Mapping[str, np.ndarray] | None) -> None:
    """A run over host arrays: every feed goes in, every output (bound ones too) comes out."""
    for name, value in feeds.items():
        counter.to_device(name, value.nbytes)
    for name, value in returned.items():
        counter.to_host(name, value.nbytes)
    for name, value in (bound or {}).items():
        counter.to_host(name, value.nbytes)
