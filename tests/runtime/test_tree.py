"""Token trees without engines: the tree's verify inputs, greedy acceptance against the target's
own greedy continuation, and the deterministic-draft rejection rule against the target's exact
distribution (chi-square), with two wrong rules as failing controls."""

import numpy as np
import pytest

from specexport.runtime.acceptance import (
    Sampling,
    _inverse_cdf,
    as_kept,
    tree_greedy,
    tree_rejection,
    warp_reference,
)
from specexport.runtime.tree import ROOT, DraftTree
from tests.lossless import assert_sampled_as_target
from tests.runtime.fakes import random_table

V = 6
# root -> 0, 1, 2; 0 -> 3, 4; 1 -> 5; 3 -> 6
TREE = DraftTree(np.array([2, 4, 1, 5, 0, 3, 2]), np.array([-1, -1, -1, 0, 0, 1, 3]))


def test_verify_inputs_are_depths_and_ancestors():
    offsets, mask = TREE.verify_inputs()
    assert offsets.tolist() == [0, 1, 1, 1, 2, 2, 2, 3]
    assert TREE.path(6) == [0, 3, 6] and TREE.path(ROOT) == []
    for row in range(1 + TREE.size):
        seen = {0} | {n + 1 for n in TREE.path(row - 1)}
        assert set(np.flatnonzero(mask[row]).tolist()) == seen, row


def test_a_chain_is_a_tree_with_one_child_each():
    chain = DraftTree.chain([5, 1, 3])
    offsets, mask = chain.verify_inputs()
    assert offsets.tolist() == [0, 1, 2, 3] and np.array_equal(mask, np.tril(np.ones((4, 4), dtype=bool)))


def test_parents_must_come_first():
    with pytest.raises(ValueError):
        DraftTree(np.array([1, 2]), np.array([1, -1]))


def greedy_chain(table, last, n):
    out = []
    for _ in range(n):
        last = int(table[last].argmax())
        out.append(last)
    return out


def test_greedy_walk_follows_the_target_argmax():
    table = random_table(V, seed=0)
    for last in range(V):
        want = greedy_chain(table, last, 4)
        # a tree holding the greedy path two deep among decoys
        tree = DraftTree(np.array([(want[0] + 1) % V, want[0], (want[1] + 2) % V, want[1], want[1]]),
                         np.array([-1, -1, 1, 1, 0]))
        rows = [last, *tree.tokens.tolist()]
        path, nxt = tree_greedy(tree, lambda r, rows=rows: int(table[rows[r]].argmax()))
        assert [int(tree.tokens[n]) for n in path] + [nxt] == want[:3]
        assert path == [1, 3]


def row_reader(table, last, tree, sampling):
    rows = [last, *tree.tokens.tolist()]
    probs = warp_reference(table, sampling)  # [V, V] next | current
    return lambda r: probs[rows[r]]


def _wrong_rule(renormalise: bool, exclude_rejected: bool):
    """A wrong sibling rule, a failing control: without ``renormalise`` each child is tried with
    its original p; without ``exclude_rejected`` the last draw comes from the whole p again."""

    def rule(tree, target, rng):
        node, path = ROOT, []
        while True:
            p = as_kept(target(node + 1))
            probs = np.array(p.probs, dtype=np.float64)
            for child in tree.children(node):
                at = p.index(int(tree.tokens[child]))
                if at is not None and rng.random() * (probs.sum() if renormalise else 1.0) < (
                        probs[at] if renormalise else p.probs[at]):
                    break
                if at is not None:
                    probs[at] = 0.0
            else:
                return path, p.token(_inverse_cdf(probs if exclude_rejected else np.array(p.probs), rng))
            node = child
            path.append(node)

    return rule


_no_renormalisation = _wrong_rule(renormalise=False, exclude_rejected=True)
_residual_keeps_rejected = _wrong_rule(renormalise=True, exclude_rejected=False)


@pytest.mark.parametrize("rule", [pytest.param(tree_rejection, id="right-rule"),
                                  pytest.param(_no_renormalisation, id="control-no-renormalisation"),
                                  pytest.param(_residual_keeps_rejected, id="control-residual-keeps-rejected")])
