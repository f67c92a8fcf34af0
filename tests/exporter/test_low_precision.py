"""fp16 / bf16 onnxruntime graphs (exporter/low_precision.py) and `device: cuda` recipes
(exporter/gpu_build.py): the KV cache in the low type, logits fp32, validation against
transformers within what transformers' own fp16 run justifies, lossless decoding on them."""

from __future__ import annotations

import json

import onnx
import pytest

from specexport.errors import BadInput
from specexport.exporter.recipe import parse_recipe
from tests.conftest import TINY_SHAPE, run_cli, tiny_recipe

FP16_DRAFTERS = ("ngram", "quantized-self", "draft-model")


@pytest.fixture(scope="module")
def fp16_engines(tiny_engines):
    return tiny_engines.get("llama", drafters=FP16_DRAFTERS, attention="ort-gqa", precision="fp16",
                            batch=(1, 2), **TINY_SHAPE)


def test_fp16_graphs_keep_their_kv_cache_in_fp16_and_their_logits_in_fp32(fp16_engines):
    manifest = json.loads((fp16_engines / "manifest.json").read_text())
    assert manifest["build"]["onnxruntime"]["precision"] == "fp16"
    assert {m["kv"]["dtype"] for m in manifest["models"].values()} == {"float16"}
    for entry in manifest["engines"]:
        specs = {**entry["inputs"], **entry["outputs"]}
        kv = {dtype for name, (dtype, _) in specs.items() if name.startswith(("past_key_values.", "present."))}
        assert kv == {"float16"}, entry["name"]
        if entry["role"] == "fill":  # a drafter's fill graph computes no logits
            assert "logits" not in specs, entry["name"]
            continue
        assert specs["logits"][0] == "float32", entry["name"]
    graph = onnx.load(str(fp16_engines / "target.onnx"), load_external_data=False)
    gqa = [n for n in graph.graph.node if n.op_type == "GroupQueryAttention"]
    assert gqa
    weights = [t for t in graph.graph.initializer if t.data_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16)]
    assert sum(t.data_type == onnx.TensorProto.FLOAT16 for t in weights) > len(weights) / 2


def test_fp16_graphs_are_validated_within_transformers_own_fp16_error(fp16_engines):
    manifest = json.loads((fp16_engines / "manifest.json").read_text())
    # a fill graph is held to its own full graph instead, bit for bit (tests/exporter/test_fill_graphs.py)
    fills = [e for e in manifest["engines"] if e["role"] == "fill"]
    assert fills and all(e["parity"]["cache_equal_to_full_graph"] is True for e in fills)
    checked = [e for e in manifest["engines"] if e["batch"] == 1 and e["model"] != "quantized-self" and e not in fills]
    assert checked
    for entry in checked:
        parity = entry["parity"]
        assert parity["enforced"] and parity["precision"] == "fp16", entry["name"]
        assert 0 < parity["reference_low_precision_error"]  # transformers fp16 against fp32
        assert parity["max_abs_logit_diff"] <= parity["max_abs_logit_diff_limit"]
        # the graph keeps norms and rotary angles in fp32: no worse than transformers' own fp16 run
        assert parity["max_abs_logit_diff"] <= parity["reference_low_precision_error"], entry["name"]
        assert parity["max_margin_at_disagreement"] < parity["near_tie_margin_limit"]


def test_fp16_decoding_is_lossless_with_every_drafter(fp16_engines):
    outputs = {}
    for drafter in ("none", *FP16_DRAFTERS):
        code, out, err = run_cli("generate", str(fp16_engines), "--prompt", "the quick brown fox", "-n", "24",
                                 "--threads", "1", "--drafter", drafter)
        assert code == 0, err
        outputs[drafter] = out
    assert len(set(outputs.values())) == 1, outputs


def test_a_bf16_onnxruntime_build_is_refused_in_one_line_before_exporting(tmp_path):
    recipe = tiny_recipe(tmp_path / "r.yaml", attention="ort-gqa", precision="bf16")
    code, _, err = run_cli("build", str(recipe), "-o", str(tmp_path / "out"))
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "bf16" in err and "CPU provider" in err and "precision: fp16" in err
    assert not (tmp_path / "out").exists()


def test_a_bf16_cast_types_the_cache_bf16_and_keeps_logits_fp32(tiny_engines):
    from specexport.exporter.low_precision import kv_dtype, low_precision_graph

    engines = tiny_engines.get("llama", drafters=(), attention="ort-gqa", **TINY_SHAPE)
    low = low_precision_graph(onnx.load(str(engines / "target.onnx")), "bf16")
    types = {v.name: v.type.tensor_type.elem_type for v in [*low.graph.input, *low.graph.output]}
    assert {t for n, t in types.items() if n.startswith(("past_key_values.", "present."))} == {onnx.TensorProto.BFLOAT16}
    assert types["logits"] == onnx.TensorProto.FLOAT
    assert kv_dtype("bf16") == "bfloat16" and kv_dtype("fp16") == "float16" and kv_dtype("int4") == "float32"


# -- device: cuda -------------------------------------------------------------------------

BASE = {"name": "gpu", "target": {"source": "tiny"}}


