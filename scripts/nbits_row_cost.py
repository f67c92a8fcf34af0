"""What each row of a MatMulNBits call costs on this CPU: the default int4 recipe's layer and
head shapes as one-node graphs (random weights), timed at 1, 2, 4 and 8 rows, for 4-bit and
8-bit weights at accuracy levels 0 (fp32 compute) and 4 (int8 activations).

    python scripts/nbits_row_cost.py [--threads 2] [--calls 40]

Where a verify pass of 1+D tokens costs about what one token does, the kernels have idle compute
for drafts to use; where each row costs as much as the first, they have none (docs/results.md:
an AVX2 CPU without VNNI against an AVX-512 VNNI one).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

BLOCK = 32
# (K, N, bits): SmolLM2's gate and up (fused), and its 49,152-column head at the recipe's 8 bits and at 4
SHAPES = [(576, 3072, 4), (576, 49152, 8), (576, 49152, 4)]
ROWS = (1, 2, 4, 8)


def session(k: int, n: int, bits: int, accuracy_level: int, threads: int) -> ort.InferenceSession:
    rng = np.random.default_rng(0)
    blocks = k // BLOCK
    weights = rng.integers(0, 255, size=(n, blocks, BLOCK * bits // 8), dtype=np.uint8)  # [N, K/32, bytes]
    scales = (rng.random(n * blocks, dtype=np.float32) * 0.01).astype(np.float32)  # [N * K/32]
    node = helper.make_node("MatMulNBits", ["A", "B", "S"], ["Y"], domain="com.microsoft", K=k, N=n, bits=bits,
                            block_size=BLOCK, accuracy_level=accuracy_level)
    graph = helper.make_graph([node], "nbits", [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["M", k])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["M", n])],
                              initializer=[numpy_helper.from_array(weights, "B"), numpy_helper.from_array(scales, "S")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def median_ms(sess: ort.InferenceSession, rows: int, k: int, calls: int) -> float:
    a = np.random.default_rng(1).standard_normal((rows, k)).astype(np.float32)  # [rows, K]
    for _ in range(5):
        sess.run(None, {"A": a})
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        sess.run(None, {"A": a})
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--calls", type=int, default=40)
    args = parser.parse_args()
    print(f"onnxruntime {ort.__version__}, {args.threads} threads, median ms of {args.calls} calls")
    print("| K × N | bits | accuracy level | " + " | ".join(f"{m} rows" for m in ROWS) + " | 8 rows / 1 |")
    print("|---|---|---|" + "---|" * (len(ROWS) + 1))
    for k, n, bits in SHAPES:
        for level in (0, 4):
            sess = session(k, n, bits, level, args.threads)
            ms = [median_ms(sess, rows, k, args.calls) for rows in ROWS]
            print(f"| {k} × {n} | {bits} | {level} | " + " | ".join(f"{t:.2f}" for t in ms) + f" | {ms[-1] / ms[0]:.1f}× |",
                  flush=True)


if __name__ == "__main__":
    main()
