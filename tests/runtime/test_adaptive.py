"""Adaptive draft depth: it drafts deep when drafts are kept and stops when they are not."""

import numpy as np
import pytest

from specexport.runtime.acceptance_estimate import AcceptanceEstimate
from specexport.runtime.adaptive import DepthPolicy
from specexport.runtime.drafters import NgramDrafter
from specexport.runtime.policy import trim_chain
from specexport.runtime.tree import DraftTree
from tests.runtime.fakes import FixedDrafter, OracleDrafter, markov, random_table
from tests.runtime.test_decode import greedy_reference, run

# a CPU-like cost curve: 8 tokens cost 1.5x one token
COSTS = {1: 0.020, 2: 0.0256, 4: 0.0256, 8: 0.030}


def verify_cost(tokens):
    return next(COSTS[s] for s in sorted(COSTS) if s >= tokens)


def drafts(n: int, tag: str = "") -> DraftTree:
    """A weightless chain of ``n`` drafts (what the estimate is told a round verified)."""
    return DraftTree.chain(np.zeros(n, dtype=np.int64), tag)


def test_depth_zero_when_drafts_keep_failing():
    policy = DepthPolicy(verify_cost, checked=False)
    for _ in range(30):
        policy.estimate.observe("bad", drafts(7), 0)
    depths = [policy.best_depth("bad", 7) for _ in range(16)]
    assert depths.count(0) >= 14  # off, but probing now and then
    assert 7 in depths
    later = [policy.best_depth("bad", 7) for _ in range(120)]
    probes = [i for i, depth in enumerate(later) if depth == 7]
    assert np.diff(probes).tolist()[-2:] == [32, 32], probes  # ever rarer, up to every 32 rounds


def test_a_probe_costs_at_most_its_share_of_the_rounds_it_follows():
    """Plain rounds cost 20 ms. A tag's first probe comes on the 8th round at depth 0 whatever its
    catch-up, as deep as half a plain round more pays for: 7 drafts for a free drafter, 1 for one
    whose steps cost 12 ms or 4 ms (3 drafts at 4 ms cost 37.6 ms, over 30). Later probes cost at
    most 3% of the rounds before them: the free drafter's next one 16 rounds on, 3 deep (4 tokens
    cost 5.6 ms more, within 9.6 ms; 8 tokens 10 ms), the one after 32 rounds on at full depth
    (within 19.2 ms); the 12 ms one's next when the 30 rounds since its last pay for one 1 deep
    (17.6 ms); a draft model whose catch-up costs 5 ms a skipped round (a quarter of a plain
    round) none."""
    for step, catchup, want in ((0.0, 0.0, [(7, 7), (23, 3), (55, 7)]), (0.012, 0.0, [(7, 1), (38, 1)]),
                                (0.004, 0.0, [(7, 1)]), (0.0, 0.005, [(7, 7)])):
        policy = DepthPolicy(verify_cost, round_cost=lambda k, step=step: step * k,
                             catchup_cost=lambda s, catchup=catchup: catchup * s, checked=False)
        for _ in range(30):
            policy.estimate.observe("bad", drafts(7), 0)
        depths = [policy.best_depth("bad", 7) for _ in range(100)]
        probes = [(i, d) for i, d in enumerate(depths) if d]
        assert probes[: len(want)] == want and (catchup == 0 or len(probes) == 1), probes


