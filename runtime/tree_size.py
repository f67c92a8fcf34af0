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
"""

from __future__ import annotations

from collections.abc import Callable
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
        if tree.weights is None or tree.size == 0:
            return tree.size
        costs = [self.verify_cost(1 + n) for n in range(1, tree.size + 1)]
        if any(not cost for cost in costs):
            return tree.size
        ranked = tree.ranked()
        expected = 1.0 + self.scale * np.cumsum(tree.capped_weights()[ranked])  # [N] tokens with n = 1..N nodes
        return int(np.argmax(expected / np.asarray(costs))) + 1

    def update(self, tree: DraftTree, accepted: int) -> None:
        """A verified tree and the nodes of it the target accepted."""
        if tree.weights is None:
            return
        self._predicted = self.decay * self._predicted + float(tree.capped_weights().sum())
        self._accepted = self.decay * self._accepted + accepted
