"""Draft depth by batch size (issue 11, part 3): TensorRT-LLM's draft_len_schedule semantics
(keys are upper bounds), vLLM's disable_by_batch_size as its shorthand, from the recipe through
the plan and the manifest to the batched loop."""

from __future__ import annotations

import json

import numpy as np
import pytest
import yaml

from specexport.contract import DraftSchedule
from specexport.errors import BadInput
from specexport.runtime import load
from specexport.runtime.acceptance import Sampling
from specexport.runtime.loop import Request
from tests.conftest import run_cli, tiny_recipe
from tests.runtime.fakes import decode_all


def test_upper_bound_semantics_and_the_disable_shorthand():
    schedule = DraftSchedule(((4, 4), (8, 2), (32, 1)))
    assert [schedule.depth(b) for b in (1, 4, 5, 8, 9, 32, 33)] == [4, 4, 2, 2, 1, 1, 0]
    off = DraftSchedule.disable_by_batch_size(4, 5)
    assert [off.depth(b) for b in (1, 3, 4, 9)] == [5, 5, 0, 0]
    assert DraftSchedule.parse(schedule.to_json()) == schedule
    for bad in (((8, 2), (4, 4)), ((0, 3),), ((4, -1),), ()):
        with pytest.raises(BadInput, match="draft schedule"):
            DraftSchedule(bad)


def _recipe(tmp_path, **draft):
    path = tiny_recipe(tmp_path / "r.yaml", attention="ort-gqa", max_draft=4, batch=(1, 2, 4))
    data = yaml.safe_load(path.read_text())
    data["draft"].update(draft)
    path.write_text(yaml.safe_dump(data))
    return path


def test_the_plan_carries_the_schedule_capped_at_d(tmp_path):
    code, out, err = run_cli("plan", _recipe(tmp_path, schedule={2: 9, 4: 1}), "--json")
    assert code == 0, err
    assert json.loads(out)["schedule"] == [[2, 4], [4, 1]]  # depth 9 capped at D = 4
    code, out, _ = run_cli("plan", _recipe(tmp_path, schedule={2: 9, 4: 1}))
    assert "batch 1-2: 4, 3-4: 1, above 4: 0" in out
    code, out, _ = run_cli("plan", _recipe(tmp_path, disable_by_batch_size=3), "--json")
    assert json.loads(out)["schedule"] == [[2, 4]]


def test_schedule_and_disable_together_is_one_line(tmp_path):
    code, _, err = run_cli("plan", _recipe(tmp_path, schedule={2: 1}, disable_by_batch_size=3))
    assert code == 2 and "schedule or disable_by_batch_size" in err and "Traceback" not in err



def test_the_loop_drafts_only_where_the_schedule_allows(batched_engines):
    pipe = load(batched_engines)
    motif = [7, 8, 9, 10, 11]
    prompts = [motif * 5, [12, 13] + motif * 4, motif * 3 + [14]]
    alone = [pipe.generate(prompt_ids=p, drafter="ngram", max_new_tokens=12, adaptive=False).token_ids
             for p in prompts]
    target = pipe.batched_target()
    # per-sequence depth reads the cost surface t(B, T): timed once (which also warms every call
    # up), then replaced by one where a verify token is nearly free, so that drafting pays
    # whatever else the machine runs (the width rule has its own tests): this test is about the
    # schedule's cap
    timed = target.measure_costs(rounds=1)
    d = pipe.manifest.draft_len

    def run(schedule, per_sequence=False):
        # each run starts from that surface (a run updates it from the calls it makes)
        target.costs = {(batch, tokens): timed[(batch, 1)] * (1 + 0.01 * tokens) for batch, tokens in timed}
        requests = [Request(np.asarray(p), 12, Sampling()) for p in prompts]
        return decode_all(target, pipe.drafter("ngram", target.slots), requests, draft_len=d, eos_ids=pipe.text.eos_ids,
                            schedule=schedule, per_sequence=per_sequence)

    for per_sequence in (False, True):  # per-sequence depth chooses widths under the schedule's cap
        off = run(DraftSchedule.disable_by_batch_size(3, d), per_sequence)  # three running: no drafting
        assert [r.tokens for r in off] == alone and sum(r.stats.proposed for r in off) == 0
        on = run(DraftSchedule(((4, d),)), per_sequence)
        assert [r.tokens for r in on] == alone and sum(r.stats.proposed for r in on) > 0


def test_a_measured_schedule_keeps_the_fastest_depth_per_batch_size():
    from specexport.bench.batched import measured_schedule

    def row(batch, drafter, depth, tps):
        return {"loop": "batched", "batch": batch, "drafter": drafter, "depth": depth, "depth_rule": "fixed",
                "aggregate_tokens_per_s": tps}

    rows = [row(1, "none", 0, 30), row(1, "ngram", 5, 45), row(1, "ngram", 1, 40),
            row(2, "none", 0, 50), row(2, "ngram", 5, 49), row(2, "ngram", 1, 55),
            row(4, "none", 0, 70), row(4, "ngram", 5, 60), row(4, "ngram", 1, 66),
            row(8, "none", 0, 71), row(8, "ngram", 5, 58), row(8, "ngram", 1, 69),
            {**row(1, "ngram", 5, 99), "loop": "single"}]  # the single-sequence loop is not a batch size
    steps = measured_schedule(rows, "ngram")
    assert steps == [[1, 5], [2, 1]]  # batch 3 and above: the target alone won, so no drafting
    schedule = DraftSchedule.parse(steps)
    assert [schedule.depth(b) for b in (1, 2, 3, 8)] == [5, 1, 0, 0]


def test_per_sequence_width_follows_acceptance_and_cost():
    from specexport.runtime.goodput import best_width

    def lengths(rate, drafts):  # [drafts] E(k) of a row whose drafts are kept at ``rate`` each
        return 1.0 + np.cumsum(rate ** np.arange(1, drafts + 1))

    cost = {1: 1.0, 2: 1.1, 6: 1.4}.__getitem__
    assert best_width([1, 2, 6], cost, [lengths(0.9, 5)] * 2) == 6  # rows that keep hitting: wide
    assert best_width([1, 2, 6], cost, [lengths(0.05, 5)] * 2) == 1  # rows that keep missing: no drafts
    # no long draft to pay for
    assert best_width([1, 2, 6], cost, [lengths(0.9, 0)] + [lengths(0.05, 1)] * 3) in (1, 2)
    steep = {1: 1.0, 2: 2.0, 6: 6.0}.__getitem__  # a saturated machine: width costs in proportion
    assert best_width([1, 2, 6], steep, [lengths(0.9, 5)] * 4) == 1


def test_per_sequence_depth_is_lossless(batched_engines):
    pipe = load(batched_engines)
    motif = [7, 8, 9, 10, 11]
    prompts = [motif * 5, list(range(20, 45)), motif * 3 + [14], list(range(60, 70)), [5]]
    alone = [pipe.generate(prompt_ids=p, drafter="ngram", max_new_tokens=16, adaptive=False).token_ids
             for p in prompts]
    target = pipe.batched_target()
    requests = [Request(np.asarray(p), 16, Sampling()) for p in prompts]
    done = decode_all(target, pipe.drafter("ngram", target.slots), requests, draft_len=pipe.manifest.draft_len,
                        eos_ids=pipe.text.eos_ids, per_sequence=True)
    assert [r.tokens for r in done] == alone
    assert set(target.costs) >= set(target.calls) and all(t > 0 for t in target.costs.values())
