"""Why exact speculation on int4 costs what it does: onnxruntime's MatMulNBits kernels by row count.

Two measurements, each printed as one JSON line per case:

1. ``kernels``: one MatMulNBits (K x N, random weights) per bits / block size / accuracy level:
   whether a row computed alone (the one-row kernel) equals the same row inside a call of 2, 3
   and 8 rows bit for bit, and the median cost of a call at each row count.
2. ``graphs`` (with --graphs A.onnx B.onnx ...): the cost of one call of each decoder graph at
   1, 2 and 3 tokens over a 200-token past, I/O bound as each runtime binds it (the cache in
   place: ours, and onnxruntime-genai's with its past_present_share_buffer). A graph of ours pads a one-token
   call to two rows (exporter/row_pad.py); genai's takes the one-row kernel.

    .venv/bin/python scripts/int4_kernels.py
    .venv/bin/python scripts/int4_kernels.py --graphs engines/smollm2-135m-int4/target.onnx \\
        engines/.smollm2-135m-int4.peers/ort-genai-int4/model.onnx

Each graph runs in its own session, one after the other, 2 threads; figures move by 10-20%
between runs on a shared VM, so compare within one run.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import numpy as np

GENAI_ROOM = 64  # genai's shared cache buffer: this many positions past the past


def _median_us(run, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return round(float(np.median(times[repeats // 10:])) * 1e6, 1)


def kernels(threads: int, repeats: int) -> None:
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    logging.getLogger("onnxruntime.quantization").setLevel(logging.ERROR)
    rng = np.random.default_rng(0)
    k, n = 576, 1536
    weight = rng.standard_normal((k, n)).astype(np.float32) * 0.05
    x = rng.standard_normal((8, k)).astype(np.float32)
    for bits in (4, 8):
        for block in (16, 32, 64):
            for level in (1, 4):
                graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, k])],
                                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, n])],
                                          [onnx.numpy_helper.from_array(weight, "w")])
                model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
                quantizer = MatMulNBitsQuantizer(model, block_size=block, is_symmetric=False, accuracy_level=level,
                                                 bits=bits)
                quantizer.process()
                so = ort.SessionOptions()
                so.intra_op_num_threads, so.log_severity_level = threads, 3
                session = ort.InferenceSession(quantizer.model.model.SerializeToString(), so,
                                               providers=["CPUExecutionProvider"])
                alone = np.concatenate([session.run(None, {"x": x[i:i + 1]})[0] for i in range(8)])  # [8, N]
                row = {"case": "kernels", "bits": bits, "block": block, "accuracy_level": level}
                for rows in (1, 2, 3, 8):
                    got = session.run(None, {"x": x[:rows]})[0]
                    row[f"rows_{rows}_equal_one_row_calls"] = bool(np.array_equal(got, alone[:rows]))
                    row[f"rows_{rows}_us"] = _median_us(lambda s=session, r=rows: s.run(None, {"x": x[:r]}), repeats)
                print(json.dumps(row), flush=True)


def _session(path: str, threads: int, profile: str | None = None):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads, so.log_severity_level = threads, 3
    if profile:
        so.enable_profiling, so.profile_file_prefix = True, profile
    return ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])


def _bound(session, path: str, tokens: int, past: int):
    """An IOBinding for one call of ``tokens`` tokens over a ``past``-token cache, bound as each
    runtime binds it: the cache in place (ours; onnxruntime-genai's with past_present_share_buffer).
    Returns (binding, the arrays it reads, which must outlive it)."""
    import onnxruntime as ort

    from specexport.contract import CACHE_LENGTH, INPUT_IDS, PRESENT, VALID_TOKENS, present_of

    names = [i.name for i in session.get_inputs()]
    genai = "attention_mask" in names  # onnxruntime-genai's export
    binding, keep = session.io_binding(), []
    for value in session.get_inputs():
        name = value.name
        if name == INPUT_IDS:
            array = np.full((1, tokens), 42, dtype=np.int64)
        elif name == "attention_mask":
            array = np.ones((1, past + tokens), dtype=np.int64)
        elif name == CACHE_LENGTH:
            array = np.array([past], dtype=np.int64)
        elif name == VALID_TOKENS:
            array = np.array([tokens], dtype=np.int64)
        else:  # a past key or value: [1, n_kv, length, head_dim], the present the same buffer
            # (ours: the cache in place; genai's runtime: past_present_share_buffer, a buffer
            # of its max length)
            length = past + GENAI_ROOM if genai else int(value.shape[2])
            array = np.random.default_rng(0).random((1, int(value.shape[1]), length, _head_dim(path, value)),
                                                    dtype=np.float32) * 0.1
            ortvalue = ort.OrtValue.ortvalue_from_numpy(array)
            keep.append(ortvalue)
            binding.bind_ortvalue_input(name, ortvalue)
            binding.bind_ortvalue_output(present_of(name), ortvalue)  # genai names its cache as ours
            continue
        keep.append(array)
        binding.bind_cpu_input(name, array)
    for output in session.get_outputs():
        if not output.name.startswith(PRESENT):
            binding.bind_output(output.name)
    return binding, keep


def graphs(paths: list[str], threads: int, repeats: int, past: int = 200) -> None:
    for path in paths:
        session = _session(path, threads)
        row = {"case": "graphs", "graph": path}
        for tokens in (1, 2, 3):
            binding, keep = _bound(session, path, tokens, past)
            row[f"tokens_{tokens}_ms"] = round(_median_us(lambda s=session, b=binding: s.run_with_iobinding(b), repeats) / 1e3, 2)
        print(json.dumps(row), flush=True)


def profile(paths: list[str], threads: int, repeats: int, past: int = 200) -> None:
    """Where a one-token step's time goes: onnxruntime's profiler over ``repeats`` one-token calls
    of each graph (after a tenth as many warm-up calls, left out), summed by op type. Prints one JSON line per graph: per op
    type its nodes run per step, and its microseconds per step; and the step's wall time and the
    part of it no node accounts for (session overhead, binding, thread hand-offs)."""
    import collections
    import tempfile

    for path in paths:
        with tempfile.TemporaryDirectory() as tmp:
            session = _session(path, threads, profile=f"{tmp}/profile")
            binding, keep = _bound(session, path, 1, past)
            for _ in range(max(3, repeats // 10)):
                session.run_with_iobinding(binding)
            for _ in range(repeats):
                session.run_with_iobinding(binding)
            events = json.loads(Path(session.end_profiling()).read_text())
        model_runs = [e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"]
        kept = model_runs[-repeats:]  # the warm-up runs dropped
        start = kept[0]["ts"]
        us: dict[str, float] = collections.defaultdict(float)
        count: dict[str, int] = collections.defaultdict(int)
        for event in events:
            if event.get("cat") != "Node" or not event["name"].endswith("_kernel_time") or event["ts"] < start:
                continue
            op = event["args"]["op_name"]
            us[op] += event["dur"]
            count[op] += 1
        step = sum(e["dur"] for e in kept) / repeats
        nodes = sum(us.values()) / repeats
        by_op = {op: {"nodes": count[op] // repeats, "us": round(us[op] / repeats, 1)}
                 for op in sorted(us, key=lambda o: -us[o])}
        print(json.dumps({"case": "profile", "graph": path, "step_us": round(step, 1), "nodes_us": round(nodes, 1),
                          "outside_nodes_us": round(step - nodes, 1), "by_op": by_op}), flush=True)


def _head_dim(path: str, value) -> int:
    """A cache input's head size: its static last dim, else (onnxruntime-genai's symbolic
    kv_cache_dim) the head_size of the genai_config.json beside the graph."""
    if isinstance(value.shape[3], int):
        return value.shape[3]
    return int(json.loads((Path(path).parent / "genai_config.json").read_text())["model"]["decoder"]["head_size"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--graphs", nargs="*", default=None, help="decoder graphs to time instead of the kernels")
    parser.add_argument("--profile", action="store_true",
                        help="with --graphs: where a one-token step's time goes, by op type (onnxruntime's profiler)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=60)
    args = parser.parse_args()
    if args.graphs and args.profile:
        profile(args.graphs, args.threads, args.repeats)
    elif args.graphs:
        graphs(args.graphs, args.threads, args.repeats)
    else:
        kernels(args.threads, args.repeats)


if __name__ == "__main__":
    main()
