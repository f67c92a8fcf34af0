"""Drafters with their own KV cache in the batched loop (issue 11): the int4 copy of the target and
draft models draft for every running row at once, in one [B_max] cache of the draft model whose
rows follow the target's slots. Every request decodes as it would alone: the same tokens, and
(greedy) the same drafts, so each row's draft cache stays in step with its own sequence."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from specexport.contract import DrafterEntry, DraftSchedule
from specexport.errors import BadInput
from specexport.runtime import load
from specexport.runtime.acceptance import Sampling
from specexport.runtime.adaptive import DepthPolicy
from specexport.runtime.api import HEAD_KINDS, batched_refusal
from specexport.runtime.drafters import ModelDrafter
from specexport.runtime.loop import Request
from specexport.runtime.tree import DraftTree
from tests.conftest import run_cli
from tests.runtime.fakes import decode_all
from tests.runtime.own_cache import int4_copy
from tests.runtime.test_batch_decode import _prompts

MODEL_DRAFTERS = ("quantized-self", "draft-model")


def _alone(pipe, drafter: str, prompts, budgets, **kwargs):
    return [pipe.generate(prompt_ids=p, drafter=drafter, max_new_tokens=n, adaptive=False, **kwargs)
            for p, n in zip(prompts, budgets)]


def _together(pipe, drafter: str, prompts, budgets, schedule: DraftSchedule | None = None):
    """decode_all with each request's own budget, through the pipeline's batched drafter."""
    target = pipe.batched_target()
    requests = [Request(np.asarray(p, dtype=np.int64), n, Sampling()) for p, n in zip(prompts, budgets)]
    return decode_all(target, pipe.drafter(drafter, target.slots), requests, draft_len=pipe.manifest.draft_len,
                        eos_ids=pipe.text.eos_ids, schedule=schedule)


def _drafting(stats) -> tuple[int, int, int]:
    return stats.rounds, stats.proposed, stats.accepted


def _own_cache(pipe, slots: int) -> ModelDrafter:
    """The int4 copy computing its own K/V: the draft model family's prefill and catch-up, which
    a shared cache never needs."""
    return int4_copy(pipe, share=False, slots=slots)


@pytest.mark.parametrize("drafter", MODEL_DRAFTERS)
def test_every_request_decodes_and_drafts_as_it_would_alone(batched_engines, drafter):
    """Seven requests through four slots: staggered joins, rows leaving mid-batch (the last row's
    draft cache moves into the freed slot), batch sizes 4, 2 and 1 as the queue drains, a
    one-token prompt, and rows at depth 0 in their last round (one token of budget left) beside
    rows that draft. Same tokens, and the same rounds, drafts offered and drafts kept."""
    pipe = load(batched_engines)
    prompts = _prompts(6) + [[42]]
    budgets = [5, 17, 9, 30, 12, 3, 20]
    alone = _alone(pipe, drafter, prompts, budgets)
    together = _together(pipe, drafter, prompts, budgets)
    for i, (got, want) in enumerate(zip(together, alone)):
        assert got.tokens == want.token_ids, (drafter, i)
        assert _drafting(got.stats) == _drafting(want.stats), (drafter, i)
    assert sum(g.stats.proposed for g in together) > 0
    if drafter == "quantized-self":  # the int4 copy agrees with its target: drafts are kept
        assert sum(g.stats.accepted for g in together) > 0
        assert all(g.stats.draft_engine_s > 0 for g in together)


def test_rows_that_skip_drafting_catch_up_when_depth_returns(batched_engines, monkeypatch):
    """A schedule that drafts only at two rows or fewer: while four run, no row drafts and their
    draft caches fall behind by a token a round; once rows leave, each catches up (the gap past
    the catch-up graph at batch 1, in its own slot) and drafts what it would have drafted."""
    alone_feeds = []
    forward_alone = ModelDrafter._forward_alone

    def spy(self, slot, tokens):
        alone_feeds.append(len(tokens))
        return forward_alone(self, slot, tokens)

    monkeypatch.setattr(ModelDrafter, "_forward_alone", spy)
    pipe = load(batched_engines)
    prompts = _prompts(6, seed=2)
    budgets = [30, 25, 8, 40, 11, 28]
    alone = _alone(pipe, "none", prompts, budgets)
    target = pipe.batched_target()
    requests = [Request(np.asarray(p, dtype=np.int64), n, Sampling()) for p, n in zip(prompts, budgets)]
    together = decode_all(target, _own_cache(pipe, target.slots), requests, draft_len=pipe.manifest.draft_len,
                          eos_ids=pipe.text.eos_ids, schedule=DraftSchedule(((2, 4),)))
    assert [g.tokens for g in together] == [a.token_ids for a in alone]
    assert alone_feeds and max(alone_feeds) > 2  # long gaps were caught up
    assert sum(g.stats.accepted for g in together) > 0  # and the drafts after them were good ones
    assert any(g.stats.proposed == 0 for g in together)  # rows that never drafted


def test_a_row_that_never_drafts_never_runs_the_draft_model(batched_engines):
    """A schedule that drafts at no batch size: the draft model's prefill waits for a first draft
    that never comes (Drafter.prefill), so its engines never run and the loop costs what the
    target alone costs; a row that joins where the schedule drafts prefills it at once."""
    pipe = load(batched_engines)
    prompts = _prompts(5, seed=8)
    budgets = [6, 9, 4, 7, 5]
    target = pipe.batched_target()
    requests = [Request(np.asarray(p, dtype=np.int64), n, Sampling()) for p, n in zip(prompts, budgets)]
    idle = _own_cache(pipe, target.slots)
    together = decode_all(target, idle, requests, draft_len=pipe.manifest.draft_len, eos_ids=pipe.text.eos_ids,
                          schedule=DraftSchedule(((1, 0),)))
    assert [g.tokens for g in together] == [a.token_ids for a in _alone(pipe, "none", prompts, budgets)]
    assert idle.engine_seconds == 0.0 and all(g.stats.proposed == 0 for g in together)
    drafting = _own_cache(pipe, target.slots)
    decode_all(target, drafting, requests[:1], draft_len=pipe.manifest.draft_len, eos_ids=pipe.text.eos_ids)
    runner = drafting.model.runners[0]
    assert runner.seconds > 0 and runner.length >= len(prompts[0]) - 1  # its prompt fed, then its drafts


def test_a_draft_model_adaptive_depth_keeps_off_is_never_fed(batched_engines):
    """Adaptive depth may choose 0 from the first round on (here: its estimate says drafts are
    never kept), so the draft model's prefill waits for a first draft and never runs; the
    control, the same loop at a fixed depth, prefills at once."""
    pipe = load(batched_engines, check_prices=False)
    prompts = _prompts(3, seed=9)
    target = pipe.batched_target()
    requests = [Request(np.asarray(p, dtype=np.int64), 6, Sampling()) for p in prompts]

    def never() -> DepthPolicy:
        policy = pipe.costs.depth_policy(idle, pipe.target)
        for _ in range(30):
            policy.estimate.observe(idle.name, DraftTree.chain(np.zeros(4, dtype=np.int64)), 0)
        policy.probe_every = 10**6  # and never probes
        return policy

    for adaptive in (never, None):
        idle = _own_cache(pipe, target.slots)
        done = decode_all(target, idle, requests, draft_len=pipe.manifest.draft_len, eos_ids=pipe.text.eos_ids,
                          adaptive=adaptive)
        assert [g.tokens for g in done] == [a.token_ids for a in _alone(pipe, "none", prompts, [6] * 3)]
        assert (idle.engine_seconds == 0.0) is (adaptive is not None), idle.engine_seconds


def test_sampled_rows_draw_exactly_what_they_would_draw_alone(batched_engines):
    """Each row drafts and rejects with its own rng, in the order the single-sequence loop uses
    it: the same seed gives the same tokens, batched or not."""
    pipe = load(batched_engines)
    prompts = _prompts(5, seed=4)
    alone = [pipe.generate(prompt_ids=p, drafter="quantized-self", max_new_tokens=12, temperature=1.0, seed=3 + i,
                           adaptive=False).token_ids for i, p in enumerate(prompts)]
    together = pipe.generate_batch(prompts, drafter="quantized-self", max_new_tokens=12, temperature=1.0, seed=3,
                                   adaptive=False)
    assert [g.token_ids for g in together] == alone
    assert sum(g.stats.accepted for g in together) > 0
    assert together[0].backends == {"target": "onnxruntime", "quantized-self": "onnxruntime"}


def test_per_sequence_depth_with_the_int4_drafter(batched_engines):
    pipe = load(batched_engines)
    prompts = _prompts(5, seed=6)
    alone = _alone(pipe, "quantized-self", prompts, [15] * 5)
    together = pipe.generate_batch(prompts, drafter="quantized-self", max_new_tokens=15, per_sequence=True)
    assert [g.token_ids for g in together] == [a.token_ids for a in alone]
    assert sum(g.stats.proposed for g in together) > 0


def test_a_drafter_model_without_the_targets_batch_sizes_is_refused(batched_engines):
    pipe = load(batched_engines)
    pipe.manifest = dataclasses.replace(pipe.manifest, engines=[
        e for e in pipe.manifest.engines if not (e.model == "quantized-self" and e.batch == 4)])
    with pytest.raises(BadInput, match=r"'quantized-self' \(quantized-self\) cannot run batched: .*"
                                       r"batch sizes \[1, 2\], not \[4\]"):
        pipe.batch_loop(drafter="quantized-self")
    # up to the batch sizes it has, it runs
    assert batched_refusal(pipe.manifest, "quantized-self", max_batch=2) is None
    prompts = _prompts(3, seed=8)
    together = pipe.generate_batch(prompts, drafter="quantized-self", max_new_tokens=8, max_batch=2)
    assert [g.token_ids for g in together] == [a.token_ids for a in _alone(pipe, "quantized-self", prompts, [8] * 3)]


@pytest.mark.parametrize("kind", HEAD_KINDS)
def test_a_head_without_its_graphs_or_the_targets_taps_is_refused_in_one_line(batched_engines, kind):
    """Heads run batched (tests/runtime/test_batch_heads.py) when the directory has their graphs
    and the target's taps; a manifest entry without them is refused before anything runs."""
    pipe = load(batched_engines)
    pipe.manifest = dataclasses.replace(pipe.manifest, drafters={
        **pipe.manifest.drafters, "head": DrafterEntry("head", kind, "head")})
    with pytest.raises(BadInput, match=f"'head' \\({kind}\\) cannot run batched: its model 'head' has no "
                                       "onnxruntime graphs"):
        pipe.batch_loop(drafter="head")
    # its graphs present (the int4 copy's stand in), the target's taps still missing
    pipe.manifest = dataclasses.replace(pipe.manifest, drafters={
        **pipe.manifest.drafters, "head": DrafterEntry("head", kind, "quantized-self")})
    assert "output no aux_hidden_states" in batched_refusal(pipe.manifest, "head")


