"""Acceptance rules without any engine."""

import numpy as np
import pytest

from specexport.errors import BadInput
from specexport.runtime.acceptance import (
    Draft,
    Kept,
    Sampling,
    Warped,
    greedy,
    rejection,
    warp_reference,
    warp_row,
)
from tests.lossless import (
    assert_sampled_as_target,
    residual_is_q,
    residual_keeps_the_rejected_token,
    sample,
    warp,
)


def test_greedy_stops_at_first_mismatch():
    assert greedy(np.array([5, 6, 7]), np.array([5, 6, 9, 1])) == (2, 9)
    assert greedy(np.array([5, 6, 7]), np.array([4, 6, 7, 1])) == (0, 4)


def test_greedy_all_accepted_takes_the_bonus():
    assert greedy(np.array([5, 6, 7]), np.array([5, 6, 7, 8])) == (3, 8)
    assert greedy(np.array([], dtype=np.int64), np.array([3])) == (0, 3)


def test_warp_temperature():
    logits = np.array([[1.0, 2.0, 3.0]])
    p1 = warp(logits, Sampling(temperature=1.0))
    assert np.allclose(p1, np.exp(logits) / np.exp(logits).sum())
    p_half = warp(logits, Sampling(temperature=0.5))
    assert np.allclose(p_half, np.exp(2 * logits) / np.exp(2 * logits).sum())


def test_warp_top_k_keeps_k():
    logits = np.array([[0.1, 3.0, 2.0, -1.0, 2.5]])
    p = warp(logits, Sampling(temperature=1.0, top_k=2))[0]
    assert set(np.flatnonzero(p)) == {1, 4}
    assert np.isclose(p.sum(), 1) and np.isclose(p[1] / p[4], np.exp(0.5))


def test_warp_top_p_keeps_smallest_set_reaching_p():
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    logits = np.log(probs)[None]
    assert set(np.flatnonzero(warp(logits, Sampling(1.0, top_p=0.5))[0])) == {0}
    assert set(np.flatnonzero(warp(logits, Sampling(1.0, top_p=0.51))[0])) == {0, 1}
    assert set(np.flatnonzero(warp(logits, Sampling(1.0, top_p=0.9))[0])) == {0, 1, 2}
    kept = warp(logits, Sampling(1.0, top_p=0.75))[0]
    assert np.allclose(kept[:2], [0.625, 0.375]) and kept[2:].sum() == 0


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_k=-2), dict(top_p=0), dict(top_p=1.5),
                                 dict(temperature=float("nan"))])
def test_invalid_sampling_values(bad):
    with pytest.raises(BadInput):
        Sampling(**bad)


def test_sample_follows_distribution():
    rng = np.random.default_rng(0)
    p = np.array([0.1, 0.0, 0.6, 0.3])
    draws = np.bincount([sample(p, rng) for _ in range(20000)], minlength=4) / 20000
    assert draws[1] == 0 and np.abs(draws - p).max() < 0.015


def _first_token_counts(p_rows, q_rows, draft_probs: bool, draws: int, seed: int, rule=None) -> dict:
    """How often each first emitted token came out of many rounds of ``rule`` (None: rejection):
    (token,) -> count."""
    rng = np.random.default_rng(seed)
    accept = rule or rejection
    counts: dict[tuple[int], int] = {}
    for _ in range(draws):
        token = sample(q_rows[0], rng)
        draft = Draft(np.array([token]), q_rows[:1] if draft_probs else None)
        n, nxt = accept(draft, p_rows, rng)
        counts[(token if n else nxt,)] = counts.get((token if n else nxt,), 0) + 1
    return counts


# the drafter's q (False: a point mass) and the rule; each wrong one is the failing control of the
# right one: the same draws must fail the same chi-square test
FIRST_TOKEN_RULES = [pytest.param(True, None, id="q-right-rule"),
                     pytest.param(True, residual_is_q, id="q-control-residual_is_q"),
                     pytest.param(True, residual_keeps_the_rejected_token, id="q-control-residual_keeps_the_rejected_token"),
                     pytest.param(False, None, id="point-mass-right-rule"),
                     pytest.param(False, residual_keeps_the_rejected_token,
                                  id="point-mass-control-residual_keeps_the_rejected_token")]


