"""The runtime obeys the manifest's roles, and decodes prompts of any length >= 1.

Defect 3: a probe graph larger than the prefill chunk was picked for the prefill, because the
runtime guessed roles from token counts. Defect 1: a one-token prompt crashed (the prefill of
prompt[:-1] is empty, and the runner concatenated no pieces).
"""

from __future__ import annotations

import numpy as np
import pytest
import yaml

from specexport.bench.harness import cost_curve
from specexport.runtime import load
from tests.conftest import TINY_SHAPE, tiny_recipe, tuned_copy
from tests.runtime.fakes import MarkovRunner, random_table

DRAFTERS = ("none", "ngram", "quantized-self", "draft-model")


@pytest.fixture(scope="module")
def probe_dir(tmp_path_factory):
    """A target-only tiny build whose probe graph (24 tokens) is larger than its prefill chunk (8)."""
    from specexport.exporter.builder import build
    from specexport.progress import Reporter

    root = tmp_path_factory.mktemp("probe")
    recipe = tiny_recipe(root / "probe.yaml", name="tiny-probe", drafters=[{"kind": "ngram"}], max_seq_len=64,
                         prefill_chunk=8, max_draft=2)
    data = yaml.safe_load(recipe.read_text())
    data["draft"]["probe_tokens"] = [24]
    recipe.write_text(yaml.safe_dump(data, sort_keys=False))
    build(recipe, root / "engines", False, Reporter(quiet=True))
    return root / "engines"


def test_a_probe_larger_than_the_prefill_chunk_is_not_used_for_prefill(probe_dir):
    pipe = load(probe_dir)
    roles = {e.tokens: e.role for e in pipe.manifest.engines_of("target", "onnxruntime")}
    assert roles[24] == "probe" and roles[8] == "prefill"
    assert pipe.target.decoding_sizes == [1, 3, 8] and not pipe.target.is_open(24)
    # the prefill of a 20-token prompt runs in prefill chunks, never through the probe graph
    for remaining in (8, 9, 19, 24, 40):
        assert pipe.target.engine_size(remaining) != 24, remaining
    baseline = pipe.generate(prompt_ids=list(range(3, 23)), max_new_tokens=6)
    assert not pipe.target.is_open(24), "decoding opened a probe graph"
    # the bench's cost curve (and calibration, through the same call) still times the probe
    assert [point["tokens"] for point in cost_curve(pipe, repeats=1)] == pipe.target.sizes == [1, 3, 8, 24]
    assert pipe.target.is_open(24)
    again = pipe.generate(prompt_ids=list(range(3, 23)), max_new_tokens=6)
    assert again.token_ids == baseline.token_ids


def test_adaptive_depth_never_prices_a_verify_at_a_probes_cost(probe_dir, tmp_path):
    """A probe measured cheap (noise, or a graph the machine likes) is no verify price: the
    probe never runs in a round. Standard graphs: a round at depth 1 runs the nearest static
    entry holding 2 tokens (3), and is priced at it."""
    costs = {"decode": 3.0, "verify": 5.0, "prefill": 20.0, "probe": 0.5}  # a verify: less than 2 decodes
    tuned = tuned_copy(probe_dir, tmp_path / "engines", lambda entry: costs[entry.role.value])
    pipe = load(tuned)
    verify = {e.tokens for e in pipe.manifest.engines_of("target", "onnxruntime") if e.role == "verify"}
    assert verify == {3} and pipe.target.engine_size(2) == 3
    policy = pipe.costs.depth_policy(pipe.drafter("ngram"), pipe.target)
    assert policy.verify_cost(1) == pytest.approx(costs["decode"] / 1e3)
    for tokens in (2, 3):
        assert policy.verify_cost(tokens) == pytest.approx(costs["verify"] / 1e3), tokens


@pytest.mark.parametrize("attention", ["standard", "ort-gqa"])
def test_a_one_token_prompt_decodes_with_every_drafter(tiny_engines, attention):
    pipe = load(tiny_engines.get("llama", attention=attention, **TINY_SHAPE))
    for token in (5, 72):
        baseline = pipe.generate(prompt_ids=[token], drafter="none", max_new_tokens=12)
        assert len(baseline.token_ids) == 12
        for drafter in DRAFTERS[1:]:
            result = pipe.generate(prompt_ids=[token], drafter=drafter, max_new_tokens=12)
            assert result.token_ids == baseline.token_ids, (attention, drafter, token)


def test_an_empty_forward_is_a_no_op_in_the_real_runner_and_the_fake(tiny_engines):
    pipe = load(tiny_engines.get("llama", **TINY_SHAPE))
    fake = MarkovRunner(random_table(8, seed=0))
    for runner in (pipe.target, fake):
        runner.cache.set_length(0)
        calls = runner.calls
        for want_logits in (False, True):
            out = runner.forward(np.zeros(0, dtype=np.int64), want_logits)
            assert out.next_tokens.shape == (0,) and out.next_tokens.dtype == np.int64
            assert (out.logits is None) if not want_logits else out.logits.shape[0] == 0
        assert runner.length == 0 and runner.calls == calls, type(runner).__name__