def test_device_cuda_picks_fp16_ort_gqa_unless_the_recipe_says_otherwise():
    recipe = parse_recipe({**BASE, "device": "cuda"}, "r.yaml")
    assert (recipe.precision, recipe.attention, recipe.onnx_precision) == ("fp16", "ort-gqa", "fp16")
    recipe = parse_recipe({**BASE, "device": "cuda", "precision": "bf16", "attention": "standard"}, "r.yaml")
    assert (recipe.precision, recipe.attention) == ("bf16", "standard")
    cpu = parse_recipe(BASE, "r.yaml")
    assert (cpu.device, cpu.precision, cpu.attention) == ("cpu", "fp32", "standard")


@pytest.mark.parametrize(("extra", "names"), [
    ({"precision": "fp32"}, "GroupQueryAttention runs fp16 or bf16 only"),
    ({"precision": "int4"}, "GroupQueryAttention runs fp16 or bf16 only"),
    ({"attention": "standard", "precision": "int8"}, "quantized (MatMulNBits) graphs"),
    ({"draft": {"tile": 128, "tree": {"max_nodes": 4}}}, "draft.tree"),
    ({"backends": ["onnxruntime", "tensorrt"]}, "backends: [onnxruntime]"),
    ({"drafters": [{"kind": "model", "model": {"source": "tiny"}, "precision": "fp32"}]}, "drafters.0.precision"),
])
def test_device_cuda_refuses_what_would_place_a_node_on_the_cpu_in_one_line(extra, names):
    with pytest.raises(BadInput) as err:
        parse_recipe({**BASE, "device": "cuda", **extra}, "r.yaml")
    message = str(err.value)
    assert names in message and "\n" not in message and message.startswith("r.yaml: ")
    assert "{" not in message  # the section itself is not echoed


def test_fp32_with_standard_attention_runs_on_cuda_as_asked():
    recipe = parse_recipe({**BASE, "device": "cuda", "precision": "fp32", "attention": "standard"}, "r.yaml")
    assert recipe.onnx_precision == "fp32"


def test_fp16_with_tensorrt_casts_the_engines_and_keeps_the_onnx_graphs_fp32():
    recipe = parse_recipe({**BASE, "precision": "fp16", "backends": ["onnxruntime", "tensorrt"]}, "r.yaml")
    assert recipe.onnx_precision == "fp32"


def test_the_ready_cuda_recipe_parses_as_fp16_ort_gqa_on_cuda():
    from specexport.exporter.recipe import load_recipe
    from tests.conftest import REPO

    recipe, _ = load_recipe(REPO / "recipes" / "smollm2-135m-cuda.yaml")
    assert (recipe.device, recipe.onnx_precision, recipe.attention) == ("cuda", "fp16", "ort-gqa")


def test_a_device_cuda_build_records_its_device_and_lists_its_host_arithmetic(tmp_path):
    import yaml

    from specexport.runtime.placement import HOST_NODES

    path = tiny_recipe(tmp_path / "r.yaml", **TINY_SHAPE)
    recipe = {**yaml.safe_load(path.read_text()), "device": "cuda"}
    del recipe["attention"]  # device: cuda picks ort-gqa and fp16
    path.write_text(yaml.safe_dump(recipe))
    code, _, err = run_cli("build", str(path), "-o", str(tmp_path / "out"), "--threads", "1")
    assert code == 0, err
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["build"]["onnxruntime"] == {"device": "cuda", "precision": "fp16", "attention": "ort-gqa"}
    graph = onnx.load(str(tmp_path / "out" / "target.onnx"), load_external_data=False)
    listed = next(p.value for p in graph.metadata_props if p.key == HOST_NODES).split(",")
    ops = {n.name: n.op_type for n in graph.graph.node}
    # GroupQueryAttention's lengths (cache length + tokens, ReduceMax, Cast) are host arithmetic;
    # nothing that reads or writes a float is (ArgMax over the logits included)
    assert {"ReduceMax", "Cast"} <= {ops[name] for name in listed}
    assert not {"MatMul", "GroupQueryAttention", "ArgMax", "SkipSimplifiedLayerNormalization"} & {ops[n] for n in listed}
    # the same directory decodes on the CPU (the device only decides the provider)
    code, _, err = run_cli("generate", str(tmp_path / "out"), "--prompt", "hi", "-n", "4", "--threads", "1")
    assert code == 0, err


def test_fp16_limits_widen_to_transformers_own_error_and_no_further():
    from specexport.errors import SpecexportError
    from specexport.exporter.validate import LOW_REFERENCE_FACTOR, check_parity

    scale = 16.0  # the table's fp16 limit: 1e-2 x 16 = 0.16; transformers' own fp16 error here 0.5
    figures = {"max_abs_logit_diff": 0.4, "logit_scale": scale, "next_tokens_match": True, "argmax_agreement": 0.99,
               "max_margin_at_disagreement": 0.02}
    with pytest.raises(SpecexportError, match="exceeds the limit 0.16"):
        check_parity("g", figures, "fp16")
    applied = check_parity("g", figures, "fp16", reference_error=0.5)
    assert applied["max_abs_logit_diff_limit"] == LOW_REFERENCE_FACTOR * 0.5
    assert applied["near_tie_margin_limit"] == 2 * 0.5
    with pytest.raises(SpecexportError, match="transformers' own error in this type"):
        check_parity("g", {**figures, "max_abs_logit_diff": 0.8}, "fp16", reference_error=0.5)
    with pytest.raises(SpecexportError, match="near-tie limit"):  # a flip at a margin transformers' error cannot explain
        check_parity("g", {**figures, "max_margin_at_disagreement": 1.2}, "fp16", reference_error=0.5)
