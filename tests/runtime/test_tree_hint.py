"""A drafter growing its tree alone stops at a level none of whose nodes the loop's adaptive tree
size would verify (runtime/tree.py ``expansion_budget``): by the verify cost alone the verified
tree stays the same and fewer steps run; counting the drafter's steps too, fewer still, for as
many expected tokens per second. Checked on the head's level-by-level expansion
(runtime/chain_drafter.py ``Expansion``) and on a draft model's spine (runtime/tree.py
``Spine``), over synthetic drafters whose logits hang on the path drafted, without engines."""

import numpy as np
import pytest

from specexport.runtime.acceptance_estimate import AcceptanceEstimate
from specexport.runtime.chain_drafter import Expansion
from specexport.runtime.tree import DraftTree, grow_spine, top_candidates
from specexport.runtime.tree_size import shared_size, size_ranked

V, TOP_K, NODES, DEPTH = 24, 3, 8, 6
SEEDS = range(120)
TAG = "t"  # the trees' tag in the acceptance estimate


def path_logits(seed: int, path: tuple[int, ...]) -> np.ndarray:
    """[V] a synthetic drafter's logits after ``path``: fixed per path, peaked by the seed (some
    drafters confident, whose trees are chains, some unsure, whose trees branch)."""
    sharpness = 0.5 + 4.0 * (seed % 7) / 6
    return np.random.default_rng([seed, *path]).standard_normal(V) * sharpness


def expand(seed: int, hint) -> tuple[DraftTree, int]:
    """The head's expansion over the synthetic drafter: (its tree, the tree-step calls run)."""
    tokens_at: dict[int, int] = {}  # cache slot -> its node's token
    expansion = Expansion(lambda rows: top_candidates(rows, TOP_K), path_logits(seed, ()), np.zeros(2), DEPTH,
                          NODES, TOP_K, 0, hint)
    steps = 0
    while (level := expansion.next_level()) is not None:
        steps += 1
        logits = []
        for i, token in enumerate(level.tokens):
            tokens_at[level.write + i] = token
            path = tuple(tokens_at[slot] for slot in reversed(level.seen[i])) + (token,)
            logits.append(path_logits(seed, path))
        expansion.grow(np.stack(logits), np.zeros((len(logits), 2)))
    return expansion.tree("head"), steps


def spine(seed: int, hint) -> tuple[DraftTree, int]:
    """A draft model's spine over the synthetic drafter: (its tree, the model steps run)."""
    path: list[int] = []

    def next_logits(token):
        if token is not None:
            path.append(token)
        return path_logits(seed, tuple(path))

    tree = grow_spine(next_logits, DEPTH, NODES, TOP_K, "spine", hint=hint)
    return tree, len(path)


def hint_of(sizer: AcceptanceEstimate, cost, draft_cost=None):
    """The loop's SizeHint for a sequence alone (runtime/policy.py ``_size_hint``): by the pass's
    cost, and with ``draft_cost`` the drafter's steps too."""
    return lambda weights, depths, drafted: size_ranked(sizer, TAG, weights, depths, cost, drafted, draft_cost)


def sizer_and_cost(seed: int):
    """A tree sizer, fresh or calibrated by some rounds, and a pass cost per row count (convex,
    or CPU-like steps)."""
    sizer = AcceptanceEstimate()
    verified = DraftTree(np.array([1, 2, 3]), np.array([-1, 0, 1]), "c", np.array([0.8, 0.5, 0.3]))
    for accepted in range(seed % 4):  # rounds that kept fewer or more than the weights predicted
        sizer.observe(TAG, verified, accepted)
    costs = [lambda rows: 1.0 + 0.08 * rows, lambda rows: 1.0 + 0.02 * rows ** 2,
             lambda rows: [1.0, 1.0, 1.1, 1.15, 1.2, 1.3, 1.45, 1.5, 1.55, 1.6][min(rows, 9)]]
    return sizer, costs[seed % 3]