def test_a_round_that_catches_up_says_so():
    """The first drafting round after rounds at depth 0 also feeds the drafter what it skipped:
    ``resumed`` (its time is no price of its kind); the next one does not. So does the very first
    drafting round, which feeds it the prompt. A drafter that skips for free never resumes so."""
    for catchup in (0.001, 0.0):
        policy = DepthPolicy(verify_cost, catchup_cost=lambda s, catchup=catchup: catchup * s, checked=False)
        policy.start_cost = catchup * 20  # a 20-token prompt (SpeculationPolicy.start sets it)
        first = [(policy.best_depth("m", 7) > 0, policy.resumed) for _ in range(2)]
        assert first == ([(True, True), (True, False)] if catchup else [(True, False), (True, False)]), first
        for _ in range(30):
            policy.estimate.observe("m", drafts(7), 0)
        assert [policy.best_depth("m", 7) for _ in range(3)] == [0, 0, 0]
        for _ in range(60):
            policy.estimate.observe("m", drafts(7), 7)
        flags = []
        for _ in range(2):
            flags.append((policy.best_depth("m", 7) > 0, policy.resumed))
        assert flags == ([(True, True), (True, False)] if catchup else [(True, False), (True, False)]), flags


def test_full_depth_when_drafts_are_kept():
    policy = DepthPolicy(verify_cost, checked=False)
    for _ in range(30):
        policy.estimate.observe("good", drafts(7), 7)
    assert policy.best_depth("good", 7) == 7


def test_drafting_cost_shortens_the_draft():
    cheap = DepthPolicy(verify_cost, round_cost=lambda k: 0.0)
    dear = DepthPolicy(verify_cost, round_cost=lambda k: 0.012 * k)
    for policy in (cheap, dear):
        for accepted in [7, 5, 3, 6, 2, 7, 4, 6, 5, 7] * 3:  # about 0.8 per position
            policy.estimate.observe("m", drafts(7), accepted)
    assert dear.best_depth("m", 7) < cheap.best_depth("m", 7)


def test_trim_keeps_a_prefix_and_its_probabilities():
    policy = DepthPolicy(verify_cost, checked=False)
    for _ in range(40):
        policy.estimate.observe("t", drafts(4), 1)
    draft = DraftTree.chain(np.array([1, 2, 3, 4]), "t", np.full((4, 5), 0.2))
    trimmed = trim_chain(policy, draft, "fallback")
    assert trimmed.size < 4 and trimmed.tokens.tolist() == [1, 2, 3, 4][: trimmed.size]
    assert trimmed.probs.shape == (trimmed.size, 5) and trimmed.tag == "t"


def test_adaptive_loop_is_lossless_and_stops_wasting_verifies():
    table = random_table(6, seed=0)
    prompt = [1, 2, 3]
    wrong = FixedDrafter([5, 5, 5, 5, 5, 5, 5])
    fixed_out, fixed = run(markov(table), wrong, prompt, draft_len=7, max_new=60)
    policy = DepthPolicy(verify_cost, checked=False)
    adaptive_out, adaptive = run(markov(table), wrong, prompt, draft_len=7, max_new=60, policy=policy)
    assert adaptive_out == fixed_out == greedy_reference(table, prompt, 60)
    assert adaptive.proposed < fixed.proposed / 3


def test_adaptive_loop_keeps_drafting_when_it_pays():
    table = random_table(6, seed=1)
    policy = DepthPolicy(verify_cost, checked=False)
    out, stats = run(markov(table), OracleDrafter(table), [0], draft_len=4, max_new=40, policy=policy)
    assert out == greedy_reference(table, [0], 40)
    # the prior starts short of full depth; accepted drafts soon make every round draft 4
    assert stats.accepted == stats.proposed and stats.proposed_at[3] >= stats.rounds // 2
    assert stats.acceptance_length > 4.0


def test_ngram_drafts_are_tagged_by_match_length():
    drafter = NgramDrafter(max_ngram=3)
    draft = drafter.chain(np.array([1, 2, 3, 9, 1, 2, 3]), 2)
    assert draft.tag == "ngram/n3" and draft.tokens.tolist() == [9, 1]


