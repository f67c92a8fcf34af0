"""`plan --calibrate`'s depth by batch size: K(B) = argmax_k B·E(k) / (t(B, 1+k) + t_draft(B, k)),
written into the calibration file and read back by the plan (the recipe's own schedule first)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from specexport.bench.calibrate import schedule_steps, schedule_table
from tests.bench.short_prompts import short_prompts
from tests.conftest import run_cli

KEEP_THREE = np.array([1.0, 1.0, 1.0, 0.0, 0.0])  # the first 3 drafts always kept: E(k) = 1 + min(k, 3)


def _surface(ms_of) -> dict[tuple[int, int], float]:
    return {(b, t): ms_of(b, t) / 1e3 for b in (1, 2, 4) for t in range(1, 7)}


def _brute_force(surface, profiles, rounds, depth, batch) -> int:
    """The argmax, spelled out: the geometric mean over cells of B·E(k) / t against B / t(B, 1);
    ``rounds``: drafter -> batch -> its round's seconds at k = 0..depth."""
    best, best_value = 0, -1.0
    for k in range(depth + 1):
        ratios = [(1 + cum[:k].sum()) * surface[(batch, 1)] / (surface[(batch, 1 + k)] + (rounds[d][batch][k] if d in rounds else 0))
                  for (d, _), cum in profiles.items()]
        value = float(np.exp(np.mean(np.log(ratios))))
        if value > best_value + 1e-12:
            best, best_value = k, value
    return best


def test_depth_by_batch_size_is_the_argmax_of_the_injected_costs():
    # B=1: drafts nearly free, keep all 3 that land; B=2: a width of 2 costs what 1 does, 3 and
    # more cost 3x; B=4: every token costs 12 ms more, the target alone wins
    surface = _surface(lambda b, t: {1: 10 + 0.5 * (t - 1), 2: 10 if t <= 2 else 30, 4: 10 + 12 * (t - 1)}[b])
    profiles = {("ngram", "code"): KEEP_THREE}
    table = schedule_table(surface, profiles, {}, depth=5, batches=[1, 2, 4])
    assert [row["depth"] for row in table] == [3, 1, 0]
    for row in table:
        assert row["depth"] == _brute_force(surface, profiles, {}, 5, row["batch"])
        assert row["speedup_by_depth"][0] == 1.0  # k = 0 is the target alone
        assert row["speedup"] == max(row["speedup_by_depth"])
    one = table[0]
    assert one["speedup"] == pytest.approx(4 * 10 / 11.5, abs=1e-3)
    assert one["tokens_per_s"] == pytest.approx(1 * 4 / 0.0115, rel=1e-3)  # B·E(K) / t(B, 1+K)
    assert table[1]["tokens_per_s"] == pytest.approx(2 * 2 / 0.010, rel=1e-3)
    assert schedule_steps(table) == [[1, 3], [2, 1]]  # past batch 2: no drafting

    # a draft model's step cost at B counts per draft: 12 ms a draft at batch 1 is more than a
    # kept draft saves (1 token per 10 ms alone against 2 per 22.5 ms), free at batch 2
    steps = {"model": {1: [0.012 * k for k in range(6)], 2: [0.0] * 6, 4: [0.0] * 6}}  # the drafter's round at k
    costly = schedule_table(surface, {("model", "code"): KEEP_THREE}, steps, depth=5, batches=[1, 2, 4])
    assert [row["depth"] for row in costly] == [0, 1, 0]
    assert costly[0]["depth"] == _brute_force(surface, {("model", "code"): KEEP_THREE}, steps, 5, 1)
    assert schedule_steps(costly) == [[1, 0], [2, 1]]

    # a drafter the batched loop cannot run at B counts for nothing there: the target alone
    mixed = {("ngram", "code"): KEEP_THREE, ("eagle3", "code"): np.ones(5)}
    only_ngram = schedule_table(surface, mixed, {}, depth=5, batches=[1, 2, 4],
                                runnable={1: {"ngram"}, 2: {"ngram"}, 4: {"ngram"}})
    assert [row["depth"] for row in only_ngram] == [3, 1, 0]
    assert all(set(row["best_depth_by_drafter"]) == {"ngram"} for row in only_ngram)
    nothing = schedule_table(surface, mixed, {}, depth=5, batches=[1, 2, 4], runnable={})
    assert [row["depth"] for row in nothing] == [0, 0, 0]


def test_schedule_steps_merge_and_drop_the_trailing_zeros():
    rows = lambda *pairs: [{"batch": b, "depth": d} for b, d in pairs]  # noqa: E731
    assert schedule_steps(rows((1, 2), (2, 2), (4, 1), (8, 0))) == [[2, 2], [4, 1]]
    assert schedule_steps(rows((1, 0), (2, 0))) == [[1, 0]]
    assert schedule_steps(rows((1, 3), (2, 0), (4, 1))) == [[1, 3], [2, 0], [4, 1]]


def _recipe(tmp_path: Path, **draft) -> Path:
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump({
        "name": "tiny-calibrated", "target": {"source": "tiny", "arch": "llama", "seed": 0},
        "drafters": [{"kind": "ngram", "max_ngram": 3}, {"kind": "quantized-self", "bits": 4, "block_size": 32}],
        "shapes": {"batch": [1, 2, 4], "max_seq_len": 96, "prefill_chunk": 16},
        # G = 4/2 = 2: a 16-row tile gives D = 7, a small calibration build
        "draft": {"tile": 16, "max_draft": 4, "calibration": "tiny.calibration.json", **draft},
        "attention": "ort-gqa",
    }, sort_keys=False))
    return path


