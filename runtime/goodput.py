"""Per-sequence depth inside a batch: how many tokens a batched verify pass should hold.

Rows share one verify call whose width T (a built size: 1, 2, 1+D) follows the longest row, and
its cost t(B, T) is paid once for the batch. So depth is chosen per round across all rows: with
each row's drafts in hand, take the T that maximises the expected committed tokens of all rows
per second of verify, sum_r E_r(min(drafts_r, T-1)) / t(B, T), where a row's E(k) = 1 + a + a^2
+ ... + a^k from the acceptance of its draft's tag (the drafter, or the n-gram match length),
pooled over all rows (runtime/adaptive.py's estimate), and t(B, T) measured once at start and
fixed from then on (runtime/policy.py says why). A row with a good record keeps its drafts when
the batch can afford them; rows that keep missing stop pulling the width up, and the round drops
to T = 1 when drafting does not pay at this batch size.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np


def expected_lengths(rate: float, depth: int) -> np.ndarray:
    """[depth] tokens a round commits with k = 1..depth drafts at per-position acceptance
    ``rate`` (a geometric model): E(k) = 1 + rate + rate² + ... + rate^k (E(0) = 1). The one
    expected-length formula: adaptive depth and the shared width both read it."""
    return 1.0 + np.cumsum(float(rate) ** np.arange(1, depth + 1))


def expected_tokens(rate: float, depth: int) -> float:
    """E(depth): tokens a round commits with ``depth`` drafts."""
    return float(expected_lengths(rate, depth)[-1]) if depth > 0 else 1.0


def best_width(widths: Sequence[int], cost: Callable[[int], float], rates: Sequence[float],
               drafted: Sequence[int]) -> int:
    """The verify width T among ``widths`` with the most expected tokens per second; rows hold
    ``drafted`` drafts each (ties: the narrower T)."""
    def goodput(width: int) -> float:
        tokens = sum(expected_tokens(rate, min(k, width - 1)) for rate, k in zip(rates, drafted))
        return tokens / cost(width)

    return max(sorted(widths), key=lambda w: (goodput(w), -w))
