"""The bench harness, report, regression gate and calibration arithmetic (tiny engines)."""

import json

import numpy as np
import pytest

from specexport.bench.calibrate import _interpolate, choose, predict
from specexport.bench.gate import (
    baseline_for,
    baseline_of,
    compare,
    load_baseline,
    machine_class,
    write_baseline,
)
from specexport.bench.summary import predict_speedup, rounds_by_draft_size, summarize
from tests.conftest import TINY_SHAPE, check_one_line, run_cli


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
    code, text, err = run_cli("bench", tiny_engines.get("llama", **TINY_SHAPE), "--prompts", prompts, "-n", "24",
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
                    "host_fraction", "draft_host_fraction"):
            assert key in r, key
        # the drafter's engines, the target's and the host split the decode time
        assert r["draft_fraction"] + r["verify_fraction"] + r["host_fraction"] == pytest.approx(1, abs=0.01)
        assert 0 <= r["draft_host_fraction"] <= r["host_fraction"] + 0.001
        assert r["matches_baseline"] is True  # greedy: every drafter reproduces the target alone
    assert {r["speedup"] for r in result["results"] if r["drafter"] == "none"} == {1.0}
    sizes = [c["tokens"] for c in result["cost_curve"]]
    assert sizes == sorted(sizes) and sizes[0] == 1 and all(c["ms"] > 0 for c in result["cost_curve"])
    assert result["tile_point"]["tokens"] == result["plan"]["tile_draft_len"] + 1
    assert {(c["drafter"], c["category"]) for c in result["categories"]} >= {("ngram", "grounded"), ("none", "chat")}
    assert result["peers"] == [] and result["settings"]["threads"] == 2
    costs = result["costs"]  # what the prediction is made of, timed apart from the runs
    assert len(costs["verify_ms"]) == result["settings"]["draft_len"] + 1 and all(ms > 0 for ms in costs["verify_ms"])
    assert set(costs["draft_parts_ms"]) == set(costs["draft_ms"]) == {"quantized-self", "draft-model"}
    assert {r["predicted_speedup"] for r in result["results"] if r["drafter"] == "none"} == {1.0}


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


def test_gate_compares_fixed_depth_acceptance_not_the_adaptive_one(bench_result):
    """Adaptive E[L] follows the machine's tuned costs; the gate reads E[L] at the fixed depth."""
    result, _ = bench_result
    drafted = [r for r in result["categories"] if r["drafter"] != "none"]
    assert drafted and all(r["acceptance_length_fixed"] >= 1.0 for r in drafted)
    baseline = baseline_of(result)
    shallower = json.loads(json.dumps(result))
    for row in shallower["categories"]:
        row["acceptance_length"] = 1.0  # another machine's costs chose depth 0 everywhere
    assert all(c.ok for c in compare(shallower, baseline))
    assert {c.metric for c in compare(shallower, baseline)} == {"speedup", "acceptance_length_fixed"}
    worse = json.loads(json.dumps(result))
    best = max((r for r in worse["categories"] if r["drafter"] != "none"), key=lambda r: r["acceptance_length_fixed"])
    assert best["acceptance_length_fixed"] > 1.2  # some drafter's drafts land on the tiny model
    best["acceptance_length_fixed"] = 1.0  # and now none do
    failed = [c for c in compare(worse, baseline) if not c.ok]
    assert [(c.drafter, c.category, c.metric) for c in failed] == [
        (best["drafter"], best["category"], "acceptance_length_fixed")]
    old = {**baseline, "categories": [{k: v for k, v in row.items() if k != "acceptance_length_fixed"}
                                      for row in baseline["categories"]]}
    assert {c.metric for c in compare(result, old)} == {"speedup", "acceptance_length"}  # an older baseline


