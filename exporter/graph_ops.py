"""A graph's nodes by op type, as saved and as onnxruntime runs it (after its graph optimizations):
on the CPU a small model's step costs about a node's overhead per node, so the count is a cost."""

from __future__ import annotations

import collections
import tempfile
from pathlib import Path

import onnx


def op_counts(model: onnx.ModelProto) -> collections.Counter:
    """Nodes of ``model``'s main graph by op type."""
    return collections.Counter(node.op_type for node in model.graph.node)


def optimized_op_counts(path: Path) -> collections.Counter:
    """Nodes by op type of the graph onnxruntime runs for ``path`` on the CPU (the session options
    our engines use, its optimized model written to a temporary folder, weights left out)."""
    import onnxruntime as ort

    from specexport.runtime.ort_engine import session_options

    with tempfile.TemporaryDirectory() as tmp:
        so = session_options(ort, None)
        so.optimized_model_filepath = str(Path(tmp) / "optimized.onnx")
        so.add_session_config_entry("session.optimized_model_external_initializers_file_name", "optimized.weights")
        ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
        return op_counts(onnx.load(so.optimized_model_filepath, load_external_data=False))
