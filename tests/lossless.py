"""The losslessness checks shared by the tiny and the SmolLM2 tests: greedy output against the
target alone, and sampled output against the target's exact distribution (a chi-square test),
with the wrong acceptance rules a distribution test's failing control decodes under."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import chi2 as chi2_distribution

from specexport.runtime.acceptance import Sampling, as_kept, warp_row


def warp(logits: np.ndarray, sampling: Sampling) -> np.ndarray:
    """Logits [n, V] -> dense probabilities [n, V]: warp_row for each row."""
    logits = np.atleast_2d(logits)
    return np.stack([warp_row(row, sampling).dense(logits.shape[-1]) for row in logits])


def sample(probs: np.ndarray, rng: np.random.Generator) -> int:
    """One draw from a distribution [V] (need not be normalised)."""
    return as_kept(probs).draw(rng)

NEAR_TIE = 1e-3

# The chance that a correct sampler fails one chi-square test, from the chi-square tail that
# Pearson's statistic follows asymptotically (cells expected fewer than 5 times are pooled, so
# the approximation holds roughly this far out). About twenty such tests run in the suite
# (counting each position of a per-position test), so a correct suite false-alarms about once in
# 5,000 runs of fresh seeds. The seeds are fixed, so a test mostly draws the same way every run
# (not exactly where the loop's choices follow measured time: adaptive depth in the batched
# loop): the rate is the chance that a harmless change in how the loops use their random
# streams turns a passing test into a failing one.
ALPHA = 1e-5
# A failing control must exceed the limit by this factor: a wrong rule fails by far, not by luck.
CONTROL_MARGIN = 2.0


def target_margin_at(pipe, prompt_ids: list[int], prefix: list[int]) -> float:
    """The target's top-2 logit margin for the token after prompt + prefix."""
    runner = pipe.target
    runner.cache.set_length(0)
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
    (warped: temperature, top-k, top-p), from target-alone logits: sequence -> probability. A
    continuation that draws an end-of-sequence token stops there (a shorter sequence)."""

    eos = pipe.text.eos_ids

    def step(prefix: list[int], depth: int) -> dict[tuple[int, ...], float]:
        if depth == 0:
            return {(): 1.0}
        runner = pipe.target
        runner.cache.set_length(0)
        logits = runner.forward(np.asarray([*prompt_ids, *prefix], dtype=np.int64), want_logits=True).logits
        p = warp(logits[-1:], sampling)[0]  # [V]
        return {(int(t), *rest): float(p[t]) * q for t in np.flatnonzero(p)
                for rest, q in (step([*prefix, int(t)], depth - 1) if int(t) not in eos else {(): 1.0}).items()}

    return step([], length)


def sample_counts(pipe, prompt_ids: list[int], draws: int, **generate) -> tuple[dict[tuple[int, ...], int], list]:
    """``draws`` generations of ``prompt_ids`` with seeds 0, 1, ...: how often each token
    sequence came out, and each run's stats."""
    counts: dict[tuple[int, ...], int] = {}
    stats = []
    for seed in range(draws):
        out = pipe.generate(prompt_ids=prompt_ids, seed=seed, **generate)
        counts[tuple(out.token_ids)] = counts.get(tuple(out.token_ids), 0) + 1
        stats.append(out.stats)
    return counts, stats


def chi_square(counts: dict, exact: dict, draws: int, min_expected: float = 5.0) -> tuple[float, int]:
    """Pearson's statistic of observed ``counts`` against ``exact`` probabilities, cells expected
    fewer than ``min_expected`` times pooled into one (small cells inflate the statistic); a
    sequence observed outside the support (p = 0) makes it infinite.
    Returns (chi2, degrees of freedom)."""
    if any(n > 0 and exact.get(s, 0.0) == 0.0 for s, n in counts.items()):
        return float("inf"), max(len(exact) - 1, 1)
    big = [s for s, p in exact.items() if p * draws >= min_expected]
    cells = [(counts.get(s, 0), exact[s] * draws) for s in big]
    rest = [s for s in exact if s not in set(big)]
    if rest:
        cells.append((sum(counts.get(s, 0) for s in rest), sum(exact[s] for s in rest) * draws))
    return sum((c - e) ** 2 / e for c, e in cells), len(cells) - 1


def chi_square_limit(df: int) -> float:
    """The statistic a correct sampler exceeds with probability ALPHA at ``df`` degrees of freedom."""
    return float(chi2_distribution.isf(ALPHA, df))


def _over_limit(counts: dict, exact: dict, draws: int) -> tuple[float, str]:
    """The statistic as a multiple of its limit (< 1: passes), and what to print."""
    chi2, df = chi_square(counts, exact, draws)
    limit = chi_square_limit(df)
    return chi2 / limit, f"chi2 {chi2:.1f} (limit {limit:.1f} at alpha {ALPHA:g}, df {df})"


def assert_sampled_as_target(counts: dict, exact: dict, draws: int, right_rule: bool) -> None:
    """Under the right rule the sequences in ``counts`` pass the chi-square test against
    ``exact``; under a wrong one (the test's failing control, the same draws) they fail it by
    CONTROL_MARGIN."""
    _assert_verdicts([_over_limit(counts, exact, draws)], right_rule, counts)


