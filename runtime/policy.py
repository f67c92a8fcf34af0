"""The speculation policy: how much every round drafts, and which graph verifies it.

One interface over what decides the amount of speculation, asked at three points of a round:

- ``plan``, before drafting: the round's depth cap (the draft length, under the batch-size
  schedule), each row's depth within its cache and token budget, as its own adaptive depth
  chooses (runtime/adaptive.py; a long drafter's row alone past D, below), and whether the
  round drafts token trees (the loop has a tree verifier, the batch size has a tree graph and
  every row's cache holds it) with their node budget and, for a sequence alone, the size its
  tree will be cut to;
- ``fit``, after drafting: the proposals cut to what one pass should hold: a chain at the
  widest verify graph, or at the batch-wide width with the most expected tokens per second of
  verify (``SharedWidth``, runtime/goodput.py); trees at their best shared size
  (runtime/tree_size.py);
- ``observe``, after acceptance: what each row kept, for its acceptance estimate
  (runtime/acceptance_estimate.py: one estimator for depth, width and tree size) and the shared
  width's pooled one; and ``price_round``, what the round took, for the round prices.

A drafter whose drafts cost nothing and carry their evidence (``Drafter.drafts_free``: prompt
lookup and suffix decoding, whose chains are tagged with their match length) drafts a chain as
deep as its row's depth allows whenever adaptive depth chose to draft: the depth planned before
drafting knows no match length (its tag, the drafter's name, is never observed), and held every
n-gram chain of SmolLM2's int4 code edit at 2 drafts where its 12-token matches kept all 7. One
that also ``drafts_long`` (suffix decoding, whose draft grows with its match) drafts past D when
its row runs alone: as deep as the target's widest long verify size holds (the probe entries
past every verify entry, runtime/runner.py), within the request's own cap, its cache and its
token budget. The chain's tag then cuts it to the prefix with the most expected tokens per
second (``trim``), each depth priced as the round prices price it (the entry that would run it,
checked against the clock), so a long draft is verified only where its expected accepted tokens
pay for the larger verify. Tree rounds and the shared width keep their own sizes; batched rows
keep D.

A round is priced from the engines' costs (tuned, built, or timed on first ask) and the price
is checked against the clock by the kind of round (runtime/round_prices.py): a price off by
more than a margin is replaced by the measurement, with hysteresis. The graph costs themselves
stay fixed once known, for chains as for trees: a running average of single passes ratcheted
choices down (a width timed slow on one noisy pass was no longer chosen, so never timed again).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from specexport.contract import DraftSchedule
from specexport.runtime.acceptance_estimate import AcceptanceEstimate
from specexport.runtime.adaptive import DepthPolicy
from specexport.runtime.drafter_set import DrafterSet
from specexport.runtime.drafters import DraftBudget, Drafter
from specexport.runtime.goodput import best_width
from specexport.runtime.model import Model
from specexport.runtime.round_prices import RoundPrices
from specexport.runtime.tree import DraftTree, SizeHint
from specexport.runtime.tree_size import shared_size, size_ranked
from specexport.runtime.tree_verify import TreeVerifier
from specexport.runtime.verifier import ChainVerifier, Verifier

if TYPE_CHECKING:
    from specexport.runtime.loop import Request, Running


@dataclass
class RoundPlan:
    """What a round drafts, decided before drafting."""

    cap: int  # the round's depth (the draft length under the schedule)
    depths: list[int]  # [rows] each row's depth (0: it only verifies)
    verifier: Verifier  # the graph that verifies the round
    nodes: int = 0  # > 0: a tree round, at most this many nodes a row
    top_k: int = 0  # a tree round: at most this many children a node
    hints: list[SizeHint | None] | None = None  # a tree round: each row's size hint for its drafter

    @property
    def trees(self) -> bool:
        return self.nodes > 0

    @property
    def budget(self) -> DraftBudget:
        """What the drafter is asked for."""
        return DraftBudget(self.depths, self.nodes, self.top_k)


@dataclass
class SharedWidth:
    """The batch-wide verify width (``per_sequence``): rows share one verify call whose width
    follows the longest row, so the width is chosen once across all rows from their drafts'
    tags, their acceptance pooled over the rows; every ``probe_every`` rounds that chose no
    drafts, the narrowest width holding every draft is verified anyway so the estimate can
    recover."""

    estimate: AcceptanceEstimate
    probe_every: int = 8
    skipped: int = 0

    def choose(self, target: Model, proposals: Sequence[DraftTree], width: int, tags: Sequence[str]) -> int:
        """``tags``: each proposal's acceptance tag."""
        rows = len(proposals)
        batch = target.batch_for(rows)
        built = target.widths(rows)
        holding = [w for w in built if w >= width][:1] or built[-1:]  # the narrowest holding every draft
        lengths = [self.estimate.chain_lengths(tag, p.size) for p, tag in zip(proposals, tags)]
        chosen = best_width([w for w in built if w < width] + holding, lambda w: target.costs[(batch, w)], lengths)
        self.skipped = self.skipped + 1 if chosen == 1 else 0
        if self.skipped >= self.probe_every:
            self.skipped, chosen = 0, holding[0]
        return chosen