def test_the_plan_takes_the_recipe_schedule_first_then_the_calibrated_one(tmp_path, monkeypatch):
    from specexport.exporter.plan_command import plan_recipe

    monkeypatch.setenv("COLUMNS", "300")  # rich: one line per table row

    recipe = _recipe(tmp_path)
    plan = plan_recipe(recipe)
    assert plan["schedule"] is None and plan["schedule_source"] is None  # no file yet
    (tmp_path / "tiny.calibration.json").write_text(json.dumps({
        "draft_len": 3, "why": "measured", "host": "box", "measured": "2026-11-30T21:00:00+00:00",
        "schedule": [[1, 5], [2, 1]]}))
    plan = plan_recipe(recipe)
    assert plan["draft_len"] == 3
    assert plan["schedule"] == [[1, 3], [2, 1]]  # capped at D
    assert plan["schedule_source"] == "calibrated on box, 2026-11-30"
    code, out, _ = run_cli("plan", recipe)
    assert code == 0 and "depth by batch size" in out and "calibrated on box, 2026-11-30" in out

    recipe = _recipe(tmp_path, schedule={2: 2})
    plan = plan_recipe(recipe)
    assert plan["schedule"] == [[2, 2]] and plan["schedule_source"] == "recipe"
    code, out, _ = run_cli("plan", recipe)
    assert code == 0 and "(recipe)" in out

    (tmp_path / "tiny.calibration.json").write_text(json.dumps({"draft_len": 3, "schedule": [[2, 1], [1, 1]]}))
    code, _, err = run_cli("plan", _recipe(tmp_path))
    assert code == 2 and "schedule" in err


def test_a_real_tiny_calibration_writes_the_schedule_and_the_plan_reads_it(tmp_path, monkeypatch):
    from specexport.exporter.plan_command import plan_recipe

    monkeypatch.setenv("COLUMNS", "300")
    monkeypatch.chdir(tmp_path)  # the calibration build goes to ./engines
    recipe = _recipe(tmp_path)
    prompts = short_prompts(tmp_path / "prompts.jsonl", 2)
    code, out, err = run_cli("plan", recipe, "--calibrate", "--prompts", prompts, "--max-new-tokens", "12", "--json",
                             "--accept-noise")  # tiny graphs time noisily
    assert code == 0, err
    written = json.loads((tmp_path / "tiny.calibration.json").read_text())
    depth = written["draft_len"]
    table = written["schedule_table"]
    assert [row["batch"] for row in table] == [1, 2, 4]
    assert set(written["cost_surface_ms"]) == {"1", "2", "4"}
    assert all(list(by_t) == [str(t) for t in range(1, depth + 2)] for by_t in written["cost_surface_ms"].values())
    assert set(written["draft_round_ms_by_batch"]) == {"quantized-self"}
    # the table follows the formula from what the file records (rounded costs: the same argmax
    # unless two depths are within the rounding)
    surface = {(int(b), int(t)): ms / 1e3 for b, by_t in written["cost_surface_ms"].items() for t, ms in by_t.items()}
    profiles = {tuple(key.split("/")): np.array(cum) for key, cum in written["acceptance"].items()}
    steps = {d: {int(b): [ms / 1e3 for ms in by_k] for b, by_k in by_b.items()}
             for d, by_b in written["draft_round_ms_by_batch"].items()}
    again = schedule_table(surface, profiles, steps, depth, [1, 2, 4])
    for row, recomputed in zip(table, again):
        assert len(row["speedup_by_depth"]) == depth + 1
        assert row["speedup_by_depth"] == pytest.approx(recomputed["speedup_by_depth"], rel=1e-2)
        assert row["speedup_by_depth"][row["depth"]] == max(row["speedup_by_depth"])
    assert written["schedule"] == schedule_steps(table)
    assert written["host"] and written["measured"]
    plan = plan_recipe(recipe)
    assert plan["schedule"] == [[b, min(d, plan["draft_len"])] for b, d in written["schedule"]]
    assert plan["schedule_source"].startswith(f"calibrated on {written['host']}, ")
    code, out, _ = run_cli("plan", recipe)
    assert code == 0 and "calibrated on" in out


def test_a_noisy_calibration_writes_nothing_and_names_the_entries(tmp_path, monkeypatch):
    """Timings whose rounds scatter (a fake timer: the target's one-token graph alternates 1
    and 3 ms) stop `plan --calibrate` before its file: non-zero exit, the entry named with its
    spread, one error line suggesting a quieter machine or more --rounds."""
    import itertools

    from specexport.runtime.runner import ModelRunner

    ticks = itertools.count()

    def time_run(self, size, want_logits=False):
        if self.name == "target" and size == 1:
            return 1e-3 if next(ticks) % 2 else 3e-3
        return size * 1e-3

    monkeypatch.setattr(ModelRunner, "time_run", time_run)
    # the int4 copy's fill entries (an ort-gqa build), timed apart: quiet
    monkeypatch.setattr(ModelRunner, "time_fill", lambda self, size: size * 1e-3)
    monkeypatch.chdir(tmp_path)  # the calibration build goes to ./engines
    recipe = _recipe(tmp_path)
    prompts = short_prompts(tmp_path / "prompts.jsonl", 2)
    code, _, err = run_cli("plan", recipe, "--calibrate", "--prompts", prompts, "--max-new-tokens", "8",
                           "--rounds", "4")
    assert code == 3 and "Traceback" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("specexport: error:")]
    assert len(errors) == 1 and err.strip().splitlines()[-1] == errors[0]
    assert "--rounds (now 4)" in errors[0] and "--accept-noise" in errors[0]
    assert any("target t1: spread" in line for line in err.splitlines())
    assert not any("fill" in line for line in err.splitlines() if "spread" in line)  # only the noisy one named
    assert not (tmp_path / "tiny.calibration.json").exists()
