"""Build-time parity of a TensorRT engine with its ONNX graph, the comparison alone: fake
engines (callables) against a reference, since no TensorRT runs here. exporter/trt_parity.py's
TrtPlanRunner, the one piece that needs a GPU, is only type-checked (tests/test_mypy_tensorrt.py)."""

from __future__ import annotations

import numpy as np
import pytest

from specexport.contract import Manifest
from specexport.errors import SpecexportError
from specexport.exporter.trt_parity import check, compare, onnx_runner, parity_feeds, parity_record
from specexport.exporter.validate import TOLERANCES, cache_lengths
from tests.conftest import TINY_SHAPE


@pytest.fixture(scope="module")
def verify_graph(tiny_engines):
    root = tiny_engines.get("llama", **TINY_SHAPE)  # the session's shared tiny llama build
    entry = next(e for e in Manifest.load(root).engines_of("target", "onnxruntime") if e.role == "verify")
    return entry, root / entry.path


def fixed(logits: np.ndarray, next_tokens: np.ndarray | None = None):
    """An engine that returns these outputs whatever it is fed: logits [T, V]."""
    tokens = logits.argmax(-1) if next_tokens is None else next_tokens
    return lambda feeds: {"logits": logits[None], "next_tokens": tokens[None]}


def figures(engine_logits, reference_logits, next_tokens=None) -> dict:
    return compare(fixed(engine_logits, next_tokens), fixed(reference_logits), [{}])


REFERENCE = np.array([[10.0, 2.0, -3.0, 0.0],  # clear argmax: 0
                      [1.0, 1.00001, -1.0, 0.5],  # near-tie between 0 and 1
                      [-2.0, 0.0, 7.0, 1.0]], np.float32)  # [T, V], logit scale 10


def test_the_feeds_are_the_graphs_inputs_at_validations_cache_lengths(verify_graph):
    entry, _ = verify_graph
    feeds = parity_feeds(entry)
    past = [n for n in entry.inputs if n.startswith("past_key_values.")]
    max_seq_len = entry.inputs[past[0]].shape[2]
    assert [int(f["cache_length"][0]) for f in feeds] == cache_lengths(max_seq_len, entry.tokens)
    for f in feeds:
        assert {n: (v.dtype.name, v.shape) for n, v in f.items()} == {n: (s.dtype, s.shape) for n, s in entry.inputs.items()}
        assert f["input_ids"].max() < entry.outputs["logits"].shape[-1]
    again = parity_feeds(entry)  # seeded: a rebuild compares on the same inputs
    assert all(np.array_equal(a[n], b[n]) for a, b in zip(feeds, again) for n in a)


def test_the_same_graph_agrees_exactly_and_a_perturbed_one_is_caught(verify_graph):
    entry, path = verify_graph
    reference, feeds = onnx_runner(entry, path), parity_feeds(entry)
    same = compare(onnx_runner(entry, path), reference, feeds)
    assert same["max_abs_logit_diff"] == 0 and same["argmax_agreement"] == 1 and same["next_tokens_match"]
    assert parity_record(entry.name, same, "fp32", enforce=True)["within_tolerance"]

    def noisy(scale: float):
        rng = np.random.default_rng(1)

        def run(f):
            out = dict(reference(f))
            logits = out["logits"] + scale * rng.standard_normal(out["logits"].shape).astype(np.float32)
            return {"logits": logits, "next_tokens": logits.argmax(-1)}
        return run

    rtol = TOLERANCES["fp32"].logit_rtol
    small = compare(noisy(rtol * same["logit_scale"] / 20), reference, feeds)
    check(entry.name, small, "fp32")  # within fp32's tolerance
    large = compare(noisy(0.05 * same["logit_scale"]), reference, feeds)
    with pytest.raises(SpecexportError, match=rf"TensorRT engine {entry.name} \(fp32\) .* max \|Δlogit\|"):
        check(entry.name, large, "fp32")


def test_a_flipped_argmax_fails_unless_it_is_a_near_tie():
    # fp16 at logit scale 10: |Δlogit| up to 0.1, near-ties below a margin of 0.05
    reference = REFERENCE.copy()
    reference[1, :2] = [1.0, 1.08]  # argmax 1 by 0.08: no near-tie
    flipped = reference.copy()
    flipped[1, :2] = [1.05, 1.03]  # within the logit limit, but the argmax moved to 0
    result = figures(flipped, reference)
    with pytest.raises(SpecexportError, match="argmax differs where the reference's top-2 margin is 0.08"):
        check("target.verify.b1.t3", result, "fp16")

    flipped_tie = REFERENCE.copy()
    flipped_tie[1, 0] = 1.00002  # position 1: the near-tie goes the other way
    result = figures(flipped_tie, REFERENCE)
    assert result["argmax_agreement"] == pytest.approx(2 / 3)
    limits = check("target.verify.b1.t3", result, "fp32")
    assert limits["enforced"] and limits["near_tie_margin_limit"] == pytest.approx(TOLERANCES["fp32"].near_tie_rtol * 10)


def test_nan_and_a_broken_in_graph_argmax_fail():
    nan = REFERENCE.copy()
    nan[2, 3] = np.nan
    with pytest.raises(SpecexportError, match="max |Δlogit| nan"):
        check("e", figures(nan, REFERENCE), "fp32")
    wrong_tokens = REFERENCE.argmax(-1)
    wrong_tokens[2] = 0
    with pytest.raises(SpecexportError, match="in-graph argmax"):
        check("e", figures(REFERENCE, REFERENCE, wrong_tokens), "fp32")


def test_the_tolerance_follows_the_precision():
    off = REFERENCE + np.float32(0.05)  # 5e-3 of the logit scale: rounding of a half-precision graph
    result = figures(off, REFERENCE)
    with pytest.raises(SpecexportError):
        check("e", result, "fp32")
    check("e", result, "fp16")
    check("e", result, "bf16")


def test_record_mode_writes_the_failure_instead_of_raising():
    bad = figures(REFERENCE * 2, REFERENCE)
    with pytest.raises(SpecexportError):
        parity_record("e", bad, "fp16", enforce=True)
    record = parity_record("e", bad, "fp16", enforce=False)
    assert record["within_tolerance"] is False and record["enforced"] is False
    assert "max |Δlogit|" in record["problem"] and record["precision"] == "fp16"
    good = parity_record("e", figures(REFERENCE, REFERENCE), "fp16", enforce=False)
    assert good["within_tolerance"] is True and good["enforced"] is False
    assert good["reference"].startswith("onnxruntime")
