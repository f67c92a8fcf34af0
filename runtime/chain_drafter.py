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
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from specexport.contract import (
    AUX_HIDDEN_STATES,
    DRAFT_FEATURES,
    HIDDEN_OUT,
    LOGITS,
    NEXT_TOKENS,
    DrafterEntry,
    Role,
)
from specexport.runtime.acceptance import EMPTY_DRAFT, Draft, Kept
from specexport.runtime.drafters import DraftRow, PartCosts, TargetOut
from specexport.runtime.model import Model

if TYPE_CHECKING:
    from specexport.runtime.api import Pipeline

CATCHUP_ROLES = frozenset({Role.CATCHUP, Role.PREFILL})
STEP_ROLES = frozenset({Role.STEP})


class ChainDrafter:
    needs = (AUX_HIDDEN_STATES,)

    def __init__(self, name: str, catchup: Model, step: Model, cost_ms: PartCosts):
        self.name = name
        self.catchup, self.step = catchup, step  # two views of one head cache
        self.cost_ms = cost_ms  # "catchup" | "step" -> tokens -> ms of one batch-1 run
        self.max_seq_len = catchup.max_seq_len
        self._committed = [0] * catchup.slots  # committed rows in each slot's cache row
        self._pending: list[list[np.ndarray]] = [[] for _ in range(catchup.slots)]  # [n, F] not yet fed

    @property
    def engine_seconds(self) -> float:
        return self.catchup.seconds + self.step.seconds

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


def make(pipe: Pipeline, entry: DrafterEntry, slots: int) -> ChainDrafter:
    model = entry.model or entry.name
    costs = pipe.costs_by_role(model)
    return ChainDrafter(entry.name, pipe.model(model, CATCHUP_ROLES, slots), pipe.model(model, STEP_ROLES, slots),
                        {"catchup": costs.get(Role.CATCHUP, {}), "step": costs.get(Role.STEP, {})})
