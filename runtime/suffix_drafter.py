"""Suffix decoding (SuffixDecoding, Oliaro et al., 2024): draft what followed the longest match
of the context's end, in the request's own context and in a store of earlier responses.

Two suffix indexes (runtime/suffix_index.py) are searched every round: the slot's own, over the
request's prompt and output (grown by the round's new tokens: O(index depth) a token, no scan of
the context), and the pipeline's store of earlier responses (runtime/suffix_store.py: bounded by
a token budget, shared by every request of a server or a batch; a finished request's output goes
in when it leaves). A draft is at most ``spec_factor`` × the match length tokens (SuffixDecoding's
draft size: a long match has earned a long draft) under the round's depth and node budget.

A tree follows the most frequent continuations of the longest match in each index (a child's
share of the counts past its parent, multiplied down a path; no node below ``min_token_prob``),
and of the two trees the one with more expected accepted tokens (the sum of its path
probabilities) is proposed. A chain is matched again at every draft: each is the most frequent
continuation of the longest match of the chain's end (the context and the drafts before it) in
either index, the longer match first, so a chain goes on from whichever occurrence (or index)
matches its end longest, not only down the one path its first match began (a chain crosses
between the indexes in 6% of the repeated-structure workload's rounds). A chain stops before a
draft whose path probability is below ``chain_min_prob``, 0.5 by default: where earlier
responses disagree (a template's slot: a name, a city) a chain does not guess, while a tree
keeps the lower ``min_token_prob`` (its siblings hold the rest of the mass). With both rules and ``spec_factor``
3 (2 before), replaying that workload (scripts/suffix_replay.py) predicts 1.25× n-gram's
speedup, 1.21× before.

The drafts are chosen, not drawn, so a sampled request stays exact through the point-mass rules
(runtime/acceptance.py: ``rejection`` with q = one-hot for a chain, ``tree_rejection`` for a
tree). A chain is tagged with its match length (``suffix/m4``: 4 or 5 tokens matched, by
runtime/drafters.py's ``tag_length``), so adaptive depth learns acceptance per match length and
trims each chain by its own (``trim_chain``), as it does prompt lookup's ``ngram/n3``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from specexport.contract import DrafterEntry
from specexport.runtime.acceptance import EMPTY_DRAFT, Draft
from specexport.runtime.drafters import (
    ChainsAndTrees,
    DraftBudget,
    DraftRow,
    PartCosts,
    TargetOut,
    tag_length,
)
from specexport.runtime.suffix_index import Match, SuffixIndex
from specexport.runtime.suffix_store import ResponseStore
from specexport.runtime.tree import DraftTree

if TYPE_CHECKING:
    from specexport.runtime.api import Pipeline

OWN, STORE = 0, 1  # a chain's indexes: the request's own, the store's
Step = tuple[int, float, Match]  # the next token after a match, its share, the match one token longer


@dataclass(frozen=True)
class SuffixSettings:
    """What a recipe's ``{kind: suffix}`` sets (DrafterParams' suffix fields)."""

    index_depth: int = 24  # tokens of each suffix indexed: the longest match plus its draft
    max_match: int = 12  # the longest context end looked up (below index_depth: room for the draft)
    spec_factor: float = 3.0  # draft at most this many tokens per matched token
    min_token_prob: float = 0.1  # no tree node whose path probability is below this
    store_tokens: int = 16384  # the store of earlier responses: its token budget (0: no store)
    store_prompts: bool = False  # store each request's prompt with its response
    chain_min_prob: float = 0.5  # a chain stops before a draft whose path probability is below this

    @classmethod
    def of(cls, entry: DrafterEntry, store_tokens: int | None = None) -> SuffixSettings:
        s = entry.settings
        return cls(s.index_depth, s.max_match, s.spec_factor, s.min_token_prob,
                   s.store_tokens if store_tokens is None else store_tokens, s.store_prompts, s.chain_min_prob)


@dataclass
class _Own:
    """A slot's index over its request's context (one document, grown as the request decodes)."""

    index: SuffixIndex
    doc: int
    prompt_len: int

    def sync(self, context: np.ndarray) -> None:
        """Index what the context gained since the last round."""
        held = len(self.index.docs[self.doc])
        if len(context) > held:
            self.index.extend(self.doc, context[held:].tolist())


@dataclass(frozen=True)
class _Found:
    """One index's draft for a row: tokens, parents, path probabilities, the match length."""

    tokens: list[int]
    parents: list[int]
    probs: list[float]
    matched: int
    from_store: bool

    @property
    def score(self) -> float:
        return sum(self.probs)  # expected accepted tokens


