"""Drafters: propose tokens after each running sequence's context; only the target decides.

One protocol, over the rows of a batch (a lone request is one row, in slot 0). Per-sequence
state (a cache row) lives in slots that follow the target's: a sequence ``join``s a slot,
every round ``propose`` drafts for all running rows at once, ``accept`` tells a slot what the
target kept, and when a row leaves, the last row's state ``move``s into its slot. A drafter
that reads the target's hidden states names them in ``needs``; the loop asks the target's
graphs for them and hands each slot the rows of the positions it committed.

Here: the target alone (``NoDrafter``), prompt lookup (``NgramDrafter``) and a model of its
own (``ModelDrafter``: a draft model or the int4 copy of the target). The hidden-state heads
live in runtime/chain_drafter.py (EAGLE-3, MTP) and runtime/block_drafter.py (DFlash, DSpark).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from specexport.contract import LOGITS, NEXT_TOKENS
from specexport.runtime.acceptance import EMPTY_DRAFT, Draft, Kept, Sampling, warp_row
from specexport.runtime.cache_store import Store
from specexport.runtime.model import Model
from specexport.runtime.rules import SequenceRules
from specexport.runtime.tree import DraftTree, SizeHint, Spine

TargetOut = Mapping[str, np.ndarray]  # target output name -> [n, ...] rows of committed positions
PartCosts = Mapping[str, Mapping[int, float]]  # a drafter's graph part ("step", "catchup", "block") -> tokens -> ms
_NOTHING = np.zeros(0, dtype=np.int64)  # an idle row's tokens


@dataclass(frozen=True)
class DraftRow:
    """What a drafter sees of one running sequence (row r of a round is slot r)."""

    context: np.ndarray  # [n] committed tokens: prompt + output so far
    sampling: Sampling
    rng: np.random.Generator  # the sequence's own stream (drafts drawn from it, then its rejection)
    rules: SequenceRules | None = None  # the request's logits rules (the target's rows get them too)
    prompt_len: int = 0  # where the output starts in context
    # adaptive tree rounds: how many nodes of a tree the loop would verify (a drafter that grows
    # its tree level by level stops at a level none of whose nodes could be among them)
    tree_size: SizeHint | None = None

    def q(self, logits: np.ndarray, drafted: np.ndarray) -> Kept:
        """The distribution a sampled draft is drawn from: the drafter's logits [V] after
        ``drafted`` [j] (this proposal's drafts so far), ruled as the target's row at that
        position will be (where the rules leave some token), then warped."""
        if self.rules is not None:
            ruled = self.rules.apply(logits, np.concatenate((self.context[self.prompt_len :], drafted)))
            if np.isfinite(ruled).any():  # else the drafter has nothing the rules allow: its draft will be rejected
                logits = ruled
        return warp_row(logits, self.sampling)


@dataclass(frozen=True)
class DraftBudget:
    """How much a round asks of the drafter: ``depths[r]`` levels for row r (0: nothing, the row
    only verifies); ``nodes`` > 0: token trees of at most that many nodes with at most ``top_k``
    children a node (for a drafter that ``builds_trees``), else chains of ``depths[r]`` tokens."""

    depths: Sequence[int]
    nodes: int = 0
    top_k: int = 0

    @property
    def trees(self) -> bool:
        return self.nodes > 0


class Drafter(Protocol):
    name: str
    needs: tuple[str, ...]  # target outputs it reads (a head's aux_hidden_states); empty for most
    builds_trees: bool  # whether ``propose`` gives trees for a tree budget (else chains)
    # whether its drafts cost nothing to make and its chains' tags carry the evidence for them
    # (prompt lookup's and suffix decoding's match length): a row whose adaptive depth chose to
    # draft drafts as deep as the round allows, and the chain's tag decides how much of it is
    # verified (runtime/policy.py); the depth planned before drafting knows no match length
    drafts_free: bool
    # whether such chains may also run past D: a row alone then drafts up to the target's longest
    # verify entry (suffix decoding, whose draft grows with its match)
    drafts_long: bool

    @property
    def engine_seconds(self) -> float:
        """Seconds inside the drafter's engines so far (0 without any): the rest is host work."""

    def round_cost(self, k: int, costs: PartCosts | None = None) -> float:
        """Seconds of engine time a round drafting ``k`` tokens costs this drafter for one
        sequence (k = 0: what skipping a round costs it, a catch-up later), from its graphs'
        costs (``costs``: measured ones, by part; default the build's or tune's): the one cost
        model adaptive depth, the schedule and the bench's prediction read."""

    def catchup_cost(self, skipped: int) -> float:
        """Seconds a drafting round after ``skipped`` rounds at depth 0 costs this drafter beyond
        its ``round_cost``: feeding what it skipped (0 for a drafter that skips for free)."""

    def cost_graphs(self) -> dict[str, tuple[object, list[int]]]:
        """part -> (a batch-1 runner with ``time_run(size)``, the sizes ``round_cost`` reads):
        what the bench times to predict with measured costs."""

    def join(self, slot: int, prompt: np.ndarray, target_out: TargetOut) -> None:
        """A sequence starts in ``slot``; the target has just prefilled prompt[:-1] there
        (``target_out``: the outputs named by ``needs``, a row per prefilled position; arrays
        are valid during the call only: copy what you keep)."""

    def prefill(self, slot: int) -> None:
        """Feed now what ``join`` left for the row's first draft (a draft model's prompt): the
        loop calls it when the sequence drafts from its first round, so that work stays the
        prefill's; a sequence that starts where the schedule drafts nothing pays it only if it
        ever drafts."""

    def propose(self, rows: Sequence[DraftRow], budget: DraftBudget) -> list[DraftTree]:
        """A proposal for every running row (row r in slot r) within ``budget``: a chain, or a
        tree where the budget asks for trees; depth 0 (or nothing to offer): no nodes, and the
        row's state stays a valid prefix of its context. A sampled chain carries the
        distributions its tokens were drawn from, drawn with the row's own rng."""

    def accept(self, slot: int, n_accepted: int, next_token: int, target_out: TargetOut) -> None:
        """The target kept ``n_accepted`` of the slot's drafts and chose ``next_token`` after them;
        ``target_out``: the row's outputs named by ``needs`` for its 1 + n_accepted committed
        positions, never a rejected one."""

    def leave(self, slot: int, context: np.ndarray, prompt_len: int) -> None:
        """The sequence in ``slot`` ended with ``context`` [n] committed (its output from
        ``prompt_len`` on); a ``move`` into the slot or a ``join`` may follow. A drafter that
        learns from finished requests (suffix decoding's store) keeps what it wants here."""

    def move(self, src: int, dst: int) -> None:
        """Slot ``dst`` takes over slot ``src``'s sequence."""


NO_NODES = DraftTree(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))  # a row verifying its root alone