def test_one_batched_drafter_per_target_and_name(batched_engines):
    pipe = load(batched_engines)
    first = pipe.batch_loop(drafter="quantized-self").drafter
    assert pipe.batch_loop(drafter="quantized-self").drafter is first
    assert pipe.batch_loop(drafter="quantized-self", max_batch=2).drafter is not first  # other slots
    with pytest.raises(BadInput, match="unknown drafter 'nope'"):
        pipe.batch_loop(drafter="nope")


def test_serve_accepts_the_model_drafters(batched_engines):
    from specexport.cli.serve import check_servable

    assert check_servable(batched_engines, "quantized-self", None) == "quantized-self"
    assert check_servable(batched_engines, "draft-model", 2) == "draft-model"
    assert batched_refusal(load(batched_engines, verify=False).manifest, "ngram") is None


def test_generate_prompts_file_with_the_int4_drafter(batched_engines, tmp_path):
    pipe = load(batched_engines)
    records = [{"id": "a", "prompt": "hello there, hello there"}, {"id": "b", "prompt": "x = 1\nx = 1\nx ="},
               {"id": "c", "prompt": "abc"}]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    code, out, err = run_cli("generate", batched_engines, "--prompts-file", path, "--drafter", "quantized-self",
                             "-n", "10", "--max-batch", "2", "--json")
    assert code == 0, err
    lines = [json.loads(line) for line in out.splitlines() if line.strip()]
    for record, line in zip(records, lines):
        want = pipe.generate(record["prompt"], drafter="quantized-self", max_new_tokens=10, adaptive=False)
        assert line["token_ids"] == want.token_ids
    assert sum(line["stats"]["proposed"] for line in lines) > 0


