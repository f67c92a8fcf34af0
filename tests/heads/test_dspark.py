"""DSpark heads (DeepSpec and speculators layouts; vanilla, gated and rnn Markov heads; the
confidence head with and without the Markov features) over a tiny target: build with parity
(the block graph and the runtime's numpy heads against the independent reference), greedy
losslessness, the runtime's drafts equal the reference's serial drafts, exact sampling, the
confidence cut, the layer-index convention, and malformed checkpoints."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from specexport.errors import BadInput, SpecexportError
from tests.heads.block_checkpoints import (
    PROMPTS,
    build,
    drafts_by_reference,
    recipe,
    tiny_target,
    write_deepspec_dspark,
    write_speculators_dspark,
)
from tests.heads.common import build_head_only, check_greedy_lossless, drop_tensor, edit_config, patch_layout
from tests.lossless import (
    assert_lossless,
    assert_sampled_as_target,
    each_with_one_control,
    exact_sequence_probs,
    residual_is_q,
    use_rule,
)

HEADS = {  # drafter name -> (layout, writer, its options, recipe extras)
    "ds": ("deepspec", write_deepspec_dspark, {}, {}),
    "ds-gated": ("deepspec", write_deepspec_dspark,
                 {"markov_head_type": "gated", "confidence": False, "layer_ids": [0, 2], "seed": 6}, {}),
    "sds": ("speculators", write_speculators_dspark, {}, {"confidence_threshold": 0.05}),
}


@pytest.fixture(scope="module")
def target():
    return tiny_target()


@pytest.fixture(scope="module")
def folders(tmp_path_factory, target):
    root = tmp_path_factory.mktemp("dspark")
    return root, {name: writer(root / name, target, **options) for name, (_, writer, options, _) in HEADS.items()}


@pytest.fixture(scope="module")
def engines(folders):
    root, _ = folders
    drafters = [{"kind": "dspark", "name": name, "path": name, **extra} for name, (*_, extra) in HEADS.items()]
    return build(recipe(*drafters, max_draft=4), root, root / "engines")


@pytest.fixture(scope="module")
def pipe(engines):
    from specexport.runtime import load

    return load(engines)


def test_every_layout_builds_with_parity(engines):
    manifest = json.loads((engines / "manifest.json").read_text())
    drafters = {d["name"]: d for d in manifest["drafters"]}
    for name in HEADS:
        blocks = [e for e in manifest["engines"] if e["model"] == name]
        assert {e["role"] for e in blocks} == {"block"} and {e["tokens"] for e in blocks} == {5, 8}, blocks
        for e in blocks:
            assert "block_hidden" in e["outputs"]
            p = e["parity"]
            assert p["enforced"] and p["positions"] >= 20, (e["name"], p)
            assert p["max_rel_logit_diff"] <= 1e-4 and p["argmax_agreement"] == 1.0, (e["name"], p)
        params = drafters[name]["params"]
        assert params["from_anchor"] and params["drafts"] == params["block_size"]  # the anchor slot drafts too
        assert params["heads_file"] == f"{name}.block.npz"
    assert drafters["ds"]["params"]["markov"] == "vanilla"
    assert drafters["sds"]["params"]["confidence_threshold"] == 0.05


@pytest.mark.parametrize("drafter", list(HEADS))
def test_greedy_is_lossless(pipe, drafter):
    check_greedy_lossless(pipe, drafter, max_new_tokens=24, prompts=PROMPTS)


def reference_drafts(folder: Path, layout: str, target, context: np.ndarray):
    """The published math's serial greedy block after ``context`` and its confidences."""
    from specexport.exporter.heads.block import read_checkpoint
    from specexport.exporter.heads.block_reference import reference_block, reference_markov

    ckpt = read_checkpoint(folder, "test")
    with torch.no_grad():
        out = target(torch.from_numpy(context).unsqueeze(0), output_hidden_states=True)
    hidden = tuple(h[0].numpy() for h in out.hidden_states)
    logits, block_hidden = reference_block(layout, ckpt.config, ckpt.tensors, target, hidden, context, len(context) - 1)
    d2t = None
    if "d2t" in ckpt.tensors:
        d2t = np.arange(len(ckpt.tensors["d2t"])) + ckpt.tensors["d2t"].numpy()
    _, tokens, confidence = reference_markov(ckpt.config, ckpt.tensors, logits, block_hidden, int(context[-1]), d2t)
    return tokens, confidence


