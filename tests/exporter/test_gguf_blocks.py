"""GGUF blocks kept exactly in MatMulNBits: Q4_0, Q4_1 (codes plus an offset term) and Q8_0,
parsed from gguf's own quantizer and checked against gguf's own dequantizer and onnxruntime."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from specexport.exporter.gguf_blocks import Blocks, GgufTensor, RowIndex, parse_blocks
from specexport.exporter.quantize import WeightQuant, dequantized, quantize_weights

K, N = 96, 40  # three blocks of 32 per row


def gguf_tensor(kind: str, seed: int = 0) -> tuple[np.ndarray, GgufTensor, np.ndarray]:
    """A random [N, K] weight through gguf's quantizer: (raw bytes, the parsed tensor, gguf's
    dequantized values)."""
    import gguf
    from gguf.quants import dequantize, quantize

    qtype = gguf.GGMLQuantizationType[kind]
    weight = np.random.default_rng(seed).standard_normal((N, K)).astype(np.float32)
    raw = quantize(weight, qtype)  # [N, bytes per row]
    codes, scales, offsets = parse_blocks(raw, kind, N, K)
    bits = 8 if kind == "Q8_0" else 4
    zero = {"Q4_0": 8, "Q4_1": 0, "Q8_0": 128}[kind]
    blocks = Blocks(f"blk.0.{kind}.weight", kind, bits, zero, codes, scales, offsets)
    values = np.asarray(dequantize(raw, qtype), dtype=np.float32).reshape(N, K)
    return raw, GgufTensor(blocks.name, kind, blocks, (N, K)), values


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_parsed_blocks_dequantize_as_gguf_does_bit_for_bit(kind):
    _, tensor, values = gguf_tensor(kind)
    assert tensor.blocks is not None
    assert np.array_equal(tensor.blocks.dequantized(), values)


def test_q4_1_centered_is_the_same_weights_at_the_default_zero_point():
    """d·(q − 8) + (m + 8d) dequantizes to gguf's d·q + m bit for bit; where some m + 8d is not
    exact in fp32 the blocks stay as they are (offsets unchanged)."""
    _, tensor, values = gguf_tensor("Q4_1")
    assert tensor.blocks is not None
    centered = tensor.blocks.centered()
    assert centered.zero_point == 8 and not np.array_equal(centered.offsets, tensor.blocks.offsets)
    assert np.array_equal(centered.dequantized(), values)
    blocks = tensor.blocks
    tiny = Blocks(blocks.name, blocks.type, 4, 0, blocks.codes, blocks.scales * np.float32(2.0 ** -30),
                  blocks.offsets)  # 8d far below m's last bit: m + 8d rounds
    assert tiny.centered() is tiny


def matmul_model(weight_kn: np.ndarray) -> onnx.ModelProto:
    """y = x @ W, x [1, T, K] (the graphs' rank), W [K, N] an initializer."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "T", K])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "T", N])
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"], name="proj")], "g", [x], [y],
                              [numpy_helper.from_array(weight_kn, "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    from specexport.runtime.ort_engine import session_options

    session = ort.InferenceSession(model.SerializeToString(), session_options(ort, None),
                                   providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


@pytest.mark.parametrize("kind, permuted", [("Q4_0", False), ("Q4_1", True), ("Q8_0", False)])
def test_a_graph_weight_keeps_its_gguf_blocks(kind, permuted):
    """The graph's weight is the GGUF tensor as transformers loads it (rows permuted, as Llama's
    q/k are): the quantized node reads the GGUF's own codes and scales, and computes x·w with the
    GGUF's weights (accuracy level 1: fp32 activations)."""
    _, tensor, values = gguf_tensor(kind)
    order = np.random.default_rng(1).permutation(N) if permuted else np.arange(N)
    weight = values[order]  # [N, K]: the graph's output channels
    bits = 8 if kind == "Q8_0" else 4
    model, rows = quantize_weights(matmul_model(np.ascontiguousarray(weight.T)),
                                   WeightQuant(bits, 32, False, 1, bits), gguf=RowIndex([tensor], [values]))
    assert rows[0]["kept"], rows
    offsets = {r["weight"]: r["offsets"] for r in rows if "offsets" in r}
    assert ("Q4_1" == kind) == bool(offsets)
    assert np.array_equal(dequantized(model, offsets)["w"], weight.T)  # [K, N], bit for bit
    node = next(n for n in model.graph.node if n.op_type == "MatMulNBits")
    # 4-bit blocks at the default zero point 8 (Q4_1's centered) run with no zero-point input
    assert (len(node.input) > 3 and bool(node.input[3])) == (kind == "Q8_0")
    x = np.random.default_rng(2).standard_normal((1, 3, K)).astype(np.float32)
    assert np.allclose(run(model, x), x @ weight.T, rtol=1e-4, atol=1e-4)


def test_a_requested_bit_width_that_differs_requantizes_and_says_why():
    _, tensor, values = gguf_tensor("Q8_0")
    _, rows = quantize_weights(matmul_model(np.ascontiguousarray(values.T)), WeightQuant(4, 32, False, 4, 4),
                               gguf=RowIndex([tensor], [values]))
    assert not rows[0]["kept"] and "8-bit" in rows[0]["why"] and "4-bit" in rows[0]["why"]


def test_weights_not_in_the_file_are_requantized():
    _, tensor, values = gguf_tensor("Q4_0")
    other = np.random.default_rng(5).standard_normal((K, N)).astype(np.float32)
    _, rows = quantize_weights(matmul_model(other), WeightQuant(4, 32, False, 4, 4), gguf=RowIndex([tensor], [values]))
    assert not rows[0]["kept"] and "gguf" not in rows[0]


def test_a_tied_embedding_is_gathered_from_the_kept_8bit_head_blocks():
    """A tied head [K, V] that the graph also gathers embedding columns from (axis 1), kept from
    Q8_0 blocks: the gather reads the same blocks (GatherBlockQuantized), the fp32 table is
    dropped, and the embedding rows are the same values bit for bit."""
    _, tensor, values = gguf_tensor("Q8_0")  # [N, K]: N plays the vocabulary
    table = np.ascontiguousarray(values.T)  # [K, N]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "T", K])
    ids = helper.make_tensor_value_info("ids", TensorProto.INT64, ["n"])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "T", N])
    rows = helper.make_tensor_value_info("rows", TensorProto.FLOAT, [K, "n"])
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"]),
                               helper.make_node("Gather", ["w", "ids"], ["rows"], axis=1)], "g", [x, ids], [y, rows],
                              [numpy_helper.from_array(table, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    quantized, report = quantize_weights(model, WeightQuant(8, 32, False, 4, 8), gguf=RowIndex([tensor], [values]))
    assert report[0]["kept"] and report[0]["embedding"] == "gathered from the same blocks"
    ops = [n.op_type for n in quantized.graph.node]
    assert "GatherBlockQuantized" in ops and "Gather" not in ops
    assert "w" not in {t.name for t in quantized.graph.initializer}
    import onnxruntime as ort

    from specexport.runtime.ort_engine import session_options

    session = ort.InferenceSession(quantized.SerializeToString(), session_options(ort, None),
                                   providers=["CPUExecutionProvider"])
    picked = np.array([3, 0, 39], dtype=np.int64)
    got = session.run(["rows"], {"x": np.zeros((1, 1, K), np.float32), "ids": picked})[0]  # [K, 3]
    assert np.array_equal(got, table[:, picked])
