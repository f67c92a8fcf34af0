"""DFlash heads (z-lab and speculators layouts) over a tiny target: build with parity against
the independent reference, greedy losslessness, the runtime's drafts equal the reference's,
exact sampling, the layer-index convention, the mask token, and every malformed checkpoint.
One whole build is shared; loader mistakes are shown on head-only builds (no target export)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from specexport.errors import BadInput, SpecexportError
from tests.conftest import copy_engines, run_cli
from tests.heads.block_checkpoints import (
    PROMPTS,
    build,
    drafts_by_reference,
    recipe,
    tiny_target,
    write_speculators_dflash,
    write_zlab_dflash,
)
from tests.heads.common import build_head_only, check_greedy_lossless, drop_tensor, edit_config, patch_layout
from tests.lossless import (
    assert_sampled_as_target,
    each_with_one_control,
    exact_sequence_probs,
    residual_is_q,
    use_rule,
)

HEADS = {  # drafter name -> (layout, writer, its options)
    "zlab": ("z-lab", write_zlab_dflash, {}),
    "zlab-maskemb": ("z-lab", write_zlab_dflash, {"mask_embedding": True, "layer_ids": [1, 2], "seed": 5}),
    "spec": ("speculators", write_speculators_dflash, {"draft_vocab": 100}),
}


@pytest.fixture(scope="module")
def target():
    return tiny_target()


@pytest.fixture(scope="module")
def folders(tmp_path_factory, target):
    root = tmp_path_factory.mktemp("dflash")
    return root, {name: writer(root / name, target, **options) for name, (_, writer, options) in HEADS.items()}


@pytest.fixture(scope="module")
def engines(folders):
    root, _ = folders
    drafters = [{"kind": "dflash", "name": name, "path": name} for name in HEADS]
    return build(recipe(*drafters), root, root / "engines")


@pytest.fixture(scope="module")
def pipe(engines):
    from specexport.runtime import load

    return load(engines)


def test_every_layout_builds_with_parity(engines):
    manifest = json.loads((engines / "manifest.json").read_text())
    drafters = {d["name"]: d for d in manifest["drafters"]}
    for name in HEADS:
        blocks = [e for e in manifest["engines"] if e["model"] == name]
        assert {e["role"] for e in blocks} == {"block"} and {e["tokens"] for e in blocks} == {4, 8}, blocks
        for e in blocks:
            p = e["parity"]
            assert p["enforced"] and p["positions"] >= 20, (e["name"], p)
            assert p["max_rel_logit_diff"] <= 1e-4 and p["argmax_agreement"] == 1.0, (e["name"], p)
        assert manifest["models"][name]["kind"] == "dflash"
    assert drafters["spec"]["params"]["heads_file"] == "spec.block.npz"  # its d2t
    assert drafters["zlab"]["params"]["drafts"] == 5  # block 6: the anchor does not draft


@pytest.mark.parametrize("drafter", list(HEADS))
def test_greedy_is_lossless(pipe, drafter):
    check_greedy_lossless(pipe, drafter, max_new_tokens=24, prompts=PROMPTS)


def reference_drafts(folder: Path, layout: str, target, context: np.ndarray) -> np.ndarray:
    """The published math's greedy block after ``context`` (its last token is the anchor)."""
    from specexport.exporter.heads.block import read_checkpoint
    from specexport.exporter.heads.block_reference import reference_block

    ckpt = read_checkpoint(folder, "test")
    with torch.no_grad():
        out = target(torch.from_numpy(context).unsqueeze(0), output_hidden_states=True)
    hidden = tuple(h[0].numpy() for h in out.hidden_states)
    logits, _ = reference_block(layout, ckpt.config, ckpt.tensors, target, hidden, context, len(context) - 1)
    ids = logits.argmax(-1)
    if "d2t" in ckpt.tensors:
        ids = ids + ckpt.tensors["d2t"].numpy()[ids]
    return ids


@pytest.mark.parametrize("drafter", list(HEADS))
def test_runtime_drafts_are_the_reference_drafts(pipe, folders, target, drafter):
    """Through the decode loop (prefill rows, then each round's committed rows as context):
    every proposal is the reference's greedy block after the same committed tokens."""
    _, paths = folders
    seen = drafts_by_reference(pipe, drafter, "The lighthouse keeper climbed")
    assert len(seen) >= 3
    for context, drafts, _, _ in seen:
        want = reference_drafts(paths[drafter], HEADS[drafter][0], target, context)
        assert drafts.tolist() == want[: len(drafts)].tolist(), (len(context), drafts, want)


