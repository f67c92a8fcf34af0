"""Targets with linear-attention layers (Qwen3-Next, Qwen3.5) through build and the runtime:
the manifest's recurrent state, exact sampling over it, and the one-line refusal of what
does not carry a recurrent state yet (TensorRT). Batched: tests/runtime/test_batch_hybrid.py.

Parity against transformers and greedy losslessness for every drafter run through the shared
builds of tests/exporter/test_archs.py and tests/runtime/test_pipeline.py (LOSSLESS_PAIRS)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import yaml

from specexport.runtime import load
from specexport.runtime.acceptance import Sampling
from tests.conftest import TINY_SHAPE, check_one_line, tiny_recipe
from tests.lossless import assert_sampled_as_target, exact_sequence_probs, residual_is_q, rules, use_rule
from tests.scaffold import run_on_fake_gpu


def test_the_manifest_holds_the_recurrent_state_beside_the_attention_layers_cache(tiny_engines):
    engines = tiny_engines.for_arch("qwen3_next", "ort-gqa")
    target = json.loads((engines / "manifest.json").read_text())["models"]["target"]
    types = target["layer_types"]
    assert "linear_attention" in types and "full_attention" in types
    assert target["kv"]["num_layers"] == types.count("full_attention")
    state = target["state"]
    assert state["num_layers"] == types.count("linear_attention")
    # the tiny config (exporter/tiny.py): 2 key heads, 4 value heads of 16, a kernel of 4
    assert (state["heads"], state["key_dim"], state["value_dim"], state["conv_kernel"]) == (4, 16, 16, 4)
    assert state["conv_channels"] == 2 * 2 * 16 + 4 * 16  # q, k and v channels
    pipe = load(engines)
    assert pipe.manifest.models["target"].state is not None
    verify = next(e for e in pipe.manifest.engines if e.model == "target" and e.role == "verify")
    assert verify.outputs["present_state.0.recurrent"].shape == (1, verify.tokens, 4, 16, 16)


@pytest.mark.parametrize("rule", rules(residual_is_q))
def test_sampled_tokens_follow_the_target_over_a_recurrent_state(tiny_engines, rule, monkeypatch):
    # the int4 copy of the target drafts (a recurrent model itself, rewound after each round):
    # its drafts are mostly kept, so rejections come after accepted drafts and the target's state
    # is selected at several depths; three tokens' exact distribution from target-alone logits.
    # The control: the same draws with the replacement token drawn from q must fail.
    pipe = load(tiny_engines.for_arch("qwen3_5", "standard"))
    sampling = Sampling(temperature=1.3, top_k=3)
    ids = pipe.prompt_ids("1, 2, 1, 2, 1, 2, 1,")
    exact = exact_sequence_probs(pipe, ids, sampling, 3)
    draws = 600
    use_rule(monkeypatch, rule)
    counts: dict[tuple[int, ...], int] = {}
    kept_two = 0
    for seed in range(draws):
        result = pipe.generate(prompt_ids=ids, drafter="quantized-self", max_new_tokens=3, temperature=1.3,
                               top_k=3, seed=seed, adaptive=False)
        key = tuple(result.token_ids)
        counts[key] = counts.get(key, 0) + 1
        kept_two += result.stats.accepted >= 2
    if rule is None:
        assert set(counts) <= set(exact), f"{set(counts) - set(exact)} are outside the target's top-k support"
        assert kept_two > 0, "no round kept two drafts"
    assert_sampled_as_target(counts, exact, draws, right_rule=rule is None)


def test_a_recurrent_target_built_for_batch_one_decodes_its_prompts_in_turn(tiny_engines):
    """One slot: prompts take it in turn, each decoding as generate does (batched graphs:
    tests/runtime/test_batch_hybrid.py)."""
    pipe = load(tiny_engines.for_arch("qwen3_5", "standard"))
    prompts = [[5, 6, 7, 5, 6, 7, 5], [9, 10, 11], [12, 13, 14, 15, 12, 13]]
    together = pipe.generate_batch(prompts, drafter="ngram", max_new_tokens=8, adaptive=False)
    assert pipe.batched_target().slots == 1
    assert [g.token_ids for g in together] == [pipe.generate(prompt_ids=p, drafter="ngram", max_new_tokens=8,
                                                             adaptive=False).token_ids for p in prompts]


@pytest.mark.parametrize("attention, change, says", [
    ("standard", {"backends": ["onnxruntime", "tensorrt"]}, "use backends: [onnxruntime]"),
])
def test_build_refuses_what_does_not_carry_a_recurrent_state_yet(tmp_path, attention, change, says):
    path = tiny_recipe(tmp_path / "r.yaml", "qwen3_next", attention=attention, **TINY_SHAPE)
    recipe = yaml.safe_load(path.read_text())
    for key, value in change.items():
        recipe[key] = {**recipe[key], **value} if isinstance(value, dict) else value
    path.write_text(yaml.safe_dump(recipe))
    # TensorRT's stand-in (tests/fake_gpu) in a child interpreter, so the build gets past its
    # check that TensorRT is installed
    done = run_on_fake_gpu(["-m", "specexport", "build", path, "-o", tmp_path / "engines"], timeout=300)
    check_one_line(done.returncode, done.stderr, says, "linear-attention")
    assert not (tmp_path / "engines").exists()
    assert not np.any([p.name.startswith(".engines") for p in tmp_path.iterdir()])  # no temporary left