def test_gate_keeps_a_baseline_per_cpu_class(bench_result, tmp_path):
    """Speedups follow the CPU's kernels: the file keeps a baseline per class, an update replaces
    only its own class's, and a class with none is gated on E[L] and exactness, not on speed."""
    result, _ = bench_result
    path = tmp_path / "baseline.json"
    write_baseline(path, result, "avx512_vnni")
    slower = json.loads(json.dumps(result))
    for row in slower["categories"]:
        row["speedup"] *= 0.5  # the same drafts on a CPU whose verify passes cost more
    write_baseline(path, slower, "avx2")
    stored = load_baseline(path)
    assert set(stored["machines"]) == {"avx2", "avx512_vnni"}
    entry, same = baseline_for(stored, "avx512_vnni")
    failed = [c for c in compare(slower, entry, speedups=same) if not c.ok]
    assert same and failed and {c.metric for c in failed} == {"speedup"}  # on its own class: a regression
    entry, same = baseline_for(stored, "avx2")
    assert same and all(c.ok for c in compare(slower, entry, speedups=same))
    entry, same = baseline_for(stored, "aarch64")  # no baseline of its own
    checks = compare(slower, entry, speedups=same)
    assert not same and checks and all(c.ok for c in checks) and "speedup" not in {c.metric for c in checks}
    lossy = json.loads(json.dumps(slower))
    lossy["categories"][0]["matches_baseline"] = False
    assert [c.metric for c in compare(lossy, entry, speedups=same) if not c.ok] == ["lossless"]
    legacy = tmp_path / "legacy.json"  # one baseline at the top: a class no machine has
    legacy.write_text(json.dumps(baseline_of(result)))
    assert baseline_for(load_baseline(legacy), machine_class())[1] is False
    assert machine_class(["avx512_vnni", "avx512f", "avx2"]) == "avx512_vnni" and machine_class(["avx2"]) == "avx2"


def test_gate_cli_exit_codes(tiny_engines, prompts, tmp_path):
    engines = tiny_engines.get("llama", **TINY_SHAPE)
    baseline = tmp_path / "baseline.json"
    args = ["bench", engines, "--prompts", prompts, "-n", "12", "--repeats", "1", "--out", tmp_path / "out",
            "--drafters", "ngram", "--baseline", baseline]
    code, _, err = run_cli(*args, "--update-baseline")
    assert code == 0 and baseline.is_file(), err
    stored = json.loads(baseline.read_text())
    assert list(stored["machines"]) == [machine_class()]  # recorded under this CPU's class
    for row in stored["machines"][machine_class()]["categories"]:
        row["acceptance_length_fixed"] *= 10  # an impossible bar: the gate must fail
    baseline.write_text(json.dumps(stored))
    code, out, _ = run_cli(*args)
    assert code == 1 and "REGRESSION" in out
    entry = stored["machines"].pop(machine_class())  # recorded on another class of CPU only
    for row in entry["categories"]:
        row["acceptance_length_fixed"] /= 10
        row["speedup"] *= 10  # a bar no run here meets: not compared across classes
    baseline.write_text(json.dumps({"machines": {"another-cpu": entry}}))
    code, out, err = run_cli(*args)
    assert code == 0 and "REGRESSION" not in out and f"no baseline for this CPU class ({machine_class()})" in err
    for bad in ("{not json", '{"machines": {}}'):
        baseline.write_text(bad)
        code, _, err = run_cli(*args)
        check_one_line(code, err, str(baseline), "--update-baseline")


def test_bench_bad_input(tiny_engines, tmp_path):
    engines = tiny_engines.get("llama", **TINY_SHAPE)
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
    costly = predict(curve, geometric, {"model": [12.0 * k for k in range(8)]}, depth=7)  # its round: 12 ms a draft
    cheap = predict(curve, geometric, {}, depth=7)
    best = lambda rows: max(rows, key=lambda r: r["geomean_speedup"])["draft_len"]  # noqa: E731
    assert best(costly) < best(cheap)
    # adaptive depth: a deeper ceiling never predicts worse, and the choice is the knee
    assert all(a["geomean_adaptive"] <= b["geomean_adaptive"] for a, b in zip(rows, rows[1:]))
    assert choose(rows)["draft_len"] == 3


def test_rounds_by_draft_size():
    # 5 rounds: offered position 1 in 4 of them, position 2 in 3, position 3 in 1
    assert rounds_by_draft_size(5, [4, 3, 1]) == [1, 1, 2, 1]
    assert rounds_by_draft_size(3, [0, 0]) == [3, 0, 0]


