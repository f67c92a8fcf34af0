#!/usr/bin/env bash
# One command for a CUDA machine with TensorRT (pip install -e '.[gpu,export]'):
#   - builds the tiny recipe and the default recipe for TensorRT in fp16,
#   - runs the GPU tests (pytest -m gpu) and the greedy losslessness check on both builds
#     (every drafter's output == plain greedy decoding on the same TensorRT engines),
#   - compares TensorRT's logits with onnxruntime's on the same inputs,
#   - benchmarks the baseline (no drafter) against each drafter,
# and prints one table. Usage: scripts/gpu_check.sh [OUT_DIR]   (PRECISION=fp32 to change it)
set -euo pipefail

cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
OUT=${1:-${OUT:-/tmp/specexport-gpu-check}}
PRECISION=${PRECISION:-fp16}
NEW_TOKENS=${NEW_TOKENS:-128}
mkdir -p "$OUT"

command -v nvidia-smi >/dev/null || { echo "gpu_check: no nvidia-smi: this needs a CUDA GPU" >&2; exit 2; }
"$PY" -c "import tensorrt, cuda.bindings" 2>/dev/null \
  || { echo "gpu_check: tensorrt / cuda-python missing: pip install 'specexport[gpu]'" >&2; exit 2; }
nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv,noheader

# The two recipes with the tensorrt backend, standard attention at batch 1 and the chosen precision
# (the originals are untouched).
for recipe in tiny-llama smollm2-135m; do
  "$PY" - "$recipe" "$OUT" "$PRECISION" <<'EOF'
import sys, yaml
from pathlib import Path
name, out, precision = sys.argv[1:]
data = yaml.safe_load(open(f"recipes/{name}.yaml"))
for drafter in data.get("drafters", []):  # paths are relative to the recipe, which moves to OUT
    if drafter.get("path"):
        drafter["path"] = str(Path("recipes", drafter["path"]).resolve())
# TensorRT compiles the standard graphs (ort-gqa's GroupQueryAttention is onnxruntime's own), built for batch 1
data.update(name=f"{name}-trt", backends=["onnxruntime", "tensorrt"], precision=precision, attention="standard",
            shapes={**data.get("shapes", {}), "batch": 1})
yaml.safe_dump(data, open(f"{out}/{name}-trt.yaml", "w"), sort_keys=False)
EOF
  "$PY" -m specexport build "$OUT/$recipe-trt.yaml" -o "$OUT/$recipe-trt"
  "$PY" -m specexport lint "$OUT/$recipe-trt" --for tensorrt >/dev/null 2>&1 || true  # report only (wiring may lag)
done

"$PY" -m pytest -q -m gpu tests/runtime/test_trt_backend.py

"$PY" - "$OUT" "$NEW_TOKENS" <<'EOF'
import json, statistics, sys
from pathlib import Path
import numpy as np
from specexport.runtime import load
from specexport.runtime.engine import EngineOptions, open_engine
from specexport.runtime.manifest import Manifest

out, new_tokens = Path(sys.argv[1]), int(sys.argv[2])
PROMPTS = {
    "chat": "What are three good habits for writing maintainable code?",
    "grounded": "Rewrite in the passive voice: The committee approved the budget, and the mayor signed "
                "the bill the next morning. The council then published the budget on its website.",
}
rows = []
for name in ("tiny-llama-trt", "smollm2-135m-trt"):
    root = out / name
    manifest = Manifest.load(root)
    trt = load(root, backend="tensorrt")
    ort_device = "cuda" if "CUDAExecutionProvider" in __import__("onnxruntime").get_available_providers() else "cpu"
    ort = load(root, backend="onnxruntime", device=ort_device)

    # TensorRT logits vs onnxruntime's on the verify graph, same random inputs
    def verify_entry(backend):
        return next(e for e in manifest.engines_of("target", backend) if e.role == "verify")
    t_entry, o_entry = verify_entry("tensorrt"), verify_entry("onnxruntime")
    rng = np.random.default_rng(0)
    feeds = {}
    for k, spec in o_entry.inputs.items():
        if k == "input_ids":
            feeds[k] = rng.integers(0, 1000, size=spec.shape).astype(spec.dtype)
        elif k == "cache_length":
            feeds[k] = np.full(spec.shape, 17, dtype=spec.dtype)
        else:
            feeds[k] = (0.5 * rng.standard_normal(spec.shape)).astype(spec.dtype)
    a = open_engine(o_entry, root, EngineOptions(device=ort_device)).run(feeds, ["logits", "next_tokens"])
    b = open_engine(t_entry, root, EngineOptions(device="cuda")).run(feeds, ["logits", "next_tokens"])
    diff = float(np.abs(a["logits"] - b["logits"]).max())
    agree = float((a["next_tokens"] == b["next_tokens"]).mean())

    drafters = ["none"] + [d for d, e in manifest.drafters.items()
                           if e.model is None or manifest.engines_of(e.model, "tensorrt")]
    skipped = [d for d in manifest.drafters if d not in drafters]
    for prompt_name, prompt in PROMPTS.items():
        base = trt.generate(prompt, chat=True, drafter="none", max_new_tokens=new_tokens)
        times = {}
        for drafter in drafters:
            runs = [trt.generate(prompt, chat=True, drafter=drafter, max_new_tokens=new_tokens) for _ in range(3)]
            lossless = all(r.token_ids == base.token_ids for r in runs)
            tps = statistics.median(r.stats.tokens / r.stats.total_s for r in runs)
            times[drafter] = tps
            rows.append({
                "build": name, "prompt": prompt_name, "drafter": drafter, "tok/s": round(tps, 1),
                "speedup": round(tps / times["none"], 2), "E[L]": round(runs[0].stats.acceptance_length, 2),
                "lossless": lossless, "max|dlogit| trt-vs-ort": f"{diff:.3g}", "argmax agree": f"{agree:.0%}",
            })
        for drafter in skipped:
            rows.append({"build": name, "prompt": prompt_name, "drafter": drafter, "tok/s": "n/a",
                         "speedup": "onnxruntime-only (int4 MatMulNBits)", "E[L]": "", "lossless": "",
                         "max|dlogit| trt-vs-ort": "", "argmax agree": ""})

cols = list(rows[0])
print("\n| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
for r in rows:
    print("| " + " | ".join(str(r[c]) for c in cols) + " |")
(out / "gpu_check.json").write_text(json.dumps(rows, indent=1))
bad = [r for r in rows if r["lossless"] is False]
sys.exit(1 if bad else 0)
EOF