@pytest.mark.parametrize("drafter, rule", each_with_one_control(["zlab", "spec"], residual_is_q))
def test_sampling_is_exact(pipe, drafter, rule, monkeypatch):
    """The first sampled token with the head drafting three: distributed as the target's warped p
    (a flat warp, so the random head's q overlaps p and drafts are sometimes kept). The control:
    the same draws with the replacement token drawn from q, not max(0, p − q), must fail."""
    from specexport.runtime.acceptance import Sampling

    sampling = Sampling(temperature=3.0)
    ids = pipe.prompt_ids("1, 2, 1, 2, 1,")
    exact = exact_sequence_probs(pipe, ids, sampling, 1)
    use_rule(monkeypatch, rule)
    draws, counts, accepted = 900, {}, 0
    for seed in range(draws):
        out = pipe.generate(prompt_ids=ids, drafter=drafter, max_new_tokens=4, draft_len=3, adaptive=False,
                            temperature=3.0, seed=seed)
        counts[tuple(out.token_ids[:1])] = counts.get(tuple(out.token_ids[:1]), 0) + 1
        accepted += out.stats.accepted
    if rule is None:
        assert accepted > 0, "no draft was ever kept: the test would not exercise acceptance"
    assert_sampled_as_target(counts, exact, draws, right_rule=rule is None)


def test_the_policy_costs_one_block_per_round(pipe, engines):
    """A block drafter's round costs one block call whatever k (its own cost model, which adaptive
    depth reads), and nothing when it skips."""
    manifest = json.loads((engines / "manifest.json").read_text())
    block = min((e for e in manifest["engines"] if e["model"] == "zlab"), key=lambda e: e["tokens"])["cost_ms"]
    policy = pipe.costs.depth_policy(pipe.drafter("zlab"), pipe.target)
    assert policy.round_cost(0) == 0.0
    for k in (1, 3):
        assert policy.round_cost(k) == pytest.approx(block / 1e3)


# -- loader mistakes must fail parity (head-only builds) ----------------------------------------


def _head_recipe(root: Path, name: str = "h") -> dict:
    """One head; the prefill chunk equal to 1+D, so a head-only build exports one graph."""
    raw = recipe({"kind": "dflash", "name": name, "path": name})
    return {**raw, "shapes": {**raw["shapes"], "prefill_chunk": 4}}


def _patch_facts(monkeypatch, layout: str, change) -> None:
    from specexport.exporter.heads import dflash

    patch_layout(monkeypatch, dflash.LAYOUTS, layout, change)


@pytest.mark.parametrize("layout,writer", [("z-lab", write_zlab_dflash), ("speculators", write_speculators_dflash)])
def test_layer_ids_in_the_wrong_convention_fail_parity(tmp_path, target, monkeypatch, layout, writer):
    writer(tmp_path / "h", target, layer_ids=(0, 2))  # in range in both conventions
    build_head_only(_head_recipe(tmp_path), tmp_path, tmp_path / "ok")  # as published: passes
    other = (lambda i: i) if layout == "z-lab" else (lambda i: i + 1)
    _patch_facts(monkeypatch, layout, lambda facts: setattr(facts, "to_tap", other))
    with pytest.raises(SpecexportError, match="validation failed for h.block"):
        build_head_only(_head_recipe(tmp_path), tmp_path, tmp_path / "wrong")


def test_a_wrong_mask_token_fails_parity(tmp_path, target, monkeypatch):
    write_zlab_dflash(tmp_path / "h", target)
    _patch_facts(monkeypatch, "z-lab", lambda facts: setattr(facts, "mask_token_id", facts.mask_token_id + 1))
    with pytest.raises(SpecexportError, match="validation failed for h.block"):
        build_head_only(_head_recipe(tmp_path), tmp_path, tmp_path / "wrong")


def test_a_mask_embedding_replaces_the_mask_token(tmp_path, target, monkeypatch):
    """With a mask_embedding tensor the mask token is not read: taking the token's embedding
    instead fails parity."""
    from specexport.exporter.heads import block

    write_zlab_dflash(tmp_path / "h", target, mask_embedding=True)
    original = block.Checkpoint.has
    monkeypatch.setattr(block.Checkpoint, "has", lambda self, name: name != "mask_embedding" and original(self, name))
    with pytest.raises(SpecexportError, match="validation failed for h.block"):
        build_head_only(_head_recipe(tmp_path), tmp_path, tmp_path / "wrong")