def test_prediction_arithmetic():
    verify_ms = [10.0, 12.0, 13.0, 15.0]  # the pass that verifies k = 0..3 drafts
    steps = [0.0, 1.0, 2.0, 3.0]  # a draft model: 1 ms per draft
    # every round drafts 3 and keeps all: E[L] = 4 at 15 ms + 3 steps of 1 ms against 10 ms per token
    assert predict_speedup(40, 10, [10, 10, 10], verify_ms, steps) == pytest.approx(40 * 10 / (10 * 18))
    # the target alone (and a drafter without engines): one token per 10 ms round, exactly 1
    assert predict_speedup(7, 7, [0, 0, 0], verify_ms, None) == 1.0
    # mixed depths: 2 rounds of 0, 1 of 1, 2 of 3 drafts, 0.5 ms per draft
    mixed = predict_speedup(12, 5, [3, 2, 2], verify_ms, [0.0, 0.5, 1.0, 1.5])
    assert mixed == pytest.approx(12 * 10 / (2 * 10 + (12 + 0.5) + 2 * (15 + 1.5)))
    assert predict_speedup(0, 0, [0, 0, 0], verify_ms, None) is None


def test_a_round_s_draft_cost_per_drafter_shape():
    """Each drafter's own cost model (Drafter.round_cost, what adaptive depth, the schedule and
    the bench read): a draft model pays one step per draft and, skipping, the skipped token's
    catch-up later (two at a time); a chain head one catch-up call (its first draft) and a step per
    further draft, and skipping priced at the catch-up too; a block head one block call whatever k;
    prompt lookup nothing."""
    from types import SimpleNamespace

    from specexport.runtime.block_drafter import BlockDrafter
    from specexport.runtime.chain_drafter import ChainDrafter
    from specexport.runtime.drafters import ModelDrafter, NgramDrafter

    one_slot = SimpleNamespace(slots=1, max_seq_len=64)
    model = ModelDrafter("m", one_slot, {1: 2000.0, 2: 3000.0})  # ms of a 1- and a 2-token step
    # the head's catch-up runner plans its calls by the same costs (no fill entries: rows it
    # does not read would run through the same entries, so it reads them all)
    catchup_ms = {6: 3500.0, 64: 9000.0}
    planned = lambda tokens: 0.0 if tokens < 1 else catchup_ms[6 if tokens <= 6 else 64]  # noqa: E731
    runner = SimpleNamespace(fill_sizes=[], planned_ms=planned, fill_ms=planned,
                             catchup_ms=lambda tokens, read: planned(read) + planned(tokens - read))
    catchup = SimpleNamespace(slots=1, max_seq_len=64, runners=[runner], widths=lambda rows: sorted(catchup_ms))
    chain = ChainDrafter("c", catchup, one_slot, {"catchup": catchup_ms, "step": {1: 2000.0}})
    block = BlockDrafter("b", {}, [SimpleNamespace(round_rows=6)], 9000.0, None)
    assert [model.round_cost(k) for k in range(4)] == [1.5, 2.0, 4.0, 6.0]
    assert [chain.round_cost(k) for k in range(4)] == [3.5, 3.5, 5.5, 7.5]
    assert [block.round_cost(k) for k in range(4)] == [0.0, 9.0, 9.0, 9.0]
    assert [NgramDrafter().round_cost(k) for k in range(4)] == [0.0] * 4
    # measured parts (the bench's) in place of the build's
    assert chain.round_cost(2, {"catchup": {6: 1000.0}, "step": {1: 500.0}}) == 1.5
    assert block.round_cost(1, {"block": {6: 4000.0}}) == 4.0


def _fake_record(drafter, total_s, draft_s, verify_s, tokens=12, rounds=4, proposed_at=(4, 4), accepted_at=(3, 2)):
    return {"drafter": drafter, "prompt_id": "p", "category": "c", "repeat": 0, "token_ids": [1] * tokens,
            "tokens": tokens, "rounds": rounds, "total_s": total_s, "draft_s": draft_s, "draft_engine_s": draft_s,
            "verify_s": verify_s, "host_s": total_s - draft_s - verify_s, "accepted_at": list(accepted_at),
            "proposed_at": list(proposed_at)}


