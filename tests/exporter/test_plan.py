import json

import pytest
import yaml

from specexport.errors import BadInput
from specexport.exporter.plan import plan_draft_len
from tests.conftest import REPO, run_cli, tiny_recipe


@pytest.mark.parametrize(
    "heads, kv, tile_d",
    [(9, 3, 41), (32, 8, 31), (32, 32, 127), (16, 2, 15), (64, 8, 15), (28, 4, 17), (40, 8, 24)],
)
def test_tile_rule(heads, kv, tile_d):
    plan = plan_draft_len(heads, kv, tile=128)
    g = heads // kv
    assert plan.group_size == g
    assert plan.tile_draft_len == tile_d == 128 // g - 1
    assert plan.draft_len == tile_d
    assert plan.tokens_per_verify == tile_d + 1
    assert plan.tile_rows_used == g * (tile_d + 1) <= 128
    assert plan.tiles == 1
    assert not plan.warnings


def test_multi_head_attention_has_group_one():
    plan = plan_draft_len(12, None)
    assert plan.group_size == 1 and plan.tile_draft_len == 127


def test_cap_and_override():
    capped = plan_draft_len(9, 3, max_draft=7, why="measured")
    assert capped.draft_len == 7 and capped.tile_draft_len == 41
    assert "capped by draft.max_draft = 7" in capped.reason and "measured" in capped.reason
    # a cap above the tile rule does not raise D
    assert plan_draft_len(9, 3, max_draft=100).draft_len == 41


def test_override_warns_past_a_partial_tile():
    plan = plan_draft_len(32, 8, draft_len=40)  # G=4: 4*41 = 164 rows, 1.28 tiles
    assert plan.draft_len == 40 and plan.tiles == 2
    assert any("not a multiple" in w for w in plan.warnings)
    exact = plan_draft_len(32, 8, draft_len=63)  # 4*64 = 256 rows = 2 full tiles
    assert exact.tiles == 2 and not exact.warnings


def test_group_filling_a_tile_uses_one_draft():
    plan = plan_draft_len(128, 1, tile=128)
    assert plan.tile_draft_len == 0 and plan.draft_len == 1 and plan.warnings


def test_heads_not_divisible():
    with pytest.raises(BadInput, match="not a multiple"):
        plan_draft_len(10, 3)


def test_plan_command_json_for_tiny(tmp_path):
    recipe = tiny_recipe(tmp_path / "r.yaml", "llama", num_attention_heads=8, num_key_value_heads=2,
                         max_draft=5)
    code, out, err = run_cli("plan", recipe, "--json")
    assert code == 0, err
    plan = json.loads(out)
    assert plan["group_size"] == 4 and plan["tile_draft_len"] == 31 and plan["draft_len"] == 5
    assert plan["tokens_per_verify"] == 6 and plan["tile_rows_used"] == 24
    assert "capped" in plan["reason"]


def test_default_recipe_plan():
    pytest.importorskip("gguf")
    code, out, err = run_cli("plan", REPO / "recipes" / "smollm2-135m.yaml", "--json")
    assert code == 0, err
    plan = json.loads(out)
    assert (plan["group_size"], plan["tile"], plan["tile_draft_len"]) == (3, 128, 41)
    # the recipe takes D from its committed calibration file (max_draft = 7 without it)
    calibrated = json.loads((REPO / "recipes" / "smollm2-135m.calibration.json").read_text())["draft_len"]
    assert plan["draft_len"] == calibrated and plan["tokens_per_verify"] == calibrated + 1
    assert "smollm2-135m.calibration.json" in plan["reason"] and "calibrated on this machine" in plan["reason"]


def test_missing_calibration_file_falls_back_to_max_draft(tmp_path):
    import yaml

    recipe = yaml.safe_load((REPO / "recipes" / "smollm2-135m.yaml").read_text())
    recipe["target"] = {"source": "tiny", "arch": "llama", "hidden_size": 96, "num_attention_heads": 6,
                        "num_key_value_heads": 2}
    recipe["draft"]["calibration"] = "missing.calibration.json"
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe))
    code, out, err = run_cli("plan", path, "--json")
    assert code == 0, err
    plan = json.loads(out)
    assert plan["draft_len"] == 7 and "max_draft" in plan["reason"]
    assert any("missing.calibration.json not found" in w for w in plan["warnings"])


def test_plan_human_output(tmp_path):
    code, out, _ = run_cli("plan", tiny_recipe(tmp_path / "r.yaml"))
    assert code == 0 and "tile rule" in out and "draft length" in out


def test_plan_says_which_drafters_decode_trees(tmp_path):
    recipe = yaml.safe_load(tiny_recipe(tmp_path / "base.yaml", drafters=[{"kind": "ngram"}]).read_text())
    recipe["draft"]["tree"] = {"max_nodes": 4, "drafters": []}
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
    code, out, _ = run_cli("plan", tmp_path / "r.yaml", "--json")
    assert code == 0 and json.loads(out)["tree_drafters"] == []
    code, out, _ = run_cli("plan", tmp_path / "r.yaml")
    assert code == 0 and "trees by default for none" in " ".join(out.split())