def test_bench_batch_runs_the_int4_drafter_losslessly(batched_engines, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "category": "c", "prompt": "abc abc abc " * (i + 1)}) + "\n"
                               for i in range(4)))
    out = tmp_path / "out"
    code, _, err = run_cli("bench", batched_engines, "--batch", "1,2", "--drafters", "quantized-self",
                           "--prompts", prompts, "-n", "6", "--out", out, "--repeats", "1")
    assert code == 0, err
    rows = json.loads((out / "bench_batched.json").read_text())["rows"]
    drafted = [r for r in rows if r["drafter"] == "quantized-self"]
    assert {(r["loop"], r["batch"], r["depth_rule"]) for r in drafted} >= {("batched", 2, "fixed"),
                                                                          ("batched", 2, "per-sequence")}
    assert all(r["lossless"] and r["tokens"] == 24 for r in rows)
    assert any(r["acceptance_length"] > 1 for r in drafted)


def test_bench_refuses_a_head_before_running(batched_engines, tmp_path, monkeypatch):
    from specexport.bench.batched import run_batched

    pipe = load(batched_engines)
    pipe.manifest = dataclasses.replace(pipe.manifest, drafters={
        **pipe.manifest.drafters, "eagle3": DrafterEntry("eagle3", "eagle3", "eagle3")})
    with pytest.raises(BadInput, match="--drafters: 'eagle3' \\(eagle3\\) cannot run batched"):
        run_batched(pipe, tmp_path / "never-read.jsonl", [1, 2], ["eagle3"], 4, reporter=None)