@pytest.mark.parametrize("grow", [expand, spine], ids=["head-expansion", "spine"])
def test_a_tree_grown_with_the_loops_size_verifies_the_same_nodes_in_fewer_steps(grow):
    saved = 0
    for seed in SEEDS:
        sizer, cost = sizer_and_cost(seed)
        full, full_steps = grow(seed, None)
        hinted, hinted_steps = grow(seed, hint_of(sizer, cost))
        verified = full.best(shared_size([(sizer, TAG)], [full], cost))  # what the loop verifies of each
        verified_hinted = hinted.best(shared_size([(sizer, TAG)], [hinted], cost))
        assert verified_hinted.tokens.tolist() == verified.tokens.tolist(), seed
        assert verified_hinted.parents.tolist() == verified.parents.tolist(), seed
        assert hinted_steps <= full_steps, seed
        saved += full_steps - hinted_steps
    assert saved >= len(SEEDS) // 4, f"the hint saved {saved} steps over {len(SEEDS)} trees"


STEP = 0.08  # a drafter's step against a pass of 1.0 to 1.6: SmolLM2's EAGLE-3 head, 2.5-2.8 ms to 25-40 ms


def drafting(depth: int) -> float:
    """A drafter's round down to ``depth``: one call, then a step a level (Drafter.round_cost)."""
    return 0.1 + STEP * max(depth - 1, 0)


def rate(sizer: AcceptanceEstimate, cost, tree: DraftTree, steps: int) -> float:
    """Expected tokens per second of the round the loop makes of a grown tree: its verified
    nodes over the pass and the drafting that was run."""
    verified = tree.best(shared_size([(sizer, TAG)], [tree], cost))
    return (1.0 + sizer.tree_gains(TAG, verified)[-1]) / (cost(1 + verified.size) + drafting(steps + 1))


@pytest.mark.parametrize("grow", [expand, spine], ids=["head-expansion", "spine"])
def test_counting_the_drafters_steps_stops_sooner_for_as_many_tokens_per_second(grow):
    # and against the other extreme, a drafter priced so high that it stops at the first level
    saved, with_steps, verify_only, first_level = 0, [], [], []
    for seed in SEEDS:
        sizer, cost = sizer_and_cost(seed)
        hinted, hinted_steps = grow(seed, hint_of(sizer, cost))
        costed, costed_steps = grow(seed, hint_of(sizer, cost, drafting))
        shallow, shallow_steps = grow(seed, hint_of(sizer, cost, lambda depth: 10.0 * depth))
        assert costed_steps <= hinted_steps, seed
        saved += hinted_steps - costed_steps
        with_steps.append(rate(sizer, cost, costed, costed_steps))
        verify_only.append(rate(sizer, cost, hinted, hinted_steps))
        first_level.append(rate(sizer, cost, shallow, shallow_steps))
    assert saved >= len(SEEDS) // 4, f"counting the steps saved {saved} steps over {len(SEEDS)} trees"
    # measured: 1.173 against 1.142 and 1.162 (head expansion), 1.166 against 1.136 and 1.162 (spine)
    assert np.mean(with_steps) > max(np.mean(verify_only), np.mean(first_level)), \
        (np.mean(with_steps), np.mean(verify_only), np.mean(first_level))


def test_levels_already_drafted_are_paid_whatever_the_size():
    # a node 3 deep and a heavier one at depth 1, with 2 levels drafted: the steps already run
    # count against the small tree too, so the deep node pays for the one step it still needs
    # (charged to the deep node alone, the small tree looked cheaper and won)
    sizer, flat = AcceptanceEstimate(), (lambda rows: 1.0)
    weights, depths = np.array([0.6, 0.25]), np.array([1, 3])
    assert size_ranked(sizer, TAG, weights, depths, flat, 2, lambda depth: 0.1 * depth) == 2
    assert size_ranked(sizer, TAG, weights, depths, flat, 1, lambda depth: 0.1 * depth) == 1


def test_a_free_drafter_grows_as_the_verify_cost_alone_says():
    for seed in range(40):
        sizer, cost = sizer_and_cost(seed)
        alone = expand(seed, hint_of(sizer, cost))
        free = expand(seed, hint_of(sizer, cost, lambda depth: 0.0))
        assert free[1] == alone[1] and free[0].tokens.tolist() == alone[0].tokens.tolist(), seed


def test_without_a_hint_the_tree_is_the_drafters_own():
    # fixed-size rounds pass no hint: the expansion is EAGLE-2's over ``nodes``, as before
    for seed in range(20):
        tree, steps = expand(seed, None)
        assert tree.size == NODES and 1 <= steps <= DEPTH - 1
