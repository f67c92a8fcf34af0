"""How many drafts the target will keep: the one acceptance estimator of adaptive depth, the
shared width and the tree size.

Every proposal is a tree (a chain is one), and every node comes with a weight: the drafter's
estimate that the node ends up on the accepted path (a head's joint draft probability, the share
of n-gram matches through it). A proposal without weights, a chain from a drafter that gives
none, is weighed by the geometric prior ``prior ** depth``: optimistic, so a new drafter drafts
until rounds say otherwise. Weights are the drafter's opinion, not the target's, so for each tag
(the drafter's name, or the n-gram match length for prompt lookup) and each depth d the estimate
keeps a scale c_d: the nodes accepted at that depth over the weight predicted there in recent
rounds (exponentially forgotten), with a prior of one unit of weight for a drafter's own
weights, one round's worth of the geometric prior's for weightless chains (so a chain drafter
that keeps failing loses its deep drafts as fast as its shallow ones). The prior sits at the
scale of the depth above (depth 1's at 1): with a prior at 1 at every depth, the deep depths a
policy had stopped drafting, their rounds forgotten, went back to the prior's 0.8 a draft and
looked worth drafting again (SmolLM2's EAGLE-3 head on a summary it mostly missed: a round at
depth 5 every ten rounds, each kept nothing). A node of depth d is then
expected to be kept with probability c_d · w, capped by its parent's, and a proposal of n nodes
commits

    E(n) = 1 + sum of its n best calibrated weights

tokens: for a chain of k drafts, E(k) = 1 + p_1 + ... + p_k, the one expected-length formula
that adaptive depth (runtime/adaptive.py), the batch-wide width (runtime/goodput.py) and the
tree size (runtime/tree_size.py) read.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from specexport.runtime.tree import DraftTree


@dataclass
class _DepthSums:
    """One tag's forgotten sums by depth (index d: depth d + 1)."""

    predicted: np.ndarray = field(default_factory=lambda: np.zeros(0))  # [depth] weight verified there
    accepted: np.ndarray = field(default_factory=lambda: np.zeros(0))  # [depth] rounds whose path reached it
    rounds: np.ndarray = field(default_factory=lambda: np.zeros(0))  # [depth] rounds that drafted that deep
    weighted: bool = False  # the drafter gives weights (else the geometric prior's)

    def scales(self, depth: int) -> np.ndarray:
        """[depth] accepted over predicted at depths 1..depth, with one average round's
        predicted weight of prior at the scale of the depth above (depth 1: at 1); where never
        drafted, the depth above's scale."""
        known = min(depth, len(self.predicted))
        drafted = self.rounds[:known] > 0
        prior = np.ones(known) if self.weighted else \
            np.divide(self.predicted[:known], self.rounds[:known], out=np.zeros(known), where=drafted)  # [known]
        scales = np.ones(depth)
        above = 1.0
        for d in range(depth):
            if d < known and drafted[d]:
                above = (self.accepted[d] + prior[d] * above) / (self.predicted[d] + prior[d])
            scales[d] = above
        return scales

    def add(self, predicted: np.ndarray, accepted: int, decay: float) -> None:
        """One round: ``predicted`` [depth] the weight it verified at depths 1..depth, of which
        the target kept the path down to ``accepted``. In place, the sums growing only when the
        round went deeper than any before it."""
        depth = len(predicted)
        if depth > len(self.predicted):
            grow = (0, depth - len(self.predicted))
            self.predicted, self.accepted, self.rounds = (np.pad(a, grow) for a in
                                                          (self.predicted, self.accepted, self.rounds))
        for sums in (self.predicted, self.accepted, self.rounds):
            sums *= decay
        self.predicted[:depth] += predicted
        self.accepted[: min(accepted, depth)] += 1.0
        self.rounds[:depth] += 1.0


