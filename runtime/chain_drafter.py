"""Chain drafters (EAGLE-3, MTP): a head that reads the target's hidden states, one draft per call.

The head's cache row p of a slot holds (token x_{p+1}, the target's features of position p).
The target hands over its tapped features for committed positions (the prompt after prefill,
then 1 + accepted rows after each verify); they wait as pending rows until the slot drafts
again. A round:

- catch-up: one call feeds every drafting row its pending rows, each at its own cache length
  (one row: its runner, chunked by cost; more: the smallest batched catch-up graph holding them,
  T <= 1+D, the rows it cannot take first alone through the slot's runner); the last row's
  output is the first draft;
- steps: draft j+1 of every row that wants it comes from one step-graph call fed draft j and
  the head's own hidden of the row before, at cache length committed + j. A row that drafts
  fewer sits out the later calls. Step rows lie past the committed rows and are overwritten by
  the next catch-up.

Sampled rows draw each draft from the warped head distribution with their own rng, so
rejection sampling keeps every row exact.

A tree is EAGLE-2's: candidates weigh their joint draft probability and the heaviest are
verified. With the head's tree step (Role.TREE, exporter/heads/chain_tree.py) the tree grows level
by level (``Expansion``): the best ``top_k`` nodes of a level go in one call, each its node's
token and its parent's hidden, written into the head's cache after the committed rows in
expansion order and seeing only the committed rows and its ancestors'; each node's top-k become
the next level's candidates. A batch (``trees``) grows every row's tree together: one
catch-up call, then one tree-step call per level, batch row r holding slot r's level (rows whose
tree is grown idle). Without that graph only the greedy chain is stepped, slot by slot
(runtime/tree.py ``spine_tree``: siblings are leaves). Either way the rows past the committed ones
are overwritten by the next catch-up, which brings the accepted path's rows in from the target
like any committed rows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
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
)
from specexport.runtime.acceptance import EMPTY_DRAFT, Draft, Kept
from specexport.runtime.drafters import ChainsAndTrees, DraftBudget, DraftRow, PartCosts, TargetOut
from specexport.runtime.engine import LazyEngine
from specexport.runtime.graph_call import GraphCall
from specexport.runtime.model import Model
from specexport.runtime.runner import PAD_ID
from specexport.runtime.tree import ROOT, DraftTree, SizeHint, expansion_budget, grow_spine, top_candidates

if TYPE_CHECKING:
    from specexport.runtime.api import Pipeline

CATCHUP_ROLES = frozenset({Role.CATCHUP, Role.PREFILL, Role.FILL})
STEP_ROLES = frozenset({Role.STEP})


class ChainDrafter(ChainsAndTrees):
    needs = (AUX_HIDDEN_STATES,)

    def __init__(self, name: str, catchup: Model, step: Model, cost_ms: PartCosts,
                 tree_steps: dict[int, LazyEngine] | None = None, tree_rows: int = 0):
        self.name = name
        self.catchup, self.step = catchup, step  # two views of one head cache
        # batch size -> the tree step: one level of a tree, tree_rows nodes a row per call
        self.tree_steps, self.tree_rows = tree_steps or {}, tree_rows
        self._tree_calls: dict[tuple[int, int | None], GraphCall] = {}  # (batch, alone's slot) -> its tree step
        self._draftable: np.ndarray | None = None  # [V_draft] target ids the head can draft (its finite logits)
        self.cost_ms = cost_ms  # "catchup" | "step" -> tokens -> ms of one batch-1 run
        self.max_seq_len = catchup.max_seq_len
        self._committed = [0] * catchup.slots  # committed rows in each slot's cache row
        self._pending: list[list[np.ndarray]] = [[] for _ in range(catchup.slots)]  # [n, F] not yet fed

    @property
    def engine_seconds(self) -> float:
        return self.catchup.seconds + self.step.seconds + sum(c.seconds for c in self._tree_calls.values())

    def round_cost(self, k: int, costs: PartCosts | None = None) -> float:
        """The catch-up call a round at depth k leads to (its accepted drafts and the bonus token:
        at most 1+k rows, on the smallest catch-up entry holding them, as the runner picks), then
        k-1 steps. Priced at 1+k, exact when every draft is accepted; a directory built with one
        catch-up entry (1+D) prices that one, which is what it runs. Skipping (k = 0) is charged
        the one row's catch-up too. That is a price, not engine time: a skipped round's rows join
        the next catch-up call. But priced at zero a skip looked cheap, and adaptive depth
        skipped where drafting paid (a skip also stops the acceptance estimate until the next
        probe): 2-3% fewer tokens/s with SmolLM2's EAGLE-3 head than this price or k steps
        (docs/results.md)."""
        step = (costs or self.cost_ms).get("step", {}).get(1, 0.0)
        catchup = (costs or self.cost_ms).get("catchup", {})
        fed = self._split(1 + k)[1] if costs is None else None  # as _catch_up feeds the rows
        if fed is None:
            fed = holding_cost(catchup, 1 + k) if catchup else step
        return fed / 1e3 + max(k - 1, 0) * step / 1e3

    def catchup_cost(self, skipped: int) -> float:
        """The skipped rounds' rows join the next catch-up: what feeding 1 + skipped rows costs
        over one row, as the slot's runner plans it. Past the largest catch-up entry that runs
        in pieces: priced as that one entry, a resumed round after 31 skipped cost 9 ms where
        0.6 ms was priced, and the policy resumed drafting where it lost."""
        fed, alone = self._split(1 + skipped)[1], self._split(1)[1]
        if fed is None or alone is None:
            return skipped * self.round_cost(0)
        return max(fed - alone, 0.0) / 1e3

    def cost_graphs(self) -> dict[str, tuple[object, list[int]]]:
        catchup = self.catchup.runners[0]
        round_sizes = sorted(t for t in self.cost_ms.get("catchup", {}) if t in catchup.decoding_sizes)
        return {"catchup": (catchup, round_sizes or catchup.decoding_sizes[:1]), "step": (self.step.runners[0], [1])}

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

    def chains(self, rows: Sequence[DraftRow], ks: Sequence[int]) -> list[Draft]:
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

    def trees(self, rows: Sequence[DraftRow], budget: DraftBudget) -> list[DraftTree | None]:
        """A tree for every running row (row r in slot r; None at depth 0 or with nothing to
        feed). With the tree step at the batch's size: one catch-up call for all rows, then one
        tree-step call per level over every row still expanding; else slot by slot."""
        n, depths, nodes, top_k = len(rows), budget.depths, budget.nodes, budget.top_k
        batch = self._tree_batch(n)
        if n == 1 or batch is None:
            return [self.tree_alone(row, depth, nodes, top_k, slot) if depth > 0 else None
                    for slot, (row, depth) in enumerate(zip(rows, depths))]
        active = [r for r in range(n) if depths[r] > 0 and self._pending[r]]
        trees: list[DraftTree | None] = [None] * n
        if not active:
            return trees
        feed = {r: self._catch_up(n, r, rows[r].context) for r in active}  # slot -> (length, tokens, inputs)
        out = self.catchup.run(n, feed, True, (HIDDEN_OUT,))
        grown = {}
        for r in active:
            at = len(feed[r][1]) - 1  # the row's last fed row: its logits give level 1
            grown[r] = self._expansion(out[LOGITS][r, at], out[HIDDEN_OUT][r, at], depths[r], nodes, top_k, r,
                                       rows[r].tree_size)
        self._grow(grown, self._tree_call(batch), batch)
        for r, expansion in grown.items():
            trees[r] = expansion.tree(f"{self.name}/tree")
        return trees

    def tree_alone(self, row: DraftRow, depth: int, nodes: int, top_k: int, slot: int = 0) -> DraftTree | None:
        """A tree of up to ``nodes`` nodes and ``depth`` levels for the sequence in ``slot`` (its
        runners alone): expanded level by level with the tree step, else over the greedy chain."""
        if not self._pending[slot]:
            return None
        fed = self._catch_up(1, slot, row.context)
        out = self.catchup.run_slot(slot, fed, True, (HIDDEN_OUT,))
        at = len(fed[1]) - 1  # the last fed row: its logits give level 1
        if 1 in self.tree_steps and depth > 1:
            expansion = self._expansion(out[LOGITS][0, at], out[HIDDEN_OUT][0, at], depth, nodes, top_k, slot,
                                        row.tree_size)
            self._grow({0: expansion}, self._tree_call(1, slot), 1)
            return expansion.tree(f"{self.name}/tree")
        return self._spine(out, at, depth, nodes, top_k, slot, row.tree_size)

    def _tree_batch(self, rows: int) -> int | None:
        """The smallest batch size of the tree step that holds ``rows`` slots of the shared host
        cache (None: none built, or the slots do not share one)."""
        if self.catchup.caches.store is None:
            return None
        return min((b for b in self.tree_steps if rows <= b <= self.catchup.slots), default=None)

    def _expansion(self, logits: np.ndarray, hidden: np.ndarray, depth: int, nodes: int, top_k: int,
                   slot: int, hint: SizeHint | None = None) -> Expansion:
        """The slot's expansion from its last committed row's ``logits`` [V] and ``hidden`` [H],
        its tree-step rows written after the committed ones (as deep as they fit the cache)."""
        committed = self._committed[slot]
        depth = min(depth, (self.max_seq_len - committed) // self.tree_rows + 1)
        return Expansion(lambda row: self._top(row, top_k), logits, hidden, depth, nodes, self.tree_rows, committed,
                         hint)

    def _tree_call(self, batch: int, slot: int | None = None) -> GraphCall:
        """The tree step of ``batch`` rows over the first rows of the slots' shared store, or
        (``slot``) at batch 1 over that slot's row alone; made once, its feeds reused."""
        key = (batch, slot)
        if key not in self._tree_calls:
            store = self.catchup.caches.store if slot is None else self.catchup.runners[slot].cache.rows_store
            assert store is not None  # _tree_batch found a batched tree step: the slots share a host store
            self._tree_calls[key] = GraphCall.over(self.tree_steps[batch], store, batch, in_place=False)
        return self._tree_calls[key]

    def _grow(self, grown: dict[int, Expansion], call: GraphCall, batch: int) -> None:
        """Expand every sequence of ``grown`` (batch row -> its expansion) level by level: one
        tree-step call per level over the rows still expanding (the others idle), each row's
        new K/V appended into its row of the call's store (B = ``batch``, the graph's)."""
        cache = {name: call.feeds[name] for name in call.cache_names}  # [B, n_kv, S_max, hd] each
        while True:
            levels = {r: level for r, expansion in grown.items() if (level := expansion.next_level()) is not None}
            if not levels:
                return
            feeds = tree_step_feeds(cache, self.tree_rows, [levels.get(r) for r in range(batch)])
            call.set({name: value for name, value in feeds.items() if name not in call.cache_names})
            out = call.run([LOGITS, HIDDEN_OUT], [(r, level.write, len(level.tokens)) for r, level in levels.items()])
            for r, level in levels.items():
                count = len(level.tokens)
                grown[r].grow(out[LOGITS][r, :count], out[HIDDEN_OUT][r, :count])

    def _spine(self, out: dict[str, np.ndarray], at: int, depth: int, nodes: int, top_k: int,
               slot: int, hint: SizeHint | None = None) -> DraftTree:
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
        return grow_spine(next_logits, depth, nodes, top_k, f"{self.name}/tree", self._top, hint)

    def _top(self, logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The head's k best target ids after one row and their log q (logits [V_target]; [n,
        V_target]: each row's, [n, k]), over its draft vocabulary only: a reduced one (-inf
        elsewhere) is a sixth of SmolLM2's."""
        if self._draftable is None:
            self._draftable = np.flatnonzero(np.isfinite(logits.reshape(-1, logits.shape[-1])[0]))  # the graph's scatter
        tokens, logp = top_candidates(np.take(logits, self._draftable, axis=-1), k)
        return self._draftable[tokens], logp

    def _catch_up(self, n: int, slot: int, context: np.ndarray) -> tuple[int, np.ndarray, dict[str, np.ndarray]]:
        """The slot's pending rows as its row of the catch-up call; what the call does not read
        (alone: ``_split``, by cost; batched: past ``_read_rows``) goes first, alone, through the
        slot's runner, without logits. The call takes at most its
        largest decoding graph's rows even alone (where the runner would chunk any number): only
        the last row's logits are read, and a prompt's would be tens of MB (SmolLM2: 200 KB a
        row), which cost the first tree round of a 400-token prompt about 0.2 s. The rows count
        as committed from here on."""
        features = np.concatenate(self._pending[slot])  # [m, F]
        self._pending[slot] = []
        start = self._committed[slot]
        tokens = context[start + 1 : start + 1 + len(features)]  # row p: token x_{p+1}
        read = self._split(len(features))[0] if n == 1 else min(self.catchup.holds(n, len(features)), self._read_rows(n))
        extra = len(features) - read
        if extra > 0:  # the prompt after a join, a row back from rounds at depth 0
            runner = self.catchup.runners[slot]
            runner.cache.set_length(start)
            runner.fill(tokens[:extra], inputs={DRAFT_FEATURES: features[:extra]})  # its fill entries where built
            start, tokens, features = start + extra, tokens[extra:], features[extra:]
        self._committed[slot] = start + len(tokens)
        return start, tokens, {DRAFT_FEATURES: features}

    def _split(self, rows: int) -> tuple[int, float | None]:
        """Of ``rows`` rows a slot alone feeds, how many its catch-up call reads (the last ones;
        the rows before them go first through ``fill``) and what the two cost (ms; None without
        costs): the split that costs least by the runner's own plans, reading at most
        ``_read_rows(1)``, the most rows on a tie. Rows a call reads pay the head's output
        layer each (SmolLM2's int8 head on an AVX2 CPU: 8 rows read 7.8 ms, 7 filled and one
        read 3.9), where a fill entry computes only the cache; on a CPU whose multi-row kernels
        are cheap a read costs less than a second call, and the rows are read together."""
        runner = self.catchup.runners[0]
        most = min(rows, self._read_rows(1))
        best: tuple[float, int] | None = None
        for read in range(most, 0, -1):
            ms = runner.catchup_ms(rows, read)  # the last ``read`` rows read, the rest filled
            if ms is None:
                return most, None
            if best is None or ms < best[0]:
                best = (ms, read)
        assert best is not None  # rows >= 1
        return best[1], best[0]

    def _read_rows(self, n: int) -> int:
        """The most rows a catch-up call over ``n`` rows takes (the rest are fed first, alone): its
        largest graph, or with fill entries (Role.FILL) the largest catch-up entry (1+D), since only
        the last row's outputs are read and the fill graph computes the rows before it for less
        (SmolLM2's EAGLE-3 head: 64 rows 8.8 ms read, 0.8 ms filled; 8 rows read 1.9 ms)."""
        runner = self.catchup.runners[0]
        widest = max(self.catchup.widths(n))
        return min(widest, runner.verify_limit) if runner.fill_sizes else widest

    @staticmethod
    def _draw(out: dict[str, np.ndarray], r: int, at: int, row: DraftRow, probs: list[Kept], drafted: np.ndarray) -> int:
        """Row r's draft from its output at ``at``: the argmax, or drawn with the row's rng from
        the warped head distribution (kept for rejection sampling)."""
        if row.sampling.greedy:
            return int(out[NEXT_TOKENS][r, at])
        probs.append(row.q(out[LOGITS][r, at], drafted))  # over target ids (-inf outside the draft vocabulary)
        return int(probs[-1].draw(row.rng))


