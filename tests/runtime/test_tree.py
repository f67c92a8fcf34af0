"""Token trees without engines: the tree's verify inputs, greedy acceptance against the target's
own greedy continuation, and the deterministic-draft rejection rule against the target's exact
distribution (chi-square), with two wrong rules as failing controls."""

import numpy as np
import pytest

from specexport.runtime.acceptance import Sampling, _inverse_cdf, as_kept, warp_reference
from specexport.runtime.tree import ROOT, DraftTree, tree_greedy, tree_rejection
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
            probs = np.array(p.probs)
            for child in tree.children(node):
                x = int(tree.tokens[child])
                if rng.random() * (probs.sum() if renormalise else 1.0) < (probs[x] if renormalise else p.prob(x)):
                    break
                probs[x] = 0.0
            else:
                return path, _inverse_cdf(probs if exclude_rejected else p.probs, rng)
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