@dataclass
class AcceptanceEstimate:
    decay: float = 0.9  # per round: the last ten rounds or so count
    prior: float = 0.8  # a weightless node's weight at depth 1 (at depth d: prior ** d)
    _tags: dict[str, _DepthSums] = field(default_factory=dict)
    _powers: dict[int, np.ndarray] = field(default_factory=dict)  # depth -> [depth] prior ** (1..depth)
    # chain_lengths by tag and depth until the tag's next observation: a row at depth 0 observes
    # nothing, and asks again every round (a tenth of a ms of numpy a round, ~1% of a step)
    _lengths: dict[str, dict[int, np.ndarray]] = field(default_factory=dict)  # tag -> depth -> [depth]

    def _prior_weights(self, depth: int) -> np.ndarray:
        """[depth] a weightless chain's weights, made once per depth."""
        if depth not in self._powers:
            self._powers[depth] = self.prior ** np.arange(1, depth + 1, dtype=np.float64)
        return self._powers[depth]

    def _sums(self, tag: str) -> _DepthSums:
        if tag not in self._tags:
            self._tags[tag] = _DepthSums()
        return self._tags[tag]

    def weights(self, proposal: DraftTree) -> np.ndarray:
        """[N] the proposal's weights, each capped by its parent's; the prior's without weights."""
        if proposal.weights is None:
            return self._prior_weights(proposal.size) if proposal.is_chain \
                else self.prior ** proposal.depths().astype(np.float64)
        return proposal.capped_weights()

    def scales(self, tag: str, depth: int) -> np.ndarray:
        """[depth] the calibration c_d of ``tag``'s weights at depths 1..depth."""
        return self._sums(tag).scales(depth)

    def chain_lengths(self, tag: str, depth: int) -> np.ndarray:
        """[depth] E(k), k = 1..depth: tokens a round commits with a weightless chain of ``tag``
        cut to k drafts (each draft kept at most as often as the one before it). Past the
        depths drafted so far, each further draft is kept at the rate per position so far, at
        most the prior's (a chain kept whole at depth 3 is worth trying at 4; one rarely kept at
        1 is not at 2). At the rate so far alone, a tag kept whole in a round or two at depth 3
        was worth all 7 at once: prompt lookup's fresh match lengths, drafted as deep as a round
        allows, then missed past the few tokens they had been kept for."""
        cached = self._lengths.setdefault(tag, {}).get(depth)
        if cached is not None:
            return cached
        sums = self._sums(tag)
        kept = np.minimum(self._prior_weights(depth) * sums.scales(depth), 1.0)  # [depth]
        known = min(depth, int(np.argmin(np.append(sums.rounds, 0.0) > 0)))  # depths drafted so far
        if 0 < known < depth:
            per_position = min(kept[known - 1] ** (1.0 / known), self.prior)
            kept[known:] = kept[known - 1] * per_position ** np.arange(1, depth - known + 1)
        lengths = 1.0 + np.cumsum(np.minimum.accumulate(kept))  # [depth]
        lengths.flags.writeable = False  # shared by the rounds until the next observation
        self._lengths[tag][depth] = lengths
        return lengths

    def ranked_gains(self, tag: str, weights: np.ndarray, depths: np.ndarray) -> np.ndarray:
        """[N] nodes expected on the accepted path of the n best nodes, n = 1..N, given the best
        nodes' capped ``weights`` and ``depths`` [N], best first."""
        return np.cumsum(weights * self.scales(tag, int(depths.max()))[depths - 1])

    def tree_gains(self, tag: str, tree: DraftTree) -> np.ndarray:
        """[N] ``ranked_gains`` of the tree's n best nodes (``DraftTree.ranked``)."""
        ranked = tree.ranked()
        return self.ranked_gains(tag, self.weights(tree)[ranked], tree.depths()[ranked])

    def observe(self, tag: str, proposal: DraftTree, accepted: int) -> None:
        """A verified proposal, ``accepted`` of whose nodes the target kept (its path reached
        depths 1..accepted)."""
        if proposal.size == 0:
            return
        if proposal.is_chain and proposal.weights is None:
            self.observe_chain(tag, proposal.size, accepted)
            return
        predicted = np.bincount(proposal.depths() - 1, weights=self.weights(proposal))  # [depth]
        self._lengths.pop(tag, None)  # its chain_lengths change
        sums = self._sums(tag)
        sums.weighted = proposal.weights is not None
        sums.add(predicted, accepted, self.decay)

    def observe_chain(self, tag: str, depth: int, accepted: int) -> None:
        """A verified weightless chain of ``depth`` drafts, ``accepted`` of them kept (a tree
        round counts so for the depth its tree was planned with)."""
        if depth == 0:
            return
        self._lengths.pop(tag, None)  # its chain_lengths change
        sums = self._sums(tag)
        sums.weighted = False
        sums.add(self._prior_weights(depth), accepted, self.decay)
