"""A loop over several drafters (runtime/drafter_set.py): each request drafts with the one it
names, every member drafts only for its own rows, and each output is its request's output alone."""

from __future__ import annotations

import numpy as np
import pytest

PROMPTS = [f"Item {i}: write about {'rivers' if i % 2 else 'stars'} number {i * 7}." for i in range(5)]
MEMBERS = ("quantized-self", "ngram")


@pytest.fixture(scope="module")
def pipe(batched_engines):
    from specexport.runtime import load

    return load(batched_engines, threads=2, check_prices=False)


def spy(monkeypatch, loop, name: str, seen: list) -> None:
    """Record, for every propose call of member ``name``, the drafters of the running requests
    whose rows it was asked to draft for."""
    member = loop.drafter.members[name]
    propose = member.propose

    def recording(rows, budget):
        seen.append([loop.running[r].drafter for r, depth in enumerate(budget.depths) if depth > 0])
        return propose(rows, budget)

    monkeypatch.setattr(member, "propose", recording)  # the pipeline's drafter: put back after the test


def test_each_request_drafts_with_its_own_member_and_keeps_its_output(pipe, monkeypatch):
    # (prompt, the member named; None: the set's default, the first)
    asked = [(0, "ngram"), (1, None), (2, "quantized-self"), (3, "ngram"), (4, None)]
    wants = [pipe.generate(PROMPTS[i], drafter=name or MEMBERS[0], max_new_tokens=12, adaptive=False).token_ids
             for i, name in asked]
    loop = pipe.batch_loop(drafter=list(MEMBERS), max_batch=4, adaptive=False, schedule=False)
    seen: dict[str, list] = {name: [] for name in MEMBERS}
    for name in MEMBERS:
        spy(monkeypatch, loop, name, seen[name])
    for key, (i, name) in enumerate(asked):
        request, _ = pipe.batch_request(pipe.prompt_ids(PROMPTS[i]), max_new_tokens=12, drafter=name)
        loop.submit(key, request)
    done = {key: finished for ended in loop.run() for key, finished in ended}
    assert [done[k].tokens for k in range(len(asked))] == wants
    for name, calls in seen.items():  # a member drafts for its own requests' rows, and for them all
        assert any(calls) and all(owner == name for rows in calls for owner in rows), (name, calls)


def test_a_set_drafts_what_its_members_would(pipe, monkeypatch):
    """The control for the routing: a request naming a member gets that member's drafts, not the
    default's (the two drafters propose differently on these prompts)."""
    ids = pipe.prompt_ids(PROMPTS[0])
    proposals = {}
    for name in MEMBERS:
        loop = pipe.batch_loop(drafter=list(MEMBERS), max_batch=4, adaptive=False, schedule=False)
        seen: list = []
        member = loop.drafter.members[name]
        propose = member.propose

        def recording(rows, budget, propose=propose, seen=seen):
            out = propose(rows, budget)
            seen.append([tree.tokens.tolist() for tree, depth in zip(out, budget.depths) if depth > 0])
            return out

        monkeypatch.setattr(member, "propose", recording)
        request, _ = pipe.batch_request(ids, max_new_tokens=8, drafter=name)
        loop.submit(0, request)
        list(loop.run())
        proposals[name] = [p for call in seen for p in call]
    assert proposals["quantized-self"] and proposals["quantized-self"] != proposals["ngram"]


def test_an_unknown_member_is_refused(pipe):
    from specexport.runtime.drafter_set import DrafterSet

    loop = pipe.batch_loop(drafter=list(MEMBERS), max_batch=4)
    assert isinstance(loop.drafter, DrafterSet)
    with pytest.raises(ValueError, match="draft-model"):
        loop.drafter.assign(0, "draft-model")
    assert np.array_equal(loop.drafter.needs, ())  # neither member reads the target's hidden states


def test_a_finished_request_leaves_through_its_own_member(pipe):
    """suffix decoding keeps what its requests wrote (Drafter.leave): a request of the set's other
    member adds nothing to its store, one of its own adds its response."""
    loop = pipe.batch_loop(drafter=["quantized-self", "suffix"], max_batch=4, adaptive=False)
    store = pipe.stores["suffix"]
    store.clear()
    for name, responses in (("quantized-self", 0), ("suffix", 1)):
        request, _ = pipe.batch_request(pipe.prompt_ids(PROMPTS[0]), max_new_tokens=8, drafter=name)
        loop.submit(name, request)
        list(loop.run())
        assert store.stats()["responses"] == responses, name