class SpeculationPolicy:
    """The schedule, adaptive depth, the shared width and the tree size behind one interface
    (the module docstring says when each is asked)."""

    unmeasured_after_draft = True  # price_round: depth 0 is measured in rounds after plain ones

    def __init__(self, target: Model, drafter: Drafter, *, draft_len: int, schedule: DraftSchedule | None = None,
                 per_sequence: bool = False, adaptive: Callable[..., DepthPolicy] | None = None,
                 trees: TreeVerifier | None = None, tree_nodes: int = 0, tree_top_k: int = 4,
                 prices: dict[str, RoundPrices] | None = None):
        if per_sequence and not target.costs:
            target.measure_costs()
        self.target, self.drafter, self.draft_len, self.schedule = target, drafter, draft_len, schedule
        self.chains = ChainVerifier(target)
        # the batch-wide width (per_sequence): after each row drafted as deep as its own depth
        # allows, the one verify width that pays for the batch
        self.shared = SharedWidth(AcceptanceEstimate()) if per_sequence else None
        # each sequence's own adaptive depth under the cap: a request alone in the batch decodes
        # as `generate` does (the same depths, so the same draws when sampled)
        self.adaptive = adaptive
        # what a round costs, by batch size and depth, checked against the clock: shared by
        # every sequence of a drafter (made with the first one's adaptive depth), and by the
        # loops of a pipeline where it passes its own (``prices``): a request that starts with
        # the build's prices, where the clock said otherwise on the requests before it, opened
        # at depths that lost (SmolLM2 fp32, EAGLE-3: three rounds at depths 5, 4, 3 priced as if
        # a plain round cost 13.7 ms, measured 9.3 ms all through the request before)
        self.prices: dict[str, RoundPrices] = {} if prices is None else prices
        # token trees where the drafter builds them: each row verifies a tree of up to
        # tree_nodes drafts (at B > 1 at most the round's depth) when its batch size has a tree graph
        self.trees = trees if tree_nodes > 0 and drafter.builds_trees else None
        self.tree_nodes, self.tree_top_k = tree_nodes, tree_top_k
        self._drafted_last = False  # the last chain round drafted (price_round)

    def drafter_of(self, seq: Running) -> Drafter:
        """The drafter drafting for ``seq``: the loop's, or its request's member of a set."""
        return self.drafter.members[seq.drafter] if isinstance(self.drafter, DrafterSet) else self.drafter

    def start(self, seq: Running) -> None:
        """A sequence joined: its own adaptive depth, over its drafter's round prices."""
        if self.adaptive is None:
            return
        drafter = self.drafter_of(seq)
        seq.depth_policy = self.adaptive(drafter) if isinstance(self.drafter, DrafterSet) else self.adaptive()
        # what its first draft feeds it: the prompt but its last token (which the draft takes)
        seq.depth_policy.start_cost = drafter.catchup_cost(len(seq.request.prompt) - 1)
        own = seq.depth_policy.prices
        if own is None:  # a policy that prices nothing (a test's replay)
            return
        if drafter.name not in self.prices:  # the first sequence's settings, priced at every batch size
            self.prices[drafter.name] = replace(own, priced=self._priced(seq.depth_policy, drafter), _kinds={})
        else:  # kept from the sequences before: what the clock said long ago is no measure now
            self.prices[drafter.name].forget_stale()
        seq.depth_policy.prices = self.prices[drafter.name]

    def _priced(self, depth: DepthPolicy, drafter: Drafter) -> Callable[[int, int], float | None]:
        """(batch, depth) -> a round's price: at a built batch size B > 1 the batched verify
        graph that runs (its measured cost, where measured) and the drafter's round; depth 0 at
        the rows a one-token call runs (DepthPolicy.one_token_rows)."""
        def priced(batch: int, k: int) -> float | None:
            if batch > 1:
                built = [t for t in self.target.widths(batch) if t >= max(1 + k, depth.one_token_rows)]
                seconds = self.target.costs.get((batch, built[0])) if built else None
                if seconds:
                    return seconds + (drafter.round_cost(k) if k > 0 else 0.0)
            return depth.priced(1, k)
        return priced

    def price_round(self, running: Sequence[Running], proposals: Sequence[DraftTree], batch: int,
                    seconds: float) -> float | None:
        """A chain round of these ``proposals`` at built batch ``batch`` took ``seconds``: its
        price before it was checked against them (None: unpriced), by its widest row. A round
        whose rows drafted with different drafters (a set's) is no measure of either drafter's
        rounds, and a round in which a row resumed drafting after rounds at depth 0 is none of
        its kind (it also caught the drafter up on them, DepthPolicy.resumed): neither is
        measured. A round without drafts measures the target alone for every drafter in it."""
        depth = max(p.size for p in proposals)
        drafting = {self.drafter_of(seq).name for seq, p in zip(running, proposals) if p.size}
        names = drafting or {self.drafter_of(seq).name for seq in running}
        prices = [self.prices[name] for name in names if name in self.prices]
        if not prices:
            return None
        priced = prices[0].seconds(batch, depth)
        if len(drafting) > 1:
            return priced
        caught_up = any(seq.depth_policy is not None and seq.depth_policy.resumed for seq in running)
        # the first plain round after drafting ones is slower than the target alone is (on
        # SmolLM2's EAGLE-3 head: 16-19 ms against 15 for the rounds after it): what it pays for
        # is theirs, and measured, it stood as depth 0's price for a whole request
        cold = depth == 0 and self._drafted_last and self.unmeasured_after_draft
        self._drafted_last = depth > 0
        if not caught_up and not cold:
            for price in prices:
                price.observe(batch, depth, seconds)
        return priced

    def drafts_joining(self, rows: int, request: Request) -> bool:
        """Whether a request joining as the ``rows``-th running sequence drafts in its first
        round for sure: its own cap and the schedule's at that batch size allow a draft, and no
        adaptive depth may choose 0 there. Else the drafter's own prefill (a draft model's
        prompt) waits for a first draft: an int4 copy of SmolLM2 fed a 150-token prompt for
        about 115 ms on requests where adaptive depth then never drafted."""
        return self._cap(rows) > 0 and (request.max_depth is None or request.max_depth > 0) and self.adaptive is None

    def _cap(self, rows: int) -> int:
        """A round's depth at ``rows`` running sequences: the loop's D, or the schedule's there."""
        return self.draft_len if self.schedule is None else min(self.draft_len, self.schedule.depth(rows))

    def plan(self, running: Sequence[Running]) -> RoundPlan:
        """Before drafting: the round's cap, each row's depth, and a tree round where the batch
        size has a tree graph that every row's cache holds (else chains)."""
        n = len(running)
        cap = self._cap(n)
        trees = self.trees
        if trees is not None:
            batch = trees.batch_for(n)
            # one sequence: the tree's own budget; more: at most the round's depth per row, as chains
            nodes = min(self.tree_nodes, trees.nodes, cap if n > 1 else self.tree_nodes)
            if batch is not None and nodes > 0 and all(trees.fits(seq.length - 1, nodes, batch) for seq in running):
                depths = self._depths(running, cap)
                # an adaptive row alone has its drafter stop growing where the size below would cut
                hints = [self._size_hint(seq) if n == 1 else None for seq in running]
                return RoundPlan(cap, depths, trees, nodes, self.tree_top_k, hints)
        return RoundPlan(cap, self._long(running, self._depths(running, cap, chains=True)), self.chains)

    def _long(self, running: Sequence[Running], depths: list[int]) -> list[int]:
        """The depths with a long drafter's row alone (adaptive, chose to draft) let past D: as
        deep as the target's widest long size holds, within its request's cap, its cache and its
        token budget (the module docstring). Batched rows and the shared width keep theirs."""
        long_depth = self.target.long_depth
        if len(running) != 1 or self.shared is not None or long_depth <= depths[0] or depths[0] == 0:
            return depths
        seq = running[0]
        if seq.depth_policy is None or not self.drafter_of(seq).drafts_long:
            return depths
        request = seq.request
        return [min(long_depth, request.max_depth if request.max_depth is not None else long_depth,
                    self.target.max_seq_len - seq.length, request.max_new_tokens - seq.stats.tokens - 1)]

    def chain_round(self, plan: RoundPlan) -> RoundPlan:
        """A tree round in which no row drafted a node, as a chain round: the roots alone are
        verified by the target's own graphs, not the tree graph."""
        return RoundPlan(plan.cap, plan.depths, self.chains)

    def _depths(self, running: Sequence[Running], cap: int, chains: bool = False) -> list[int]:
        """Each row's depth: the round's, within its request's own cap (``Request.max_depth``,
        its stats' draft_len), its cache and its token budget, then as its own adaptive depth
        chooses; in a chain round, all of it for a free drafter's row that chose to draft
        (``Drafter.drafts_free``: its chain's tag then cuts it, ``trim``)."""
        max_seq_len, batch = self.target.max_seq_len, self.target.batch_for(len(running))
        depths = []
        for seq in running:
            k = min(cap, seq.stats.draft_len, max_seq_len - seq.length, seq.request.max_new_tokens - seq.stats.tokens - 1)
            if seq.depth_policy is not None:
                drafter = self.drafter_of(seq)
                chosen = seq.depth_policy.best_depth(drafter.name, k, batch,
                                                     remaining=seq.request.max_new_tokens - seq.stats.tokens)
                k = k if chosen > 0 and chains and drafter.drafts_free else chosen
            depths.append(k)
        return depths

    def _size_hint(self, seq: Running) -> SizeHint | None:
        """The size an adaptive sequence verifying alone will cut its tree to, counting the
        drafter's steps down to its deepest node (None: a fixed-size row). Not at B > 1: there the
        rows share one size, which may give a row more nodes than its own tree would choose."""
        if seq.depth_policy is None or self.trees is None:
            return None
        drafter = self.drafter_of(seq)
        estimate, tag = seq.depth_policy.estimate, tree_tag(drafter)
        cost, round_cost = self.trees.cost, drafter.round_cost
        return lambda weights, depths, drafted: size_ranked(estimate, tag, weights, depths, cost, drafted, round_cost)

    def trim(self, seq: Running, chain: DraftTree) -> DraftTree:
        """A chain that exists, cut to the prefix the row's adaptive depth keeps."""
        if seq.depth_policy is None:
            return chain
        # a long chain (past D) is priced as its rounds are, by the entry that runs it, checked by the clock
        return trim_chain(seq.depth_policy, chain, self.drafter_of(seq).name)

    def fit(self, running: Sequence[Running], proposals: list[DraftTree], plan: RoundPlan) -> list[DraftTree]:
        """The proposals cut to what the round's pass should hold."""
        if plan.trees:
            if any(seq.depth_policy is not None for seq in running):  # adaptive: the trees' best shared size at this batch
                trees = plan.verifier
                assert isinstance(trees, TreeVerifier)
                batch = trees.batch_for(len(running))
                # a fixed-depth row's weights are taken as they are: a fresh estimate
                estimates = [(seq.depth_policy.estimate if seq.depth_policy is not None else AcceptanceEstimate(),
                              tree_tag(self.drafter_of(seq))) for seq in running]
                keep = shared_size(estimates, proposals, lambda rows: trees.cost(rows, batch))
                proposals = [tree.best(keep) if tree.size > keep else tree for tree in proposals]
            return proposals
        n = len(running)
        # an in-place graph checks its padded length against every row's cache: a batched call's
        # graph (its T, not only the longest row) fits the fullest row; one row's runner picks a
        # graph that fits by itself
        room = min(self.target.max_seq_len - (seq.length - 1) for seq in running)
        if self.target.batch_for(n) > 1:
            room = max(t for t in self.target.widths(n) if t <= room)
        width = min(1 + max(p.size for p in proposals), room)
        if self.shared is not None and width > 1:  # the width with the most expected tokens per second of verify
            tags = [p.tag or self.drafter_of(seq).name for seq, p in zip(running, proposals)]
            width = self.shared.choose(self.target, proposals, width, tags)
        holds = self.chains.holds(n, width)
        return [p if 1 + p.size <= holds else p.prefix(holds - 1) for p in proposals]

    def observe(self, seq: Running, proposal: DraftTree, accepted: int, tree: bool) -> None:
        """Row ``seq`` kept ``accepted`` nodes of ``proposal`` (a path down to that depth) in a
        tree round or not."""
        drafter = self.drafter_of(seq)
        tag = proposal.tag or drafter.name
        # a tree's depth is planned as a chain's: the tree counts as a chain of its depth too
        estimates = [e for e in (self.shared.estimate if self.shared is not None else None,
                                 seq.depth_policy.estimate if seq.depth_policy is not None else None) if e is not None]
        for estimate in estimates:
            if tree:
                estimate.observe_chain(tag, proposal.depth, accepted)
            else:
                estimate.observe(tag, proposal, accepted)
        if tree and seq.depth_policy is not None:
            seq.depth_policy.estimate.observe(tree_tag(drafter), proposal, accepted)


def tree_tag(drafter: Drafter) -> str:
    """The acceptance tag of a drafter's trees (apart from its chains')."""
    return f"{drafter.name}/tree"


def trim_chain(depth: DepthPolicy, chain: DraftTree, planned_tag: str) -> DraftTree:
    """A chain that exists, cut to the best prefix worth verifying when its tag says more than
    the one its depth was planned with (prompt lookup: the match length it found). The drafts
    are sunk, so only the verify counts, as the round prices (checked by the clock) price it."""
    if not chain.tag or chain.tag == planned_tag:
        return chain
    return chain.prefix(depth.best_depth(chain.tag, chain.size, sunk=True))