@pytest.mark.parametrize("drafter", list(HEADS))
def test_runtime_drafts_are_the_reference_drafts(pipe, folders, target, drafter):
    """Through the decode loop, every proposal is the reference's serial greedy block after the
    same committed tokens (cut where the confidence product falls below the threshold)."""
    _, paths = folders
    chosen = pipe.drafter(drafter)
    seen = drafts_by_reference(pipe, drafter, "The lighthouse keeper climbed")
    assert len(seen) >= 3
    for context, drafts, k, _ in seen:
        tokens, confidence = reference_drafts(paths[drafter], HEADS[drafter][0], target, context)
        assert drafts.tolist() == tokens[: len(drafts)].tolist(), (len(context), drafts, tokens)
        slot = chosen.slots[0]  # generate's one slot
        if len(drafts) < min(slot.drafts, k):  # cut by the confidence product
            assert slot.threshold > 0 and np.cumprod(confidence)[len(drafts)] < slot.threshold


def test_the_confidence_product_cuts_the_draft(pipe):
    """With a threshold, a draft stops before the slot whose running confidence product falls
    below it; greedy output stays the target's."""
    drafter = pipe.drafter("ds").slots[0]  # generate's one slot
    ids = pipe.prompt_ids(PROMPTS[0])
    base = pipe.generate(prompt_ids=ids, max_new_tokens=16).token_ids
    full = drafts_by_reference(pipe, "ds", PROMPTS[0], 16)
    _, first, _, products = full[0]  # the first round drafts after the prompt alone
    assert len(first) >= 2 and products is not None and products[1] < products[0]
    drafter.threshold = float((products[0] + products[1]) / 2)  # between the first two: cut after one
    try:
        cut = drafts_by_reference(pipe, "ds", PROMPTS[0], 16)
        spec = pipe.generate(prompt_ids=ids, max_new_tokens=16, drafter="ds", adaptive=False)
    finally:
        drafter.threshold = 0.0
    assert len(cut[0][1]) == 1 and cut[0][1][0] == first[0]
    assert sum(len(d) for _, d, _, _ in cut) < sum(len(d) for _, d, _, _ in full)
    assert_lossless(pipe, ids, base, spec.token_ids, "ds with a confidence cut")


@pytest.mark.parametrize("drafter, rule", each_with_one_control(["ds", "sds"], residual_is_q))
def test_sampling_is_exact(pipe, drafter, rule, monkeypatch):
    """The first sampled token with the Markov-refined block drafting: distributed as the
    target's warped p (a flat warp, so drafts are sometimes kept). The control: the same draws
    with the replacement token drawn from q, not max(0, p − q), must fail."""
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


# -- loader mistakes must fail parity (head-only builds) ----------------------------------------


def _head_recipe(name: str = "h") -> dict:
    """One head; the prefill chunk equal to 1+D, so a head-only build exports one graph."""
    raw = recipe({"kind": "dspark", "name": name, "path": name}, max_draft=4)
    return {**raw, "shapes": {**raw["shapes"], "prefill_chunk": 5}}


def _patch_facts(monkeypatch, layout: str, change) -> None:
    from specexport.exporter.heads import dspark

    patch_layout(monkeypatch, dspark.LAYOUTS, layout, change)


def test_deepspec_layer_ids_in_the_wrong_convention_fail_parity(tmp_path, target, monkeypatch):
    write_deepspec_dspark(tmp_path / "h", target, confidence=False, markov_rank=0)
    build_head_only(_head_recipe(), tmp_path, tmp_path / "ok")  # -1 -> embeddings, i -> output of layer i
    _patch_facts(monkeypatch, "deepspec", lambda facts: setattr(facts, "to_tap", lambda i: max(i, 0)))
    with pytest.raises(SpecexportError, match="validation failed for h.block"):
        build_head_only(_head_recipe(), tmp_path, tmp_path / "wrong")