def _summarized(records: list[dict], repeats: int) -> dict:
    """``summarize`` over fake records of the target alone ("none") and a drafter "m" whose
    costs measured apart are a 10 ms verify of one token, 11 of two, 12 of three and 2 ms a draft."""
    from types import SimpleNamespace

    pipe = SimpleNamespace(manifest=SimpleNamespace(plan={"tile_draft_len": 41, "group_size": 3}, name="x",
                                                    toolchain={}, root="r", draft_len=2))
    options = SimpleNamespace(threads=2, max_new_tokens=12, repeats=repeats, temperature=0.0, adaptive=True,
                              draft_len=2, prompts="p.jsonl")
    costs = {"curve": [{"tokens": 1, "ms": 10.0, "relative": 1.0}], "verify_ms": [10.0, 11.0, 12.0],
             "draft_ms": {"m": [0.0, 2.0, 4.0]}, "draft_parts_ms": {"m": {"step": {"1": 2.0}}},
             "repeats": 3, "logits": False}
    return summarize(pipe, options, [], ["none", "m"], records, [], [], costs)


def test_prediction_comes_from_costs_measured_apart_not_from_the_run():
    def predicted(draft_s, verify_s):
        records = [_fake_record("none", 1.2, 0.0, 1.0, rounds=12, proposed_at=(0, 0), accepted_at=(0, 0)),
                   _fake_record("m", 1.0, draft_s, verify_s)]
        result = _summarized(records, repeats=1)
        return next(r["predicted_speedup"] for r in result["results"] if r["drafter"] == "m")

    # 4 rounds of 2 drafts, 12 tokens: 12 · 10 / (4 · (12 + 2 · 2))
    assert predicted(0.3, 0.5) == predicted(0.01, 0.9) == pytest.approx(12 * 10 / (4 * 16), abs=1e-3)


def test_a_paired_speedup_follows_a_machine_that_changes_speed_between_repeats():
    """Three repeats on a machine whose speed changes between them (the target alone at 10, 20
    and 30 tok/s), the drafter 1.5x, 0.9x and 1.0x the target alone within each: paired, the
    median repeat's ratio (1.0) and the range; the ratio of the medians (18 / 20 = 0.9) takes
    them from different repeats."""
    records = []
    for repeat, (alone_tps, ratio) in enumerate([(10.0, 1.5), (20.0, 0.9), (30.0, 1.0)]):
        alone = _fake_record("none", 12 / alone_tps, 0.0, 0.5, rounds=12, proposed_at=(0, 0), accepted_at=(0, 0))
        drafted = _fake_record("m", 12 / (alone_tps * ratio), 0.1, 0.2)
        records += [{**alone, "repeat": repeat}, {**drafted, "repeat": repeat}]
    row = next(r for r in _summarized(records, repeats=3)["results"] if r["drafter"] == "m")
    assert row["speedup_paired"] == pytest.approx(1.0, abs=1e-3)
    assert row["speedup_range"] == [pytest.approx(0.9, abs=1e-3), pytest.approx(1.5, abs=1e-3)]
    assert row["speedup"] == pytest.approx(0.9, abs=1e-3)


def test_sampled_bench_reports_the_split_and_a_prediction(tiny_engines, prompts, tmp_path):
    code, text, err = run_cli("bench", tiny_engines.get("llama", **TINY_SHAPE), "--prompts", prompts, "-n", "12",
                              "--repeats", "1", "--drafters", "quantized-self", "--temperature", "0.8",
                              "--out", tmp_path, "--json")
    assert code == 0, err
    result = json.loads(text)
    assert result["costs"]["logits"] is True  # sampled rounds copy logits out: so do the timings
    for r in result["results"]:
        assert r["predicted_speedup"] is not None and r["matches_baseline"] is None
        assert r["draft_fraction"] + r["verify_fraction"] + r["host_fraction"] == pytest.approx(1, abs=0.01)
    assert "Costs behind the prediction" in (tmp_path / "bench.md").read_text()


def test_every_bench_json_key_is_documented(bench_result):
    """docs/bench.md lists every key a bench run writes (tests/test_docs.py reads the page)."""
    from tests.test_docs import undocumented_bench_keys

    result, out = bench_result
    assert undocumented_bench_keys(json.loads((out / "bench.json").read_text())) == []


