"""The logits stage: a verify pass's rows for one sequence's proposal, as acceptance reads them.

Between the target's graph and the acceptance rule (vLLM's logits processors before its
rejection sampler): each row is ruled with the output before it (the committed output, then
the proposal's nodes on the path down to that row: runtime/rules.py) and, when sampling,
warped (temperature, min-p, top-k, top-p: acceptance.warp_row). Rows are processed when read,
so the rows after the first rejection (and their grammar masks) are never paid for. Greedy rows
without rules are the graph's own argmax (``next_tokens``): no logits are copied out.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from specexport.contract import LOGITS, NEXT_TOKENS
from specexport.runtime.acceptance import Kept, Sampling, warp_row
from specexport.runtime.rules import SequenceRules
from specexport.runtime.tree import DraftTree


class TargetRows:
    """Row r of one sequence's verify outputs (0: the root, 1+i: node i of ``proposal``)."""

    def __init__(self, out: Mapping[str, np.ndarray], proposal: DraftTree, sampling: Sampling,
                 rules: SequenceRules | None, output: np.ndarray):
        self.next_tokens = out[NEXT_TOKENS]  # [1+N] the graph's argmax
        self.logits = out.get(LOGITS)  # [1+N, V] when a row samples, has rules or logprobs
        self.proposal, self.sampling, self.rules = proposal, sampling, rules
        self.output = output  # [m] the committed output before the root's token

    def argmaxes(self, n: int) -> np.ndarray | None:
        return self.next_tokens[:n] if self.rules is None else None

    def argmax(self, r: int) -> int:
        return int(self.next_tokens[r]) if self.rules is None else int(np.argmax(self.ruled(r)))

    def __getitem__(self, r: int) -> Kept:
        return warp_row(self.ruled(r), self.sampling)

    def ruled(self, r: int) -> np.ndarray:
        """[V] row r's logits with the request's rules applied for the output before it."""
        assert self.logits is not None, "logits are fetched for rows that rules or sampling read"
        if self.rules is None:
            return self.logits[r]
        proposal = self.proposal
        before = proposal.tokens[:r] if proposal.is_chain else proposal.tokens[proposal.path(r - 1)]
        return self.rules.apply(self.logits[r], np.concatenate((self.output, before)))
