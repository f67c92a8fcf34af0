"""Why exact speculation on int4 costs what it does: onnxruntime's MatMulNBits kernels by row count.

Two measurements, each printed as one JSON line per case:

1. ``kernels``: one MatMulNBits (K x N, random weights) per bits / block size / accuracy level:
   whether a row computed alone (the one-row kernel) equals the same row inside a call of 2, 3
   and 8 rows bit for bit, and the median cost of a call at each row count.
2. ``graphs`` (with --graphs A.onnx B.onnx ...): the cost of one call of each decoder graph at
   1, 2 and 3 tokens over a 200-token past, I/O bound as the runtime binds it (ours: the cache
   in place; onnxruntime-genai's: past and present apart). A graph of ours pads a one-token
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

import numpy as np


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


def graphs(paths: list[str], threads: int, repeats: int, past: int = 200) -> None:
    import onnxruntime as ort

    from specexport.contract import CACHE_LENGTH, INPUT_IDS, PRESENT, VALID_TOKENS, present_of

    for path in paths:
        so = ort.SessionOptions()
        so.intra_op_num_threads, so.log_severity_level = threads, 3
        session = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
        names = [i.name for i in session.get_inputs()]
        genai = "attention_mask" in names  # onnxruntime-genai's export: past and present apart
        row = {"case": "graphs", "graph": path}
        for tokens in (1, 2, 3):
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
                else:  # a past key or value: [1, n_kv, length, head_dim]
                    length = past if genai else int(value.shape[2])
                    array = np.random.default_rng(0).random((1, int(value.shape[1]), length, _head_dim(path, value)),
                                                            dtype=np.float32) * 0.1
                    if not genai:  # ours: the present is the same buffer (the cache in place)
                        ortvalue = ort.OrtValue.ortvalue_from_numpy(array)
                        keep.append(ortvalue)
                        binding.bind_ortvalue_input(name, ortvalue)
                        binding.bind_ortvalue_output(present_of(name), ortvalue)
                        continue
                keep.append(array)
                binding.bind_cpu_input(name, array)
            for output in session.get_outputs():
                if genai or not output.name.startswith(PRESENT):
                    binding.bind_output(output.name)
            row[f"tokens_{tokens}_ms"] = round(_median_us(lambda s=session, b=binding: s.run_with_iobinding(b), repeats) / 1e3, 2)
        print(json.dumps(row), flush=True)


def _head_dim(path: str, value) -> int:
    """A cache input's head size: its static last dim, else (onnxruntime-genai's symbolic
    kv_cache_dim) the head_size of the genai_config.json beside the graph."""
    if isinstance(value.shape[3], int):
        return value.shape[3]
    from pathlib import Path

    return int(json.loads((Path(path).parent / "genai_config.json").read_text())["model"]["decoder"]["head_size"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--graphs", nargs="*", default=None, help="decoder graphs to time instead of the kernels")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=60)
    args = parser.parse_args()
    if args.graphs:
        graphs(args.graphs, args.threads, args.repeats)
    else:
        kernels(args.threads, args.repeats)


if __name__ == "__main__":
    main()