def test_a_speculative_peer_is_checked_against_its_own_plain_run():
    """peers[].matches_own_plain: an n-gram peer whose tokens differ from its own plain peer's on
    a prompt is reported not lossless there (the int4 peers' speculation is not: docs/quantized.md);
    a plain peer, or one whose plain peer did not run, gets null."""
    from specexport.bench.summary import _peers

    def record(peer, prompt, tokens):
        return {"peer": peer, "prompt_id": prompt, "category": "chat", "threads": 2, "token_ids": tokens,
                "total_s": 1.0, "first_token_s": 0.1, "decode_s": 0.9}

    records = [record("ort-genai-int4", "a", [1, 2, 3]), record("ort-genai-int4-ngram", "a", [1, 2, 3]),
               record("ort-genai-int4", "b", [1, 2, 3]), record("ort-genai-int4-ngram", "b", [1, 2, 4]),
               record("llama-cpp-lookup", "a", [1, 2, 3])]
    baseline = {p: {"tokens_per_s": 1.0, "token_ids": [1, 2, 3], "greedy": True} for p in ("a", "b")}
    got = {(r["peer"], r["prompt_id"]): r["matches_own_plain"] for r in _peers(records, baseline)}
    assert got == {("ort-genai-int4", "a"): None, ("ort-genai-int4-ngram", "a"): True,
                   ("ort-genai-int4", "b"): None, ("ort-genai-int4-ngram", "b"): False,
                   ("llama-cpp-lookup", "a"): None}


def test_a_prompt_with_a_json_schema_is_benched_constrained(tiny_engines, tmp_path):
    pytest.importorskip("llguidance")
    pytest.importorskip("jsonschema")
    schema = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "tag": {"enum": ["a", "b"]}},
              "required": ["id", "tag"], "additionalProperties": False}
    path = tmp_path / "structured.jsonl"
    path.write_text(json.dumps({"id": "item", "category": "json", "json_schema": schema,
                                "messages": [{"role": "user", "content": "An item."}]}) + "\n")
    code, text, err = run_cli("bench", tiny_engines.get("llama", **TINY_SHAPE), "--prompts", path, "-n", "40",
                              "--repeats", "1", "--drafters", "ngram", "--out", tmp_path / "out", "--json")
    assert code == 0, err
    result = json.loads(text)
    for r in result["results"]:
        assert r["constrained"] is True and r["schema_valid"] == 1.0, r
        assert r["mask_ms_per_row"] > 0 and 0 < r["mask_fraction"] < 1
        assert r["matches_baseline"] is True  # the n-gram drafter's output equals the constrained target's
    assert all(c["schema_valid_all"] for c in result["categories"])
    assert "Structured output" in (tmp_path / "out" / "bench.md").read_text()
    from tests.test_docs import undocumented_bench_keys

    assert undocumented_bench_keys(result) == []
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"id": "x", "json_schema": {"type": "bogus"}, "prompt": "x"}) + "\n")
    code, _, err = run_cli("bench", tiny_engines.get("llama", **TINY_SHAPE), "--prompts", bad, "--out", tmp_path)
    assert code == 2 and "prompt 'x' json_schema" in err


def test_bench_runs_tree_sizes_side_by_side(tiny_engines, prompts, tmp_path):
    engines = tiny_engines.get("llama", drafters=("ngram",), tree_nodes=4, **TINY_SHAPE)
    code, text, err = run_cli("bench", engines, "--prompts", prompts, "-n", "16", "--repeats", "1",
                              "--tree-nodes", "0,4", "--out", tmp_path, "--json")
    assert code == 0, err
    result = json.loads(text)
    rows = {(r["drafter"], r["prompt_id"]): r for r in result["results"]}
    assert {d for d, _ in rows} == {"none", "ngram", "ngram+tree4"}
    for (drafter, _), r in rows.items():
        assert r["tree_nodes"] == (4 if drafter == "ngram+tree4" else 0)
        assert r["matches_baseline"] is True and r["verify_tokens_per_round"] >= 1
        assert (r["predicted_speedup"] is None) == (r["tree_nodes_per_round"] > 0)
    assert rows[("ngram+tree4", "loop")]["tree_nodes_per_round"] > 0
    from tests.test_docs import undocumented_bench_keys

    assert undocumented_bench_keys(result) == []
    code, _, err = run_cli("bench", engines, "--prompts", prompts, "--tree-nodes", "9", "--out", tmp_path)
    assert code == 2 and "--tree-nodes" in err