class ChainsAndTrees(ABC):
    """``propose`` over a drafter's two ways of drafting: ``chains(rows, depths)`` (a Draft per
    row) and ``trees(rows, budget)`` (a DraftTree or None per row), asked for only where the
    drafter ``builds_trees``."""

    builds_trees = True
    drafts_free = False
    drafts_long = False

    def propose(self, rows: Sequence[DraftRow], budget: DraftBudget) -> list[DraftTree]:
        if budget.trees and self.builds_trees:
            return [tree if tree is not None else NO_NODES for tree in self.trees(rows, budget)]
        return [DraftTree.of_draft(draft) for draft in self.chains(rows, budget.depths)]

    @abstractmethod
    def chains(self, rows: Sequence[DraftRow], depths: Sequence[int]) -> list[Draft]:
        """A chain of at most ``depths[r]`` tokens for every row (0: EMPTY_DRAFT)."""

    @abstractmethod
    def trees(self, rows: Sequence[DraftRow], budget: DraftBudget) -> list[DraftTree | None]:
        """A tree within ``budget`` for every row (None: nothing to offer)."""

    def prefill(self, slot: int) -> None:  # noqa: B027 - most defer nothing
        """Most drafters' ``join`` leaves nothing for later."""

    def leave(self, slot: int, context: np.ndarray, prompt_len: int) -> None:  # noqa: B027 - most keep nothing
        """Most drafters forget a sequence when another moves into its slot or joins it."""

    def catchup_cost(self, skipped: int) -> float:
        """Each skipped round at what ``round_cost(0)`` charges a skip."""
        return skipped * self.round_cost(0)  # type: ignore[attr-defined]