def holding_cost(ms: dict[int, float], rows: int) -> float:
    """ms of the cheapest entry of ``ms`` (tokens -> ms) holding ``rows`` rows, else of the
    largest (a longer input runs in pieces): the entry the runner picks by cost."""
    holding = [cost for tokens, cost in ms.items() if tokens >= rows]
    return min(holding) if holding else ms[max(ms)]


@dataclass(frozen=True)
class TreeLevel:
    """One sequence's row of a tree-step call: the nodes of one level it expands."""

    tokens: Sequence[int]  # [n] the nodes' tokens, n at most the graph's rows
    features: np.ndarray  # [n, H] the head's hidden of each node's parent's row
    write: int  # the cache slot of the first node's row (the rest follow)
    position: int  # the level's position: the committed rows + its depth - 1
    committed: int  # the committed rows, seen by every node
    seen: Sequence[Sequence[int]]  # each node's ancestors' cache slots


def tree_step_feeds(cache: dict[str, np.ndarray], rows: int, levels: Sequence[TreeLevel | None]) -> dict[str, np.ndarray]:
    """A head's tree-step feeds (exporter/heads/chain_tree.py) over ``cache`` ([B, n_kv, S_max,
    hd] each, B = len(levels)): batch row b takes ``levels[b]`` (None: idle). Missing rows are
    pads that see nothing but themselves. The runtime's expansion and the build's validation
    both feed through here."""
    batch, s_max = len(levels), next(iter(cache.values())).shape[2]
    width = next((level.features.shape[-1] for level in levels if level is not None), 1)
    ids = np.full((batch, rows), PAD_ID, dtype=np.int64)  # [B, T]
    feats = np.zeros((batch, rows, width), dtype=np.float32)  # [B, T, H]
    offsets = np.zeros((batch, rows), dtype=np.int64)  # [B, T]: position - write slot
    write = np.zeros(batch, dtype=np.int64)  # [B]
    mask = np.zeros((batch, rows, s_max), dtype=bool)  # [B, T, S_max]
    for b, level in enumerate(levels):
        if level is None:
            continue
        n = len(level.tokens)
        ids[b, :n] = level.tokens
        feats[b, :n] = level.features
        offsets[b, :n] = level.position - level.write
        write[b] = level.write
        mask[b, :n, : level.committed] = True
        for i, slots in enumerate(level.seen):
            mask[b, i, list(slots)] = True
    return {**cache, INPUT_IDS: ids, DRAFT_FEATURES: feats, CACHE_LENGTH: write, TREE_OFFSETS: offsets,
            TREE_PAST_MASK: mask}


