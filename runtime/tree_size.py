"""Adaptive tree size: how many of a drafted tree's nodes one verify pass should hold.

A drafter weighs each node by its estimate that the node ends up on the accepted path (the
joint draft probability for a head, the share of matches through it for prompt lookup), so a
tree of n nodes is expected to commit 1 + sum of its n best weights. Those weights are the
drafter's opinion, not the target's: a scale c, the tokens accepted over the weight predicted
in recent rounds (forgotten like adaptive depth's alpha), calibrates them. Each round keeps the
n that maximises

    (1 + c · (w_1 + ... + w_n)) / T_tree(1 + n)

with T_tree the measured cost of the tree graph that holds 1 + n rows. The drafts already exist,
so the drafter's cost does not enter (adaptive depth decided how deep to draft).

Rows of a batch share one pass of the graph of the largest tree, so there n is chosen once for
all of them (``shared_size``): the sum over rows of 1 + c_r · (row r's n best weights), over
T_tree(B, 1 + n) at that batch size. A row with a confident drafter spends its n on one path (a
chain), an unsure one on siblings: the shape is each row's own, the width the batch's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from specexport.runtime.tree import DraftTree


@dataclass
class TreeSizer:
    verify_cost: Callable[[int], float | None]  # rows (1 + nodes) -> seconds of that tree pass (None: unknown)
    decay: float = 0.9
    _predicted: float = 0.0  # forgotten sums of weight verified and of nodes accepted
    _accepted: float = 0.0

    @property
    def scale(self) -> float:
        """Accepted nodes per unit of predicted weight, with one round's worth of prior at 1 (the
        drafter's weights taken as they are until rounds say otherwise)."""
        return (self._accepted + 1.0) / (self._predicted + 1.0)

    def size(self, tree: DraftTree) -> int:
        """The node count with the most expected tokens per second (the whole tree without weights
        or costs)."""
        return shared_size([self], [tree], self.verify_cost)

    def update(self, tree: DraftTree, accepted: int) -> None:
        """A verified tree and the nodes of it the target accepted."""
        if tree.weights is None:
            return
        self._predicted = self.decay * self._predicted + float(tree.capped_weights().sum())
        self._accepted = self.decay * self._accepted + accepted


def shared_size(sizers: Sequence[TreeSizer], trees: Sequence[DraftTree], verify_cost: Callable[[int], float | None]) -> int:
    """The node count n that rows verified in one pass are cut to: the most expected tokens of
    all rows per second of the pass, sum_r (1 + c_r · sum of row r's n best weights) / T(1 + n);
    the largest tree's size where a tree has no weights or a cost is unknown."""
    largest = max(tree.size for tree in trees)
    if largest == 0 or any(tree.weights is None for tree in trees if tree.size):
        return largest
    costs = [verify_cost(1 + n) for n in range(1, largest + 1)]
    if any(not cost for cost in costs):
        return largest
    expected = np.zeros(largest)  # [N] tokens of all rows with n = 1..N nodes each
    for sizer, tree in zip(sizers, trees):
        gained = np.cumsum(tree.capped_weights()[tree.ranked()]) if tree.size else np.zeros(1)  # [size]
        expected += 1.0 + sizer.scale * np.pad(gained, (0, largest - len(gained)), mode="edge")
    return int(np.argmax(expected / np.asarray(costs))) + 1
