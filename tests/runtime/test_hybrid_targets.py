"""Targets with linear-attention layers (Qwen3-Next, Qwen3.5) through build and the runtime:
the manifest's recurrent state, exact sampling over it, and the one-line refusals of what
does not carry a recurrent state yet (batched graphs, TensorRT, the batched loop).

Parity against transformers and greedy losslessness for every drafter run through the shared
builds of tests/exporter/test_archs.py and tests/runtime/test_pipeline.py (LOSSLESS_PAIRS)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from specexport.errors import BadInput
from specexport.runtime import load
from specexport.runtime.acceptance import Sampling
from tests.conftest import TINY_SHAPE, tiny_recipe
from tests.lossless import chi_square_passes, exact_sequence_probs

REPO = Path(__file__).resolve().parents[2]
FAKE_GPU = REPO / "tests" / "fake_gpu"


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


def test_sampled_tokens_follow_the_target_over_a_recurrent_state(tiny_engines):
    # the int4 copy of the target drafts (a recurrent model itself, rewound after each round):
    # its drafts are mostly kept, so rejections come after accepted drafts and the target's state
    # is selected at several depths; three tokens' exact distribution from target-alone logits
    pipe = load(tiny_engines.for_arch("qwen3_5", "standard"))
    sampling = Sampling(temperature=1.3, top_k=3)
    ids = pipe.prompt_ids("1, 2, 1, 2, 1, 2, 1,")
    exact = exact_sequence_probs(pipe, ids, sampling, 3)
    draws = 600
    counts: dict[tuple[int, ...], int] = {}
    kept_two = 0
    for seed in range(draws):
        result = pipe.generate(prompt_ids=ids, drafter="quantized-self", max_new_tokens=3, temperature=1.3,
                               top_k=3, seed=seed, adaptive=False)
        key = tuple(result.token_ids)
        assert key in exact, f"{key} is outside the target's top-k support"
        counts[key] = counts.get(key, 0) + 1
        kept_two += result.stats.accepted >= 2
    assert kept_two > 0, "no round kept two drafts"
    passes, figures = chi_square_passes(counts, exact, draws)
    assert passes, figures


def test_the_batched_loop_refuses_a_recurrent_target_in_one_line(tiny_engines):
    pipe = load(tiny_engines.for_arch("qwen3_5", "standard"))
    with pytest.raises(BadInput, match="linear-attention layers") as refused:
        pipe.batch_loop()
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("attention, change, says", [
    ("ort-gqa", {"shapes": {"batch": [1, 2]}}, "use shapes.batch: [1]"),
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
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(FAKE_GPU), str(REPO)])}
    done = subprocess.run([sys.executable, "-m", "specexport", "build", str(path), "-o", str(tmp_path / "engines")],
                          capture_output=True, text=True, env=env, timeout=300)
    code, out, err = done.returncode, done.stdout, done.stderr
    assert code == 2, (out, err)
    errors = [line for line in err.splitlines() if line.startswith("specexport: error:")]
    assert len(errors) == 1 and says in errors[0] and "linear-attention" in errors[0], err
    assert "Traceback" not in err
    assert not (tmp_path / "engines").exists()
    assert not np.any([p.name.startswith(".engines") for p in tmp_path.iterdir()])  # no temporary left
