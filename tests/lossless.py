"""The losslessness check shared by the tiny and the SmolLM2 tests."""

from __future__ import annotations

import numpy as np

NEAR_TIE = 1e-3


def target_margin_at(pipe, prompt_ids: list[int], prefix: list[int]) -> float:
    """The target's top-2 logit margin for the token after prompt + prefix."""
    runner = pipe.target
    runner.rewind(0)
    logits = runner.forward(np.asarray([*prompt_ids, *prefix], dtype=np.int64), want_logits=True).logits[-1]
    top2 = np.sort(logits)[-2:]
    return float(top2[1] - top2[0])


def assert_lossless(pipe, prompt_ids: list[int], baseline: list[int], speculative: list[int], label: str) -> None:
    """Equal, or the first difference falls at a near-tie of the target (margin < 1e-3)."""
    if speculative == baseline:
        return
    first = next((i for i, (a, b) in enumerate(zip(baseline, speculative)) if a != b), None)
    if first is None:  # one is a prefix of the other: a stop reason differed
        raise AssertionError(f"{label}: lengths differ ({len(baseline)} vs {len(speculative)}) with no differing token")
    margin = target_margin_at(pipe, prompt_ids, baseline[:first])
    assert margin < NEAR_TIE, (
        f"{label}: output differs from the target alone at token {first} "
        f"({baseline[first]} vs {speculative[first]}) where the target's top-2 margin is {margin:.3g}, not a near-tie"
    )