def test_reading_dspark_as_dflash_slots_fails_parity(tmp_path, target, monkeypatch):
    """sample_from_anchor: the anchor slot drafts; dropping it (DFlash's slots) must fail."""
    write_speculators_dspark(tmp_path / "h", target, markov_rank=0, confidence=False, draft_vocab=None)
    _patch_facts(monkeypatch, "speculators", lambda facts: setattr(facts, "from_anchor", False))
    with pytest.raises(SpecexportError, match="validation failed for h.block"):
        build_head_only(_head_recipe(), tmp_path, tmp_path / "wrong")


def test_a_misread_markov_head_fails_parity(tmp_path, target, monkeypatch):
    """The runtime's numpy heads are checked too: running a gated head as vanilla fails."""
    from specexport.exporter.heads import dspark

    write_deepspec_dspark(tmp_path / "h", target, markov_head_type="gated", confidence=False)
    read_heads = dspark.read_heads

    def as_vanilla(spec):
        read_heads(spec)
        spec.params["markov"] = "vanilla"

    monkeypatch.setattr(dspark, "read_heads", as_vanilla)
    with pytest.raises(SpecexportError, match="validation failed for h.block"):
        build_head_only(_head_recipe(), tmp_path, tmp_path / "wrong")


# -- malformed checkpoints ---------------------------------------------------------------------




def _grow(name):
    def change(folder: Path):
        tensors = load_file(str(folder / "model.safetensors"))
        tensors[name] = torch.cat((tensors[name], tensors[name][:, :1]), dim=1).contiguous()
        save_file(tensors, str(folder / "model.safetensors"))
    return change


MALFORMED = [
    (write_deepspec_dspark, drop_tensor("markov_head.markov_w2.weight"), r"tensor 'markov_head\.markov_w2\.weight' is missing"),
    (write_deepspec_dspark, _grow("confidence_head.proj.weight"),
     r"tensor 'confidence_head\.proj\.weight' has shape \[1, 73\], expected \[1, 72\]"),
    (write_deepspec_dspark, drop_tensor("embed_tokens.weight"), None),  # not malformed: the target's embedding serves
    (write_deepspec_dspark, edit_config(lambda c: c.update(markov_head_type="lstm")), r"markov_head_type 'lstm'"),
    (write_deepspec_dspark, edit_config(lambda c: c.update(markov_rank=0)), r"confidence_head_with_markov needs"),
    (write_deepspec_dspark, edit_config(lambda c: c.update(mask_token_id=-1)), r"mask_token_id -1 is outside"),
    (write_deepspec_dspark, edit_config(lambda c: c.update(target_layer_ids=[-2])), r"target layer id -2 is outside"),
    (write_speculators_dspark, drop_tensor("d2t"), r"tensor 'd2t' is missing"),
    (write_speculators_dspark, drop_tensor("markov_head.joint_proj.bias"), r"tensor 'markov_head\.joint_proj\.bias' is missing"),
    (write_speculators_dspark, edit_config(lambda c: c.update(speculators_model_type="dflash")), r"not dspark"),
]


@pytest.mark.parametrize("writer,breaks,message", MALFORMED, ids=[str(m)[:40] for _, _, m in MALFORMED])
def test_malformed_checkpoints_are_one_line_errors(tmp_path, target, writer, breaks, message):
    from specexport.exporter.heads import dspark
    from specexport.exporter.recipe import parse_recipe
    from specexport.exporter.sources import LoadedModel
    from specexport.exporter.tiny import byte_tokenizer

    folder = writer(tmp_path / "h", target)
    breaks(folder)
    spec = parse_recipe(_head_recipe(), "r").drafters[0]
    loaded = LoadedModel(target, byte_tokenizer(), "target")
    if message is None:
        assert dspark.load(spec, loaded, tmp_path, "drafters.0").taps == (0, 2, 3)
        return
    with pytest.raises(BadInput) as caught:
        dspark.load(spec, loaded, tmp_path, "drafters.0")
    line = str(caught.value)
    assert "\n" not in line and re.search(message, line), line
    assert str(folder) in line
