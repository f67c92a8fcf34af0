"""Every supported architecture: a tiny random model exported and checked against transformers."""

import json

import pytest

from specexport.exporter.archs import ARCHITECTURES
from tests.conftest import LOSSLESS_PAIRS, TINY_SHAPE, run_cli, tiny_recipe

# recipe arch name -> transformers model_type
TESTED = {
    "llama": "llama",
    "mistral": "mistral",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma": "gemma",
    "gemma2": "gemma2",
    "gemma3": "gemma3_text",
    "phi3": "phi3",
    "glm4_moe": "glm4_moe",  # MoE (sigmoid routing, groups, shared experts), partial rotary, q/k/v biases
    "deepseek_v3": "deepseek_v3",  # MoE and MLA (q_lora, interleaved RoPE, V narrower than Q/K)
    # linear-attention (Gated DeltaNet) layers with a recurrent state beside gated full attention
    "qwen3_next": "qwen3_next",  # + softmax-routed MoE with a gated shared expert
    "qwen3_5": "qwen3_5_text",  # dense MLP, separate q/k/v, z, b, a projections
    "qwen3_5_moe": "qwen3_5_moe_text",
}


def test_every_supported_architecture_has_a_parity_test():
    assert set(ARCHITECTURES) == set(TESTED.values()), "add the new architecture to TESTED"


@pytest.mark.parametrize("attention", ["standard", "ort-gqa"])
@pytest.mark.parametrize("arch", sorted(TESTED))
def test_tiny_parity(tiny_engines, arch, attention):
    # The session's one build of this pair (shared with tests/runtime/test_pipeline.py's lossless
    # decoding): long enough (160) that the Gemma sliding window (16) matters, a partial last
    # prefill chunk when validation fills the cache, and qwen2 with biases, qwen3/gemma3 with
    # q/k norms, phi3 with fused projections.
    engines = tiny_engines.for_arch(arch, attention)
    manifest = json.loads((engines / "manifest.json").read_text())
    assert manifest["models"]["target"]["model_type"] == TESTED[arch]
    assert manifest["recipe"]["attention"] == attention
    max_seq_len, chunk = TINY_SHAPE["max_seq_len"], TINY_SHAPE["prefill_chunk"]
    draft_len = manifest["plan"]["draft_len"]
    assert draft_len == 4
    target = [e for e in manifest["engines"] if e["model"] == "target"]
    tokens = sorted(e["tokens"] for e in target)
    # decode, verify (1+D; an ort-gqa graph of attention layers alone: every size 2..1+D, one
    # symbolic graph), prefill; and the catchup the int4 drafter is made from, when built
    catchup = [2] if (arch, attention) in LOSSLESS_PAIRS else []
    recurrent = any(name.startswith("past_state") for name in target[0]["inputs"])  # linear-attention layers
    verify = list(range(2, 2 + draft_len)) if attention == "ort-gqa" and not recurrent else [1 + draft_len]
    assert tokens == sorted({1, *catchup, *verify, chunk})
    for engine in target:
        parity = engine["parity"]
        assert parity["argmax_agreement"] == 1.0, engine
        assert parity["max_abs_logit_diff"] < 1e-3, engine
        assert parity["cache_lengths"][0] == 0 and parity["cache_lengths"][-1] == max_seq_len - engine["tokens"]


def test_build_fails_when_parity_fails(tmp_path):
    # An impossible threshold proves the check is enforced for tiny models.
    import yaml

    path = tiny_recipe(tmp_path / "r.yaml", "llama", max_seq_len=32, prefill_chunk=5)  # 1+D: two graphs
    recipe = yaml.safe_load(path.read_text())
    recipe["validation"] = {"max_abs_logit_diff": 1e-12}
    path.write_text(yaml.safe_dump(recipe))
    code, _, err = run_cli("build", path, "-o", tmp_path / "engines")
    assert code == 1 and "validation failed" in err
    assert not (tmp_path / "engines").exists()
