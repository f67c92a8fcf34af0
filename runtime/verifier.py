"""The target's verify pass: run every row's proposal in one call, then commit each row's
accepted path. Two graphs can verify: the causal verify graphs (``ChainVerifier``: chains, a
row's tokens one after another) and the tree graphs (runtime/tree_verify.py ``TreeVerifier``:
any tree, each node attending to its ancestors). Both take the same rows and proposals and give
the same ``Verified``; the speculation policy (runtime/policy.py) says which one a round uses.

Cache invariant: a row's cache holds every committed token but the last one, the root of its
proposal; the pass runs [root, nodes...] at that length. After acceptance the row's cache holds
the root and its accepted path: for a chain they are already in place (the next pass feeds the
row at its new length: a rewind is a length); a tree's path is compacted by its verifier.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from specexport.contract import LOGITS, NEXT_TOKENS
from specexport.runtime.model import Model
from specexport.runtime.tree import DraftTree

VerifyRow = tuple[int, int]  # (cache length, root token) of one running slot


@dataclass
class Verified:
    """One verify pass: each row's outputs, name -> [1+N_r, ...] (row 0 the root, 1+i node i;
    views valid until the next pass), and what ran."""

    rows: list[dict[str, np.ndarray]]
    batch: int  # the built batch size that ran them
    width: int  # rows per sequence of the graph that ran (1 + the widest proposal it held)
    seconds: float  # inside the target's engines


class Verifier(Protocol):
    def verify(self, rows: Sequence[VerifyRow], proposals: Sequence[DraftTree], want_logits: bool,
               want: tuple[str, ...] = ()) -> Verified:
        """One pass over the first len(rows) slots, slot r fed rows[r]'s root and proposals[r]."""

    def commit(self, length: int, path: list[int], slot: int = 0) -> None:
        """Keep the slot's root and accepted ``path`` at ``length``, ``length`` + 1, ..."""


class ChainVerifier:
    """Chains through the target's own graphs (runtime/model.py): one row runs through its
    slot's runner (a chain past every verify entry in a long size, runtime/runner.py), more
    through the batched verify graph that holds the longest, right-padded."""

    def __init__(self, target: Model):
        self.target = target

    def holds(self, rows: int, tokens: int) -> int:
        """How many of ``tokens`` per row one pass over ``rows`` rows takes."""
        return self.target.holds(rows, tokens)

    def verify(self, rows: Sequence[VerifyRow], proposals: Sequence[DraftTree], want_logits: bool,
               want: tuple[str, ...] = ()) -> Verified:
        target, n = self.target, len(rows)
        feed = {r: (length, np.concatenate(([root], chain.tokens)), {})  # [1+k] root, then the drafts
                for r, ((length, root), chain) in enumerate(zip(rows, proposals))}
        before = target.seconds
        out = target.run(n, feed, want_logits, want, verify=True)  # name -> [B, T, ...]
        seconds = target.seconds - before
        batch, width = target.graph(n, 1 + max(chain.size for chain in proposals), verify=True)
        names = [NEXT_TOKENS, *([LOGITS] if want_logits else []), *want]  # not an append graph's presents
        return Verified([{name: out[name][r] for name in names} for r in range(n)], batch, width, seconds)

    def commit(self, length: int, path: list[int], slot: int = 0) -> None:
        """Nothing moves: the chain's accepted drafts were written in place, and the next pass
        feeds the row at its new length."""
