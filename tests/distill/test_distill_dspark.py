"""`specexport distill --drafter dspark` on the tiny target of test_distill.py: a seconds-long
run must lower the held-out loss and raise held-out acceptance over the untrained head, and its
confidence head must tell right drafts from wrong ones; the training forward (block, Markov and
confidence heads) is the build's reference math on the same weights; the output is a speculators
DSpark checkpoint that builds with enforced parity, decodes losslessly and whose drafts are
accepted (an E[L] floor on the held-out prompts)."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_cli
from tests.distill.test_distill import TARGET, TOPICS, check_training_gain, command, work  # noqa: F401 (work: the shared fixture)
from tests.distill.test_distill_dflash import (
    build_with_block_parity,
    check_accepted_on_held_out_prompts,
    load_trained,
)
from tests.heads.common import check_greedy_lossless

STEPS = 150
# three times test_distill.py's prompts: on its 16 the head overfits the few training responses and
# the confidence head, calibrated on them, is overconfident on the 4 held out (one generate call either way)
TOPICS = TOPICS + ["gardens", "trains", "volcanoes", "honey", "maps", "bridges", "winter", "a violin", "owls",
                   "deserts", "soap", "glass", "kites", "salt", "thunder", "a library", "bees", "ice", "candles",
                   "forests", "coffee", "stars", "a bicycle", "whales", "clouds", "cheese", "mountains", "a letter",
                   "wolves", "sand", "rope", "islands"]


@pytest.fixture(scope="module")
def trained(work):  # noqa: F811
    out = work / "dspark"
    prompts = work / "prompts-dspark.jsonl"
    prompts.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Tell me about {t}."}]}) + "\n"
                               for t in TOPICS))
    proc = command(work / "recipe.yaml", "-o", out, "--drafter", "dspark", "--prompts", prompts,
                   "--data", work / "data.jsonl", "--max-steps", STEPS, "--max-new", 48, "--holdout", 0.25,
                   "--warmup", 10, "--batch-tokens", 1024, "--lr", 3e-3, "--markov-rank", 16, "--minutes", 30,
                   "--eval-minutes", 60)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err
    return out, json.loads((out / "distill.json").read_text())


def test_training_lowers_the_loss_and_raises_acceptance(trained):
    before, after = check_training_gain(trained[1], loss_ratio=0.5)
    assert sum(after["acceptance"]) > sum(before["acceptance"]) + 0.5, (before, after)
    assert len(after["acceptance"]) == 3 and after["block_size"] == 3  # D = 3: the anchor slot drafts too


def test_the_confidence_head_tells_right_drafts_from_wrong(trained):
    """Untrained, conf is 0.5 everywhere; trained, the slots the runtime reaches that were right
    get a clearly higher mean confidence than those that were wrong, and the BCE falls."""
    _, record = trained
    before, after = record["curve"][0]["confidence"], record["final"]["confidence"]
    assert before["right"] == before["wrong"] == 0.5, before
    assert after["slots"] > 300 and after["right"] is not None and after["wrong"] is not None, after
    assert after["right"] > after["wrong"] + 0.05, after
    assert after["bce"] < before["bce"], (before, after)


def test_the_output_is_a_speculators_dspark_checkpoint(trained):
    out, record = trained
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "distill.json", "model.safetensors", "state"]
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "dspark" and config["block_size"] == 3
    assert config["sample_from_anchor"] is True and config["markov_head_type"] == "vanilla"
    assert config["markov_rank"] == record["head"]["markov_rank"] == 16
    assert config["enable_confidence_head"] is True and config["confidence_head_with_markov"] is True
    assert config["aux_hidden_state_layer_ids"] == record["taps"] == [1, 2, 3]
    assert config["mask_token_id"] == record["head"]["mask_token_id"]
    assert record["drafter"] == "dspark" and record["layout"] == "speculators" and record["draft_len"] == 3
    assert record["head"]["gamma"] == 1.5 and record["head"]["draft_layers"] == 1


def test_the_training_forward_is_the_reference(trained, work):  # noqa: F811
    """The trained module, read back from model.safetensors, gives the build's reference (the
    block of block_reference.py, then its serial Markov/confidence refinement) and the runtime's
    numpy heads at several anchors, each slot fed the token the reference drafted before it."""
    import numpy as np
    import torch

    from specexport.exporter.distill import checkpoint
    from specexport.exporter.distill.dspark_model import DSparkDraft
    from specexport.exporter.heads.block_reference import reference_block, reference_markov
    from specexport.runtime.block_drafter import BlockHeads

    out, _ = trained
    target, config, saved, ours = load_trained(out, work, DSparkDraft)
    d2t = (torch.arange(len(saved["d2t"])) + saved["d2t"]).numpy()
    tensors = {k: v.float() if v.is_floating_point() else v for k, v in saved.items()}
    arrays = {"markov_w1": tensors["markov_head.markov_w1.weight"].numpy(),
              "markov_w2": tensors["markov_head.markov_w2.weight"].numpy(),
              "confidence_w": tensors["confidence_head.proj.weight"][0].numpy(),
              "confidence_b": tensors["confidence_head.proj.bias"].numpy(), "d2t": d2t}
    numpy_heads = BlockHeads(arrays, "vanilla", True)
    seqs = checkpoint.read(out).sequences
    ids = seqs.ids[seqs.members(holdout=True, greedy_only=True)[0]][:40]
    anchors = [1, 9, 20, 36]
    with torch.no_grad():
        hidden = target.model(torch.from_numpy(ids)[None], output_hidden_states=True).hidden_states
        aux = torch.cat([hidden[t][0] for t in config["aux_hidden_state_layer_ids"]], dim=-1)  # [S, n·H]
        block = ours(torch.from_numpy(ids)[None], aux[None], torch.tensor([anchors]))[0]  # [4, 3, H]
    states = tuple(h[0].numpy() for h in hidden)
    checked_conf = []
    for row, a in enumerate(anchors):
        base, ref_hidden = reference_block("speculators", config, tensors, target.model, states, ids, a)  # [3, V_d]
        np.testing.assert_allclose(block[row].numpy(), ref_hidden, rtol=1e-4, atol=1e-4)
        want, drafted, conf = reference_markov(config, tensors, base, ref_hidden, int(ids[a]), d2t)
        prev = torch.tensor([int(ids[a]), *drafted[:-1].tolist()])  # [3]: the anchor, then the drafts
        with torch.no_grad():
            mine = ours.draft_logits(block[row], prev).numpy()  # [3, V_d]
            mine_conf = torch.sigmoid(ours.confidence_logit(block[row], prev)).numpy()  # [3]
        np.testing.assert_allclose(mine, want, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(mine_conf, conf, rtol=1e-4, atol=1e-4)
        for k in range(3):
            logits, confidence = numpy_heads.step(base[k], ref_hidden[k], int(prev[k]))
            np.testing.assert_allclose(mine[k], logits, rtol=1e-4, atol=1e-4)
            assert abs(mine_conf[k] - confidence) < 1e-4
        checked_conf += conf.tolist()
    assert np.ptp(checked_conf) > 1e-3, checked_conf  # the confidence head is not constant here


@pytest.fixture(scope="module")
def built(trained, work):  # noqa: F811
    """The trained head built as drafter "distilled" (block parity enforced and met): its
    manifest and the loaded pipeline."""
    from specexport.runtime import load

    engines, manifest = build_with_block_parity(trained[0], work, "dspark")
    return manifest, load(engines)


def test_the_checkpoint_builds_with_parity_and_decodes_losslessly(built):
    manifest, pipe = built
    drafter = next(d for d in manifest["drafters"] if d["name"] == "distilled")
    assert drafter["params"]["markov"] == "vanilla" and drafter["params"]["confidence_with_markov"], drafter
    check_greedy_lossless(pipe, "distilled")


def test_the_trained_head_is_accepted(built, trained):
    # measured 1.61 over the 11 held-out prompts (1.68 over the 37 trained on)
    check_accepted_on_held_out_prompts(built[1], trained[0], floor=1.3)


def test_the_markov_rank_needs_dspark(work, tmp_path):  # noqa: F811
    code, _, err = run_cli("distill", work / "recipe.yaml", "-o", tmp_path / "out", "--prompts",
                           work / "prompts.jsonl", "--markov-rank", 8)
    assert code == 2 and "--markov-rank is a DSpark setting" in err, err