class Stateless(ChainsAndTrees):
    """A drafter without engines or per-sequence state: each row drafts from its context alone
    (``chain``, and ``tree`` where it builds trees)."""

    name = "none"
    needs: tuple[str, ...] = ()
    engine_seconds = 0.0
    builds_trees = False

    def round_cost(self, k: int, costs: PartCosts | None = None) -> float:
        return 0.0

    def cost_graphs(self) -> dict[str, tuple[object, list[int]]]:
        return {}

    def join(self, slot: int, prompt: np.ndarray, target_out: TargetOut) -> None:
        pass

    def chains(self, rows: Sequence[DraftRow], depths: Sequence[int]) -> list[Draft]:
        return [self.chain(row.context, k) if k > 0 else EMPTY_DRAFT for row, k in zip(rows, depths)]

    def trees(self, rows: Sequence[DraftRow], budget: DraftBudget) -> list[DraftTree | None]:
        return [self.tree(row, depth, budget.nodes, budget.top_k) if depth > 0 else None
                for row, depth in zip(rows, budget.depths)]

    def chain(self, context: np.ndarray, k: int) -> Draft:
        """Up to ``k`` tokens after ``context`` [n]."""
        return EMPTY_DRAFT

    def tree(self, row: DraftRow, depth: int, nodes: int, top_k: int) -> DraftTree | None:
        """A tree of at most ``nodes`` nodes and ``depth`` levels after the row's context."""
        return None

    def accept(self, slot: int, n_accepted: int, next_token: int, target_out: TargetOut) -> None:
        pass

    def move(self, src: int, dst: int) -> None:
        pass


class NoDrafter(Stateless):
    """The target alone: every round verifies one token. The baseline, through the same engines."""


# How much more a prompt-lookup match of n tokens counts than one of n − 1 in a tree. Measured on
# the dev prompts (fixed 5-node trees, depth 5): counting every match once, grounded code's E[L]
# was the chain's (3.15); at 4 it is 3.27, and 16 changes nothing further.
LONGER_MATCH_WEIGHT = 4


# The match lengths a draft's tag names (the largest at or under the match): adaptive depth
# learns acceptance per tag, and a few buckets fill faster than one tag per length.
TAG_LENGTHS = (1, 2, 3, 4, 6, 8, 12)


def tag_length(matched: int) -> int:
    """The tag of a draft after a ``matched``-token match: the largest of TAG_LENGTHS <= it."""
    return max(n for n in TAG_LENGTHS if n <= matched)