def assert_each_position_sampled_as_target(counts: dict, exact: dict, draws: int, right_rule: bool) -> None:
    """For a warp too flat for whole sequences to fill the cells: each position's token alone
    (the marginals of ``counts`` and ``exact``) passes its chi-square test under the right rule
    (L positions, L tests: a correct sampler fails one with probability at most L·ALPHA); under a
    wrong rule one of them fails by CONTROL_MARGIN."""
    length = len(next(iter(exact)))
    verdicts = [_over_limit(at_position(counts, i), at_position(exact, i), draws) for i in range(length)]
    _assert_verdicts(verdicts, right_rule, counts)


def at_position(table: dict, i: int) -> dict:
    """Sequence -> count (or probability) as the token at position ``i`` -> its total:
    (token,) -> sum, where (None,) stands for the sequences that stopped before ``i``."""
    out: dict[tuple[int | None], float] = {}
    for sequence, value in table.items():
        key = (sequence[i] if i < len(sequence) else None,)
        out[key] = out.get(key, 0) + value
    return out


def _assert_verdicts(verdicts: list[tuple[float, str]], right_rule: bool, counts: dict) -> None:
    figures = "; ".join(figure for _, figure in verdicts)
    if right_rule:
        assert all(ratio < 1.0 for ratio, _ in verdicts), (figures, counts)
    else:
        assert max(ratio for ratio, _ in verdicts) > CONTROL_MARGIN, (
            f"a wrong acceptance rule passed (or nearly): {figures}; the test cannot tell it from the right one",
            counts)


# -- wrong acceptance rules: the failing controls decode under these (runtime/acceptance.py's
# ``rejection`` is the right one: keep x ~ q with probability min(1, p/q), else draw from
# norm(max(0, p − q)); a point-mass drafter's q is one-hot) ----------------------------------------


def _rows(draft, target, i):
    """The target's p and the drafter's q (None: a point mass) at draft position ``i``, as Kept."""
    from specexport.runtime.acceptance import as_kept

    return as_kept(target[i]), None if draft.probs is None else as_kept(draft.probs[i])


def _first_rejection(draft, target, rng):
    """The right rule's acceptance test: (position of the first rejected draft, or None, and p, q there)."""
    for i, token in enumerate(draft.tokens.tolist()):
        p, q = _rows(draft, target, i)
        if rng.random() * (1.0 if q is None else q.prob(token)) >= p.prob(token):
            return i, p, q
    return None, None, None


def residual_is_q(draft, target, rng):
    """Wrong: on rejection draw from q instead of max(0, p − q), over p's kept tokens (what a
    ``residual = q`` slip in ``rejection`` draws: a point mass, the rejected token again); from p
    where q puts nothing there."""
    from specexport.runtime.acceptance import Kept

    i, p, q = _first_rejection(draft, target, rng)
    if i is None:
        return draft.size, _bonus(draft, target, rng)
    if q is None:
        q_on_p = np.zeros(len(p.probs))  # [m]
        at = p.index(int(draft.tokens[i]))
        if at is not None:
            q_on_p[at] = 1.0
    else:
        q_on_p = q.at(p.ids, len(p.probs))  # [m]
    return i, Kept(p.ids, q_on_p if q_on_p.sum() > 0 else p.probs).draw(rng)


def residual_keeps_the_rejected_token(draft, target, rng):
    """Wrong: on rejection draw from p itself, the rejected token not removed (for a point mass,
    max(0, p − q) is p without it)."""
    i, p, _ = _first_rejection(draft, target, rng)
    if i is None:
        return draft.size, _bonus(draft, target, rng)
    return i, p.draw(rng)


def _bonus(draft, target, rng) -> int:
    from specexport.runtime.acceptance import as_kept

    return as_kept(target[draft.size]).draw(rng)


def rules(wrong) -> list:
    """A distribution test's parametrization: the right rule (None), then the failing control,
    the same draws under the ``wrong`` rule."""
    return [pytest.param(None, id="right-rule"), pytest.param(wrong, id=f"control-{wrong.__name__}")]


def each_with_one_control(subjects: list[str], wrong) -> list:
    """(subject, rule) parametrization for checkpoint layouts of one drafter kind, which draft the
    same way under the same settings: the right rule for each, one failing control (the first
    subject under the ``wrong`` rule) for them all, to keep the suite's time down."""
    return [*[pytest.param(s, None, id=f"{s}-right-rule") for s in subjects],
            pytest.param(subjects[0], wrong, id=f"{subjects[0]}-control-{wrong.__name__}")]


def use_rule(monkeypatch, rule) -> None:
    """Make the decode loop accept chains by ``rule`` (a wrong one, for a failing control; None:
    the right one, nothing patched): the one acceptance entry point (``acceptance.accept``)
    reads ``rejection`` from its module, so that is where ``rule`` goes."""
    if rule is None:
        return
    import specexport.runtime.acceptance as acceptance

    monkeypatch.setattr(acceptance, "rejection", rule)
