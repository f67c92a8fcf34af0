"""The fused kernels our graphs rely on are really there once onnxruntime has optimized them.

Counted in the model onnxruntime writes after its graph optimizations (``optimized_model_filepath``):
the ort-gqa graph carries onnxruntime-genai's fusions itself (graph_model.OrtFusions says what
each is worth);
the standard graph's RMSNorm is written so that onnxruntime fuses it.
"""

from __future__ import annotations

import collections

import onnx
import pytest

from specexport.exporter.archs import read_decoder
from specexport.exporter.graph_model import StaticDecoder
from specexport.exporter.onnx_export import export_graph
from specexport.exporter.recipe import load_recipe
from specexport.exporter.sources import load_source
from tests.conftest import tiny_recipe

ort = pytest.importorskip("onnxruntime")
LAYERS = 2


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    path = tiny_recipe(tmp_path_factory.mktemp("fusions") / "r.yaml", "llama", max_seq_len=32, num_layers=LAYERS)
    recipe, base = load_recipe(path)
    return read_decoder(load_source(recipe.target, base, "target").model, 32, "target")


def _optimized(proto: onnx.ModelProto, tmp_path) -> onnx.ModelProto:
    from specexport.runtime.ort_engine import session_options

    so = session_options(ort, None)  # on the process's shared pool, like every session of ours
    so.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(proto.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return onnx.load(str(tmp_path / "optimized.onnx"))


@pytest.mark.parametrize("tokens", [1, 4])
def test_ort_gqa_graph_has_genai_fusions(parts, tokens, tmp_path):
    proto = export_graph(StaticDecoder(parts, 32, "ort-gqa").eval(), 1, tokens, 18)
    optimized = _optimized(proto, tmp_path)
    ops = collections.Counter(node.op_type for node in optimized.graph.node)
    # Each residual Add is fused with the next norm; only the first norm has no Add before it.
    assert ops["SkipSimplifiedLayerNormalization"] == 2 * LAYERS
    assert ops["SimplifiedLayerNormalization"] == 1
    assert ops["Split"] == 0  # packed QKV into the attention op; gate and up apart
    gqa = [n for n in optimized.graph.node if n.op_type == "GroupQueryAttention"]
    assert len(gqa) == LAYERS and all(list(n.input[1:3]) == ["", ""] for n in gqa)
    assert ops["MatMul"] == 5 * LAYERS + 1  # qkv, o, gate, up, down; the output head
    assert ops["Gemm"] == 0


def test_unread_optional_outputs_are_not_produced(parts):
    proto = export_graph(StaticDecoder(parts, 32, "ort-gqa").eval(), 1, 1, 18)
    skips = [n for n in proto.graph.node if n.op_type == "SkipSimplifiedLayerNormalization"]
    assert skips and all(list(n.output[1:3]) == ["", ""] and n.output[3] for n in skips)


def test_standard_graph_rms_norm_is_fused(parts, tmp_path):
    proto = export_graph(StaticDecoder(parts, 32, "standard").eval(), 1, 1, 18)
    ops = collections.Counter(node.op_type for node in _optimized(proto, tmp_path).graph.node)
    assert ops["SimplifiedLayerNormalization"] == 2 * LAYERS + 1
    assert ops["Sqrt"] == 0 and ops["ReduceMean"] == 0
    # plain ONNX only: TensorRT and other runtimes read it
    assert all(n.domain in ("", "ai.onnx") for n in proto.graph.node)


@pytest.mark.parametrize("keep_head", [True, False])
def test_int4_copy_keeps_the_matmul_head_fp32_when_asked(parts, keep_head):
    from specexport.exporter.graph_model import HEAD_WEIGHT
    from specexport.exporter.quantize import quantize_int4

    proto = export_graph(StaticDecoder(parts, 32, "ort-gqa").eval(), 1, 1, 18)
    quantized = quantize_int4(proto, 32, False, 4, keep_head=keep_head)
    head = [n.op_type for n in quantized.graph.node
            if n.op_type != "Gather" and any(HEAD_WEIGHT in name for name in n.input)]  # the embedding gathers too
    assert head == (["MatMul"] if keep_head else ["MatMulNBits"])
    # qkv, o, gate and up as one (nbits_graph.fuse_siblings), down; the head unless kept
    assert sum(n.op_type == "MatMulNBits" for n in quantized.graph.node) == 4 * LAYERS + (not keep_head)