class NgramDrafter(Stateless):
    """Prompt lookup: find the context's last n tokens earlier in the context (longest n
    first) and propose what followed: as a chain, the latest occurrence of the longest match that
    still has k tokens after it; as a tree, every occurrence's continuation merged into a trie.

    A long ``max_ngram`` is what tells copies apart: in a code edit the last three tokens
    (`` self.``) occur a dozen times, the last twelve once. Matches are found from the last
    token back (its occurrences, then each extended while the tokens before it agree), so a
    long ``max_ngram`` costs the occurrences of the last token times the match length, not a
    scan of the context per length.

    Its drafts cost nothing, and a chain's tag names its match length (``drafts_free``): a
    row drafts as deep as its round allows and adaptive depth verifies as much as that match
    length has been kept. A depth planned before the match is known held every chain of
    SmolLM2's int4 code edit at the 2 drafts a fresh estimate pays for, where its 12-token
    matches kept all 7."""

    builds_trees = True
    drafts_free = True

    def __init__(self, name: str = "ngram", max_ngram: int = 16, min_ngram: int = 1):
        self.name = name
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def occurrences(self, context: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Every earlier occurrence of the context's end: (where its continuation starts [h],
        how many tokens it matches [h], at most ``max_ngram``), longest first, latest first
        among equals; those under ``min_ngram`` left out. An occurrence ends before the last
        token, so each has a continuation."""
        size = len(context)
        last = size - 1
        ends = np.flatnonzero(context[:last] == context[last]) if size > 1 else np.empty(0, np.int64)  # [h]
        lengths = np.ones(len(ends), dtype=np.int64)  # [h]
        alive = np.arange(len(ends))  # [a] the occurrences still matching at distance m
        for m in range(1, min(self.max_ngram, size - 1)):
            alive = alive[ends[alive] >= m]
            alive = alive[context[ends[alive] - m] == context[last - m]]
            if not alive.size:
                break
            lengths[alive] += 1
        keep = lengths >= self.min_ngram
        starts, lengths = ends[keep] + 1, lengths[keep]
        order = np.lexsort((-starts, -lengths))  # longest first, then latest
        return starts[order], lengths[order]

    def chain(self, context: np.ndarray, k: int) -> Draft:
        starts, lengths = self.occurrences(context)
        if not starts.size:
            return EMPTY_DRAFT
        longest = starts[lengths == lengths[0]]  # [h'] latest first
        full = longest[longest + k <= len(context)]
        start = int(full[0] if full.size else longest[-1])  # else the earliest: the longest continuation
        return Draft(np.array(context[start : start + k], dtype=np.int64), tag=f"{self.name}/n{tag_length(int(lengths[0]))}")

    def tree(self, row: DraftRow, depth: int, nodes: int, top_k: int) -> DraftTree | None:
        """Several continuations at once: what followed the earlier occurrences of the
        context's end (longest match first, latest first, up to ``depth`` tokens each), merged
        into a trie; the ``nodes`` prefixes with the most matches behind them are kept, at most
        ``top_k`` children under a node (None: no match). An occurrence matching n tokens weighs
        1 + 4 + ... + ``LONGER_MATCH_WEIGHT`` ** (n − 1) (it counts once as a match of each
        length up to n), so the few long matches a chain would follow outrank the many short
        ones that merely share the last token. Occurrences are taken a match length at a time
        until there are 2 × ``top_k``."""
        context = row.context
        starts, lengths = self.occurrences(context)
        if not starts.size:
            return None
        if len(starts) > 2 * top_k:  # the first 2 top_k, and the rest of the last one's match length
            keep = lengths >= lengths[2 * top_k - 1]
            starts, lengths = starts[keep], lengths[keep]
        found = [context[s : s + depth] for s in starts]
        weights = [float((LONGER_MATCH_WEIGHT ** int(n) - 1) / (LONGER_MATCH_WEIGHT - 1)) for n in lengths]
        return trie_tree(found, nodes, top_k, f"{self.name}/tree", weights)


def trie_tree(continuations: Sequence[np.ndarray], nodes: int, top_k: int, tag: str,
              weights: Sequence[float] | None = None) -> DraftTree:
    """The trie of ``continuations`` (in priority order), cut to its ``nodes`` best prefixes:
    best-first from the root by the weight of the continuations that share the prefix (each
    its ``weights`` entry, default 1; earlier ones first on a tie), at most ``top_k`` children
    per node. Parents come before children; a node weighs its share of the total weight."""
    weights = [1.0] * len(continuations) if weights is None else weights
    trie: dict[tuple[int, ...], list] = {}  # prefix -> [weight through it, first continuation holding it]
    for order, (tokens, weight) in enumerate(zip(continuations, weights)):
        for end in range(1, len(tokens) + 1):
            entry = trie.setdefault(tuple(int(t) for t in tokens[:end]), [0.0, order])
            entry[0] += weight
    children: dict[tuple[int, ...], list[tuple[int, ...]]] = {}
    for prefix in trie:
        children.setdefault(prefix[:-1], []).append(prefix)
    rank = {prefix: (-count, first) for prefix, (count, first) in trie.items()}
    for kids in children.values():
        kids.sort(key=rank.__getitem__)
        del kids[top_k:]
    kept: list[tuple[int, ...]] = []
    index: dict[tuple[int, ...], int] = {(): -1}
    frontier = list(children.get((), []))
    while frontier and len(kept) < nodes:
        best = min(frontier, key=rank.__getitem__)
        frontier.remove(best)
        index[best] = len(kept)
        kept.append(best)
        frontier += children.get(best, [])
    return DraftTree(np.array([p[-1] for p in kept], dtype=np.int64),
                     np.array([index[p[:-1]] for p in kept], dtype=np.int64), tag,
                     np.array([trie[p][0] for p in kept], dtype=np.float64) / sum(weights))


class ModelDrafter(ChainsAndTrees):
    """A draft model (or the int4 copy of the target) with its own cache, whose row r follows
    the target's slot r. A round: one step feeds every drafting row what its row lacks (the
    last committed token, plus the last draft after a fully accepted round, or more after
    rounds at depth 0), then k-1 single-token steps; a row that drafts fewer sits out the later
    steps. On accept a row goes back to base + min(n_accepted, k-1). A gap wider than the
    batched graphs is fed first through the slot's own runner.

    ``target_rows`` (the int4 copy of its own target, QSpec's shared cache): slot -> the
    target's cache row, of the same layout. The target holds the K/V of every context position
    but the last when a round drafts, so a row takes what it lacks from there instead of
    computing it: no prompt prefill, no catch-up after rounds at depth 0, and the row drafts
    from the full-precision K/V of its context. Only the target decides what is emitted, so
    outputs are the same either way; the drafts are the int4 copy's over the target's past."""

    needs: tuple[str, ...] = ()

    def __init__(self, name: str, model: Model, cost_ms: dict[int, float], target_rows: Sequence[Store] | None = None):
        self.name = name
        self.model = model
        self.cost_ms = cost_ms  # tokens -> ms of one batch-1 run
        self.target_rows = target_rows
        slots = model.slots
        self._length = [0] * slots  # positions each slot's row holds: its context's first ones
        self._base = [0] * slots  # context length at the slot's last proposal
        self._k = [0] * slots  # drafts of that proposal (0: none since the last accept)
        # the prompt (less its last token) a slot's row is fed when it first drafts (None: fed)
        self._unfed: list[np.ndarray | None] = [None] * slots

    @property
    def engine_seconds(self) -> float:
        return self.model.seconds

    def round_cost(self, k: int, costs: PartCosts | None = None) -> float:
        """k one-token steps (the first one feeds the row's gap too); skipping costs the
        skipped token's catch-up later, two tokens at a time."""
        ms = (costs or {"step": self.cost_ms})["step"]
        step = ms.get(1, 0.0) / 1e3
        if k == 0 and self.target_rows is not None:
            return 0.0  # the skipped token's K/V is taken from the target, not computed
        return k * step if k > 0 else ms.get(2, 2e3 * step) / 2e3

    def catchup_cost(self, skipped: int) -> float:
        """The first step feeds the skipped tokens with the last one: what feeding 1 + skipped
        tokens costs over feeding 1, as the slot's runner runs it (a gap wider than its widest
        entry: the rows before it filled first, ``_gap``); nothing when the row takes them from
        the target's cache (a copy of ~46 KB a position for SmolLM2, microseconds)."""
        if self.target_rows is not None:
            return 0.0
        runner = self.model.runners[0]
        fed, alone = runner.catchup_ms(1 + skipped), runner.planned_ms(1)
        if fed is None or alone is None:
            return skipped * self.round_cost(0)
        return max(fed - alone, 0.0) / 1e3

    def cost_graphs(self) -> dict[str, tuple[object, list[int]]]:
        runner = self.model.runners[0]
        return {"step": (runner, [t for t in (1, 2) if t in runner.decoding_sizes])}

    def join(self, slot: int, prompt: np.ndarray, target_out: TargetOut) -> None:
        """The row's prefill waits for ``prefill`` (the loop's, for a sequence that drafts at
        once) or its first draft (``_gap``): a sequence that joins where the schedule drafts
        nothing pays for it only if it ever drafts. Run here always, an int4 copy that drafted
        nothing cost 0.75-0.83x the target alone on a batched hybrid."""
        self.model.runners[slot].cache.set_length(0)
        self._length[slot], self._k[slot] = 0, 0
        # as the target: all but the last token; a prompt longer than the cache never drafts
        # (``chains`` caps its depth); a row that takes the target's K/V never prefills
        fed = len(prompt) > self.model.max_seq_len or self.target_rows is not None
        self._unfed[slot] = None if fed else prompt[:-1]

    def prefill(self, slot: int) -> None:
        unfed, self._unfed[slot] = self._unfed[slot], None
        if unfed is not None and len(unfed):
            self._forward_alone(slot, unfed)  # [n] one runner call over an empty row, as join ran it

    def chains(self, rows: Sequence[DraftRow], ks: Sequence[int]) -> list[Draft]:
        n = len(rows)
        # within the draft cache too: the context, then k-1 drafts
        ks = [max(0, min(k, self.model.max_seq_len - len(row.context))) for row, k in zip(rows, ks)]
        active = [r for r in range(n) if ks[r] > 0]
        drafts = [EMPTY_DRAFT] * n
        self._k[:n] = [0] * n
        if not active:
            return drafts
        sampled = any(not rows[r].sampling.greedy for r in active)
        feed = self._gaps(rows, active)
        out = self._run(n, feed, sampled)
        at = {r: len(tokens) - 1 for r, tokens in feed.items()}  # each row's last fed token: its first draft
        tokens = np.zeros((n, max(ks)), dtype=np.int64)  # [n, k_max]
        probs: dict[int, list[Kept]] = {r: [] for r in active}  # q of each draft of a sampled row
        for j in range(tokens.shape[1]):
            for r in (r for r in active if j < ks[r]):
                row = rows[r]
                if row.sampling.greedy:
                    tokens[r, j] = out[NEXT_TOKENS][r, at[r]]
                else:
                    probs[r].append(row.q(out[LOGITS][r, at[r]], tokens[r, :j]))
                    tokens[r, j] = probs[r][-1].draw(row.rng)
            stepping = [r for r in active if ks[r] > j + 1]  # rows that want draft j+2
            if not stepping:
                break
            out = self._run(n, {r: tokens[r, j : j + 1] for r in stepping}, sampled)
            at = dict.fromkeys(stepping, 0)
        for r in active:
            self._base[r], self._k[r] = len(rows[r].context), ks[r]
            drafts[r] = Draft(tokens[r, : ks[r]].copy(), None if rows[r].sampling.greedy else probs[r], self.name)
        return drafts

    def trees(self, rows: Sequence[DraftRow], budget: DraftBudget) -> list[DraftTree | None]:
        """The model's greedy chain of up to the row's depth as the spine, each step's top-k
        hanging under it as leaves (runtime/tree.py ``Spine``): the tree branches where the model
        is unsure, and the chain stops once no deeper node can make the cut. Every row at once:
        one call feeds every drafting row what its cache row lacks, then each spine step is one
        call over the rows whose spine goes on (the others sit out), as ``chains`` steps. A path
        may end on a leaf the cache never held, so the round keeps only the context in the
        cache: the next round feeds what was accepted."""
        n = len(rows)
        depths = [max(0, min(d, self.model.max_seq_len - len(row.context))) for row, d in zip(rows, budget.depths)]
        active = [r for r in range(n) if depths[r] > 0]
        trees: list[DraftTree | None] = [None] * n
        if not active:
            return trees
        feed = self._gaps(rows, active)
        out = self._run(n, feed, True)
        at = {r: len(tokens) - 1 for r, tokens in feed.items()}  # each row's last fed token: level 1
        spines = {r: Spine(depths[r], budget.nodes, budget.top_k, hint=rows[r].tree_size) for r in active}
        while at:
            stepping = {r: token for r in at if (token := spines[r].add(out[LOGITS][r, at[r]])) is not None}
            if not stepping:
                break
            out = self._run(n, {r: np.array([token]) for r, token in stepping.items()}, True)
            at = dict.fromkeys(stepping, 0)
        for r in active:
            trees[r] = spines[r].tree(f"{self.name}/tree")
            self._base[r], self._k[r] = len(rows[r].context), 1  # accept keeps base + min(n, 0): the context
        return trees

    def accept(self, slot: int, n_accepted: int, next_token: int, target_out: TargetOut) -> None:
        # The row holds the context and drafts 1..k-1; keep those the target accepted.
        if self._k[slot]:
            self._length[slot] = self._base[slot] + min(n_accepted, self._k[slot] - 1)
            self._k[slot] = 0

    def move(self, src: int, dst: int) -> None:
        self.model.move(src, dst, self._length[src])
        self._length[dst], self._base[dst], self._k[dst] = self._length[src], self._base[src], self._k[src]
        self._unfed[dst], self._unfed[src] = self._unfed[src], None

    def _gaps(self, rows: Sequence[DraftRow], active: list[int]) -> dict[int, np.ndarray]:
        """What each drafting row's cache row lacks of its context (``_gap``): slot -> tokens for
        one call over the rows."""
        widest = self.model.widths(len(rows))[-1]
        return {r: self._gap(r, rows[r].context, widest) for r in active}

    def _gap(self, slot: int, context: np.ndarray, widest: int) -> np.ndarray:
        """What the slot's cache row lacks of ``context``, always its last token (whose output is
        the first draft). A gap wider than ``widest`` (after rounds at depth 0) is fed first
        through the slot's runner, without logits: only the last row's are read, and a long
        gap's would be MBs (200 KB a row for SmolLM2's vocabulary). A row's first draft first
        prefills its prompt as the join would have (one runner call, the same pieces)."""
        self.prefill(slot)
        self._length[slot] = min(self._length[slot], len(context) - 1)
        if self.target_rows is not None:  # the target holds context[:-1]: only the last token is fed
            self._take(slot, len(context) - 1)
        if len(context) - self._length[slot] > widest:
            self._forward_alone(slot, context[self._length[slot] : len(context) - widest])
        return context[self._length[slot] :]

    def _take(self, slot: int, length: int) -> None:
        """The slot's row takes the target's K/V of positions [its length, ``length``)."""
        assert self.target_rows is not None
        start = self._length[slot]
        if length > start:
            cache = self.model.runners[slot].cache
            cache.set_length(start)
            cache.rows_store.take(self.target_rows[slot], start, length - start)
            cache.advance(length - start)  # a batch-1 cache counts what it holds
            self._length[slot] = length

    def _run(self, n: int, feed: dict[int, np.ndarray], want_logits: bool) -> dict[str, np.ndarray]:
        """One step over the first ``n`` slots, each fed row at its own length; lengths advance."""
        out = self.model.run(n, {r: (self._length[r], tokens, {}) for r, tokens in feed.items()}, want_logits)
        for r, tokens in feed.items():
            self._length[r] += len(tokens)
        return out

    def _forward_alone(self, slot: int, tokens: np.ndarray) -> None:
        """``tokens`` into the slot's row, nothing read: its fill entries where built."""
        runner = self.model.runners[slot]
        runner.cache.set_length(self._length[slot])
        runner.fill(tokens)
        self._length[slot] = runner.length