def test_sampled_tree_output_follows_the_target(rule):
    table = random_table(V, seed=3, spread=1.5)
    sampling, last, draws = Sampling(1.0), 1, 20000
    probs = warp_reference(table, sampling)
    # the tree holds the two most likely first tokens, and below them their most likely next
    first = np.argsort(-probs[last])[:3]
    tree = DraftTree(np.array([first[0], first[1], first[2], *np.argsort(-probs[first[0]])[:2]]),
                     np.array([-1, -1, -1, 0, 0]))
    rng = np.random.default_rng(11)
    counts: dict[tuple[int, int], int] = {}
    read = row_reader(table, last, tree, sampling)
    for _ in range(draws):
        path, nxt = rule(tree, read, rng)
        tokens = [int(tree.tokens[n]) for n in path] + [int(nxt)]
        if len(tokens) < 2:  # the next round drafts nothing: one token from the target
            tokens.append(_inverse_cdf(probs[tokens[0]], rng))
        key = (tokens[0], tokens[1])
        counts[key] = counts.get(key, 0) + 1
    exact = {(a, b): float(probs[last, a] * probs[a, b]) for a in range(V) for b in range(V)}
    assert_sampled_as_target(counts, exact, draws, right_rule=rule is tree_rejection)


def test_a_rejected_child_is_never_the_next_token():
    # p puts mass on 0 and 1 only; children 0 and 1 rejected is impossible, 0 rejected leaves 1
    tree = DraftTree(np.array([0]), np.array([-1]))
    p = np.array([0.3, 0.7, 0, 0, 0, 0])
    rng = np.random.default_rng(0)
    for _ in range(200):
        path, nxt = tree_rejection(tree, lambda r: p, rng)
        assert (path == [0]) or nxt == 1


def test_spine_tree_keeps_the_heaviest_joint_candidates():
    """Level j's top-k under the spine node above, weighed by joint probability: with a sure
    first level and an unsure second one, the second level's runners-up beat the third level."""
    from specexport.runtime.tree import spine_tree

    tops = np.array([[10, 11, 12], [20, 21, 22], [30, 31, 32]])  # [d, k] tokens, best first
    probs = np.array([[0.9, 0.05, 0.05], [0.4, 0.35, 0.25], [0.5, 0.3, 0.2]])
    tree = spine_tree(tops, np.log(probs), nodes=4)
    # joints: 10 .9 | 20 .36, 21 .315, 22 .225 | 30 .18 ...; 11 and 12 .05
    assert tree.tokens.tolist() == [10, 20, 21, 22] and tree.parents.tolist() == [-1, 0, 0, 0]
    assert tree.weights == pytest.approx([0.9, 0.36, 0.315, 0.225])
    deeper = spine_tree(tops, np.log(probs), nodes=6)  # 30 (.18) under 20, then 31 (.108)
    assert deeper.tokens.tolist() == [10, 20, 21, 22, 30, 31] and deeper.parents.tolist() == [-1, 0, 0, 0, 1, 1]


def test_top_candidates_are_normalised_over_the_finite_logits():
    from specexport.runtime.tree import top_candidates

    logits = np.array([1.0, -np.inf, 3.0, 2.0, -np.inf])
    tokens, logp = top_candidates(logits, 2)
    assert tokens.tolist() == [2, 3]
    assert np.exp(logp) == pytest.approx(np.exp([3.0, 2.0]) / np.exp([1.0, 2.0, 3.0]).sum())


def test_the_best_n_nodes_keep_their_ancestors():
    """A node never outranks its parent, whatever weight the drafter gave it."""
    tree = DraftTree(TREE.tokens, TREE.parents, weights=np.array([0.5, 0.3, 0.1, 0.4, 0.05, 0.2, 0.9]))
    # capped: node 6 (0.9) under 3 (0.4) under 0 (0.5): 0.4
    assert tree.capped_weights() == pytest.approx([0.5, 0.3, 0.1, 0.4, 0.05, 0.2, 0.4])
    best = tree.best(4)
    assert best.tokens.tolist() == TREE.tokens[[0, 1, 3, 6]].tolist() and best.parents.tolist() == [-1, -1, 0, 2]
    assert best.weights == pytest.approx([0.5, 0.3, 0.4, 0.9])
    for n in range(1, tree.size + 1):
        kept = set(tree.ranked()[:n].tolist())
        assert all(int(TREE.parents[i]) in kept | {ROOT} for i in kept), n


