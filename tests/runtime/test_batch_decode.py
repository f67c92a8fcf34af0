"""The batched decode loop (issue 11, part 2): sequences in slots of one batch cache, one verify
pass per round for all of them, joining and leaving between rounds. Every request's greedy
output equals its own batch-1 output, token for token."""

from __future__ import annotations

import json

import numpy as np
import pytest

from specexport.errors import BadInput
from specexport.runtime import load
from tests.conftest import TINY_SHAPE, run_cli
from tests.lossless import (
    assert_sampled_as_target,
    exact_sequence_probs,
    residual_is_q,
    residual_keeps_the_rejected_token,
    use_rule,
)


def _prompts(count: int, seed: int = 0) -> list[list[int]]:
    """Prompts of different lengths, some repetitive (so prompt lookup finds drafts)."""
    rng = np.random.default_rng(seed)
    prompts = []
    for i in range(count):
        if i % 2:
            motif = rng.integers(3, 250, size=5).tolist()
            prompts.append((motif * 6)[: 7 + 4 * i])
        else:
            prompts.append(rng.integers(3, 250, size=1 + 9 * i).tolist())
    return prompts


@pytest.mark.parametrize("drafter, store", [("none", "host"), ("ngram", "host"), ("none", "device"),
                                            ("ngram", "device"), ("quantized-self", "device")])
def test_every_request_decodes_as_it_would_alone(batched_engines, drafter, store):
    """Seven requests through four slots: staggered joins, rows finishing mid-batch (different
    budgets), batch sizes 4, 2 and 1 as the queue drains, a one-token prompt. "device": the
    caches in the device store on the CPU (runtime/device_store.py), the int4 drafter's batched
    cache too."""
    pipe = load(batched_engines, device_store=store == "device")
    prompts = _prompts(6) + [[42]]
    budgets = [5, 17, 9, 30, 12, 3, 20]
    alone = [pipe.generate(prompt_ids=p, drafter=drafter, max_new_tokens=n, adaptive=False).token_ids
             for p, n in zip(prompts, budgets)]
    together = _batched_run(pipe, prompts, budgets, drafter)
    for i, (got, want) in enumerate(zip(together, alone)):
        assert got.tokens == want, (drafter, i)
    if drafter != "none":
        assert sum(g.stats.accepted for g in together) > 0  # drafts were verified in batched rounds


def _batched_run(pipe, prompts, budgets, drafter):
    """Like generate_batch, with one budget per request (decode_all takes each request's own)."""
    from specexport.runtime.acceptance import Sampling
    from specexport.runtime.loop import Request
    from tests.runtime.fakes import decode_all

    target = pipe.batched_target()
    assert target.slots == 4
    requests = [Request(np.asarray(p, dtype=np.int64), n, Sampling()) for p, n in zip(prompts, budgets)]
    return decode_all(target, pipe.drafter(drafter, target.slots), requests, draft_len=pipe.manifest.draft_len,
                        eos_ids=pipe.text.eos_ids)


def test_generate_batch_equals_generate_and_depth_zero_works(batched_engines):
    pipe = load(batched_engines)
    prompts = _prompts(5, seed=3)
    alone = [pipe.generate(prompt_ids=p, drafter="ngram", max_new_tokens=14, adaptive=False, draft_len=0)
             for p in prompts]
    together = pipe.generate_batch(prompts, drafter="ngram", max_new_tokens=14, draft_len=0, max_batch=2)
    assert [g.token_ids for g in together] == [g.token_ids for g in alone]
    assert all(g.stats.proposed == 0 and g.stats.tokens == 14 for g in together)


def test_rows_at_the_end_of_the_cache_decode_in_a_batch_as_alone(batched_engines):
    # rows a few positions from a full cache beside rows with room: the batched verify graph
    # (its padded T, not only the longest row) must fit the fullest row, or onnxruntime's
    # GroupQueryAttention refuses the call; each row then ends as it does alone ("kv_full")
    pipe = load(batched_engines)
    motif = [11, 12, 13, 14, 15, 16]
    room = pipe.max_seq_len
    prompts = [(motif * 40)[: room - 3], (motif * 40)[: room - 9], motif * 3]
    alone = [pipe.generate(prompt_ids=p, drafter="ngram", max_new_tokens=12, adaptive=False) for p in prompts]
    together = pipe.generate_batch(prompts, drafter="ngram", max_new_tokens=12, adaptive=False, schedule=False)
    assert [g.token_ids for g in together] == [g.token_ids for g in alone]
    assert [g.stop_reason for g in together][:2] == ["kv_full", "kv_full"]
    assert sum(g.stats.proposed for g in together) > 0  # the rows with room drafted


