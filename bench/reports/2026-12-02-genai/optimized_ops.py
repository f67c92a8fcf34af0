"""Count the operators of our target graph and onnxruntime-genai's after onnxruntime's optimizations.

Run from the repository root after `make engines` and a bench with `--peers ort-genai` (which
builds genai's model under engines/.smollm2-135m.peers/):
    .venv/bin/python bench/reports/2026-12-02-genai/optimized_ops.py OUT_DIR
"""

import collections
import sys
from pathlib import Path

import onnx
import onnxruntime as ort

GRAPHS = {
    "genai": Path("engines/.smollm2-135m.peers/ort-genai-fp32/model.onnx"),
    "ours": Path("engines/smollm2-135m/target.onnx"),
}


def optimized_ops(name: str, path: Path, out: Path) -> collections.Counter:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.optimized_model_filepath = str(out / f"{name}.opt.onnx")
    so.add_session_config_entry("session.optimized_model_external_initializers_file_name", f"{name}.opt.data")
    so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
    ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    graph = onnx.load(str(out / f"{name}.opt.onnx"), load_external_data=False).graph
    return collections.Counter((f"{n.domain}:" if n.domain else "") + n.op_type for n in graph.node)


if __name__ == "__main__":
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    for name, path in GRAPHS.items():
        counts = optimized_ops(name, path, out)
        print(name, sum(counts.values()), "nodes:", ", ".join(f"{op} {n}" for op, n in counts.most_common()))
