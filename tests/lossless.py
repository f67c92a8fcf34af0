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


def exact_sequence_probs(pipe, prompt_ids: list[int], sampling, length: int) -> dict[tuple[int, ...], float]:
    """The target's exact probability of every ``length``-token continuation under ``sampling``
    (warped: temperature, top-k, top-p), from target-alone logits: sequence -> probability."""
    from specexport.runtime.acceptance import warp

    def step(prefix: list[int], depth: int) -> dict[tuple[int, ...], float]:
        if depth == 0:
            return {(): 1.0}
        runner = pipe.target
        runner.rewind(0)
        logits = runner.forward(np.asarray([*prompt_ids, *prefix], dtype=np.int64), want_logits=True).logits
        p = warp(logits[-1:], sampling)[0]  # [V]
        return {(int(t), *rest): float(p[t]) * q
                for t in np.flatnonzero(p) for rest, q in step([*prefix, int(t)], depth - 1).items()}

    return step([], length)


def chi_square(counts: dict, exact: dict, draws: int, min_expected: float = 5.0) -> tuple[float, int]:
    """Pearson's statistic of observed ``counts`` against ``exact`` probabilities, cells expected
    fewer than ``min_expected`` times pooled into one (small cells inflate the statistic).
    Returns (chi2, degrees of freedom)."""
    big = [s for s, p in exact.items() if p * draws >= min_expected]
    cells = [(counts.get(s, 0), exact[s] * draws) for s in big]
    rest = [s for s in exact if s not in set(big)]
    if rest:
        cells.append((sum(counts.get(s, 0) for s in rest), sum(exact[s] for s in rest) * draws))
    return sum((c - e) ** 2 / e for c, e in cells), len(cells) - 1


def chi_square_passes(counts: dict, exact: dict, draws: int) -> tuple[bool, str]:
    """Within df + 6·sqrt(2·df) (about 6 standard deviations of the statistic): a correct sampler
    fails once in millions of runs, a wrong one by far. Returns (passes, what to print)."""
    chi2, df = chi_square(counts, exact, draws)
    limit = df + 6 * np.sqrt(2 * df)
    return chi2 < limit, f"chi2 {chi2:.1f} (limit {limit:.1f}, df {df})"
