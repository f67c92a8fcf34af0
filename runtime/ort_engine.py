"""onnxruntime backend: one InferenceSession per graph, CPU by default.

CUDA and TensorRT execution providers are selectable with ``EngineOptions.device`` when the
installed onnxruntime has them (onnxruntime-gpu).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from specexport.errors import BadInput, missing_extra
from specexport.runtime.engine import EngineOptions, check_feeds
from specexport.runtime.manifest import EngineEntry, TensorSpec

_PROVIDERS = {
    "cpu": ["CPUExecutionProvider"],
    "cuda": ["CUDAExecutionProvider", "CPUExecutionProvider"],
    "tensorrt": ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"],
}


def _onnxruntime():
    try:
        import onnxruntime
    except ImportError:
        raise missing_extra("onnxruntime", "cpu") from None
    return onnxruntime


class OrtEngine:
    def __init__(self, name: str, path: Path, inputs: dict[str, TensorSpec], outputs: dict[str, TensorSpec],
                 options: EngineOptions):
        ort = _onnxruntime()
        providers = _PROVIDERS.get(options.device)
        if providers is None:
            raise BadInput(f"device '{options.device}' is unknown; choose one of {', '.join(_PROVIDERS)}")
        available = ort.get_available_providers()
        if providers[0] not in available:
            raise missing_extra(f"onnxruntime with {providers[0]}", "gpu")
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        so.log_severity_level = 3
        if options.threads:
            so.intra_op_num_threads = options.threads
        so.inter_op_num_threads = 1
        # A decode loop alternates between sessions (draft, verify, decode). Threads left
        # spinning by the last session steal the cores from the next one: measured 2.4x
        # slower steps on 2 cores. Stop spinning when a run ends.
        so.add_session_config_entry("session.force_spinning_stop", "1")
        self.name = name
        self.inputs = inputs
        self.outputs = outputs
        self._session = ort.InferenceSession(str(path), so, providers=providers)
        self._ortvalue = ort.OrtValue.ortvalue_from_numpy
        self._checked = False
        self._bindings: dict[tuple, tuple] = {}  # outputs -> (feeds, bound, binding)

    def run(self, feeds: dict[str, np.ndarray], outputs: Sequence[str] | None = None,
            bound: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        if not self._checked:  # shapes are static: checking the first call checks them all
            check_feeds(self, feeds)
            self._checked = True
        names = list(outputs) if outputs is not None else list(self.outputs)
        if not bound:
            values = self._session.run(names, feeds)
            return dict(zip(names, values))
        binding = self._binding(feeds, names, bound)
        self._session.run_with_iobinding(binding)
        values = binding.get_outputs()[: len(names)]  # not the bound cache: it is already in place
        return {name: value.numpy() for name, value in zip(names, values)}

    def _binding(self, feeds: dict[str, np.ndarray], names: list[str], bound: dict[str, np.ndarray]):
        """An I/O binding over the caller's arrays, made once per feeds dict: the runner keeps
        one dict per engine and updates its arrays in place, so the same binding serves every
        call (the dict and arrays must not be replaced). Bound outputs (the in-place KV cache)
        are written straight into the caller's buffers."""
        key = tuple(names)
        cached = self._bindings.get(key)
        if cached is not None and cached[0] is feeds and cached[1] is bound:
            return cached[2]
        binding = self._session.io_binding()
        for name in self.inputs:
            binding.bind_ortvalue_input(name, self._ortvalue(feeds[name]))  # shares the memory
        for name in names:
            binding.bind_output(name)
        for name, array in bound.items():
            binding.bind_ortvalue_output(name, self._ortvalue(array))
        self._bindings[key] = (feeds, bound, binding)
        return binding


def open_ort_engine(entry: EngineEntry, root: Path, options: EngineOptions) -> OrtEngine:
    return OrtEngine(entry.name, root / entry.path, entry.inputs, entry.outputs, options)
