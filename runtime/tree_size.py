"""Adaptive tree size: how many of a drafted tree's nodes one verify pass should hold.

A drafter weighs each node by its estimate that the node ends up on the accepted path (the
joint draft probability for a head, the share of matches through it for prompt lookup), and the
acceptance estimate calibrates those weights by depth (runtime/acceptance_estimate.py), so a
tree of n nodes is expected to commit 1 + the sum of its n best calibrated weights. Each round
keeps the n that maximises

    (1 + c_d(1) · w_1 + ... + c_d(n) · w_n) / T_tree(1 + n)

with T_tree the measured cost of the tree graph that holds 1 + n rows. The drafts already exist,
so the drafter's cost does not enter (adaptive depth decided how deep to draft), except for a
drafter growing its tree alone under a size hint (``size_ranked``), whose deeper levels cost it
more steps.

Rows of a batch share one pass of the graph of the largest tree, so there n is chosen once for
all of them (``shared_size``): the sum over rows of 1 + row r's calibrated n best weights, over
T_tree(B, 1 + n) at that batch size. A row with a confident drafter spends its n on one path (a
chain), an unsure one on siblings: the shape is each row's own, the width the batch's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from specexport.runtime.acceptance_estimate import AcceptanceEstimate
from specexport.runtime.tree import DraftTree

Cost = Callable[[int], float | None]  # rows (1 + nodes) -> seconds of that tree pass (None: unknown)


def size_ranked(estimate: AcceptanceEstimate, tag: str, weights: np.ndarray, depths: np.ndarray,
                verify_cost: Cost, drafted: int = 0, draft_cost: Callable[[int], float] | None = None) -> int:
    """The best size of a tree given as its best nodes' capped ``weights`` and ``depths`` [N],
    best first: a SizeHint (runtime/tree.py) for a drafter that grows its tree alone. With
    ``draft_cost`` (depth -> seconds of the drafter's round that deep, ``Drafter.round_cost``),
    a pass of the n best also pays for drafting down to the deepest of them, ``drafted`` levels
    being done."""
    expected = 1.0 + estimate.ranked_gains(tag, weights, depths)  # [N]
    if draft_cost is None:
        return _most_per_second(expected, verify_cost)
    reach = np.maximum(np.maximum.accumulate(depths), drafted)  # [N] levels drafted for the n best
    by_depth = np.array([draft_cost(d) for d in range(int(reach[-1]) + 1)])  # [deepest + 1] one call a depth
    return _most_per_second(expected, verify_cost, by_depth[reach])


def shared_size(estimates: Sequence[tuple[AcceptanceEstimate, str]], trees: Sequence[DraftTree],
                verify_cost: Cost) -> int:
    """The node count n that rows verified in one pass are cut to: the most expected tokens of
    all rows per second of the pass, sum_r (1 + row r's expected nodes of its n best) / T(1 + n);
    the largest tree's size where a tree has no weights or a cost is unknown. ``estimates``:
    each row's acceptance estimate and its tree's tag."""
    largest = max(tree.size for tree in trees)
    if largest == 0 or any(tree.weights is None for tree in trees if tree.size):
        return largest
    expected = np.zeros(largest)  # [N] tokens of all rows with n = 1..N nodes each
    for (estimate, tag), tree in zip(estimates, trees):
        gained = estimate.tree_gains(tag, tree) if tree.size else np.zeros(1)  # [size]
        expected[: len(gained)] += 1.0 + gained
        expected[len(gained) :] += 1.0 + gained[-1]  # a smaller tree verifies all it has
    return _most_per_second(expected, verify_cost)


def _most_per_second(expected: np.ndarray, verify_cost: Cost, drafting: Sequence[float] | None = None) -> int:
    """The n with the most ``expected`` tokens ([N], n = 1..N nodes) per second of a pass of
    1 + n rows (plus ``drafting`` [N], the drafter's seconds for the n best); N where a cost is
    unknown."""
    costs = [verify_cost(1 + n) for n in range(1, len(expected) + 1)]
    if any(not cost for cost in costs):
        return len(expected)
    seconds = np.asarray(costs) + (0.0 if drafting is None else np.asarray(drafting))  # [N]
    return int(np.argmax(expected / seconds)) + 1
