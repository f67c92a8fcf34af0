"""The example recipes for published (target, hidden-state drafter) pairs: each parses with the
recipe schema offline (the model folders need not exist), and plans the draft length the tile
rule gives on a GPU from the target's published head counts (the figures in each recipe's
comment)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from specexport.exporter.plan import plan_draft_len
from specexport.exporter.recipe import HIDDEN_STATE_KINDS, HfSource, load_recipe

EXAMPLES = Path(__file__).resolve().parents[2] / "recipes" / "examples"

# recipe -> (drafter kind, target's num_attention_heads, num_key_value_heads, tile-rule D, planned D)
# Head counts from each target's published config.json:
#   meta-llama/Llama-3.1-8B-Instruct: num_attention_heads 32, num_key_value_heads 8
#   Qwen/Qwen3-8B:                    num_attention_heads 32, num_key_value_heads 8
#   Qwen/Qwen3-4B:                    num_attention_heads 32, num_key_value_heads 8
#   Qwen/Qwen3.5-27B (text_config):   num_attention_heads 24, num_key_value_heads 4
#   deepseek-ai/DeepSeek-V3:          num_attention_heads 128, num_key_value_heads 128 (MLA: G = 1)
#   zai-org/GLM-4.5-Air:              num_attention_heads 96, num_key_value_heads 8
#   Qwen/Qwen3-Next-80B-A3B-Instruct: num_attention_heads 16, num_key_value_heads 2
# tile-rule D = floor(128 / G) - 1 with G = heads / kv heads; planned D: the recipe's max_draft cap.
EXPECTED = {
    "llama3.1-8b-eagle3.yaml": ("eagle3", 32, 8, 31, 7),
    "qwen3-8b-dflash.yaml": ("dflash", 32, 8, 31, 15),
    "qwen3-4b-dspark.yaml": ("dspark", 32, 8, 31, 6),
    "qwen3.5-27b-mtp.yaml": ("mtp", 24, 4, 20, 3),
    "deepseek-v3-mtp.yaml": ("mtp", 128, 128, 127, 3),
    "glm-4.5-air-mtp.yaml": ("mtp", 96, 8, 9, 3),
    "qwen3-next-80b-a3b-mtp.yaml": ("mtp", 16, 2, 15, 3),
}
# the MTP examples read the target's own checkpoint (no path) in the layout its MTP tensors have
MTP_LAYOUTS = {"qwen3.5-27b-mtp.yaml": "qwen3-next", "deepseek-v3-mtp.yaml": "deepseek",
               "glm-4.5-air-mtp.yaml": "deepseek", "qwen3-next-80b-a3b-mtp.yaml": "qwen3-next"}

# targets with Gated DeltaNet layers (a recurrent state beside the KV cache)
HYBRID_TARGETS = {"qwen3.5-27b-mtp.yaml", "qwen3-next-80b-a3b-mtp.yaml"}


def test_every_example_is_listed():
    assert sorted(p.name for p in EXAMPLES.glob("*.yaml")) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_example_parses_offline_with_a_hidden_state_drafter(name):
    kind, *_ = EXPECTED[name]
    recipe, base = load_recipe(EXAMPLES / name)
    assert base == EXAMPLES
    assert isinstance(recipe.target, HfSource)  # `source: hf`: the user fills in the folder
    assert not (base / recipe.target.path).exists()  # parsing needs no download
    assert [d.kind for d in recipe.drafters] == [kind] and kind in HIDDEN_STATE_KINDS
    if name in HYBRID_TARGETS:  # a recurrent state the TensorRT path does not carry: build refuses it
        assert recipe.backends == ["onnxruntime"]
    else:
        assert "tensorrt" in recipe.backends and recipe.attention == "standard"


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_example_tile_rule_draft_length(name):
    _, heads, kv_heads, tile_d, planned_d = EXPECTED[name]
    recipe, _ = load_recipe(EXAMPLES / name)
    draft = recipe.draft
    plan = plan_draft_len(heads, kv_heads, draft.tile, draft.max_draft, draft.draft_len, draft.why)
    assert plan.group_size == heads // kv_heads
    assert plan.tile_draft_len == tile_d
    assert plan.draft_len == planned_d
    assert plan.tiles == 1  # the verify pass fits one 128-row tile per KV head
    # the recipe's comment states the same figures
    text = (EXAMPLES / name).read_text()
    assert f"num_attention_heads {heads}, num_key_value_heads {kv_heads}" in text
    assert re.search(rf"G = {plan.group_size}, D = floor\(128/{plan.group_size}\) - 1 = {tile_d};", text)
    capped = rf"capped at (D = {planned_d}|the block's {planned_d} drafts) "
    assert re.search(capped + rf"\(verify T = {planned_d + 1}, {plan.tile_rows_used} tile rows\)", text)


@pytest.mark.parametrize("name", sorted(MTP_LAYOUTS))
def test_mtp_examples_read_the_targets_own_checkpoint(name):
    recipe, _ = load_recipe(EXAMPLES / name)
    (drafter,) = recipe.drafters
    assert drafter.path is None and drafter.layout == MTP_LAYOUTS[name]