@pytest.mark.parametrize("draft_probs, rule", FIRST_TOKEN_RULES)
def test_rejection_first_token_is_distributed_as_the_target(draft_probs, rule):
    rng = np.random.default_rng(1)
    p = rng.dirichlet(np.ones(6), size=2)  # [k+1, V]
    q = rng.dirichlet(np.ones(6), size=1)  # [k, V]
    if not draft_probs:
        # a point-mass drafter proposes a fixed token: q is one-hot
        q = np.eye(6)[[2]]
    draws = 10000  # the wrong rules' statistics are 20x the limit and more
    counts = _first_token_counts(p, q, draft_probs, draws, seed=2, rule=rule)
    exact = {(t,): float(p[0, t]) for t in range(6)}
    assert_sampled_as_target(counts, exact, draws, right_rule=rule is None)


def test_rejection_point_mass_never_resamples_the_rejected_token():
    p = np.array([[0.2, 0.5, 0.3], [1 / 3, 1 / 3, 1 / 3]])
    rng = np.random.default_rng(0)
    for _ in range(500):
        n, nxt = rejection(Draft(np.array([1])), p, rng)
        if n == 0:
            assert nxt != 1


def test_rejection_never_accepts_an_impossible_token():
    p = np.array([[0.0, 1.0], [0.5, 0.5]])
    q = np.array([[0.9, 0.1]])
    rng = np.random.default_rng(0)
    assert all(rejection(Draft(np.array([0]), q), p, rng) == (0, 1) for _ in range(200))