class SuffixDrafter(ChainsAndTrees):
    """Suffix decoding over the slots of a loop, with ``store`` (None: no store) shared by the
    pipeline's loops."""

    needs: tuple[str, ...] = ()
    engine_seconds = 0.0  # host work only
    drafts_free = True  # drafted as deep as the round allows, its tag (the match length) cuts it
    drafts_long = True  # a long match earns a long draft: past D at batch 1 (runtime/policy.py)

    def __init__(self, name: str, settings: SuffixSettings, store: ResponseStore | None, slots: int):
        self.name, self.settings, self.store = name, settings, store
        self._own: list[_Own | None] = [None] * slots

    def round_cost(self, k: int, costs: PartCosts | None = None) -> float:
        return 0.0

    def cost_graphs(self) -> dict[str, tuple[object, list[int]]]:
        return {}

    def join(self, slot: int, prompt: np.ndarray, target_out: TargetOut) -> None:
        index = SuffixIndex(self.settings.index_depth)
        self._own[slot] = _Own(index, index.open(prompt.tolist()), len(prompt))

    def propose(self, rows: Sequence[DraftRow], budget: DraftBudget) -> list[DraftTree]:
        for slot, row in enumerate(rows):
            own = self._own[slot]
            assert own is not None, f"slot {slot} drafts without a request"
            own.sync(row.context)
        return super().propose(rows, budget)

    def chains(self, rows: Sequence[DraftRow], depths: Sequence[int]) -> list[Draft]:
        drafts = []
        for slot, (row, k) in enumerate(zip(rows, depths)):
            found = self._chain(slot, row.context, k) if k > 0 else None
            if found is None:
                drafts.append(EMPTY_DRAFT)
                continue
            tokens, matched = found
            drafts.append(Draft(np.array(tokens, dtype=np.int64), tag=f"{self.name}/m{tag_length(matched)}"))
        return drafts

    def trees(self, rows: Sequence[DraftRow], budget: DraftBudget) -> list[DraftTree | None]:
        trees: list[DraftTree | None] = []
        for slot, (row, depth) in enumerate(zip(rows, budget.depths)):
            found = self._draft(slot, row.context, depth, budget.nodes, budget.top_k) if depth > 0 else None
            trees.append(None if found is None else DraftTree(
                np.array(found.tokens, dtype=np.int64), np.array(found.parents, dtype=np.int64), f"{self.name}/tree",
                np.array(found.probs, dtype=np.float64)))
        return trees

    def accept(self, slot: int, n_accepted: int, next_token: int, target_out: TargetOut) -> None:
        pass  # the next round's context brings the committed tokens (``propose`` indexes them)

    def leave(self, slot: int, context: np.ndarray, prompt_len: int) -> None:
        """The request's output (with its prompt where the settings say) joins the store."""
        if self.store is not None:
            self.store.add(context if self.settings.store_prompts else context[prompt_len:])
        self._own[slot] = None

    def move(self, src: int, dst: int) -> None:
        self._own[dst], self._own[src] = self._own[src], None

    def _draft(self, slot: int, context: np.ndarray, depth: int, nodes: int, top_k: int) -> _Found | None:
        """A tree: the better of the slot's own index's and the store's (None: no match in either)."""
        settings = self.settings
        end = context[-settings.max_match :].tolist()  # [m] the context's end, the longest pattern looked up
        own = self._own[slot]
        assert own is not None
        found = [f for f in (self._from(own.index, end, depth, nodes, top_k, False),) if f is not None]
        if self.store is not None and self.store.enabled:
            self.store.lookups += 1
            stored = self._from(self.store.index, end, depth, nodes, top_k, True)
            if stored is not None:
                found.append(stored)
        if not found:
            return None
        best = max(found, key=lambda f: (f.score, f.matched, not f.from_store))
        if best.from_store:
            assert self.store is not None
            self.store.hits += 1
        return best

    def _chain(self, slot: int, context: np.ndarray, depth: int) -> tuple[list[int], int] | None:
        """A chain of at most ``depth`` drafts crossing between the slot's own index and the
        store's (the module docstring), and the match length it starts from; None: no match in
        either. Each draft is the most frequent continuation of the longest match of the chain's
        end, the longer match first, then the larger share, then the request's own: O(draft ×
        match) a round (``_moved``), no scan."""
        settings = self.settings
        own = self._own[slot]
        assert own is not None
        store = self.store if self.store is not None and self.store.enabled else None
        indexes = [own.index] if store is None else [own.index, store.index]  # [OWN, STORE]
        end = context[-settings.max_match :].tolist()  # [<= max_match] the chain's end, the longest pattern looked up
        matches: list[Match | None] = [index.longest(end, settings.max_match) for index in indexes]
        tokens: list[int] = []
        prob, size, matched, from_store = 1.0, depth, 0, False
        while len(tokens) < size:
            steps = _steps(indexes, matches, end)
            ranked = [((match.length, step[1], -source), source) for source, (match, step) in enumerate(zip(matches, steps))
                      if match is not None and step is not None]  # the longer match, the larger share, the request's own
            if not ranked:
                break
            (length, _, _), source = max(ranked)
            step = steps[source]
            assert step is not None
            token, share, _ = step
            prob *= share
            if prob < settings.chain_min_prob:
                break
            if not tokens:  # SuffixDecoding's draft size, from the match the chain starts with
                matched, size = length, min(depth, math.ceil(settings.spec_factor * length))
            tokens.append(token)
            from_store = from_store or source == STORE
            end = end[1:] + [token] if len(end) == settings.max_match else end + [token]
            matches = _moved(indexes, matches, steps, end, token)
        if store is not None:
            store.lookups += 1
            store.hits += from_store
        return (tokens, matched) if tokens else None

    def _from(self, index: SuffixIndex, end: list[int], depth: int, nodes: int, top_k: int,
              from_store: bool) -> _Found | None:
        match: Match | None = index.longest(end, self.settings.max_match)
        if match is None:
            return None
        size = min(nodes, math.ceil(self.settings.spec_factor * match.length))
        tokens, parents, probs = index.continuations(match, depth, size, top_k, self.settings.min_token_prob)
        return _Found(tokens, parents, probs, match.length, from_store) if tokens else None