class Expansion:
    """One sequence's EAGLE-2 expansion: every candidate (its token, parent and log joint draft
    probability), from the top-k of the last committed row. Each level, the ``width`` heaviest
    candidates of the level go to the tree step while one of them can still beget a node that
    makes the cut; their top-k join the candidates. The tree keeps the ``nodes`` heaviest (a
    child never outweighs its parent). Node rows go into the head's cache after the
    ``committed`` rows, in expansion order."""

    def __init__(self, top: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]], logits: np.ndarray,
                 hidden: np.ndarray, depth: int, nodes: int, width: int, committed: int, hint: SizeHint | None = None):
        self._top, self.depth, self.nodes, self.width, self.committed = top, depth, nodes, width, committed
        self.hint = hint
        tokens, logp = top(logits)
        self.token, self.parent, self.joint = tokens.tolist(), [ROOT] * len(tokens), logp.tolist()
        self._depth = [1] * len(tokens)  # each candidate's depth
        self._level = list(range(len(self.token)))  # the candidates of the level being expanded
        self._hidden_of: dict[int, np.ndarray] = {ROOT: hidden}  # expanded candidate -> its row's hidden [H]
        self._slot_of: dict[int, int] = {}  # expanded candidate -> its row's cache slot
        self._chosen: list[int] = []
        self._depth_done = 1  # levels drafted so far
        self._write = committed

    def next_level(self) -> TreeLevel | None:
        """The nodes to expand next as a tree-step row, or None: the tree is grown."""
        if self._depth_done >= self.depth:
            return None
        ranked = sorted(self._level, key=lambda c: -self.joint[c])[: self.width]
        budget = self.nodes if not ranked else \
            expansion_budget(self.nodes, self.hint, np.exp(self.joint), np.asarray(self._depth), ranked[0],
                             self.depth - self._depth_done)
        cut = sorted(self.joint, reverse=True)[budget - 1] if len(self.joint) >= budget else -np.inf
        self._chosen = [c for c in ranked if self.joint[c] > cut]
        if not self._chosen:
            self.depth = self._depth_done  # no child of this level could make the cut
            return None
        seen = []  # each node's ancestors' slots
        for c in self._chosen:
            slots, ancestor = [], self.parent[c]
            while ancestor != ROOT:
                slots.append(self._slot_of[ancestor])
                ancestor = self.parent[ancestor]
            seen.append(slots)
        return TreeLevel([self.token[c] for c in self._chosen],
                         np.stack([self._hidden_of[self.parent[c]] for c in self._chosen]), self._write,
                         self.committed + self._depth_done - 1, self.committed, seen)

    def grow(self, logits: np.ndarray, hidden: np.ndarray) -> None:
        """The tree step's output for the chosen nodes, logits [n, V] and hidden [n, H]."""
        self._level = []
        tops, top_logps = self._top(logits)  # [n, k] each
        for i, c in enumerate(self._chosen):
            self._slot_of[c], self._hidden_of[c] = self._write + i, hidden[i]
            kids, kid_logp = tops[i], top_logps[i]
            self._level += range(len(self.token), len(self.token) + len(kids))
            self.token += kids.tolist()
            self.parent += [c] * len(kids)
            self.joint += (self.joint[c] + kid_logp).tolist()
            self._depth += [self._depth[c] + 1] * len(kids)
        self._write += len(self._chosen)
        self._depth_done += 1

    def tree(self, tag: str) -> DraftTree:
        """The ``nodes`` heaviest candidates, parents first."""
        keep = sorted(np.lexsort((np.arange(len(self.joint)), -np.asarray(self.joint)))[: self.nodes].tolist())
        index = {ROOT: ROOT, **{c: i for i, c in enumerate(keep)}}
        return DraftTree(np.array([self.token[c] for c in keep], dtype=np.int64),
                         np.array([index[self.parent[c]] for c in keep], dtype=np.int64), tag,
                         np.exp([self.joint[c] for c in keep]))


def make(pipe: Pipeline, entry: DrafterEntry, slots: int) -> ChainDrafter:
    model = entry.model or entry.name
    costs = pipe.costs_by_role(model)
    catchup = pipe.model(model, CATCHUP_ROLES, slots)
    # the tree step at each batch size built (one file, one session), if built
    trees = pipe.manifest.engines_of(model, pipe.backend_of(model), batch=None, tree=True)
    tree_steps = {e.batch: LazyEngine(e, pipe.manifest.root, pipe.options, None, pipe.sessions) for e in trees}
    return ChainDrafter(entry.name, catchup, pipe.model(model, STEP_ROLES, slots),
                        {"catchup": costs.get(Role.CATCHUP, {}), "step": costs.get(Role.STEP, {})},
                        tree_steps, trees[0].tokens if trees else 0)
