"""A new sequence's acceptance estimate starts from what the drafter kept on the pipeline's
earlier sequences (runtime/acceptance_estimate.py AcceptancePool), as strong as the bare prior."""

import numpy as np

from specexport.runtime import load
from specexport.runtime.acceptance import Sampling
from specexport.runtime.acceptance_estimate import AcceptanceEstimate, AcceptancePool
from specexport.runtime.adaptive import DepthPolicy
from specexport.runtime.loop import BatchLoop, Request
from tests.runtime.fakes import FixedDrafter, markov, random_table
from tests.runtime.test_adaptive import drafts, verify_cost


def pooled(rounds: int, accepted: int, depth: int = 5) -> AcceptancePool:
    """A pool fed ``rounds`` rounds of ``depth`` drafts, ``accepted`` of each kept, by earlier sequences."""
    pool = AcceptancePool()
    earlier = AcceptanceEstimate(pool=pool)
    for _ in range(rounds):
        earlier.observe("head", drafts(depth), accepted)
    return pool


def steep(tokens: int) -> float:
    """A verify whose every token costs a quarter of a one-token call more."""
    return 0.020 * (1 + 0.25 * (tokens - 1))


def test_a_sequence_opens_at_the_depth_earlier_sequences_earned():
    """From the bare prior (0.8 a draft) a new sequence opens at depth 4 here; after earlier
    sequences kept nothing it opens shallower, as if it had failed one round itself; after they
    kept every draft, deeper."""
    bare = DepthPolicy(steep, checked=False)
    failing = DepthPolicy(steep, checked=False, estimate=AcceptanceEstimate(pool=pooled(20, 0)))
    kept = DepthPolicy(steep, checked=False, estimate=AcceptanceEstimate(pool=pooled(20, 5)))
    once = DepthPolicy(steep, checked=False)
    once.estimate.observe("head", drafts(5), 0)
    opened = {name: p.best_depth("head", 5) for name, p in
              (("bare", bare), ("failing", failing), ("kept", kept), ("once", once))}
    assert opened["failing"] == opened["once"] < opened["bare"] < opened["kept"] == 5, opened


def test_the_pooled_prior_weighs_one_round():
    """However many rounds the pool holds, it weighs one round: a sequence started from 200
    pooled failures expects what the bare prior expects after one failure of its own, and two
    rounds of its own that kept everything outweigh it."""
    start = AcceptanceEstimate(pool=pooled(200, 0))
    once = AcceptanceEstimate()
    once.observe("head", drafts(5), 0)
    assert np.allclose(start.chain_lengths("head", 5), once.chain_lengths("head", 5))
    own = AcceptanceEstimate(pool=pooled(200, 0))
    for _ in range(2):
        own.observe("head", drafts(5), 5)
    assert own.chain_lengths("head", 1)[0] > 1.6


def test_an_estimate_feeds_its_pool_and_a_detached_one_does_not():
    pool = AcceptancePool()
    estimate = AcceptanceEstimate(pool=pool)
    estimate.observe("head", drafts(3), 1)
    assert pool.start("head").rounds.tolist() == [1.0, 1.0, 1.0]
    detached = AcceptanceEstimate(pool=pool)
    detached.detach_pool()
    detached.observe("head", drafts(3), 0)
    assert pool.start("head").rounds.tolist() == [1.0, 1.0, 1.0]  # unchanged
    assert detached.chain_lengths("head", 1)[0] < estimate.chain_lengths("head", 1)[0]


def test_only_greedy_sequences_share_the_pool():
    """A seeded sampled request draws by its depths: it must not learn from earlier requests."""
    pool = AcceptancePool()
    made: list[DepthPolicy] = []

    def adaptive() -> DepthPolicy:
        made.append(DepthPolicy(verify_cost, checked=False, estimate=AcceptanceEstimate(pool=pool)))
        return made[-1]

    target = markov(random_table(16, 0))
    loop = BatchLoop(target, FixedDrafter(np.zeros(4, dtype=np.int64)), draft_len=4, eos_ids=frozenset(), adaptive=adaptive)
    prompt = np.asarray([1, 2, 3], dtype=np.int64)
    loop.submit("greedy", Request(prompt, 4, Sampling()))
    loop.submit("sampled", Request(prompt, 4, Sampling(temperature=1.0), np.random.default_rng(0)))
    list(loop.run())
    assert [p.estimate.pool is pool for p in made] == [True, False]


def test_pipelines_pool_by_drafter_unless_prices_are_fixed(tiny_dir):
    pipe = load(tiny_dir, threads=1)
    first = pipe.costs.depth_policy(pipe.drafter("ngram"), pipe.target)
    second = pipe.costs.depth_policy(pipe.drafter("ngram"), pipe.target)
    assert first.estimate.pool is second.estimate.pool is not None
    fixed = load(tiny_dir, threads=1, check_prices=False)
    assert fixed.costs.depth_policy(fixed.drafter("ngram"), fixed.target).estimate.pool is None
