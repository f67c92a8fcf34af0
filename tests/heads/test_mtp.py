"""MTP heads from tiny random checkpoints in the four published layouts, read from the target's
own safetensors (DeepSeek, Qwen3-Next, MiMo) or a speculators folder: build with parity, greedy
losslessness, the runtime's drafts equal the reference's greedy chain, exact sampling, a broken mapping failing parity (head-only builds), and the
one-line errors."""

from __future__ import annotations

import pytest

from specexport.errors import BadInput, SpecexportError
from tests.heads.chain_checkpoints import write_mtp_speculators, write_mtp_target
from tests.heads.chain_reference import check_drafts_are_the_reference_chain, load_chain_heads
from tests.heads.common import (
    SHAPES,
    build,
    build_head_only,
    check_greedy_lossless,
    check_parity,
    check_sampling,
)
from tests.lossless import residual_is_q, rules


def mtp_recipe(target_path: str, *drafters: dict) -> dict:
    return {"name": "mtp", "target": {"source": "hf", "path": target_path},
            "drafters": list(drafters) or [{"kind": "mtp"}]}


# drafter name -> layout; the three in-target layouts live side by side in one qwen3 target
# (q/k norms), MiMo also in a qwen2 target (biases), speculators in a folder beside the target
IN_QWEN3 = {"m-deepseek": "deepseek", "m-qwen3-next": "qwen3-next"}
QWEN3 = mtp_recipe("t-qwen3", *[{"kind": "mtp", "name": name, "layout": layout} for name, layout in IN_QWEN3.items()],
                   {"kind": "mtp", "name": "m-speculators", "path": "spec"})
QWEN2 = mtp_recipe("t-qwen2", {"kind": "mtp", "name": "m-mimo"})


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """drafter name -> engine directory (two builds)."""
    from transformers import AutoConfig

    root = tmp_path_factory.mktemp("mtp")
    write_mtp_target(root / "t-qwen3", "qwen3", tuple(IN_QWEN3.values()))
    write_mtp_speculators(root / "spec", AutoConfig.from_pretrained(root / "t-qwen3"))
    qwen3 = build(QWEN3, root, root / "out-qwen3")
    write_mtp_target(root / "t-qwen2", "qwen2", "mimo")
    qwen2 = build(QWEN2, root, root / "out-qwen2")
    return {**dict.fromkeys([*IN_QWEN3, "m-speculators"], qwen3), "m-mimo": qwen2}


@pytest.mark.parametrize("name", [*IN_QWEN3, "m-mimo", "m-speculators"])
def test_layout_builds_with_parity_and_decodes_losslessly(built, name):
    from specexport.runtime import load

    check_parity(built[name], name)
    check_greedy_lossless(load(built[name]), name)


@pytest.fixture(scope="module")
def references(built):
    """drafter name -> (target, loaded head): the exporter's reference forward of each layout."""
    found = {}
    for raw in (QWEN3, QWEN2):
        target, heads = load_chain_heads(raw, built["m-mimo"].parent)
        found.update({name: (target, head) for name, head in heads.items()})
    return found


@pytest.mark.parametrize("name", [*IN_QWEN3, "m-mimo", "m-speculators"])
def test_runtime_drafts_are_the_reference_chain(built, references, name):
    """Through the decode loop: each round's proposals (the catch-up's draft, then the step
    graph's) are the reference's greedy chain after the same committed tokens."""
    from specexport.runtime import load

    target, head = references[name]
    check_drafts_are_the_reference_chain(load(built[name]), name, head, target)


# DeepSeek-V3 and GLM-4.5 targets (tests/exporter/test_archs.py's tiny configs): their MTP layer
# is an MoE layer (4 experts, top-2, a shared expert), DeepSeek's with MLA attention
MOE_TARGETS = ("glm4_moe", "deepseek_v3")


@pytest.mark.parametrize("arch", MOE_TARGETS)
def test_moe_and_mla_mtp_layers_build_with_parity_and_draft_the_reference_chain(tmp_path, arch):
    """Parity, greedy losslessness, and the runtime's drafts equal the reference's chain."""
    import json

    from specexport.runtime import load

    write_mtp_target(tmp_path / "t", arch, "deepseek")
    # ort-gqa: one target graph for every size (the quickest build); the head's graphs are its own
    raw = {**mtp_recipe("t", {"kind": "mtp", "name": "m"}), "attention": "ort-gqa"}
    engines = build(raw, tmp_path, tmp_path / "out")
    check_parity(engines, "m")
    pipe = load(engines)
    check_greedy_lossless(pipe, "m")
    target, heads = load_chain_heads(raw, tmp_path)
    check_drafts_are_the_reference_chain(pipe, "m", heads["m"], target)
    kv = json.loads((engines / "manifest.json").read_text())["models"]["m"]["kv"]
    if arch == "deepseek_v3":  # MLA: every head cached at the qk width (nope 24 + rope 8)
        assert (kv["num_kv_heads"], kv["head_dim"]) == (4, 32), kv


def test_a_mis_mapped_expert_fails_parity(tmp_path, monkeypatch):
    """The experts' gate and up read from each other's names: the head no longer matches the
    reference (transformers' own MoE layer over the published tensors), so the build fails."""
    from specexport.exporter.heads import mtp

    names = mtp.EXPERT_NAMES
    monkeypatch.setattr(mtp, "EXPERT_NAMES", dict(names, gate_w=names["up_w"], up_w=names["gate_w"]))
    write_mtp_target(tmp_path / "t", "glm4_moe", "deepseek")
    with pytest.raises(SpecexportError, match="validation failed for mtp"):
        build_head_only(mtp_recipe("t"), tmp_path, tmp_path / "out")


