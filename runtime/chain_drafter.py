"""Chain drafters (EAGLE-3, MTP): a head that reads the target's hidden states, one draft per call.

The head's cache row p of a slot holds (token x_{p+1}, the target's features of position p).
The target hands over its tapped features for committed positions (the prompt after prefill,
then 1 + accepted rows after each verify); they wait as pending rows until the slot drafts
again. A round:

- catch-up: one call feeds every drafting row its pending rows, each at its own cache length
  (one row: its runner, chunked by cost; more: the batched catch-up graph, T = 1+D, the rows
  it cannot take first alone through the slot's runner); the last row's output is the first draft;
- steps: draft j+1 of every row that wants it comes from one step-graph call fed draft j and
  the head's own hidden of the row before, at cache length committed + j. A row that drafts
  fewer sits out the later calls. Step rows lie past the committed rows and are overwritten by
  the next catch-up.

Sampled rows draw each draft from the warped head distribution with their own rng, so
rejection sampling keeps every row exact.

A tree (``propose_tree``, one sequence at a time) is EAGLE-2's: candidates weigh their joint draft
probability and the heaviest are verified. With the head's tree step (Role.TREE,
exporter/heads/chain_tree.py) the tree grows level by level: the best ``top_k`` nodes of a level
go in one call, each row its node's token and its parent's hidden, written into the head's cache
after the committed rows in expansion order and seeing only the committed rows and its
ancestors'; each row's top-k become the next level's candidates. Without that graph only the
greedy chain is stepped (runtime/tree.py ``spine_tree``: siblings are leaves). Either way the
rows past the committed ones are overwritten by the next catch-up, which brings the accepted
path's rows in from the target like any committed rows.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from specexport.contract import (
    AUX_HIDDEN_STATES,
    CACHE_LENGTH,
    DRAFT_FEATURES,
    HIDDEN_OUT,
    INPUT_IDS,
    LOGITS,
    NEXT_TOKENS,
    TREE_OFFSETS,
    TREE_PAST_MASK,
    DrafterEntry,
    Role,
    past_names,
    present_names,
)
from specexport.runtime.acceptance import EMPTY_DRAFT, Draft, Kept
from specexport.runtime.drafters import DraftRow, PartCosts, TargetOut
from specexport.runtime.engine import LazyEngine
from specexport.runtime.model import Model
from specexport.runtime.runner import PAD_ID
from specexport.runtime.tree import ROOT, DraftTree, grow_spine, top_candidates

if TYPE_CHECKING:
    from specexport.runtime.api import Pipeline

CATCHUP_ROLES = frozenset({Role.CATCHUP, Role.PREFILL})
STEP_ROLES = frozenset({Role.STEP})


class ChainDrafter:
    needs = (AUX_HIDDEN_STATES,)

    def __init__(self, name: str, catchup: Model, step: Model, cost_ms: PartCosts, tree_step: LazyEngine | None = None,
                 tree_rows: int = 0):
        self.name = name
        self.catchup, self.step = catchup, step  # two views of one head cache
        self.tree_step, self.tree_rows = tree_step, tree_rows  # one level of a tree, tree_rows nodes a call
        self._tree_seconds = 0.0
        self._draftable: np.ndarray | None = None  # [V_draft] target ids the head can draft (its finite logits)
        self.cost_ms = cost_ms  # "catchup" | "step" -> tokens -> ms of one batch-1 run
        self.max_seq_len = catchup.max_seq_len
        self._committed = [0] * catchup.slots  # committed rows in each slot's cache row
        self._pending: list[list[np.ndarray]] = [[] for _ in range(catchup.slots)]  # [n, F] not yet fed

    @property
    def engine_seconds(self) -> float:
        return self.catchup.seconds + self.step.seconds + self._tree_seconds

    def round_cost(self, k: int, costs: PartCosts | None = None) -> float:
        """One catch-up call of the round's committed rows (the catch-up graph), then k-1
        steps. Skipping (k = 0) is charged the catch-up too. That is a price, not engine time: a
        skipped round's rows join the next catch-up call at no cost up to its size. But priced
        at zero a skip looked cheap, and adaptive depth skipped where drafting paid (a skip also
        stops the acceptance estimate until the next probe): 2-3% fewer tokens/s with SmolLM2's
        EAGLE-3 head than this price or k steps (docs/results.md)."""
        costs = costs or self.cost_ms
        step = costs.get("step", {}).get(1, 0.0)
        catchup = costs.get("catchup", {})
        return (min(catchup.values()) if catchup else step) / 1e3 + max(k - 1, 0) * step / 1e3

    def cost_graphs(self) -> dict[str, tuple[object, list[int]]]:
        catchup = self.catchup.runners[0]
        return {"catchup": (catchup, catchup.decoding_sizes[:1]), "step": (self.step.runners[0], [1])}

    def join(self, slot: int, prompt: np.ndarray, target_out: TargetOut) -> None:
        self._committed[slot] = 0
        rows = target_out.get(AUX_HIDDEN_STATES)
        self._pending[slot] = [] if rows is None or not len(rows) else [np.array(rows, dtype=np.float32)]

    def accept(self, slot: int, n_accepted: int, next_token: int, target_out: TargetOut) -> None:
        rows = target_out.get(AUX_HIDDEN_STATES)
        if rows is not None and len(rows):
            self._pending[slot].append(np.array(rows, dtype=np.float32))  # copied: valid during the call only

    def move(self, src: int, dst: int) -> None:
        self.catchup.move(src, dst, self._committed[src])
        self._committed[dst], self._pending[dst] = self._committed[src], self._pending[src]
        self._pending[src] = []

    def propose(self, rows: Sequence[DraftRow], ks: Sequence[int]) -> list[Draft]:
        n = len(rows)
        active = [r for r in range(n) if ks[r] > 0 and self._pending[r]]  # asked to, with rows to feed
        drafts = [EMPTY_DRAFT] * n
        if not active:
            return drafts
        sampled = any(not rows[r].sampling.greedy for r in active)
        feed = {r: self._catch_up(n, r, rows[r].context) for r in active}  # slot -> (length, tokens, inputs)
        out = self.catchup.run(n, feed, sampled, (HIDDEN_OUT,))
        at = {r: len(feed[r][1]) - 1 for r in active}  # each row's last fed row: its first draft
        depth = {r: min(ks[r], self.max_seq_len - self._committed[r] + 1) for r in active}  # step rows fit
        tokens = np.zeros((n, max(depth.values())), dtype=np.int64)  # [n, k_max]
        probs: dict[int, list[Kept]] = {r: [] for r in active}
        for j in range(tokens.shape[1]):
            for r in (r for r in active if j < depth[r]):
                tokens[r, j] = self._draw(out, r, at[r], rows[r], probs[r], tokens[r, :j])
            stepping = [r for r in active if depth[r] > j + 1]  # rows that want draft j+2
            if not stepping:
                break
            out = self.step.run(n, {r: (self._committed[r] + j, tokens[r, j : j + 1],
                                        {DRAFT_FEATURES: out[HIDDEN_OUT][r, at[r] : at[r] + 1]}) for r in stepping},
                                sampled, (HIDDEN_OUT,))
            at = dict.fromkeys(stepping, 0)
        for r in active:
            drafts[r] = Draft(tokens[r, : depth[r]].copy(), None if rows[r].sampling.greedy else probs[r], self.name)
        return drafts

    def propose_tree(self, row: DraftRow, depth: int, nodes: int, top_k: int, slot: int = 0) -> DraftTree | None:
        """A tree of up to ``nodes`` nodes and ``depth`` levels for the sequence in ``slot`` (its
        runners alone): expanded level by level with the tree step, else over the greedy chain."""
        if not self._pending[slot]:
            return None
        fed = self._catch_up(1, slot, row.context)
        out = self.catchup.run_slot(slot, fed, True, (HIDDEN_OUT,))
        at = len(fed[1]) - 1  # the last fed row: its logits give level 1
        if self.tree_step is not None and depth > 1:
            return self._expand(out[LOGITS][0, at], out[HIDDEN_OUT][0, at], depth, nodes, top_k, slot)
        return self._spine(out, at, depth, nodes, top_k, slot)

    def _expand(self, logits: np.ndarray, hidden: np.ndarray, depth: int, nodes: int, top_k: int,
                slot: int) -> DraftTree:
        """EAGLE-2's expansion from the last committed row's ``logits`` [V] and ``hidden`` [H]:
        each level's ``tree_rows`` heaviest candidates are fed in one tree-step call (while one
        of them can still beget a node that makes the cut), their top-k join the candidates, and
        the ``nodes`` heaviest of all are kept (a child never outweighs its parent)."""
        committed, width = self._committed[slot], self.tree_rows
        depth = min(depth, (self.max_seq_len - committed) // width + 1)  # expanded rows fit the cache
        cache = self.catchup.runners[slot].cache.view()  # [1, n_kv, S_max, hd] each: the slot's row
        layers = len(cache) // 2
        tokens, logp = self._top(logits, top_k)
        token, parent, joint = tokens.tolist(), [ROOT] * len(tokens), logp.tolist()  # every candidate
        level = list(range(len(token)))  # the candidates of the level being expanded
        hidden_of: dict[int, np.ndarray] = {ROOT: hidden}  # expanded candidate -> its row's hidden [H]
        slot_of: dict[int, int] = {}  # expanded candidate -> its row's cache slot
        write = committed
        for d in range(1, depth):
            cut = sorted(joint, reverse=True)[nodes - 1] if len(joint) >= nodes else -np.inf
            chosen = [c for c in sorted(level, key=lambda c: -joint[c])[:width] if joint[c] > cut]
            if not chosen:
                break  # no child of this level could make the cut
            out = self._tree_call(cache, layers, chosen, token, parent, hidden_of, slot_of, write, committed + d - 1,
                                  committed)
            level = []
            for i, c in enumerate(chosen):
                slot_of[c], hidden_of[c] = write + i, out[HIDDEN_OUT][0, i]
                kids, kid_logp = self._top(out[LOGITS][0, i], top_k)
                level += range(len(token), len(token) + len(kids))
                token += kids.tolist()
                parent += [c] * len(kids)
                joint += (joint[c] + kid_logp).tolist()
            write += len(chosen)
        keep = sorted(np.lexsort((np.arange(len(joint)), -np.asarray(joint)))[:nodes].tolist())  # parents first
        index = {ROOT: ROOT, **{c: i for i, c in enumerate(keep)}}
        return DraftTree(np.array([token[c] for c in keep], dtype=np.int64),
                         np.array([index[parent[c]] for c in keep], dtype=np.int64), f"{self.name}/tree",
                         np.exp([joint[c] for c in keep]))

    def _tree_call(self, cache: dict[str, np.ndarray], layers: int, chosen: list[int], token: list[int],
                   parent: list[int], hidden_of: dict[int, np.ndarray], slot_of: dict[int, int], write: int,
                   position: int, committed: int) -> dict[str, np.ndarray]:
        """One tree-step call over the candidates ``chosen`` (one level, at ``position``), their
        rows written at ``write`` onwards; each sees the committed rows and its ancestors'."""
        seen = []  # each row's ancestors' slots
        for c in chosen:
            slots, ancestor = [], parent[c]
            while ancestor != ROOT:
                slots.append(slot_of[ancestor])
                ancestor = parent[ancestor]
            seen.append(slots)
        feeds = tree_step_feeds(cache, self.tree_rows, [token[c] for c in chosen],
                                np.stack([hidden_of[parent[c]] for c in chosen]), write,
                                [position] * len(chosen), committed, seen)
        start = time.perf_counter()
        out = self.tree_step.run(feeds, [LOGITS, HIDDEN_OUT, *present_names(layers)])
        self._tree_seconds += time.perf_counter() - start
        for past, present in zip(past_names(layers), present_names(layers)):
            cache[past][:, :, write : write + len(chosen)] = out[present][:, :, : len(chosen)]  # [1, n_kv, n, hd]
        return out

    def _spine(self, out: dict[str, np.ndarray], at: int, depth: int, nodes: int, top_k: int,
               slot: int) -> DraftTree:
        """The tree over the head's greedy chain of up to ``depth`` steps (runtime/tree.py grow_spine)."""
        steps = 0

        def next_logits(token: int | None) -> np.ndarray:  # [V] level 1, then one step per spine token
            nonlocal out, at, steps
            if token is not None:
                out = self.step.run_slot(slot, (self._committed[slot] + steps, np.array([token]),
                                                {DRAFT_FEATURES: out[HIDDEN_OUT][0, at : at + 1]}), True, (HIDDEN_OUT,))
                at, steps = 0, steps + 1
            return out[LOGITS][0, at]

        depth = min(depth, self.max_seq_len - self._committed[slot] + 1)
        return grow_spine(next_logits, depth, nodes, top_k, f"{self.name}/tree", self._top)

    def _top(self, logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The head's k best target ids after one row and their log q (logits [V_target]), over
        its draft vocabulary only: a reduced one (-inf elsewhere) is a sixth of SmolLM2's."""
        if self._draftable is None:
            self._draftable = np.flatnonzero(np.isfinite(logits))  # fixed by the graph's scatter
        tokens, logp = top_candidates(logits[self._draftable], k)
        return self._draftable[tokens], logp

    def _catch_up(self, n: int, slot: int, context: np.ndarray) -> tuple[int, np.ndarray, dict[str, np.ndarray]]:
        """The slot's pending rows as its row of the catch-up call; what the call cannot take goes
        first, alone, through the slot's runner. The rows count as committed from here on."""
        features = np.concatenate(self._pending[slot])  # [m, F]
        self._pending[slot] = []
        start = self._committed[slot]
        tokens = context[start + 1 : start + 1 + len(features)]  # row p: token x_{p+1}
        extra = len(features) - self.catchup.holds(n, len(features))
        if extra > 0:  # the prompt after a join, a row back from rounds at depth 0
            runner = self.catchup.runners[slot]
            runner.cache.set_length(start)
            runner.forward(tokens[:extra], inputs={DRAFT_FEATURES: features[:extra]})
            start, tokens, features = start + extra, tokens[extra:], features[extra:]
        self._committed[slot] = start + len(tokens)
        return start, tokens, {DRAFT_FEATURES: features}

    @staticmethod
    def _draw(out: dict[str, np.ndarray], r: int, at: int, row: DraftRow, probs: list[Kept], drafted: np.ndarray) -> int:
        """Row r's draft from its output at ``at``: the argmax, or drawn with the row's rng from
        the warped head distribution (kept for rejection sampling)."""
        if row.sampling.greedy:
            return int(out[NEXT_TOKENS][r, at])
        probs.append(row.q(out[LOGITS][r, at], drafted))  # over target ids (-inf outside the draft vocabulary)
        return int(probs[-1].draw(row.rng))


def tree_step_feeds(cache: dict[str, np.ndarray], rows: int, tokens: Sequence[int], features: np.ndarray, write: int,
                    positions: Sequence[int], committed: int, seen: Sequence[Sequence[int]]) -> dict[str, np.ndarray]:
    """A head's tree-step feeds (exporter/heads/chain_tree.py): ``tokens`` (at most ``rows``)
    with ``features`` [n, H] at ``positions``, written from cache slot ``write``; node i sees the
    ``committed`` rows and the slots ``seen[i]`` (its ancestors'). Missing rows are pads that see
    nothing but themselves. The runtime's expansion and the build's validation both feed
    through here."""
    n, s_max = len(tokens), next(iter(cache.values())).shape[2]
    ids = np.full((1, rows), PAD_ID, dtype=np.int64)  # [1, T]
    ids[0, :n] = tokens
    feats = np.zeros((1, rows, features.shape[-1]), dtype=np.float32)  # [1, T, H]
    feats[0, :n] = features
    offsets = np.zeros((1, rows), dtype=np.int64)  # [1, T]: position - write slot
    offsets[0, :n] = np.asarray(positions) - write
    mask = np.zeros((1, rows, s_max), dtype=bool)  # [1, T, S_max]
    mask[0, :n, :committed] = True
    for i, slots in enumerate(seen):
        mask[0, i, list(slots)] = True
    return {**cache, INPUT_IDS: ids, DRAFT_FEATURES: feats, CACHE_LENGTH: np.array([write], dtype=np.int64),
            TREE_OFFSETS: offsets, TREE_PAST_MASK: mask}


def make(pipe: Pipeline, entry: DrafterEntry, slots: int) -> ChainDrafter:
    model = entry.model or entry.name
    costs = pipe.costs_by_role(model)
    catchup = pipe.model(model, CATCHUP_ROLES, slots)
    trees = pipe.manifest.engines_of(model, pipe.backend_of(model), tree=True)  # the tree step, if built
    tree_step = LazyEngine(trees[0], pipe.manifest.root, pipe.options, None, pipe.sessions) if trees else None
    return ChainDrafter(entry.name, catchup, pipe.model(model, STEP_ROLES, slots),
                        {"catchup": costs.get(Role.CATCHUP, {}), "step": costs.get(Role.STEP, {})},
                        tree_step, trees[0].tokens if trees else 0)
