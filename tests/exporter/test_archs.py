"""Every supported architecture: a tiny random model exported and checked against transformers."""

import json

import pytest

from specexport.exporter.archs import ARCHITECTURES
from tests.conftest import run_cli, tiny_recipe

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
}


def test_every_supported_architecture_has_a_parity_test():
    assert set(ARCHITECTURES) == set(TESTED.values()), "add the new architecture to TESTED"


@pytest.mark.parametrize("attention", ["standard", "ort-gqa"])
@pytest.mark.parametrize("arch", sorted(TESTED))
def test_tiny_parity(arch, attention, tmp_path):
    # Long enough (48) that the Gemma sliding window (16) matters, a partial last prefill
    # chunk, and qwen2 with biases, qwen3/gemma3 with q/k norms, phi3 with fused projections.
    recipe = tiny_recipe(tmp_path / "r.yaml", arch, max_seq_len=48, prefill_chunk=8, max_draft=3,
                         head_dim=16 if arch.startswith("gemma") else None, attention=attention)
    code, out, err = run_cli("build", recipe, "-o", tmp_path / "engines", "--json")
    assert code == 0, err
    result = json.loads(out)
    manifest = json.loads((tmp_path / "engines" / "manifest.json").read_text())
    assert manifest["models"]["target"]["model_type"] == TESTED[arch]
    tokens = sorted(e["tokens"] for e in result["engines"])
    assert tokens == [1, 4, 8]  # decode, verify (1+D), prefill
    for engine in result["engines"]:
        parity = engine["parity"]
        assert parity["argmax_agreement"] == 1.0, engine
        assert parity["max_abs_logit_diff"] < 1e-3, engine
        assert parity["cache_lengths"][0] == 0 and parity["cache_lengths"][-1] == 48 - engine["tokens"]


def test_build_fails_when_parity_fails(tmp_path):
    # An impossible threshold proves the check is enforced for tiny models.
    import yaml

    path = tiny_recipe(tmp_path / "r.yaml", "llama", max_seq_len=32, prefill_chunk=8)
    recipe = yaml.safe_load(path.read_text())
    recipe["validation"] = {"max_abs_logit_diff": 1e-12}
    path.write_text(yaml.safe_dump(recipe))
    code, _, err = run_cli("build", path, "-o", tmp_path / "engines")
    assert code == 1 and "validation failed" in err
    assert not (tmp_path / "engines").exists()
