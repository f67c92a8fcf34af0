"""Chain drafters (EAGLE-3, MTP): a head that reads the target's hidden states, one draft per call.

The head's cache slot p holds the row (token x_{p+1}, features of position p). The target hands
over its tapped features for committed positions (the prompt after prefill, then 1 + accepted
rows after each verify); they wait as pending rows until the next proposal, which runs them
through the catch-up graphs (tokens from the committed context) — the last row's output is the
first draft. Each further draft is one step-graph call fed the head's own hidden of the row
before. After the verify, the step rows are dropped (rewind) and the committed rows queued.
"""

from __future__ import annotations

import numpy as np

from specexport.contract import AUX_HIDDEN_STATES, DRAFT_FEATURES, HIDDEN_OUT, DrafterEntry, Role
from specexport.runtime.acceptance import EMPTY_DRAFT, Draft, Kept, Sampling, warp_row
from specexport.runtime.drafters import DraftCost, TargetOut
from specexport.runtime.runner import ModelRunner

CATCHUP_ROLES = frozenset({Role.CATCHUP, Role.PREFILL})
STEP_ROLES = frozenset({Role.STEP})


class ChainDrafter:
    needs: tuple[str, ...] = (AUX_HIDDEN_STATES,)

    def __init__(self, name: str, catchup: ModelRunner, step: ModelRunner):
        self.name = name
        self.catchup, self.step = catchup, step  # two runners over one cache
        self._pending: list[np.ndarray] = []  # [n, F] target features of committed positions not yet fed
        self._committed = 0  # cache rows that are committed (the step rows after them are dropped)

    @property
    def engine_seconds(self) -> float:
        return self.catchup.seconds + self.step.seconds

    @property
    def draft_cost(self) -> DraftCost:
        # a round: one catch-up call (the committed rows; its last row gives the first draft),
        # then one step per further draft
        return DraftCost(per_draft=(self.step, 1), per_round=(self.catchup, self.catchup.engine_size(1)), first_drafts=1)

    def reset(self, prompt: np.ndarray, target_out: TargetOut) -> None:
        self.catchup.rewind(0)
        self._committed = 0
        rows = target_out.get(AUX_HIDDEN_STATES)
        self._pending = [] if rows is None or not len(rows) else [np.array(rows, dtype=np.float32)]

    def propose(self, context: np.ndarray, k: int, sampling: Sampling, rng: np.random.Generator) -> Draft:
        self.catchup.rewind(self._committed)
        features = np.concatenate(self._pending) if self._pending else None  # [n, F]
        if k <= 0 or features is None:
            return EMPTY_DRAFT
        start = self._committed
        tokens = context[start + 1 : start + 1 + len(features)]  # row p: token x_{p+1}
        greedy = sampling.greedy
        out = self.catchup.forward(tokens, want_logits=not greedy, inputs={DRAFT_FEATURES: features}, want=(HIDDEN_OUT,))
        self._committed += len(features)
        self._pending = []
        drafts = np.empty(k, dtype=np.int64)  # [k]
        probs: list[Kept] = []
        k = min(k, self.step.cache.free + 1)
        for j in range(k):
            if greedy:
                drafts[j] = out.next_tokens[-1]
            else:
                probs.append(warp_row(out.logits[-1], sampling))  # over target ids (-inf outside the draft vocabulary)
                drafts[j] = probs[-1].draw(rng)
            if j < k - 1:
                hidden = out.extras[HIDDEN_OUT][-1:]  # [1, H] the head's own hidden of this row
                out = self.step.forward(drafts[j : j + 1], want_logits=not greedy, inputs={DRAFT_FEATURES: hidden},
                                        want=(HIDDEN_OUT,))
        return Draft(drafts[:k], None if greedy else probs, self.name)

    def accept(self, n_accepted: int, next_token: int, target_out: TargetOut) -> None:
        self.catchup.rewind(self._committed)  # drop the step rows
        rows = target_out.get(AUX_HIDDEN_STATES)
        if rows is not None and len(rows):
            self._pending.append(np.array(rows, dtype=np.float32))  # copied: valid during the call only


def make(entry: DrafterEntry, pipe) -> ChainDrafter:
    model = entry.model or entry.name
    return ChainDrafter(entry.name, pipe.runner(model, CATCHUP_ROLES), pipe.runner(model, STEP_ROLES))
