"""Per-sequence depth inside a batch: how many tokens a batched verify pass should hold.

Rows share one verify call whose width T (a built size: 1, 2, 1+D) follows the longest row, and
its cost t(B, T) is paid once for the batch. So depth is chosen per round across all rows: with
each row's drafts in hand, take the T that maximises the expected committed tokens of all rows
per second of verify, sum_r E_r(min(drafts_r, T-1)) / t(B, T), where a row's E(k) comes from the
acceptance of its draft's tag (the drafter, or the n-gram match length), pooled over all rows
(runtime/acceptance_estimate.py), and t(B, T) measured once at start and fixed from then on
(runtime/policy.py says why). A row with a good record keeps its drafts when the batch can
afford them; rows that keep missing stop pulling the width up, and the round drops to T = 1
when drafting does not pay at this batch size.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np


def best_width(widths: Sequence[int], cost: Callable[[int], float], lengths: Sequence[np.ndarray]) -> int:
    """The verify width T among ``widths`` with the most expected tokens per second; row r's
    ``lengths[r]`` [drafts_r] is its E(k) for k = 1..its drafts (ties: the narrower T)."""
    def goodput(width: int) -> float:
        tokens = sum(float(row[min(len(row), width - 1) - 1]) if len(row) and width > 1 else 1.0 for row in lengths)
        return tokens / cost(width)

    return max(sorted(widths), key=lambda w: (goodput(w), -w))
