"""Hybrid targets (a recurrent state per row beside the K/V) in the batched loop: six requests
through four slots, staggered joins, rows leaving mid-batch (the last row's state moved into
the freed slot), rollback a choice of kept state per row. Every request gives its own batch-1
output: greedy token for token, and seeded sampled draw for draw (each row its own stream)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from specexport.runtime import load
from specexport.runtime.acceptance import Sampling
from specexport.runtime.device_store import DeviceStore
from specexport.runtime.model import RecurrentSlotView
from tests.lossless import assert_sampled_as_target, exact_sequence_probs, residual_is_q, rules, use_rule

BUDGETS = [5, 30, 9, 26, 12, 3]


def six_prompts(pipe) -> list[list[int]]:
    """Six prompts of different lengths, one of a single token, and two on which the tiny
    models fall into repeating a token (so n-gram drafts are kept too)."""
    rng = np.random.default_rng(0)
    motif = pipe.prompt_ids("1, 2, 1, 2, 1, 2, 1,")
    return [rng.integers(3, 250, size=9).tolist(), list(motif), [42], [*motif, *motif[-7:]],
            rng.integers(3, 250, size=30).tolist(), list(motif)[:9]]


def through_four_slots(pipe, drafter: str, temperature: float = 0.0, top_k: int = 0, **loop) -> list:
    """The six prompts through one batch loop of four slots, each with its budget and (sampled)
    its seed: their results in order."""
    batch_loop = pipe.batch_loop(drafter=drafter, **loop)
    assert batch_loop.target.slots == 4
    for i, (prompt, budget) in enumerate(zip(six_prompts(pipe), BUDGETS)):
        request, _ = pipe.batch_request(prompt, max_new_tokens=budget, temperature=temperature, top_k=top_k,
                                            seed=10 + i)
        batch_loop.submit(i, request)
    done = {key: finished for ended in batch_loop.run() for key, finished in ended}
    return [done[i] for i in range(len(BUDGETS))]


def alone(pipe, drafter: str, temperature: float = 0.0, top_k: int = 0) -> list[list[int]]:
    return [pipe.generate(prompt_ids=p, drafter=drafter, max_new_tokens=n, temperature=temperature, top_k=top_k,
                          seed=10 + i, adaptive=False).token_ids
            for i, (p, n) in enumerate(zip(six_prompts(pipe), BUDGETS))]


@pytest.mark.parametrize("build, drafter, store", [
    ("batched_hybrid", "none", "host"), ("batched_hybrid", "ngram", "host"), ("batched_hybrid", "quantized-self", "host"),
    ("batched_hybrid_in_place", "ngram", "host"), ("batched_hybrid_in_place", "quantized-self", "host"),
    ("batched_hybrid_in_place", "quantized-self", "device")])
def test_six_requests_through_four_slots_decode_greedily_as_alone(build, drafter, store, request):
    """With the plan's batch schedule and each row's adaptive depth (greedy: any depth gives the
    target's tokens); the int4 drafter is a recurrent model too, its rows rolled back each round.
    "device": the K/V in the device store on the CPU (runtime/device_store.py), the states on
    the host beside it."""
    pipe = load(request.getfixturevalue(build), device_store=store == "device")
    together = through_four_slots(pipe, drafter, per_sequence=True)
    assert [g.tokens for g in together] == alone(pipe, drafter)
    target = pipe.batched_target()
    assert all(isinstance(cache, RecurrentSlotView) for cache in target.caches.slots)
    assert isinstance(target.caches.store, DeviceStore) == (store == "device")
    if drafter != "none":  # drafts were verified in batched rounds (the tiny Qwen3-Next keeps no n-gram's)
        assert sum(g.stats.proposed for g in together) > 0
        assert sum(g.stats.accepted for g in together) > 0 or (build, drafter) == ("batched_hybrid_in_place", "ngram")


@pytest.mark.parametrize("drafter", ["ngram", "quantized-self"])
def test_six_seeded_sampled_requests_through_four_slots_draw_as_alone(batched_hybrid, drafter):
    """At a fixed depth each row draws what it draws alone with its seed: the same drafts
    (the int4 drafter samples them from its own rows' states), the same accept tests."""
    pipe = load(batched_hybrid)
    together = through_four_slots(pipe, drafter, temperature=0.3, top_k=2, schedule=False, adaptive=False)
    assert [g.tokens for g in together] == alone(pipe, drafter, temperature=0.3, top_k=2)
    assert sum(g.stats.accepted for g in together) > 0


def test_a_batched_call_keeps_each_fed_rows_states_and_leaves_idle_rows_alone(batched_hybrid):
    """Two rows fed through the batch-4 graph: each row keeps the states its own batch-1 run
    keeps; the idle slots' states (one holding a prefilled sequence) are neither read into the
    fed rows nor written."""
    pipe = load(batched_hybrid)
    target = pipe.batched_target()
    states = target.caches.states
    prompts = six_prompts(pipe)
    target.runners[2].cache.set_length(0)
    target.runners[2].forward(prompts[4])  # slot 2 holds a sequence of its own, idle in the call
    held = {name: array[2].copy() for name, array in states.rows().items()}
    out = target.run(2, {0: (0, np.asarray(prompts[0][:4]), {}), 1: (0, np.asarray(prompts[1][:3]), {})}, False)
    assert out["next_tokens"].shape[0] == 4  # the batch-4 graph, rows 2 and 3 idle
    assert all(np.array_equal(states.rows()[name][2], held[name]) for name in held)
    assert states.reaches(2, len(prompts[4])) and not states.reaches(3, 1)
    single = pipe.runner("target")
    for row, count in ((0, 4), (1, 3)):
        single.cache.set_length(0)
        single.forward(prompts[row][:count])
        states.set_length(row, count)  # the row's last position, chosen for its next call
        for name, want in single.cache.state_store.rows().items():
            np.testing.assert_allclose(states.rows()[name][row], want[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rule", rules(residual_is_q))
def test_batched_sampled_tokens_over_recurrent_states_follow_the_target(batched_hybrid, rule, monkeypatch):
    """The hybrid's chi-square test, batched: a prompt's first three tokens, decoded beside
    another prompt at another position in shared verify passes, against the target's exact
    warped probabilities (from target-alone logits). The int4 copy drafts (a recurrent model
    itself): its drafts are mostly kept, so each row's state is chosen at several depths after
    a rejection. The control: the same draws with the replacement token drawn from q must fail."""
    pipe = load(batched_hybrid, check_prices=False)
    sampling = Sampling(temperature=1.3, top_k=3)
    ids = pipe.prompt_ids("1, 2, 1, 2, 1, 2, 1,")
    other = pipe.prompt_ids("a longer prompt at another position, a longer prompt at")
    exact = exact_sequence_probs(pipe, ids, sampling, 3)
    draws = 600
    use_rule(monkeypatch, rule)
    results = pipe.generate_batch([ids, other] * draws, drafter="quantized-self", max_new_tokens=3, temperature=1.3,
                                  top_k=3, seed=0, adaptive=False)
    counts: dict[tuple[int, ...], int] = {}
    for result in results[::2]:
        counts[tuple(result.token_ids)] = counts.get(tuple(result.token_ids), 0) + 1
    if rule is None:
        assert set(counts) <= set(exact), f"{set(counts) - set(exact)} are outside the target's top-k support"
        assert sum(r.stats.accepted >= 2 for r in results[::2]) > 0, "no round kept two drafts"
        assert sum(r.stats.proposed for r in results[::2]) > sum(r.stats.accepted for r in results[::2])
    assert_sampled_as_target(counts, exact, draws, right_rule=rule is None)


# -- every drafter kind over a batched hybrid -------------------------------------------------

DRAFTERS = ("mtp", "eagle3", "dflash", "dspark", "draft-model")


def build_hybrid_with_every_drafter(root: Path) -> Path:
    """A tiny Qwen3.5 checkpoint (linear, full, linear, full attention layers) with its own MTP
    layer, built with batch sizes 1 and 4 and a drafter of every kind that runs a model: the
    MTP layer, EAGLE-3, DFlash and DSpark heads reading its hidden states, a tiny draft model."""
    from transformers import AutoModelForCausalLM

    from specexport.exporter.builder import build_recipe
    from specexport.exporter.recipe import parse_recipe
    from specexport.progress import Reporter
    from tests.heads.block_checkpoints import write_speculators_dflash, write_speculators_dspark
    from tests.heads.chain_checkpoints import write_eagle3, write_mtp_target

    folder = write_mtp_target(root / "t", "qwen3_5", "qwen3-next", num_layers=4)
    target = AutoModelForCausalLM.from_pretrained(folder)
    assert "linear_attention" in target.config.layer_types
    write_eagle3(root / "eagle3", target.config, "speculators", layer_ids=[0, 1, 3])
    write_speculators_dflash(root / "dflash", target, draft_vocab=100)
    write_speculators_dspark(root / "dspark", target)
    drafters = [{"kind": "mtp", "name": "mtp"},
                *({"kind": kind, "name": kind, "path": kind} for kind in ("eagle3", "dflash", "dspark")),
                {"kind": "model", "name": "draft-model",
                 "model": {"source": "tiny", "arch": "llama", "seed": 7, "num_layers": 1}}]
    raw = {"name": "hybrid-drafters", "target": {"source": "hf", "path": "t"}, "drafters": drafters,
           "shapes": {"batch": [1, 4], "max_seq_len": 64, "prefill_chunk": 8}, "draft": {"tile": 128, "max_draft": 3}}
    build_recipe(parse_recipe(raw, "recipe"), root, root / "out", False, Reporter(quiet=True))
    return root / "out"


@pytest.fixture(scope="module")
def hybrid_with_every_drafter(tmp_path_factory) -> Path:
    return build_hybrid_with_every_drafter(tmp_path_factory.mktemp("hybrid-drafters"))


@pytest.mark.slow  # its build: about 45 s on 2 cores
@pytest.mark.parametrize("drafter", DRAFTERS)
def test_every_drafter_over_a_batched_hybrid_gives_each_request_its_batch_one_output(hybrid_with_every_drafter,
                                                                                   drafter):
    """Greedy with the plan's schedule and each row's adaptive depth, then seeded sampled at a
    fixed depth: the heads read each row's hidden states from the batched verify pass over the
    rows' own recurrent states; the draft model keeps its own K/V rows."""
    pipe = load(hybrid_with_every_drafter)
    greedy = through_four_slots(pipe, drafter, per_sequence=True)
    assert [g.tokens for g in greedy] == alone(pipe, drafter)
    assert sum(g.stats.proposed for g in greedy) > 0
    sampled = through_four_slots(pipe, drafter, temperature=0.3, top_k=2, schedule=False, adaptive=False)
    assert [g.tokens for g in sampled] == alone(pipe, drafter, temperature=0.3, top_k=2)