def _swap_k_and_v(monkeypatch) -> None:
    """A loader that swaps layer 0's k_proj and v_proj: a silent mis-map."""
    from specexport.exporter.heads import block

    read_layers = block.read_layers

    def swapped(ckpt, dense, prefix="layers"):
        layers = read_layers(ckpt, dense, prefix)
        layers[0].k_w, layers[0].v_w = layers[0].v_w, layers[0].k_w
        return layers

    monkeypatch.setattr(block, "read_layers", swapped)


def test_a_broken_tensor_mapping_fails_parity(tmp_path, target, monkeypatch):
    """A loader that swaps k_proj and v_proj (a silent mis-map) is caught by the build."""
    write_speculators_dflash(tmp_path / "h", target)
    _swap_k_and_v(monkeypatch)
    with pytest.raises(SpecexportError, match="validation failed for h.block"):
        build_head_only(_head_recipe(tmp_path), tmp_path, tmp_path / "wrong")


@pytest.mark.parametrize("broken", [False, True])
def test_an_int8_head_is_held_to_its_limits(tmp_path, target, monkeypatch, broken):
    """`precision: int8` on a block head: its graphs read 8-bit MatMulNBits and an 8-bit embedding,
    and pass the int8/head limits against the fp32 reference; the control, the same head with k
    and v swapped, still fails them (quantization does not hide a wrong graph)."""
    import onnx

    write_speculators_dflash(tmp_path / "h", target)
    raw = _head_recipe(tmp_path)
    raw["drafters"] = [{**raw["drafters"][0], "precision": "int8"}]
    if broken:
        _swap_k_and_v(monkeypatch)
        with pytest.raises(SpecexportError, match=r"validation failed for h.block.*int8/head"):
            build_head_only(raw, tmp_path, tmp_path / "wrong")
        return
    builder = build_head_only(raw, tmp_path, tmp_path / "ok")
    assert builder.models["h"].info["weights_quantized"]["precision"] == "int8"
    entries = [e for e in builder.engines if e.model == "h"]
    assert entries
    for entry in entries:
        assert entry.parity["precision"] == "int8/head" and entry.parity["enforced"], entry.parity
        ops = {n.op_type for n in onnx.load(str(tmp_path / "ok" / entry.path), load_external_data=False).graph.node}
        assert {"MatMulNBits", "GatherBlockQuantized"} <= ops, ops


# -- malformed checkpoints: one line naming the file and the tensor or field -----------------------



def _reshape(name):
    def change(folder: Path):
        tensors = load_file(str(folder / "model.safetensors"))
        tensors[name] = tensors[name][:-1].contiguous()
        save_file(tensors, str(folder / "model.safetensors"))
    return change



MALFORMED = [  # (writer, breaks it, what the one line says)
    (write_zlab_dflash, drop_tensor("fc.weight"), r"model\.safetensors.*tensor 'fc\.weight' is missing"),
    (write_zlab_dflash, drop_tensor("layers.0.mlp.down_proj.weight"), r"tensor 'layers\.0\.mlp\.down_proj\.weight' is missing"),
    (write_zlab_dflash, _reshape("layers.0.self_attn.k_proj.weight"),
     r"model\.safetensors: tensor 'layers\.0\.self_attn\.k_proj\.weight' has shape \[31, 64\], expected \[32, 64\]"),
    (write_zlab_dflash, _reshape("hidden_norm.weight"), r"tensor 'hidden_norm\.weight' has shape"),
    (write_zlab_dflash, edit_config(lambda c: c["dflash_config"].update(mask_token_id=259)),
     r"config\.json: mask_token_id 259 is outside the target's vocabulary of 259"),
    (write_zlab_dflash, edit_config(lambda c: c["dflash_config"].pop("mask_token_id")), r"config\.json: 'mask_token_id' is missing"),
    (write_zlab_dflash, edit_config(lambda c: c["dflash_config"].update(target_layer_ids=[0, 3])),
     r"config\.json: target layer id 3 is outside the target's 4 layers"),
    (write_zlab_dflash, edit_config(lambda c: c["dflash_config"].update(target_layer_ids="0,2")),
     r"config\.json: 'dflash_config\.target_layer_ids' must be a non-empty list"),
    (write_zlab_dflash, edit_config(lambda c: c.pop("block_size")), r"config\.json: 'block_size' is missing"),
    (write_zlab_dflash, edit_config(lambda c: c.update(num_attention_heads=3)), r"config\.json: num_attention_heads \(3\)"),
    (write_zlab_dflash, edit_config(lambda c: c.pop("dflash_config") and c.pop("architectures")),
     r"config\.json: cannot tell which dflash layout"),
    (write_speculators_dflash, edit_config(lambda c: c.update(draft_vocab_size=100)), r"tensor 'lm_head\.weight' is missing"),
    (write_speculators_dflash, edit_config(lambda c: c.pop("transformer_layer_config")), r"'transformer_layer_config' is missing"),
    (write_speculators_dflash, edit_config(lambda c: c.update(speculators_model_type="eagle3")), r"not dflash"),
]


