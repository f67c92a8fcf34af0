"""Build-time validation: every fp32 graph of every model must match transformers, or no build.

The limits come from one table (exporter/validate.py TOLERANCES); these tests take their numbers
from it, so they follow the table instead of repeating it.
"""

import numpy as np
import onnx
import pytest
import yaml

from specexport.errors import SpecexportError
from specexport.exporter.validate import TOLERANCES, Parity, check_parity
from tests.conftest import run_cli
from tests.exporter.hf_dirs import save_tiny_hf

FP32 = TOLERANCES["fp32"]
SCALE = 20.0  # the largest |reference logit| in the synthetic logits below


def _flipped(margin: float, shift: float, positions: int = 4, vocab: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """Reference logits [T, V] whose position 1 has top-2 margin ``margin``, and graph logits that
    move those two by ``shift`` each way (flipping the argmax when shift > margin / 2)."""
    rng = np.random.default_rng(0)
    want = rng.uniform(-SCALE / 2, SCALE / 2, (positions, vocab)).astype(np.float64)  # [T, V]
    want[:, 0] = SCALE
    want[1, 1] = SCALE - margin
    got = want.copy()
    got[1, 0] -= shift
    got[1, 1] += shift
    return got, want


def _figures(got: np.ndarray, want: np.ndarray, next_tokens: np.ndarray | None = None) -> dict:
    parity = Parity()
    parity.add(got, want, got.argmax(-1) if next_tokens is None else next_tokens)
    return parity.to_dict()


def test_near_tie_disagreement_is_tolerated():
    margin = FP32.near_tie_rtol * SCALE / 2  # below the near-tie limit
    got, want = _flipped(margin, shift=margin)
    figures = _figures(got, want)
    assert figures["argmax_agreement"] == 0.75  # the flip is really there: 3 of 4 positions agree
    applied = check_parity("target.decode.b1.t1", figures, "fp32")
    assert applied["enforced"] is True
    assert applied["near_tie_margin_limit"] == pytest.approx(FP32.near_tie_rtol * SCALE)


def test_clear_margin_disagreement_fails_even_within_the_logit_limit():
    # margin above the near-tie limit, but each logit moves by less than the logit limit: only
    # the argmax rule can catch it
    tie_limit, logit_limit = FP32.near_tie_rtol * SCALE, FP32.logit_rtol * SCALE
    margin = (tie_limit + 2 * logit_limit) / 2
    shift = margin / 2 * 1.01
    assert shift < logit_limit and margin > tie_limit
    figures = _figures(*_flipped(margin, shift))
    assert figures["max_abs_logit_diff"] <= logit_limit
    with pytest.raises(SpecexportError, match=r"target\.verify\.b1\.t5 \(fp32.*top-2 margin") as err:
        check_parity("target.verify.b1.t5", figures, "fp32")
    assert f"{margin:.3g}" in str(err.value) and f"{tie_limit:.3g}" in str(err.value)
    assert "\n" not in str(err.value)


def test_logit_difference_over_the_limit_fails_naming_value_and_limit():
    limit = FP32.logit_rtol * SCALE
    got, want = _flipped(margin=1.0, shift=0.0)
    got[2, 5] += 3 * limit  # no argmax change: the logit rule alone fails it
    figures = _figures(got, want)
    assert figures["argmax_agreement"] == 1.0
    with pytest.raises(SpecexportError, match=r"draft\.prefill\.b1\.t16 \(fp32.*max \|Δlogit\|") as err:
        check_parity("draft.prefill.b1.t16", figures, "fp32")
    assert f"{3 * limit:.3g}" in str(err.value) and f"limit {limit:.3g}" in str(err.value)


def test_nan_logits_fail():
    got, want = _flipped(margin=1.0, shift=0.0)
    got[3, 7] = np.nan
    with pytest.raises(SpecexportError, match="nan"):
        check_parity("target.decode.b1.t1", _figures(got, want), "fp32")


def test_in_graph_argmax_must_match_its_logits():
    got, want = _flipped(margin=1.0, shift=0.0)
    wrong = got.argmax(-1)
    wrong[0] += 1
    with pytest.raises(SpecexportError, match="next_tokens"):
        check_parity("target.decode.b1.t1", _figures(got, want, wrong), "fp32")


def test_int4_figures_are_recorded_not_enforced():
    got, want = _flipped(margin=1.0, shift=2.0)  # a clear flip and a large difference
    with pytest.raises(SpecexportError):
        check_parity("quantized-self.decode.b1.t1", _figures(got, want), "fp32")
    assert check_parity("quantized-self.decode.b1.t1", _figures(got, want), "int4") == {
        "precision": "int4", "enforced": False}


def test_lower_precisions_are_looser_than_fp32():
    assert FP32.logit_rtol < TOLERANCES["fp16"].logit_rtol <= TOLERANCES["bf16"].logit_rtol
    assert FP32.near_tie_rtol < TOLERANCES["fp16"].near_tie_rtol <= TOLERANCES["bf16"].near_tie_rtol


# -- whole builds of non-tiny (local transformers) models -----------------------------------------

def _hf_recipe(tmp_path, drafter_dir=None, **validation) -> object:
    recipe = {
        "name": "local",
        "target": {"source": "hf", "path": "target-hf"},
        "drafters": [{"kind": "model", "name": "small", "model": {"source": "hf", "path": drafter_dir.name}}]
        if drafter_dir else [{"kind": "ngram"}],
        "shapes": {"max_seq_len": 32, "prefill_chunk": 4},  # 1+D: the fewest graphs
        "draft": {"max_draft": 3},
    }
    if validation:
        recipe["validation"] = validation
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


@pytest.fixture(scope="module")
def target_hf(tmp_path_factory):
    return save_tiny_hf(tmp_path_factory.mktemp("hf") / "target-hf", "llama", seed=3)


def _assert_failed_cleanly(code, err, tmp_path, *needles):
    lines = [line for line in err.strip().splitlines() if line.startswith("specexport: error:")]
    assert code == 1 and len(lines) == 1, err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert not (tmp_path / "engines").exists()  # nothing half-written: no directory,
    assert not list(tmp_path.glob(".engines.*"))  # and no partial one left beside it


def test_broken_exported_graph_of_a_real_model_fails_its_validation(target_hf, tmp_path):
    """Export a local transformers model step by step, corrupt one weight of the exported
    graphs (as a wrong export would), and validate: the step must fail naming the graph."""
    from specexport.exporter.builder import Builder, target_graphs
    from specexport.exporter.recipe import load_recipe
    from specexport.progress import Reporter

    (tmp_path / "target-hf").symlink_to(target_hf)
    recipe, base = load_recipe(_hf_recipe(tmp_path))
    builder = Builder(recipe, base, tmp_path / "engines", Reporter(quiet=True))
    target, _ = builder.load()
    work = tmp_path / "work"
    work.mkdir()
    builder.export_model(work, "target", "target", target, target_graphs(recipe, builder.plan(target)))

    graph = onnx.load(str(work / "target.decode.b1.t1.onnx"), load_external_data=False)
    tensor = next(t for t in graph.graph.initializer if "layers.0" in t.name and t.external_data)
    offset = int(next(e.value for e in tensor.external_data if e.key == "offset"))
    with open(work / "target.weights", "r+b") as fh:  # one float32 of that tensor, + 4
        fh.seek(offset)
        value = np.frombuffer(fh.read(4), dtype=np.float32)[0]
        fh.seek(offset)
        fh.write(np.float32(value + 4.0).tobytes())

    with pytest.raises(SpecexportError, match=r"validation failed for target\.\w+\.b1\.t\d+ \(fp32.*max \|Δlogit\|"):
        builder.validate("target", target, "fp32")


def test_real_model_build_fails_when_a_drafter_model_is_broken(target_hf, tmp_path):
    # a NaN in one weight of the draft model: transformers and the graph both give NaN logits,
    # which must fail the drafter's validation, not pass as "no difference"
    from safetensors.numpy import load_file, save_file

    (tmp_path / "target-hf").symlink_to(target_hf)
    drafter = save_tiny_hf(tmp_path / "drafter-hf", "llama", seed=4, num_layers=1)
    weights = load_file(drafter / "model.safetensors")
    name = next(k for k in sorted(weights) if "mlp.down_proj" in k)
    weights[name] = weights[name].copy()
    weights[name].flat[0] = np.nan
    save_file(weights, drafter / "model.safetensors", metadata={"format": "pt"})
    code, _, err = run_cli("build", _hf_recipe(tmp_path, drafter), "-o", tmp_path / "engines")
    _assert_failed_cleanly(code, err, tmp_path, "validation failed for small.", "(fp32", "nan", "limit")


def test_real_model_build_applies_the_recipe_limits(target_hf, tmp_path):
    # A build under an impossible limit fails: the limits really apply to a non-tiny source.
    # That they are enforced by default, and met: tests/exporter/test_build.py
    # test_local_transformers_directory_builds_offline (a whole build of a local directory).
    (tmp_path / "target-hf").symlink_to(target_hf)
    tight = 1e-12
    code, _, err = run_cli("build", _hf_recipe(tmp_path, max_abs_logit_diff=tight), "-o", tmp_path / "other")
    lines = [line for line in err.splitlines() if line.startswith("specexport: error:")]
    assert code == 1 and len(lines) == 1, err
    assert "validation failed for target." in lines[0] and f"limit {tight:.3g}" in lines[0]
    assert not (tmp_path / "other").exists() and not list(tmp_path.glob(".other.*"))
