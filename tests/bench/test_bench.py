"""The bench harness, report, regression gate and calibration arithmetic (tiny engines)."""

import json

import numpy as np
import pytest

from specexport.bench.calibrate import _interpolate, choose, predict
from specexport.bench.gate import baseline_of, compare
from tests.conftest import run_cli

SHAPE = dict(max_seq_len=160, prefill_chunk=16)


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "p.jsonl"
    lines = [
        {"id": "loop", "category": "grounded", "prompt": "1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1,"},
        {"id": "chat", "category": "chat", "messages": [{"role": "user", "content": "Tell me a story."}]},
    ]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    return path


@pytest.fixture(scope="module")
def bench_result(tiny_engines, prompts, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    code, text, err = run_cli("bench", tiny_engines.get("llama", **SHAPE), "--prompts", prompts, "-n", "24",
                              "--repeats", "2", "--out", out, "--json")
    assert code == 0, err
    return json.loads(text), out


def test_bench_json_schema(bench_result):
    result, _ = bench_result
    drafters = {r["drafter"] for r in result["results"]}
    assert drafters == {"none", "ngram", "quantized-self", "draft-model"}
    for r in result["results"]:
        for key in ("drafter", "prompt_id", "category", "tokens_per_s", "speedup", "acceptance_length",
                    "predicted_speedup", "acceptance_by_position", "draft_fraction", "verify_fraction",
                    "host_fraction"):
            assert key in r, key
        assert r["matches_baseline"] is True  # greedy: every drafter reproduces the target alone
    assert {r["speedup"] for r in result["results"] if r["drafter"] == "none"} == {1.0}
    sizes = [c["tokens"] for c in result["cost_curve"]]
    assert sizes == sorted(sizes) and sizes[0] == 1 and all(c["ms"] > 0 for c in result["cost_curve"])
    assert result["tile_point"]["tokens"] == result["plan"]["tile_draft_len"] + 1
    assert {(c["drafter"], c["category"]) for c in result["categories"]} >= {("ngram", "grounded"), ("none", "chat")}
    assert result["peers"] == [] and result["settings"]["threads"] == 2


def test_bench_writes_markdown_and_plots(bench_result):
    _, out = bench_result
    assert (out / "bench.json").is_file()
    md = (out / "bench.md").read_text()
    assert "| drafter | category |" in md and "tile rule" in md
    for png in ("cost_curve.png", "acceptance.png", "tokens_per_s.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_gate_passes_against_itself_and_catches_regressions(bench_result):
    result, _ = bench_result
    baseline = baseline_of(result)
    assert all(c.ok for c in compare(result, baseline))
    worse = json.loads(json.dumps(result))
    for row in worse["categories"]:
        if row["drafter"] == "ngram":
            row["speedup"] *= 0.5
    failed = [c for c in compare(worse, baseline) if not c.ok]
    assert failed and all(c.drafter == "ngram" and c.metric == "speedup" for c in failed)
    lossy = json.loads(json.dumps(result))
    lossy["categories"][0]["matches_baseline"] = False
    assert any(c.metric == "lossless" and not c.ok for c in compare(lossy, baseline))


def test_gate_cli_exit_codes(tiny_engines, prompts, tmp_path):
    engines = tiny_engines.get("llama", **SHAPE)
    baseline = tmp_path / "baseline.json"
    args = ["bench", engines, "--prompts", prompts, "-n", "12", "--repeats", "1", "--out", tmp_path / "out",
            "--drafters", "ngram", "--baseline", baseline]
    code, _, err = run_cli(*args, "--update-baseline")
    assert code == 0 and baseline.is_file(), err
    stored = json.loads(baseline.read_text())
    for row in stored["categories"]:
        row["acceptance_length"] *= 10  # an impossible bar: the gate must fail
    baseline.write_text(json.dumps(stored))
    code, out, _ = run_cli(*args)
    assert code == 1 and "REGRESSION" in out


def test_bench_bad_input(tiny_engines, tmp_path):
    engines = tiny_engines.get("llama", **SHAPE)
    code, _, err = run_cli("bench", engines, "--prompts", tmp_path / "none.jsonl")
    assert code == 2 and "prompt file not found" in err
    code, _, err = run_cli("bench", engines, "--peers", "vllm")
    assert code == 2 and "unknown peer" in err


def test_calibration_prediction_arithmetic():
    curve = {1: 0.020, 2: 0.025, 4: 0.026, 8: 0.030, 16: 0.044}
    assert _interpolate(curve, 6) == pytest.approx(0.028)
    # drafts always kept at positions 1-3, never after: E(D) = 1 + min(D, 3)
    profiles = {("ngram", "code"): np.array([1.0, 1.0, 1.0, 0, 0, 0, 0])}
    rows = predict(curve, profiles, {}, depth=7)
    by_d = {r["draft_len"]: r["ngram/code"] for r in rows}
    assert by_d[3] == pytest.approx(4 * 0.020 / 0.026, rel=1e-3)
    assert max(by_d, key=by_d.get) == 3
    # a costly drafter prefers fewer drafts
    geometric = {("model", "code"): 0.8 ** np.arange(1, 8)}  # each draft kept with probability 0.8
    costly = predict(curve, geometric, {"model": 0.012}, depth=7)
    cheap = predict(curve, geometric, {}, depth=7)
    best = lambda rows: max(rows, key=lambda r: r["geomean_speedup"])["draft_len"]  # noqa: E731
    assert best(costly) < best(cheap)
    # adaptive depth: a deeper ceiling never predicts worse, and the choice is the knee
    assert all(a["geomean_adaptive"] <= b["geomean_adaptive"] for a, b in zip(rows, rows[1:]))
    assert choose(rows)["draft_len"] == 3
