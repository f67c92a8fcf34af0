"""Hybrid targets (a recurrent state per row beside the K/V) in the batched loop: six requests
through four slots, staggered joins, rows leaving mid-batch (the last row's state moved into
the freed slot), rollback a choice of kept state per row. Every request gives its own batch-1
output: greedy token for token, and seeded sampled draw for draw (each row its own stream)."""

from __future__ import annotations

import numpy as np
import pytest

from specexport.runtime import load
from specexport.runtime.model import RecurrentSlotView

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


@pytest.mark.parametrize("build, drafter", [("batched_hybrid", "none"), ("batched_hybrid", "ngram"),
                                            ("batched_hybrid", "quantized-self"),
                                            ("batched_hybrid_in_place", "ngram"),
                                            ("batched_hybrid_in_place", "quantized-self")])
def test_six_requests_through_four_slots_decode_greedily_as_alone(build, drafter, request):
    """With the plan's batch schedule and each row's adaptive depth (greedy: any depth gives the
    target's tokens); the int4 drafter is a recurrent model too, its rows rolled back each round."""
    pipe = load(request.getfixturevalue(build))
    together = through_four_slots(pipe, drafter, per_sequence=True)
    assert [g.tokens for g in together] == alone(pipe, drafter)
    target = pipe.batched_target()
    assert all(isinstance(cache, RecurrentSlotView) for cache in target.caches.slots)
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