def test_a_batched_sampled_run_is_reproducible_and_each_row_has_its_own_stream(batched_engines):
    # fixed prices: adaptive depth checked against the clock chooses by what the rounds took, and
    # a draw's place in the stream follows the depths (``--fixed-prices``: a seeded run repeats)
    pipe = load(batched_engines, check_prices=False)
    prompts = _prompts(3, seed=5)
    first = pipe.generate_batch(prompts, drafter="ngram", max_new_tokens=10, temperature=1.0, seed=11)
    again = pipe.generate_batch(prompts, drafter="ngram", max_new_tokens=10, temperature=1.0, seed=11)
    assert [g.token_ids for g in first] == [g.token_ids for g in again]
    assert all(len(g.token_ids) == 10 for g in first)


def test_a_head_without_its_graphs_is_refused_in_one_line(batched_engines):
    """Drafters with engine state run batched (tests/runtime/test_batch_drafter.py, heads:
    test_batch_heads.py); an entry whose graphs the directory lacks is refused."""
    import dataclasses

    from specexport.contract import DrafterEntry

    pipe = load(batched_engines)
    pipe.manifest = dataclasses.replace(pipe.manifest, drafters={
        **pipe.manifest.drafters, "eagle3": DrafterEntry("eagle3", "eagle3", "eagle3")})
    with pytest.raises(BadInput, match="cannot run batched: its model 'eagle3' has no onnxruntime graphs"):
        pipe.generate_batch([[5, 6, 7]], drafter="eagle3")


def test_generate_prompts_file_writes_one_json_line_per_prompt(batched_engines, tmp_path):
    pipe = load(batched_engines)
    records = [{"id": "a", "category": "chat", "prompt": "hello there"},
               {"id": "b", "category": "chat", "messages": [{"role": "user", "content": "abcabcabc"}]},
               {"id": "c", "category": "code", "prompt": "x = 1\nx = 1\nx ="}]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    code, out, err = run_cli("generate", batched_engines, "--prompts-file", path, "--drafter", "ngram", "-n", "8", "--json")
    assert code == 0, err
    lines = [json.loads(line) for line in out.splitlines() if line.strip()]
    assert [line["id"] for line in lines] == ["a", "b", "c"]
    for record, line in zip(records, lines):
        want = pipe.generate(record.get("prompt"), messages=record.get("messages"), drafter="ngram",
                             max_new_tokens=8, adaptive=False)
        assert line["token_ids"] == want.token_ids and line["text"] == want.text
        assert line["stats"]["tokens"] == 8


def test_a_directory_built_for_batch_one_decodes_its_prompts_in_turn(tiny_engines):
    """A standard-attention directory built for batch 1: the loop has one slot, and the prompts
    take it in turn, each decoding as generate does."""
    pipe = load(tiny_engines.get("llama", **TINY_SHAPE))  # the session's shared standard build (tests/conftest.py)
    prompts = _prompts(3, seed=4)
    together = pipe.generate_batch(prompts, drafter="ngram", max_new_tokens=9, adaptive=False)
    assert pipe.batched_target().slots == 1
    assert [g.token_ids for g in together] == [pipe.generate(prompt_ids=p, drafter="ngram", max_new_tokens=9,
                                                             adaptive=False).token_ids for p in prompts]


def test_bench_batch_reports_every_batch_size_and_mode_losslessly(batched_engines, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "category": "c" if i % 2 else "g",
                                           "prompt": "abc abc abc " * (i + 1)}) + "\n" for i in range(5)))
    out = tmp_path / "out"
    code, _, err = run_cli("bench", batched_engines, "--batch", "1,2,4", "--prompts", prompts, "-n", "6", "--out", out,
                           "--repeats", "2")
    assert code == 0, err
    result = json.loads((out / "bench_batched.json").read_text())
    assert result["repeats"] == 2 and len(result["rows"]) == len({(r["loop"], r["batch"], r["drafter"], r["depth"],
                                                                   r["depth_rule"]) for r in result["rows"]})
    depth = load(batched_engines).manifest.draft_len
    seen = {(r["loop"], r["batch"], r["drafter"], r["depth"], r["depth_rule"]) for r in result["rows"]}
    fixed = (("none", 0, "fixed"), ("ngram", depth, "fixed"), ("ngram", 1, "fixed"))
    batched_modes = (*fixed, ("ngram", depth, "per-sequence"))
    assert seen == ({("batched", b, *mode) for b in (1, 2, 4) for mode in batched_modes}
                    | {("single", 1, *mode) for mode in fixed})
    assert all(r["lossless"] and r["tokens"] == 30 for r in result["rows"])  # per-sequence depth too
    assert all(r["speedup"] == 1.0 for r in result["rows"] if r["drafter"] == "none")
    assert (out / "speedup_by_batch.png").stat().st_size > 0 and "| 4 |" in (out / "bench_batched.md").read_text()
    code, _, err = run_cli("bench", batched_engines, "--batch", "8", "--prompts", prompts, "-n", "4", "--out", out)
    assert code == 2 and "built for batch sizes [1, 2, 4]" in err