def test_drafting_must_win_by_the_minimum_gain():
    """One draft verified costs 25.6 ms against a plain round's 20 (1.28x): expected to commit
    1.30 tokens it is 1.6% ahead, inside ``min_gain`` (3%), so the round stays plain; at 1.35,
    5.5% ahead, it drafts. Without the margin (1.0) the first drafts too."""

    def first(e1: float, **margin) -> int:
        return DepthPolicy(verify_cost, estimate=Expected([e1]), checked=False, **margin).best_depth("t", 1)

    assert (first(1.30), first(1.35), first(1.30, min_gain=1.0)) == (0, 1, 1)


def test_a_trimmed_chain_follows_the_measured_prices():
    """Prompt lookup's chains are trimmed once drafted (``sunk``): by the prices the clock
    checked, not the engines' costs. Priced, 3 drafts (4 tokens: 25.6 ms) expected to commit 1.7
    tokens are kept; once rounds at depth 3 measure 60 ms, drafting at any depth loses to a plain
    round (20 ms) and the chain is cut to nothing."""
    policy = DepthPolicy(verify_cost, estimate=Expected([1.5, 1.6, 1.7]))
    before = policy.best_depth("ngram/n2", 3, sunk=True)
    for _ in range(3):
        policy.prices.observe(1, 3, 0.060)
    assert (before, policy.best_depth("ngram/n2", 3, sunk=True)) == (3, 0)


class Expected(AcceptanceEstimate):
    """An estimate that expects fixed chain lengths E(1), E(2), ... whatever is observed."""

    def __init__(self, lengths: list[float]):
        super().__init__()
        self.lengths = lengths

    def chain_lengths(self, tag, depth):
        return np.array(self.lengths[:depth])


def test_a_draft_rides_in_the_pad_row_of_a_padded_one_token_call():
    """Where the graph pads a one-token call to two rows (ModelEntry.one_token_rows = 2), depth 0
    costs what depth 1's verify does: a draft kept a fifth of the time pays. Where a one-token
    call runs one row, the same draft costs 28% more than the plain round for 20% more tokens."""
    chosen = {}
    for rows in (1, 2):
        policy = DepthPolicy(verify_cost, checked=False, one_token_rows=rows)
        for i in range(60):
            policy.estimate.observe("fifth", drafts(1), 1 if i % 5 == 0 else 0)
        chosen[rows] = [policy.best_depth("fifth", 1) for _ in range(6)]
    assert chosen[1].count(0) >= 5 and chosen[2] == [1] * 6, chosen


def test_only_a_fully_padded_quantized_model_runs_two_rows_a_token():
    from specexport.contract import KVLayout, ModelEntry

    def entry(info):
        return ModelEntry("target", "target", KVLayout(1, 1, 8, 16, "float32"), 10, info=info)

    assert entry({}).one_token_rows == 1  # fp32
    assert entry({"quantization": {"bits": 4}}).one_token_rows == 2  # built before the probe: padded in full
    assert entry({"quantization": {"exactness": {"pad": "all"}}}).one_token_rows == 2
    assert entry({"quantization": {"exactness": {"pad": "attention"}}}).one_token_rows == 1


def test_a_drafter_starts_only_where_the_request_can_repay_its_prompt():
    """A drafter whose first draft must feed it the prompt (300 ms here, fifteen plain rounds)
    starts only when the tokens the request may still make can repay that at the estimate's
    rate (the prior's 4.2 tokens a 30 ms round saves 13 ms a token): with 16 to go it never drafts, not even the first probe (which would pay the prompt
    too); with 400 to go it starts at once; once started, the prompt is paid and no longer
    charged. The control: without a start cost it drafts at once with 16 to go."""
    def policy(start: float) -> DepthPolicy:
        made = DepthPolicy(verify_cost, checked=False)
        made.start_cost = start
        return made

    short = policy(0.300)
    assert [short.best_depth("m", 7, remaining=16) for _ in range(40)] == [0] * 40
    long = policy(0.300)
    assert long.best_depth("m", 7, remaining=400) > 0
    assert long.best_depth("m", 7, remaining=16) > 0  # started: the prompt is paid
    assert policy(0.0).best_depth("m", 7, remaining=16) > 0


