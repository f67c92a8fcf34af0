"""`specexport distill --drafter dflash` on the tiny target of test_distill.py: a seconds-long
run must lower the held-out loss and raise held-out block acceptance over the untrained head;
the training forward is the build's reference forward on the same weights; the output builds
with enforced parity, decodes losslessly and its drafts are accepted (an E[L] floor on the held-out
prompts); --resume continues it."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_cli
from tests.distill.test_distill import TARGET, check_training_gain, command, work  # noqa: F401 (work: the shared fixture)
from tests.expected_length import acceptance_length
from tests.heads.common import SHAPES, build, check_greedy_lossless

STEPS = 150
# Held-out chat prompts (about 40 tokens) and 48 new tokens, as the run generated its responses
BLOCK_SHAPES = {**SHAPES, "max_seq_len": 96}


@pytest.fixture(scope="module")
def trained(work):  # noqa: F811
    out = work / "dflash"
    proc = command(work / "recipe.yaml", "-o", out, "--drafter", "dflash", "--prompts", work / "prompts.jsonl",
                   "--data", work / "data.jsonl", "--max-steps", STEPS, "--max-new", 48, "--holdout", 0.25,
                   "--warmup", 10, "--batch-tokens", 1024, "--lr", 3e-3, "--minutes", 30, "--eval-minutes", 60)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err
    return out, json.loads((out / "distill.json").read_text())


def test_training_lowers_the_loss_and_raises_acceptance(trained):
    before, after = check_training_gain(trained[1], loss_ratio=0.5)
    assert after["acceptance"][0] > before["acceptance"][0] + 0.15, (before, after)
    assert len(after["acceptance"]) == 3 and after["block_size"] == 4  # D = 3: block = anchor + 3 drafts


def test_the_output_is_a_speculators_dflash_checkpoint(trained):
    out, record = trained
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "distill.json", "model.safetensors", "state"]
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "dflash" and config["block_size"] == 4
    assert config["aux_hidden_state_layer_ids"] == record["taps"] == [1, 2, 3]  # spread over 1..L-1, L = 4
    assert config["mask_token_id"] == record["head"]["mask_token_id"]
    assert record["drafter"] == "dflash" and record["layout"] == "speculators" and record["draft_len"] == 3
    assert record["head"]["gamma"] == 1.5 and record["head"]["draft_layers"] == 1


def test_the_training_forward_is_the_reference(trained, work):  # noqa: F811
    """The trained module, read back from model.safetensors, gives the build's reference
    forward (block_reference.py, what parity holds the graph to) at several anchors."""
    import numpy as np
    import torch

    from specexport.exporter.distill import checkpoint
    from specexport.exporter.distill.dflash_model import DFlashDraft
    from specexport.exporter.heads.block_reference import reference_block

    out, _ = trained
    target, config, saved, ours = load_trained(out, work, DFlashDraft)
    seqs = checkpoint.read(out).sequences
    ids = seqs.ids[seqs.members(holdout=True, greedy_only=True)[0]][:40]
    with torch.no_grad():
        hidden = target.model(torch.from_numpy(ids)[None], output_hidden_states=True).hidden_states
        aux = torch.cat([hidden[t][0] for t in config["aux_hidden_state_layer_ids"]], dim=-1)  # [S, n·H]
        anchors = torch.tensor([[1, 9, 20, 36]])
        mine = ours.lm_head(ours(torch.from_numpy(ids)[None], aux[None], anchors))[0]  # [4, 3, V_d]
    tensors = {k: v.float() if v.is_floating_point() else v for k, v in saved.items()}
    states = tuple(h[0].numpy() for h in hidden)
    for row, a in enumerate(anchors[0].tolist()):
        ref, _ = reference_block("speculators", config, tensors, target.model, states, ids, a)  # [3, V_d]
        np.testing.assert_allclose(mine[row].numpy(), ref, rtol=1e-4, atol=1e-4)


def load_trained(out, base, head_class):
    """The tiny target, and the trained head read back from its checkpoint into ``head_class``
    (the training module): (target, config, saved tensors, module in eval mode)."""
    import torch
    from safetensors.torch import load_file

    from specexport.exporter.distill.dflash_model import rope_tables
    from specexport.exporter.recipe import TinySource
    from specexport.exporter.sources import load_source

    target = load_source(TinySource(**TARGET), base, "target")
    config = json.loads((out / "config.json").read_text())
    saved = load_file(str(out / "model.safetensors"))
    embed = target.model.get_input_embeddings().weight.detach()
    module = head_class(config, embed, saved["lm_head.weight"].float(), rope_tables(config, 128)).eval()
    with torch.no_grad():
        for name, param in module.checkpoint_names().items():
            param.copy_(saved[name].float())
    return target, config, saved, module


def build_with_block_parity(out, base, kind: str):
    """Build a recipe with the trained block head as drafter "distilled"; every block graph's
    parity enforced and met. Returns the engine directory and its manifest."""
    recipe = {"name": f"tiny-{kind}", "target": TARGET, "shapes": BLOCK_SHAPES,
              "drafters": [{"kind": kind, "name": "distilled", "path": str(out)}]}
    engines = build(recipe, base, base / f"engines-{kind}")
    manifest = json.loads((engines / "manifest.json").read_text())
    blocks = [e for e in manifest["engines"] if e["model"] == "distilled"]
    assert blocks and {e["role"] for e in blocks} == {"block"}
    for e in blocks:
        p = e["parity"]
        assert p["enforced"] and p["positions"] >= 20, (e["name"], p)
        assert p["max_rel_logit_diff"] <= 1e-4 and p["argmax_agreement"] == 1.0, (e["name"], p)
    return engines, manifest


@pytest.fixture(scope="module")
def pipe(trained, work):  # noqa: F811
    """The trained head built as drafter "distilled" (block parity enforced and met), loaded."""
    from specexport.runtime import load

    engines, _ = build_with_block_parity(trained[0], work, "dflash")
    return load(engines)


def test_the_checkpoint_builds_with_parity_and_decodes_losslessly(pipe):
    check_greedy_lossless(pipe, "distilled")


def check_accepted_on_held_out_prompts(pipe, out, floor: float) -> None:
    """The trained head through the decode loop, greedy at D = 3, on the run's held-out prompts:
    E[L] above ``floor`` (the run's own evaluation gives the untrained head 1.0 at step 0). A head
    whose every draft is wrong still decodes losslessly; only E[L] shows it."""
    from specexport.exporter.distill import checkpoint

    seqs = checkpoint.read(out).sequences
    prompts = [seqs.ids[i][: seqs.start[i]].tolist() for i in seqs.members(holdout=True, greedy_only=True)]
    pooled, each = acceptance_length(pipe, "distilled", prompts, draft_len=3, max_new_tokens=48)
    assert pooled > floor, f"E[L] {pooled:.2f} <= {floor} at D = 3; per prompt: {each}"


def test_the_trained_head_is_accepted(pipe, trained):
    # measured 1.32 over the 4 held-out prompts (1.70 over the 12 trained on)
    check_accepted_on_held_out_prompts(pipe, trained[0], floor=1.15)


def test_resume_continues_the_dflash_run(trained, work, tmp_path):  # noqa: F811
    import shutil

    out = tmp_path / "head"
    shutil.copytree(trained[0], out)
    code, _, err = run_cli("distill", work / "recipe.yaml", "-o", out, "--drafter", "dflash", "--resume",
                           "--max-steps", STEPS + 10, "--minutes", 30, "--quiet")
    assert code == 0, err
    record = json.loads((out / "distill.json").read_text())
    assert record["steps"] == STEPS + 10 and record["head"] == trained[1]["head"]
    assert [(r["from_step"], r["to_step"]) for r in record["runs"]] == [(0, STEPS), (STEPS, STEPS + 10)]
    code, _, err = run_cli("distill", work / "recipe.yaml", "-o", out, "--resume", "--max-steps", STEPS + 20, "--quiet")
    assert code == 2 and "holds a dflash head, not --drafter eagle3" in err, err


def test_dflash_settings_need_dflash(work, tmp_path):  # noqa: F811
    code, _, err = run_cli("distill", work / "recipe.yaml", "-o", tmp_path / "out", "--prompts",
                           work / "prompts.jsonl", "--block-size", 8)
    assert code == 2 and "DFlash settings" in err, err
