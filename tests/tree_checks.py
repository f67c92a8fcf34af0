"""Checks shared by the drafters' tree tests: the trees a greedy decode drafts, and each tree
against a reference's own choice (the same nodes as token paths, weights equal to their joint
draft probabilities)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import numpy as np
import pytest


def trees_drafted(pipe, drafter: str, prompt: str | list[str], nodes: int,
                  new_tokens: int = 12) -> list[tuple[np.ndarray, object, int, int]]:
    """Greedy tree decoding at fixed depth, recording every tree with the context it followed,
    the depth asked for (less than D near the end of the output) and the nodes asked for (at
    B > 1 at most the depth). A list of prompts decodes together in one batch, each tree drafted
    for its own row (slot)."""
    slots = 1 if isinstance(prompt, str) else pipe.batched_target(len(prompt)).slots
    chosen = pipe.drafter(drafter, slots)  # the instance the loop over those slots drafts with
    seen = []
    grow = chosen.trees

    def spy(rows, budget):
        trees = grow(rows, budget)
        depths, count = budget.depths, budget.nodes
        seen.extend((np.array(row.context), tree, depth, count)
                    for row, depth, tree in zip(rows, depths, trees) if tree is not None)
        return trees

    chosen.trees = spy
    try:
        if isinstance(prompt, str):
            pipe.generate(prompt, drafter=drafter, max_new_tokens=new_tokens, adaptive=False, tree_nodes=nodes)
        else:
            pipe.generate_batch(prompt, drafter=drafter, max_new_tokens=new_tokens, adaptive=False, schedule=False,
                                tree_nodes=nodes, max_batch=len(prompt))
    finally:
        del chosen.trees
    return seen


def node_paths(tree) -> list[tuple[int, ...]]:
    """Each node as the tokens from the root's child down to it."""
    return [tuple(int(tree.tokens[n]) for n in tree.path(i)) for i in range(tree.size)]


def spine_choice(levels: Sequence[tuple[Sequence[int], Sequence[float]]],
                 nodes: int) -> tuple[list[tuple[int, ...]], np.ndarray]:
    """A spine tree by hand: level j's candidates (ids, log q; best first, the first on the
    spine) under the spine node above. Returns the ``nodes`` heaviest as token paths and every
    candidate's log joint probability, heaviest first."""
    spine, path, found = 0.0, (), []
    for ids, logp in levels:
        found += [(spine + float(v), path + (int(t),)) for t, v in zip(ids, logp)]
        spine, path = spine + float(logp[0]), path + (int(ids[0]),)
    found.sort(key=lambda c: -c[0])
    return [p for _, p in found[:nodes]], np.array([j for j, _ in found])


def check_trees(trees, reference: Callable[[np.ndarray, int, int], tuple[list, np.ndarray]],
                near_tie: float, rel: float) -> int:
    """Every drafted tree (``trees_drafted``) against ``reference(context, depth, nodes)`` ->
    (the paths it keeps, every candidate's log joint, heaviest first); a cut at a near-tie (two
    candidates within ``near_tie`` of each other) is skipped. Returns the trees checked."""
    checked = 0
    for context, tree, depth, nodes in trees:
        want, joints = reference(context, depth, nodes)
        if len(joints) > nodes and joints[nodes - 1] - joints[nodes] < near_tie:
            continue  # torch and onnxruntime may keep either
        got = node_paths(tree)
        assert sorted(got) == sorted(want), (len(context), got, want)
        weight = dict(zip(got, tree.weights))
        assert [weight[p] for p in want] == pytest.approx(np.exp(joints[: len(want)]), rel=rel)
        checked += 1
    return checked


def assert_batch_of_trees_lossless(pipe, drafter: str, prompts: Sequence[str], new_tokens: int, nodes: int,
                                   adaptive: bool = False) -> None:
    """The prompts decoded together with trees: every row verified trees and emitted what the
    target alone emits for its prompt."""
    from tests.lossless import assert_lossless

    ids = [pipe.prompt_ids(p) for p in prompts]
    got = pipe.generate_batch(ids, drafter=drafter, max_new_tokens=new_tokens, adaptive=adaptive, schedule=False,
                              tree_nodes=nodes, max_batch=len(ids))
    for prompt, result in zip(ids, got):
        assert result.stats.tree_nodes > 0
        assert_lossless(pipe, prompt, pipe.generate(prompt_ids=prompt, max_new_tokens=new_tokens).token_ids,
                        result.token_ids, f"{drafter} trees in a batch")


@contextmanager
def rows_per_call(owner, rows_of: Callable[..., int]) -> Iterator[list[int]]:
    """The rows of every ``owner.run(...)`` call inside the block (``rows_of`` reads them from
    its arguments): an instance attribute shadows the method until the block ends."""
    counts: list[int] = []
    run = owner.run

    def counted(*args, **kwargs):
        counts.append(rows_of(*args))
        return run(*args, **kwargs)

    owner.run = counted
    try:
        yield counts
    finally:
        del owner.run
