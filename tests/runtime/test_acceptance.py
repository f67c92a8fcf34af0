"""Acceptance rules without any engine."""

import numpy as np
import pytest

from specexport.errors import BadInput
from specexport.runtime.acceptance import Draft, Sampling, greedy, rejection, sample, warp


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


def _first_token_distribution(p_rows, q_rows, draft_probs: bool, draws: int, seed: int) -> np.ndarray:
    """Empirical distribution of the first emitted token over many rejection rounds."""
    rng = np.random.default_rng(seed)
    vocab = p_rows.shape[1]
    counts = np.zeros(vocab)
    for _ in range(draws):
        token = sample(q_rows[0], rng)
        draft = Draft(np.array([token]), q_rows[:1] if draft_probs else None)
        n, nxt = rejection(draft, p_rows, rng)
        counts[token if n else nxt] += 1
    return counts / draws


@pytest.mark.parametrize("draft_probs", [True, False])
def test_rejection_first_token_is_distributed_as_the_target(draft_probs):
    rng = np.random.default_rng(1)
    p = rng.dirichlet(np.ones(6), size=2)  # [k+1, V]
    q = rng.dirichlet(np.ones(6), size=1)  # [k, V]
    if not draft_probs:
        # a point-mass drafter proposes a fixed token: q is one-hot
        q = np.eye(6)[[2]]
    got = _first_token_distribution(p, q, draft_probs, 30000, seed=2)
    assert np.abs(got - p[0]).max() < 0.012, (got, p[0])


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