def test_depths_no_longer_drafted_do_not_return_to_the_prior():
    """A drafter whose first draft is kept every other round and whose deeper ones never are
    (SmolLM2's EAGLE-3 head on a summary): once its deep drafts failed, rounds stay shallow.
    Each draft costs a tenth of a plain round. With every depth's prior at 1, the deep depths'
    forgotten rounds brought them back to the prior's 0.8 a draft, and a round at depth 5 or 6
    came every ten rounds or so, each keeping at most the first draft."""
    policy = DepthPolicy(lambda tokens: 0.010 * (1 + 0.1 * (tokens - 1)), checked=False)
    depths = []
    for i in range(80):
        k = policy.best_depth("head", 7)
        if k:
            policy.estimate.observe("head", drafts(k), 1 if i % 2 else 0)
        depths.append(k)
    assert max(depths[:3]) >= 5  # a new drafter is tried deep
    assert max(depths[10:]) <= 2, depths
    assert depths[10:].count(0) < 35  # and still drafts: its first draft pays


def test_a_free_drafter_drafts_what_the_round_allows_and_its_tag_decides():
    """Prompt lookup on a target copying a 12-token cycle, verifies as steep as int4's on a
    CPU (each token 6 ms over a plain round's 20): before drafting no match length is known,
    and a fresh estimate's drafts pay only to depth 3. Prompt lookup's drafts cost nothing
    (``drafts_free``), so its rounds draft all the round allows and the match length's tag,
    once kept whole, verifies more each round, up to 7. Planned without the tag (the control), every
    round stops at 3."""
    vocab = 12
    table = np.full((vocab, vocab), -1.0, dtype=np.float32)
    table[np.arange(vocab), (np.arange(vocab) + 1) % vocab] = 1.0  # [vocab, vocab] t -> t + 1
    prompt = list(range(vocab)) + [0, 1]
    steep = lambda tokens: 0.020 + 0.006 * (tokens - 1)  # noqa: E731

    def depths(drafter: NgramDrafter) -> list[int]:
        out, stats = run(markov(table), drafter, prompt, draft_len=7, max_new=64,
                         policy=DepthPolicy(steep, checked=False))
        assert out == greedy_reference(table, prompt, 64)
        return stats.round_drafts

    free = depths(NgramDrafter())
    # 3 while each longer match is a fresh tag (n2, n6, n8, n12: 3 + 1 tokens a round); then
    # n12's rounds, kept whole, draft deeper each round (past the depths kept so far, at the
    # prior's rate a draft) up to 7; the last round drafts what the token budget leaves
    grown = free[4:-1]
    assert free[:4] == [3] * 4 and grown == sorted(grown) and grown.count(7) >= 2, str(free)

    class Planned(NgramDrafter):
        drafts_free = False

    assert max(depths(Planned())) == 3


def test_past_the_depths_drafted_a_draft_is_kept_at_most_at_the_prior_rate():
    """A tag kept whole in two rounds at depth 3: each draft past 3 is expected kept at the
    prior's 0.8 of the one before, not at the rate so far (about 1: all 7 at once, the way fresh
    match lengths drafted deep and missed past what they had been kept for). A tag rarely kept
    at depth 1 goes on at its own rate."""
    estimate = AcceptanceEstimate()
    for _ in range(2):
        estimate.observe_chain("whole", 3, 3)
    for _ in range(5):
        estimate.observe_chain("rare", 1, 0)

    def kept(tag: str) -> np.ndarray:
        return np.diff(estimate.chain_lengths(tag, 7), prepend=1.0)  # [7] each draft's expected keep

    whole, rare = kept("whole"), kept("rare")
    assert whole[2] > 0.9 and np.allclose(whole[3:] / whole[2:-1], 0.8), whole
    assert rare[0] < 0.5 and rare[1] == pytest.approx(rare[0] ** 2), rare