# (drafter, prompt, tokens, the wrong rule of the control): prompts where the drafts are
# sometimes kept (the n-gram guesses "l", to which the target's warped p gives about 0.3). For
# the n-gram's point mass the wrong rule forgets to remove the rejected token from p.
BATCHED_SAMPLED = [("ngram", "hello hello hello hel", 2, residual_keeps_the_rejected_token),
                   ("quantized-self", "1, 2, 1, 2, 1, 2, 1,", 3, residual_is_q)]


@pytest.mark.parametrize("right_rule", [True, False], ids=["right-rule", "control"])
@pytest.mark.parametrize("drafter, prompt, length, wrong_rule", BATCHED_SAMPLED, ids=["ngram", "quantized-self"])
def test_batched_sampled_tokens_follow_the_target(batched_engines, drafter, prompt, length, wrong_rule, right_rule,
                                                  monkeypatch):
    """Rejection sampling per row in shared verify passes: the first tokens of a prompt, decoded
    in batches beside another prompt at a different position, drawn as the target alone would
    draw them (chi-square against the exact warped target probabilities). The int4 drafter
    samples its drafts per row from its own batched cache (three tokens: two drafts, so a
    batched draft step too). The control: the same draws under a wrong rule must fail."""
    from specexport.runtime.acceptance import Sampling

    pipe = load(batched_engines, check_prices=False)  # the build's prices: drafts verified as often as planned
    sampling = Sampling(temperature=1.5, top_k=3, top_p=0.95)
    ids = pipe.prompt_ids(prompt)
    other = pipe.prompt_ids("a longer prompt at another position, a longer prompt at")
    exact = exact_sequence_probs(pipe, ids, sampling, length)
    draws = 800
    use_rule(monkeypatch, None if right_rule else wrong_rule)
    # at the full depth every round: the rule under test, not adaptive depth, decides what is kept
    results = pipe.generate_batch([ids, other] * draws, drafter=drafter, max_new_tokens=length, temperature=1.5,
                                  top_k=3, top_p=0.95, seed=0, adaptive=False)
    counts = dict.fromkeys(exact, 0)
    for result in results[::2]:
        counts[tuple(result.token_ids)] = counts.get(tuple(result.token_ids), 0) + 1
    if right_rule:
        assert set(counts) == set(exact), f"{set(counts) - set(exact)} are outside the target's support"
        rows = results[::2]
        proposed, accepted = sum(r.stats.proposed for r in rows), sum(r.stats.accepted for r in rows)
        assert proposed > accepted > 0  # the prompt's drafts were verified: some kept, some rejected
    assert_sampled_as_target(counts, exact, draws, right_rule=right_rule)


@pytest.mark.parametrize("drafter", ["ngram", "quantized-self"])
def test_a_request_alone_decodes_as_generate_with_its_adaptive_depth(batched_engines, drafter):
    """Alone in the loop, a request gets generate's adaptive depth round for round (the same
    drafts proposed at each position) and so, seeded and sampled, the same draws and tokens.
    Costs are set here (a wide verify is dear), not timed by the build, so that adaptive depth
    surely chooses otherwise than the full depth."""
    from specexport.runtime.api import Pipeline
    from specexport.runtime.costs import TunedCosts

    built = load(batched_engines)
    ms = {e.name: 1.0 + 3.0 * e.tokens if e.model == "target" else 2.0 for e in built.manifest.engines}
    pipe = Pipeline(built.manifest, built.options, built.backend,
                    tuned=TunedCosts({built.backend: ms}, "test", "fixed", batched_engines / "costs.json"),
                    check_prices=False)  # the prices as set, not the clock's
    prompts = [p for i, p in enumerate(_prompts(6, seed=2)) if i % 2]  # repetitive: drafts land
    varied = False
    for settings in ({}, {"temperature": 1.0, "top_k": 8, "seed": 5}):
        for prompt in prompts:
            alone = pipe.generate(prompt_ids=prompt, drafter=drafter, max_new_tokens=24, **settings)
            fixed = pipe.generate(prompt_ids=prompt, drafter=drafter, max_new_tokens=24, adaptive=False, **settings)
            [looped] = pipe.generate_batch([prompt], drafter=drafter, max_new_tokens=24, **settings)
            assert looped.token_ids == alone.token_ids
            assert (looped.stats.rounds, looped.stats.proposed_at) == (alone.stats.rounds, alone.stats.proposed_at)
            varied |= alone.stats.proposed_at != fixed.stats.proposed_at  # adaptive depth chose otherwise
    assert varied  # the equality above is about depth choices, not fixed depth on both sides
