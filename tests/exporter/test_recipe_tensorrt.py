"""The recipe's `tensorrt:` section: the builder settings trt_build reads, validated."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from specexport.errors import BadInput
from specexport.exporter.recipe import load_recipe
from specexport.exporter.trt_build import DEFAULT_WORKSPACE_MB, TrtBuildOptions

REPO = Path(__file__).resolve().parents[2]


def recipe_with(tmp_path: Path, **extra) -> Path:
    data = yaml.safe_load((REPO / "recipes" / "tiny-llama.yaml").read_text())
    data.update(extra)
    path = tmp_path / "trt.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_the_section_is_read_by_the_tensorrt_build(tmp_path):
    section = {"workspace_mb": 2048, "builder_optimization_level": 5, "timing_cache_dir": "caches",
               "parity": "record"}
    recipe, _ = load_recipe(recipe_with(tmp_path, tensorrt=section, precision="fp16"))
    opts = TrtBuildOptions.from_recipe(recipe)
    assert (opts.precision, opts.workspace_mb, opts.optimization_level, opts.enforce_parity) == ("fp16", 2048, 5, False)
    assert opts.timing_cache_folder(tmp_path) == tmp_path / "caches"
    assert opts.timing_cache_folder(tmp_path) != TrtBuildOptions().timing_cache_folder(tmp_path / "x")
    # the command line wins over the recipe
    assert TrtBuildOptions.from_recipe(recipe, "bf16", 512).precision == "bf16"
    assert TrtBuildOptions.from_recipe(recipe, "bf16", 512).workspace_mb == 512


def test_defaults_without_the_section(tmp_path):
    recipe, _ = load_recipe(recipe_with(tmp_path))
    opts = TrtBuildOptions.from_recipe(recipe)
    assert (opts.workspace_mb, opts.optimization_level, opts.enforce_parity) == (DEFAULT_WORKSPACE_MB, 3, True)
    assert opts.timing_cache_folder(tmp_path) == tmp_path
    assert TrtBuildOptions(timing_cache_dir=Path("/abs")).timing_cache_folder(tmp_path) == Path("/abs")


@pytest.mark.parametrize("section, field, says", [
    ({"workspace_mb": 0}, "tensorrt.workspace_mb", "greater than or equal to 1"),
    ({"workspace_mb": "lots"}, "tensorrt.workspace_mb", "valid integer"),
    ({"builder_optimization_level": 6}, "tensorrt.builder_optimization_level", "less than or equal to 5"),
    ({"parity": "maybe"}, "tensorrt.parity", "'enforce' or 'record'"),
    ({"workspace_gb": 4}, "tensorrt.workspace_gb", "unknown key"),
    ({"cuda_graphs": True}, "tensorrt.cuda_graphs", "unknown key"),  # a runtime option, not the build's
    ("fast", "tensorrt", "valid dictionary"),
])
def test_bad_values_are_one_line_naming_the_field(tmp_path, section, field, says):
    path = recipe_with(tmp_path, tensorrt=section)
    with pytest.raises(BadInput) as err:
        load_recipe(path)
    message = str(err.value)
    assert message.startswith(f"{path}: {field}: ") and says in message, message
    assert "\n" not in message and err.value.exit_code == 2