def _steps(indexes: list[SuffixIndex], matches: list[Match | None], end: list[int]) -> list[Step | None]:
    """Each index's most frequent next token after its match of the chain's ``end`` (None: none).
    A match whose path has ended (its document's end, the index depth) gives way, in
    ``matches``, to the longest shorter one that goes on."""
    steps = []
    for i, (index, match) in enumerate(zip(indexes, matches)):
        step = index.follow(match) if match is not None else None
        if match is not None and step is None:
            match = matches[i] = index.longest(end, match.length - 1)
            step = index.follow(match) if match is not None else None
        steps.append(step)
    return steps


def _moved(indexes: list[SuffixIndex], matches: list[Match | None], steps: list[Step | None], end: list[int],
           token: int) -> list[Match | None]:
    """Each index's longest match of the chain's ``end`` after it drafted ``token``: one token on
    where that index's step was ``token``, else looked up again no longer than one past its last
    match (a longer one would have been its last match)."""
    return [step[2] if step is not None and step[0] == token else index.longest(end, 1 + (match.length if match else 0))
            for index, match, step in zip(indexes, matches, steps)]


def make(pipe: Pipeline, entry: DrafterEntry, slots: int) -> SuffixDrafter:
    """The suffix drafter of ``entry`` over ``slots`` rows, with the pipeline's store for its name
    (made on first use: every loop of the pipeline shares it)."""
    settings = SuffixSettings.of(entry, pipe.store_tokens)
    store = None
    if settings.store_tokens > 0:
        store = pipe.stores.setdefault(entry.name, ResponseStore(settings.store_tokens, settings.index_depth))
    return SuffixDrafter(entry.name, settings, store, slots)
