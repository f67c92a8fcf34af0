"""Per-call time of two or more builds' decoder graphs in one process, interleaved: which graph is
slower, with the machine's drift spread over all of them.

Each graph runs on the runtime's session options (one shared pool, 2 threads by default), its cache
bound in place over a 200-token past as the runtime binds it, at 1 and 6 tokens (a decode step and
a verify of 1 + D = 6). onnxruntime-genai's export (found by its attention_mask input) binds as
genai's CPU loop runs it: past and present apart. Blocks of ``--calls`` calls rotate over the
graphs, the order reversed every round, and each figure is the median of its blocks' medians.
The graph listed first has run 2-7% slower on the project's VM: run both orders.

    .venv/bin/python scripts/step_ab.py /tmp/old/smollm2-135m/target.onnx engines/smollm2-135m/target.onnx
    .venv/bin/python scripts/step_ab.py engines/smollm2-135m/target.onnx \\
        engines/.smollm2-135m.peers/ort-genai-fp32/model.onnx --past 100
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO.parent))  # the repository is the specexport package

from specexport.contract import (  # noqa: E402
    CACHE_LENGTH,
    CHAIN_TREE_INPUTS,
    INPUT_IDS,
    PRESENT,
    VALID_TOKENS,
    TensorSpec,
    chain_tree_feeds,
    present_of,
)
from specexport.runtime.ort_engine import session_options  # noqa: E402


def _genai_head_size(path: Path) -> int:
    """onnxruntime-genai's cache head size (its graph leaves it symbolic): genai_config.json beside it."""
    return int(json.loads((path.parent / "genai_config.json").read_text())["model"]["decoder"]["head_size"])


def _genai_binding(session, path: Path, tokens: int, past: int):
    """onnxruntime-genai's export binds as its CPU loop runs it: a past of exactly ``past``
    positions and the present apart (written fresh each call), with an attention mask."""
    binding, keep = session.io_binding(), []
    for value in session.get_inputs():
        if value.name == INPUT_IDS:
            array = np.full((1, tokens), 42, dtype=np.int64)  # [1, tokens]
        elif value.name == "attention_mask":
            array = np.ones((1, past + tokens), dtype=np.int64)  # [1, past + tokens]
        else:  # past key or value, [1, n_kv, past, head_size]
            shape = (1, int(value.shape[1]), past, _genai_head_size(path))
            array = np.random.default_rng(0).random(shape, dtype=np.float32) * 0.1
        keep.append(array)
        binding.bind_cpu_input(value.name, array)
    for output in session.get_outputs():
        binding.bind_output(output.name)
    return binding, keep


def _binding(session, ort, path: Path, tokens: int, past: int):
    """An I/O binding for a call of ``tokens`` over ``past`` cached positions; the arrays it holds."""
    if "attention_mask" in {v.name for v in session.get_inputs()}:
        return _genai_binding(session, path, tokens, past)
    binding, keep = session.io_binding(), []
    trees = {v.name for v in session.get_inputs()} & set(CHAIN_TREE_INPUTS)  # a graph that also verifies trees
    chain = chain_tree_feeds(trees, TensorSpec("int64", (1, tokens))) if trees else {}
    for value in session.get_inputs():
        if value.name == INPUT_IDS:
            array = np.full((1, tokens), 42, dtype=np.int64)  # [1, tokens]
        elif value.name == CACHE_LENGTH:
            array = np.array([past], dtype=np.int64)  # [1]
        elif value.name == VALID_TOKENS:
            array = np.array([tokens], dtype=np.int64)  # [1]
        elif value.name in chain:
            array = chain[value.name]  # offsets [1, tokens], a causal mask [1, tokens, tokens]
        else:  # a cache input, [1, n_kv, max_seq_len, head_dim]: present is the same buffer
            shape = [1] + [int(d) for d in value.shape[1:]]  # batch 1
            cache = np.random.default_rng(0).random(shape, dtype=np.float32) * 0.1
            ortvalue = ort.OrtValue.ortvalue_from_numpy(cache)
            keep.append(ortvalue)
            binding.bind_ortvalue_input(value.name, ortvalue)
            binding.bind_ortvalue_output(present_of(value.name), ortvalue)
            continue
        keep.append(array)
        binding.bind_cpu_input(value.name, array)
    for output in session.get_outputs():
        if not output.name.startswith(PRESENT):
            binding.bind_output(output.name)
    return binding, keep


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("graphs", nargs="+", type=Path)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--past", type=int, default=200)
    args = parser.parse_args()
    import onnxruntime as ort

    sessions = []
    for path in args.graphs:
        if not path.is_file():
            sys.exit(f"{path}: no such graph; pass target.onnx files of engine directories")
        sessions.append(ort.InferenceSession(str(path), session_options(ort, args.threads),
                                             providers=["CPUExecutionProvider"]))
    sizes = (1, 6)
    bindings = [{t: _binding(s, ort, path, t, args.past) for t in sizes} for s, path in zip(sessions, args.graphs)]
    blocks: dict[tuple[int, int], list[float]] = {(g, t): [] for g in range(len(sessions)) for t in sizes}
    for g, session in enumerate(sessions):  # warm-up: weights pre-packed, buffers allocated
        for t in sizes:
            for _ in range(5):
                session.run_with_iobinding(bindings[g][t][0])
    for round_ in range(args.rounds):
        order = list(range(len(sessions)))
        for g in order if round_ % 2 == 0 else order[::-1]:
            for t in sizes:
                times = []
                for _ in range(args.calls):
                    start = time.perf_counter()
                    sessions[g].run_with_iobinding(bindings[g][t][0])
                    times.append(time.perf_counter() - start)
                blocks[(g, t)].append(statistics.median(times) * 1e3)
    for g, path in enumerate(args.graphs):
        row = {"graph": str(path)}
        for t in sizes:
            row[f"tokens_{t}_ms"] = round(statistics.median(blocks[(g, t)]), 3)
            row[f"tokens_{t}_blocks"] = [round(ms, 2) for ms in blocks[(g, t)]]
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
