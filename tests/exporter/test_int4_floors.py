"""scripts/int4_floors.py: its timed copies take out exactly the exporter's Q4_1 offset terms
(nbits_graph) and attention pad (attention_pad), found by the exporter's own tensor names, and
nothing else; a graph without them is refused rather than timed as a "floor"."""

from __future__ import annotations

import collections

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from specexport.contract import CACHE_LENGTH, INPUT_IDS, VALID_TOKENS
from specexport.exporter.attention_pad import GQA, pad_attention_rows
from specexport.exporter.quantize import WeightQuant, quantize_weights
from tests.exporter.test_gguf_blocks import K, N
from tests.exporter.test_nbits_graph import q4_1_pair, run_all, siblings_model
from tests.scripts import load_script

pytest.importorskip("onnxruntime")


def _floors():
    return load_script("int4_floors")


def test_offsets_dropped_leave_the_kernel_alone():
    """Two kept Q4_1 siblings (fused, offsets beside): the copy keeps the MatMulNBits and the
    Split and loses the AveragePool, the MatMul and the Add; its outputs are the kernel's codes
    alone (d·(q − 8)), so they differ from the GGUF's product by x·(m + 8d)."""
    weights, index = q4_1_pair()
    model, _ = quantize_weights(siblings_model(*weights), WeightQuant(4, 32, False, 1, 4), gguf=index)
    x = np.random.default_rng(2).standard_normal((1, 3, K)).astype(np.float32)
    kept = run_all(model, x)
    assert _floors().drop_offsets(model) == 3
    assert collections.Counter(n.op_type for n in model.graph.node) == {"MatMulNBits": 1, "Split": 1}
    for got, want in zip(run_all(model, x), kept, strict=True):
        assert got.shape == want.shape and not np.allclose(got, want, atol=1e-3)


def test_a_graph_without_offsets_has_nothing_to_drop():
    """The control: requantized weights carry no offset terms, and the script would refuse to
    time such a graph as a floor."""
    rng = np.random.default_rng(3)
    model, _ = quantize_weights(siblings_model(rng.standard_normal((K, N)).astype(np.float32)),
                                WeightQuant(4, 32, False, 1, 4))
    assert _floors().drop_offsets(model) == 0


def _attention_model() -> onnx.ModelProto:
    """One GroupQueryAttention on a packed qkv [B, T, 3·8] (one head of 8 each), its cache in
    place: the inputs attention_pad rewrites."""
    inputs = [helper.make_tensor_value_info(INPUT_IDS, TensorProto.INT64, ["B", "T"]),
              helper.make_tensor_value_info(CACHE_LENGTH, TensorProto.INT64, ["B"]),
              helper.make_tensor_value_info(VALID_TOKENS, TensorProto.INT64, ["B"]),
              helper.make_tensor_value_info("qkv", TensorProto.FLOAT, ["B", "T", 24]),
              helper.make_tensor_value_info("past_key", TensorProto.FLOAT, ["B", 1, 16, 8]),
              helper.make_tensor_value_info("past_value", TensorProto.FLOAT, ["B", 1, 16, 8])]
    nodes = [helper.make_node("Add", [CACHE_LENGTH, VALID_TOKENS], ["total"]),
             helper.make_node("Cast", ["total"], ["seqlens"], to=TensorProto.INT32),
             helper.make_node("ReduceMax", ["total"], ["total_max"], keepdims=0),
             helper.make_node("Cast", ["total_max"], ["total32"], to=TensorProto.INT32),
             helper.make_node(GQA, ["qkv", "", "", "past_key", "past_value", "seqlens", "total32"],
                              ["attn", "present_key", "present_value"], domain="com.microsoft",
                              num_heads=1, kv_num_heads=1)]
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("attn", "present_key", "present_value")]
    graph = helper.make_graph(nodes, "g", inputs, outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)])


def test_pad_dropped_gives_the_attention_its_own_inputs_back():
    """A padded attention: the copy's GroupQueryAttention reads the unpadded qkv and lengths and
    writes the graph's output itself again; every node the pad added besides its shared head is gone."""
    model = _attention_model()
    before = [list(n.input) for n in model.graph.node if n.op_type == GQA]
    pad_attention_rows(model, max_seq_len=16)
    assert {"Pad", "Slice"} <= {n.op_type for n in model.graph.node}
    assert _floors().drop_attention_pad(model) == 4  # Pad, Slice, the seqlens_k and total Adds
    assert not {"Pad", "Slice"} & {n.op_type for n in model.graph.node}
    attention = next(n for n in model.graph.node if n.op_type == GQA)
    assert [list(attention.input)] == before and attention.output[0] == "attn"


def test_an_unpadded_attention_has_nothing_to_drop():
    """The control: without attention_pad's nodes there is no pad to take out."""
    assert _floors().drop_attention_pad(_attention_model()) == 0
