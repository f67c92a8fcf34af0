"""The lighter MatMulNBits graph (exporter/nbits_graph.py): sibling projections fused along N
compute what the separate nodes did, and Q4_1's offsets added by a reduction over each block
compute x·w with the GGUF's own weights."""

from __future__ import annotations

import collections

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from specexport.exporter.gguf_blocks import RowIndex
from specexport.exporter.nbits_graph import fuse_siblings
from specexport.exporter.quantize import WeightQuant, dequantized, quantize_weights
from tests.exporter.test_gguf_blocks import K, N, gguf_tensor, run

pytest.importorskip("onnxruntime")


def siblings_model(*weights_kn: np.ndarray, lead: tuple = (1, "T")) -> onnx.ModelProto:
    """y_i = x @ W_i for each weight, all reading x [*lead, K] (as gate and up read one norm)."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [*lead, K])
    outputs = [helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, [*lead, w.shape[1]])
               for i, w in enumerate(weights_kn)]
    nodes = [helper.make_node("MatMul", ["x", f"w{i}"], [f"y{i}"], name=f"proj{i}") for i in range(len(weights_kn))]
    inits = [numpy_helper.from_array(w, f"w{i}") for i, w in enumerate(weights_kn)]
    graph = helper.make_graph(nodes, "g", [x], outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def run_all(model: onnx.ModelProto, x: np.ndarray) -> list[np.ndarray]:
    import onnxruntime as ort

    from specexport.runtime.ort_engine import session_options

    session = ort.InferenceSession(model.SerializeToString(), session_options(ort, None),
                                   providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})


def q4_1_pair() -> tuple[list[np.ndarray], RowIndex]:
    """Two Q4_1 tensors through gguf's quantizer: their values [K, N] each (as the graph holds
    them) and the file's row index."""
    tensors, values = zip(*(gguf_tensor("Q4_1", seed)[1:] for seed in (0, 7)))
    return [np.ascontiguousarray(v.T) for v in values], RowIndex(list(tensors), list(values))


@pytest.mark.parametrize("accuracy_level", [1, 4])
def test_fused_siblings_compute_what_the_separate_nodes_did(accuracy_level):
    """Requantized weights: gate and up as one MatMulNBits over both's rows, then a Split; each
    output equal, bit for bit, to its own node's (blocks run along K within a row)."""
    rng = np.random.default_rng(3)
    weights = [rng.standard_normal((K, N)).astype(np.float32), rng.standard_normal((K, 2 * N)).astype(np.float32)]
    spec = WeightQuant(4, 32, False, accuracy_level, 4)
    fused, _ = quantize_weights(siblings_model(*weights), spec)
    apart, _ = quantize_weights(siblings_model(*weights), spec, light=False)
    ops = collections.Counter(n.op_type for n in fused.graph.node)
    assert ops["MatMulNBits"] == 1 and ops["Split"] == 1, ops
    assert collections.Counter(n.op_type for n in apart.graph.node)["MatMulNBits"] == 2
    x = rng.standard_normal((1, 5, K)).astype(np.float32)
    for got, want in zip(run_all(fused, x), run_all(apart, x), strict=True):
        assert np.array_equal(got, want)


@pytest.mark.parametrize("lead, summed_by", [((1, "T"), ["AveragePool"]), (("T",), ["Reshape", "ReduceSum"])])
def test_q4_1_offsets_are_block_sums_not_a_dense_matmul(lead, summed_by):
    """Two kept Q4_1 siblings: fused, their offsets added from the input's block sums (an
    AveragePool over [B, T, K], or a Reshape and a ReduceSum at another rank; once per input, no
    [K, K/32] 0/1 matrix), and x·w equal to the GGUF's own weights' product (accuracy level 1:
    fp32 activations)."""
    weights, index = q4_1_pair()
    model, rows = quantize_weights(siblings_model(*weights, lead=lead), WeightQuant(4, 32, False, 1, 4), gguf=index)
    assert all(r["kept"] and "offsets" in r for r in rows)
    ops = collections.Counter(n.op_type for n in model.graph.node)
    assert ops == {"MatMulNBits": 1, **dict.fromkeys(summed_by, 1), "MatMul": 1, "Add": 1, "Split": 1}, ops
    offsets = {r["weight"]: r["offsets"] for r in rows}
    kernel = dequantized(model, {"w0+w1": np.concatenate([offsets["w0"], offsets["w1"]])})["w0+w1"]  # [K, 2N]
    assert np.array_equal(kernel, np.concatenate(weights, axis=1))  # the GGUF's weights, bit for bit
    x = np.random.default_rng(2).standard_normal((*lead[:-1], 3, K)).astype(np.float32)  # [1, 3, K] or [3, K]
    for got, weight in zip(run_all(model, x), weights, strict=True):
        assert np.allclose(got, x @ weight, rtol=1e-4, atol=1e-4)


def test_siblings_with_and_without_offsets_stay_apart():
    """A kept Q4_1 weight and a requantized one (no offsets) read the same input: not fused (the
    offsets would reach both), and each still computes its own product."""
    weights, index = q4_1_pair()
    other = np.random.default_rng(9).standard_normal((K, N)).astype(np.float32)
    model, rows = quantize_weights(siblings_model(weights[0], other), WeightQuant(4, 32, False, 1, 4), gguf=index)
    assert [r["kept"] for r in rows] == [True, False]
    ops = collections.Counter(n.op_type for n in model.graph.node)
    assert ops["MatMulNBits"] == 2 and ops["Split"] == 0, ops
    x = np.random.default_rng(2).standard_normal((1, 3, K)).astype(np.float32)
    assert np.allclose(run(model, x), x @ weights[0], rtol=1e-4, atol=1e-4)


def test_a_weight_another_node_reads_is_not_fused():
    """Blocks that feed another node too (a kept head's blocks also feed the embedding's
    GatherBlockQuantized) stay where they are."""
    rng = np.random.default_rng(4)
    model, _ = quantize_weights(siblings_model(*(rng.standard_normal((K, N)).astype(np.float32) for _ in range(2))),
                                WeightQuant(4, 32, False, 4, 4), light=False)
    first = next(n for n in model.graph.node if n.op_type == "MatMulNBits")
    model.graph.node.append(helper.make_node("Identity", [first.input[1]], ["codes"]))
    assert fuse_siblings(model, {}) == []