def test_rejection_all_accepted_draws_the_bonus_from_the_last_row():
    p = np.array([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    n, bonus = rejection(Draft(np.array([1])), p, np.random.default_rng(0))
    assert (n, bonus) == (1, 2)


def test_seeded_rejection_is_reproducible():
    rng = np.random.default_rng(3)
    p = rng.dirichlet(np.ones(8), size=4)
    q = rng.dirichlet(np.ones(8), size=3)
    draft = Draft(np.array([1, 2, 3]), q)
    a = [rejection(draft, p, np.random.default_rng(11)) for _ in range(5)]
    b = [rejection(draft, p, np.random.default_rng(11)) for _ in range(5)]
    assert a == b


# The fast warp against the definition: the same kept tokens and the same probabilities.

VOCAB = 300


def _logits(seed: int, n: int, vocab: int, ties: bool) -> np.ndarray:
    x = np.random.default_rng(seed).normal(0, 3, size=(n, vocab))
    if ties:
        x = np.round(x * 2) / 2  # many tokens share a logit, at every rank
    return x.astype(np.float32)


FAST_CASES = [Sampling(t, k, p) for t in (1e-3, 0.3, 0.8, 1.0, 2.5) for k in (0, 1, 7, VOCAB - 1, VOCAB, VOCAB + 5)
              for p in (1.0, 0.999, 0.95, 0.5, 1e-9)]


@pytest.mark.parametrize("ties", [True, False], ids=["ties", "distinct"])
@pytest.mark.parametrize("sampling", FAST_CASES, ids=lambda s: f"t{s.temperature}-k{s.top_k}-p{s.top_p}")
def test_fast_warp_equals_the_reference(sampling, ties):
    logits = _logits(int(sampling.temperature * 1e3) + sampling.top_k, 8, VOCAB, ties)  # [n, V]
    ref = warp_reference(logits, sampling)  # [n, V]
    fast = warp(logits, sampling)  # [n, V] from warp_row, row by row
    # the same kept tokens, ties resolved alike (the fast path works in float32 where it can:
    # a probability below float32's range, ~1e-38, is 0 there)
    assert not np.any((fast > 0) & (ref == 0)) and not np.any((fast == 0) & (ref > 1e-30))
    np.testing.assert_allclose(fast, ref, rtol=1e-5, atol=1e-12)


@pytest.mark.parametrize("sampling", [Sampling(0.8, top_p=0.95), Sampling(1.0, top_p=0.9), Sampling(2.5, top_p=0.95),
                                      Sampling(0.8, top_k=50), Sampling(0.7, top_k=40, top_p=0.9), Sampling(1.0)],
                         ids=str)
def test_fast_warp_equals_the_reference_at_full_vocabulary(sampling):
    logits = _logits(5, 2, 49152, ties=True)  # flat enough that top-p needs the wider candidate sets
    row = warp_row(logits[1], sampling)
    ref = warp_reference(logits, sampling)[1]
    assert np.array_equal(row.dense(49152) > 0, ref > 0)
    np.testing.assert_allclose(row.dense(49152), ref, rtol=1e-5, atol=1e-12)
    if sampling.top_k or sampling.top_p < 1:
        assert row.ids is not None and len(row.ids) == np.count_nonzero(ref)  # only the kept tokens


def test_tie_rules_are_shared():
    flat = np.zeros((1, 4), dtype=np.float32)  # four equal logits
    for warp_fn in (warp_reference, warp):
        # top-p ranks equal logits by id: the first two reach 0.5
        assert set(np.flatnonzero(warp_fn(flat, Sampling(1.0, top_p=0.5))[0])) == {0, 1}
        # top-k keeps every token tied with the k-th
        stepped = np.array([[3.0, 2.0, 2.0, 2.0, 1.0]], dtype=np.float32)
        assert set(np.flatnonzero(warp_fn(stepped, Sampling(1.0, top_k=2))[0])) == {0, 1, 2, 3}
        # a tiny top_p keeps the most likely token, the lowest id among equals
        assert set(np.flatnonzero(warp_fn(np.array([[0.0, 5.0, 5.0]]), Sampling(1.0, top_p=1e-9))[0])) == {1}


def test_kept_lookups():
    kept = Kept(np.array([2, 5, 9]), np.array([0.5, 0.3, 0.2]))
    assert kept.prob(5) == 0.3 and kept.prob(4) == 0.0 and kept.prob(10) == 0.0
    assert kept.at(np.array([9, 1, 2]), 12).tolist() == [0.2, 0.0, 0.5]
    assert kept.dense(12)[[2, 5, 9]].tolist() == [0.5, 0.3, 0.2] and kept.dense(12).sum() == pytest.approx(1)
    rng = np.random.default_rng(0)
    assert {kept.draw(rng) for _ in range(200)} == {2, 5, 9}


@pytest.mark.parametrize("model_draft", [True, False], ids=["model", "point-mass"])
def test_sparse_rejection_makes_the_dense_choices(model_draft):
    # Same seed, same choices: the sparse path draws over the kept tokens in id order, as the
    # dense one does over the whole vocabulary (where the dropped tokens weigh nothing).
    sampling = Sampling(0.9, top_k=60, top_p=0.9)
    target_logits = _logits(11, 4, VOCAB, ties=True)  # [k+1, V]
    draft_logits = target_logits[:3] + _logits(12, 3, VOCAB, ties=False) * 0.3  # [k, V] a near model
    outcomes = set()
    for seed in range(300):
        rng = np.random.default_rng(seed)
        q_rows = [warp_row(row, sampling) for row in draft_logits]
        tokens = np.array([q.draw(rng) for q in q_rows])
        dense_q = np.stack([q.dense(VOCAB) for q in q_rows])
        sparse = Draft(tokens, q_rows if model_draft else None)
        dense = Draft(tokens, dense_q if model_draft else None)
        got = rejection(sparse, Warped(target_logits, sampling), np.random.default_rng(seed + 1000))
        want = rejection(dense, warp_reference(target_logits, sampling), np.random.default_rng(seed + 1000))
        assert got == want
        outcomes.add(got[0])
    assert len(outcomes) > 1  # rejections and acceptances both happened


class _CountingRows:
    def __init__(self, rows):
        self.rows, self.read = rows, []

    def __getitem__(self, i):
        self.read.append(i)
        return self.rows[i]


def test_rejection_reads_target_rows_only_up_to_the_first_rejection():
    p = np.array([[0.0, 1.0, 0.0]] * 4)  # the target always wants token 1
    rows = _CountingRows(p)
    n, nxt = rejection(Draft(np.array([1, 2, 1])), rows, np.random.default_rng(0))
    assert (n, nxt) == (1, 1) and rows.read == [0, 1]