@pytest.mark.parametrize("writer,breaks,message", MALFORMED, ids=[m[:40] for _, _, m in MALFORMED])
def test_malformed_checkpoints_are_one_line_errors(tmp_path, target, writer, breaks, message):
    from specexport.exporter.heads import dflash
    from specexport.exporter.recipe import parse_recipe
    from specexport.exporter.sources import LoadedModel
    from specexport.exporter.tiny import byte_tokenizer

    folder = writer(tmp_path / "h", target)
    breaks(folder)
    spec = parse_recipe(_head_recipe(tmp_path), "r").drafters[0]
    with pytest.raises(BadInput) as caught:
        dflash.load(spec, LoadedModel(target, byte_tokenizer(), "target"), tmp_path, "drafters.0")
    line = str(caught.value)
    assert "\n" not in line and re.search(message, line), line
    assert str(folder) in line


def test_unreadable_files_are_one_line_errors(tmp_path, target):
    from specexport.exporter.heads import dflash
    from specexport.exporter.recipe import parse_recipe
    from specexport.exporter.sources import LoadedModel
    from specexport.exporter.tiny import byte_tokenizer

    spec = parse_recipe(_head_recipe(tmp_path), "r").drafters[0]
    loaded = LoadedModel(target, byte_tokenizer(), "target")
    folder = write_zlab_dflash(tmp_path / "h", target)
    (folder / "config.json").write_text("{not json")
    with pytest.raises(BadInput, match=r"config\.json: not valid JSON"):
        dflash.load(spec, loaded, tmp_path, "drafters.0")
    folder = write_zlab_dflash(tmp_path / "h", target)
    (folder / "model.safetensors").unlink()
    with pytest.raises(BadInput, match=r"has no \*\.safetensors weights"):
        dflash.load(spec, loaded, tmp_path, "drafters.0")


def test_the_cli_exits_2_on_a_malformed_head(tmp_path, target):
    folder = write_zlab_dflash(tmp_path / "h", target)
    drop_tensor("norm.weight")(folder)
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(_head_recipe(tmp_path)))
    code, _, err = run_cli("build", tmp_path / "r.yaml", "-o", tmp_path / "out", "-q")
    assert code == 2 and "tensor 'norm.weight' is missing" in err and "Traceback" not in err, err


def test_tune_times_the_block_graphs_too(engines, tmp_path):
    """`specexport tune` times every graph of every model: block graphs take one anchor token
    for C context rows, so the runner sizes their input_ids from the graph (it failed before)."""

    from specexport.contract import Manifest, Role
    from specexport.runtime.costs import COSTS

    copy = tmp_path / "engines"
    copy_engines(engines, copy)
    code, _, err = run_cli("tune", copy, "--rounds", "1", "--threads", "1")
    assert code == 0, err
    costs = json.loads((copy / COSTS).read_text())["engines"]["onnxruntime"]
    blocks = [e.name for e in Manifest.load(copy).engines if e.role == Role.BLOCK]
    assert blocks and all(costs[name] > 0 for name in blocks)


def test_the_bench_costs_a_round_as_one_block_call(pipe):
    """A block head drafts the whole block in one call: the bench's prediction charges one
    block per round whatever k (it crashed on block heads before: they have no step graph)."""
    from specexport.bench.harness import measure_costs

    names = [n for n in pipe.drafter_names if n != "none"]
    costs = measure_costs(pipe, names, repeats=3, want_logits=False, draft_len=pipe.manifest.draft_len)
    for name in names:
        draft = costs["draft_ms"][name]  # k = 0..D
        assert draft[0] == 0.0 and draft[1] > 0 and len(set(draft[1:])) == 1
        assert list(costs["draft_parts_ms"][name]) == ["block"]
