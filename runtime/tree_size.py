"""Adaptive tree size: how many of a drafted tree's nodes one verify pass should hold.

A drafter weighs each node by its estimate that the node ends up on the accepted path (the
joint draft probability for a head, the share of matches through it for prompt lookup), so a
tree of n nodes is expected to commit 1 + sum of its n best weights. Those weights are the
drafter's opinion, not the target's: a scale c_d per depth d, the nodes accepted at that depth
over the weight predicted there in recent rounds (forgotten like adaptive depth's alpha),
calibrates them. Each round keeps the n that maximises

    (1 + c_d(1) · w_1 + ... + c_d(n) · w_n) / T_tree(1 + n)

with T_tree the measured cost of the tree graph that holds 1 + n rows. The drafts already exist,
so the drafter's cost does not enter (adaptive depth decided how deep to draft).

Rows of a batch share one pass of the graph of the largest tree, so there n is chosen once for
all of them (``shared_size``): the sum over rows of 1 + row r's calibrated n best weights, over
T_tree(B, 1 + n) at that batch size. A row with a confident drafter spends its n on one path (a
chain), an unsure one on siblings: the shape is each row's own, the width the batch's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from specexport.runtime.tree import DraftTree


@dataclass
class TreeSizer:
    verify_cost: Callable[[int], float | None]  # rows (1 + nodes) -> seconds of that tree pass (None: unknown)
    decay: float = 0.9
    # forgotten sums, by depth (index d: depth d + 1), of the weight verified and the nodes accepted
    _predicted: np.ndarray = field(default_factory=lambda: np.zeros(0))
    _accepted: np.ndarray = field(default_factory=lambda: np.zeros(0))

    @property
    def scale(self) -> float:
        """Accepted nodes per unit of predicted weight over every depth, with one round's worth of
        prior at 1."""
        return (float(self._accepted.sum()) + 1.0) / (float(self._predicted.sum()) + 1.0)

    def scales(self, depth: int) -> np.ndarray:
        """[depth] accepted nodes per unit of predicted weight at depths 1..depth, each with one
        round's worth of prior at 1 (the drafter's weights taken as they are until rounds say
        otherwise). By depth, because a drafter's error grows with depth unevenly: prompt lookup
        weighs every node of a lone match 1, and the target leaves such a path part way down."""
        known = min(depth, len(self._predicted))
        scales = np.ones(depth)
        scales[:known] = (self._accepted[:known] + 1.0) / (self._predicted[:known] + 1.0)
        return scales

    def expected(self, tree: DraftTree) -> np.ndarray:
        """[N] nodes expected on the accepted path of the tree's n best nodes (``ranked``), n = 1..N:
        each node's weight capped by its parent's, scaled at its depth."""
        ranked = tree.ranked()
        return self.expected_ranked(tree.capped_weights()[ranked], tree.depths()[ranked])

    def expected_ranked(self, weights: np.ndarray, depths: np.ndarray) -> np.ndarray:
        """``expected`` from the best nodes' capped ``weights`` and ``depths`` [N], best first."""
        return np.cumsum(weights * self.scales(int(depths.max()))[depths - 1])

    def size_ranked(self, weights: np.ndarray, depths: np.ndarray, verify_cost: Callable[[int], float | None],
                    drafted: int = 0, draft_cost: Callable[[int], float] | None = None) -> int:
        """``size`` of a tree given as its best nodes (``expected_ranked``): a SizeHint
        (runtime/tree.py) for a drafter that grows its tree alone. With ``draft_cost`` (depth ->
        seconds of the drafter's round that deep, ``Drafter.round_cost``), a pass of the n best
        also pays for drafting down to the deepest of them, ``drafted`` levels being done."""
        expected = 1.0 + self.expected_ranked(weights, depths)  # [N]
        if draft_cost is None:
            return _most_per_second(expected, verify_cost)
        reach = np.maximum(np.maximum.accumulate(depths), drafted)  # [N] levels drafted for the n best
        by_depth = np.array([draft_cost(d) for d in range(int(reach[-1]) + 1)])  # [deepest + 1] one call a depth
        return _most_per_second(expected, verify_cost, by_depth[reach])

    def size(self, tree: DraftTree) -> int:
        """The node count with the most expected tokens per second (the whole tree without weights
        or costs)."""
        return shared_size([self], [tree], self.verify_cost)

    def update(self, tree: DraftTree, accepted: int) -> None:
        """A verified tree and the nodes of it the target accepted (its path reached depths
        1..accepted)."""
        if tree.weights is None or tree.size == 0:
            return
        depths = tree.depths()
        deepest = max(int(depths.max()), len(self._predicted))
        predicted = np.bincount(depths - 1, weights=tree.capped_weights(), minlength=deepest)  # [deepest]
        reached = (np.arange(deepest) < accepted).astype(np.float64)  # [deepest]
        self._predicted = self.decay * np.pad(self._predicted, (0, deepest - len(self._predicted))) + predicted
        self._accepted = self.decay * np.pad(self._accepted, (0, deepest - len(self._accepted))) + reached


def shared_size(sizers: Sequence[TreeSizer], trees: Sequence[DraftTree], verify_cost: Callable[[int], float | None]) -> int:
    """The node count n that rows verified in one pass are cut to: the most expected tokens of
    all rows per second of the pass, sum_r (1 + row r's expected nodes of its n best) / T(1 + n);
    the largest tree's size where a tree has no weights or a cost is unknown."""
    largest = max(tree.size for tree in trees)
    if largest == 0 or any(tree.weights is None for tree in trees if tree.size):
        return largest
    expected = np.zeros(largest)  # [N] tokens of all rows with n = 1..N nodes each
    for sizer, tree in zip(sizers, trees):
        gained = sizer.expected(tree) if tree.size else np.zeros(1)  # [size]
        expected[: len(gained)] += 1.0 + gained
        expected[len(gained) :] += 1.0 + gained[-1]  # a smaller tree verifies all it has
    return _most_per_second(expected, verify_cost)


def _most_per_second(expected: np.ndarray, verify_cost: Callable[[int], float | None],
                     drafting: Sequence[float] | None = None) -> int:
    """The n with the most ``expected`` tokens ([N], n = 1..N nodes) per second of a pass of
    1 + n rows (plus ``drafting`` [N], the drafter's seconds for the n best); N where a cost is
    unknown."""
    costs = [verify_cost(1 + n) for n in range(1, len(expected) + 1)]
    if any(not cost for cost in costs):
        return len(expected)
    seconds = np.asarray(costs) + (0.0 if drafting is None else np.asarray(drafting))  # [N]
    return int(np.argmax(expected / seconds)) + 1