def test_the_tree_size_follows_the_costs_and_the_record():
    """Flat costs: every node pays. Steep costs: only heavy nodes. A drafter whose weights
    keep failing is trusted less, so its trees shrink."""
    from specexport.runtime.acceptance_estimate import AcceptanceEstimate
    from specexport.runtime.tree_size import shared_size

    def size(estimate, tree, cost):
        return shared_size([(estimate, "t")], [tree], cost)

    tree = DraftTree(np.arange(6), np.array([-1, 0, 1, 2, 3, 4]), weights=np.array([0.9, 0.7, 0.5, 0.3, 0.2, 0.1]))
    assert size(AcceptanceEstimate(), tree, lambda rows: 1.0) == 6
    steep, estimate = (lambda rows: 1.0 + 0.4 * (rows - 1)), AcceptanceEstimate()
    # tokens per cost for n = 1..4: 1.9/1.4, 2.6/1.8, 3.1/2.2, 3.4/2.6: n = 2 is best
    assert size(estimate, tree, steep) == 2
    for _ in range(20):
        estimate.observe("t", tree.best(2), accepted=0)
    assert (estimate.scales("t", 2) < 0.2).all() and size(estimate, tree, steep) == 1
    assert size(AcceptanceEstimate(), tree, lambda rows: None) == 6  # no costs: the whole tree


def test_the_tree_size_is_calibrated_by_depth():
    """Prompt lookup's lone match weighs every node of its path 1; the target keeps its first
    two nodes every round. Calibrated by depth, the size falls to those two; one scale for all
    depths (the failing control: accepted over predicted in total, a third) would keep all six,
    since a third of a token per node still beats the cost of a row."""
    from specexport.runtime.acceptance_estimate import AcceptanceEstimate
    from specexport.runtime.tree_size import shared_size

    chain = DraftTree(np.arange(6), np.array([-1, 0, 1, 2, 3, 4]), weights=np.ones(6))
    estimate, cost = AcceptanceEstimate(), (lambda rows: 1.0 + 0.1 * (rows - 1))
    assert shared_size([(estimate, "t")], [chain], cost) == 6  # no record yet: the weights as they are
    for _ in range(20):
        estimate.observe("t", chain, accepted=2)
    scales = estimate.scales("t", 6)
    assert scales[:2] == pytest.approx([1.0, 1.0], abs=0.02) and (scales[2:] < 0.15).all(), scales
    assert shared_size([(estimate, "t")], [chain], cost) == 2
    one_scale = scales.mean()  # accepted over predicted in total: a third
    uniform = 1.0 + one_scale * np.arange(1, 7)  # [6] tokens with n nodes under one scale
    assert int(np.argmax(uniform / (1.0 + 0.1 * np.arange(1, 7)))) + 1 == 6


def test_the_recipes_tree_drafters_decode_trees_by_default():
    from types import SimpleNamespace

    from specexport.errors import BadInput
    from specexport.runtime.api import check_tree_nodes

    manifest = SimpleNamespace(plan={"tree_nodes": 5, "tree_drafters": ["eagle3"]})
    assert check_tree_nodes(manifest, None, "eagle3") == 5
    assert check_tree_nodes(manifest, None, "ngram") == 0  # chains unless asked
    assert check_tree_nodes(manifest, 3, "ngram") == 3
    before = SimpleNamespace(plan={"tree_nodes": 5})  # a directory built before draft.tree.drafters
    assert check_tree_nodes(before, None, "ngram") == 5
    with pytest.raises(BadInput, match="--tree-nodes must be between 0 and 5"):
        check_tree_nodes(manifest, 6, "eagle3")