def test_layouts_are_detected_from_the_files(tmp_path):
    from specexport.exporter.heads.chain import Tensors, safetensors_files
    from specexport.exporter.heads.mtp import detect_layout

    for layout in ("deepseek", "qwen3-next", "mimo"):
        folder = write_mtp_target(tmp_path / layout, "llama", layout)
        assert detect_layout({}, Tensors(safetensors_files(folder, "t"), "t"))[0] == layout


@pytest.mark.parametrize("rule", rules(residual_is_q))
def test_sampling_is_exact(built, rule, monkeypatch):
    from specexport.runtime import load

    check_sampling(load(built["m-mimo"]), "m-mimo", monkeypatch, rule, draws=400)


@pytest.mark.parametrize("what", ["concat order", "swapped tensors"])
def test_a_broken_loader_fails_parity(tmp_path, monkeypatch, what):
    """MiMo concatenates [hidden, embedding]: read in DeepSeek's order, or with gate/up
    swapped in the mapping table, the graph no longer matches the reference (a head-only
    build: the head's parity is what fails, the target's export would be the same)."""
    from dataclasses import replace

    from specexport.exporter.heads import mtp

    if what == "concat order":
        monkeypatch.setitem(mtp.LAYOUTS, "mimo", replace(mtp.LAYOUTS["mimo"], hidden_first=False))
    else:
        monkeypatch.setattr(mtp, "LAYER_NAMES", dict(mtp.LAYER_NAMES, gate_w="mlp.up_proj.weight",
                                                     up_w="mlp.gate_proj.weight"))
    write_mtp_target(tmp_path / "t", "qwen2", "mimo")
    with pytest.raises(SpecexportError, match="validation failed for mtp"):
        build_head_only(mtp_recipe("t"), tmp_path, tmp_path / "out")


MALFORMED = [
    ("deepseek", {"drop": "model.layers.2.eh_proj.weight"}, "no MTP weights found"),
    ("deepseek", {"drop": "model.layers.2.enorm.weight"}, "tensor 'model.layers.2.enorm.weight' is missing"),
    ("qwen3-next", {"drop": "mtp.layers.0.mlp.down_proj.weight"}, "tensor 'mtp.layers.0.mlp.down_proj.weight' is missing"),
    ("mimo", {"reshape": "model.mtp_layers.0.input_proj.weight"}, "tensor 'model.mtp_layers.0.input_proj.weight' in model.safetensors has shape"),
    ("qwen3-next", {"reshape": "mtp.pre_fc_norm_hidden.weight"}, "'mtp.pre_fc_norm_hidden.weight' in model.safetensors has shape"),
]


@pytest.mark.parametrize("layout,broken,message", MALFORMED, ids=[m for *_, m in MALFORMED])
def test_malformed_checkpoints_are_one_line_errors(tmp_path, layout, broken, message):
    from specexport.exporter.heads.mtp import load
    from specexport.exporter.recipe import HfSource, MtpDrafterSpec
    from specexport.exporter.sources import load_source

    write_mtp_target(tmp_path / "t", "llama", layout, **broken)
    target = load_source(HfSource(source="hf", path=tmp_path / "t"), tmp_path, "target")
    with pytest.raises(BadInput, match=message) as err:
        load(MtpDrafterSpec(kind="mtp"), target, tmp_path, "drafters.0")
    assert "\n" not in str(err.value) and str(err.value).startswith("drafters.0")


def test_unreachable_layers_and_targets_are_refused(tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    from specexport.exporter.heads.mtp import load
    from specexport.exporter.recipe import HfSource, MtpDrafterSpec, TinySource
    from specexport.exporter.sources import load_source

    folder = write_mtp_target(tmp_path / "t", "llama", "deepseek")
    weights = load_file(str(folder / "model.safetensors"))
    weights["model.layers.2.mlp.experts.0.up_proj.weight"] = torch.zeros(4, 4)  # an MoE layer
    save_file(weights, str(folder / "model.safetensors"))
    target = load_source(HfSource(source="hf", path=folder), tmp_path, "target")
    with pytest.raises(BadInput, match="mixture-of-experts"):
        load(MtpDrafterSpec(kind="mtp"), target, tmp_path, "drafters.0")
    tiny = load_source(TinySource(source="tiny"), tmp_path, "target")
    with pytest.raises(BadInput, match="needs a transformers directory target"):
        load(MtpDrafterSpec(kind="mtp"), tiny, tmp_path, "drafters.0")


def test_a_malformed_speculators_config_is_one_line(tmp_path):
    import yaml
    from transformers import AutoConfig

    from tests.conftest import run_cli

    write_mtp_target(tmp_path / "t", "llama", "deepseek")
    write_mtp_speculators(tmp_path / "spec", AutoConfig.from_pretrained(tmp_path / "t"),
                          drop="mtp_layers.0.token_layernorm.weight")
    (tmp_path / "r.yaml").write_text(yaml.safe_dump({**mtp_recipe("t", {"kind": "mtp", "path": "spec"}),
                                                    "shapes": SHAPES}))
    code, _, err = run_cli("build", tmp_path / "r.yaml", "--out", tmp_path / "out")
    assert code == 2 and "mtp_layers.0.token_layernorm.weight" in err and "Traceback" not in err, err
