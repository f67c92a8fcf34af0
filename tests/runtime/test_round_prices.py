"""Round prices checked against the clock (runtime/round_prices.py), and adaptive depth's floor:
a drafter slower than its price stops drafting, and starts again when it pays."""

from __future__ import annotations

import time

import numpy as np
import pytest

from specexport.runtime.adaptive import DepthPolicy
from specexport.runtime.loop import BatchLoop, Request, RoundReport
from specexport.runtime.round_prices import RoundPrices
from tests.runtime.fakes import MarkovRunner, OracleDrafter, markov, random_table


def flat(batch: int, depth: int) -> float:
    return 0.010  # every kind priced at 10 ms


def test_a_price_the_clock_disagrees_with_is_replaced_after_a_window_of_rounds():
    prices = RoundPrices(flat)
    for seconds in (0.030, 0.030):
        prices.observe(1, 2, seconds)
    assert prices.seconds(1, 2) == pytest.approx(0.010)  # two rounds: not yet a window
    prices.observe(1, 2, 0.030)
    assert prices.seconds(1, 2) == pytest.approx(0.030)


def test_one_slow_round_does_not_move_a_price():
    prices = RoundPrices(flat)
    for seconds in (0.010, 0.050, 0.011, 0.010):
        prices.observe(1, 1, seconds)
    assert prices.seconds(1, 1) == pytest.approx(0.010)


def test_hysteresis_keeps_a_replaced_price_until_the_clock_agrees_closely():
    prices = RoundPrices(flat)  # margin 1.1, settle 1.05
    for _ in range(3):
        prices.observe(1, 3, 0.020)
    for _ in range(3):  # 1.08x: inside the margin, outside settle: the measurement stays
        prices.observe(1, 3, 0.0108)
    assert prices.seconds(1, 3) == pytest.approx(0.0108)
    for _ in range(3):  # 1.03x: back to the price
        prices.observe(1, 3, 0.0103)
    assert prices.seconds(1, 3) == pytest.approx(0.010)


def test_an_unmeasured_drafting_depth_is_scaled_as_the_nearest_measured_one():
    prices = RoundPrices(flat)
    for _ in range(3):
        prices.observe(1, 4, 0.040)
    assert prices.seconds(1, 3) == pytest.approx(0.040)  # a drafter slower than priced is slow at any depth
    assert prices.seconds(1, 0) == pytest.approx(0.010)  # the target alone is not the drafter
    assert prices.seconds(2, 3) == pytest.approx(0.010)  # another batch size: its own measurements


def test_a_depth_measured_right_is_not_scaled_by_a_farther_slow_one():
    prices = RoundPrices(flat)
    for _ in range(3):
        prices.observe(1, 4, 0.040)  # replaced: 4x its price
        prices.observe(1, 1, 0.010)  # priced right
    assert prices.seconds(1, 2) == pytest.approx(0.010)  # nearest measured: depth 1
    assert prices.seconds(1, 3) == pytest.approx(0.040)  # nearest measured: depth 4


def test_a_replaced_price_no_round_refreshes_expires():
    """A kind priced out of use is never run again: its measurement is forgotten after
    ``expire`` rounds of other kinds, so a round can measure it anew."""
    prices = RoundPrices(flat, expire=10)
    for _ in range(3):
        prices.observe(1, 4, 0.040)
    for _ in range(10):
        prices.observe(1, 0, 0.010)
    assert prices.seconds(1, 4) == pytest.approx(0.040)  # 10 rounds since: still the measurement
    prices.observe(1, 0, 0.010)
    assert prices.seconds(1, 4) == pytest.approx(0.010) and prices.rounds(1, 4) == 0  # 11: priced again
    for _ in range(20):  # a measurement refreshed by its own rounds never expires
        prices.observe(1, 2, 0.030)
    assert prices.seconds(1, 2) == pytest.approx(0.030)


def test_fixed_prices_ignore_the_clock():
    prices = RoundPrices(flat, margin=float("inf"))
    for _ in range(5):
        prices.observe(1, 2, 0.100)
    assert not prices.checked and prices.seconds(1, 2) == pytest.approx(0.010)


class SleepyRunner(MarkovRunner):
    """A target whose every call takes ``delay`` seconds, whatever its token count."""

    delay = 0.004

    def forward(self, tokens, want_logits=False, inputs=None, want=(), verify=False):
        if len(tokens):
            time.sleep(self.delay)
        return super().forward(tokens, want_logits, inputs, want)


class SleepyOracle(OracleDrafter):
    """Drafts the target's own continuation (every draft is kept), taking ``delay`` seconds a
    drafting round: its price (round_cost) says 0."""

    delay = 0.0

    def chain(self, context, k):
        if k > 0:
            time.sleep(self.delay)
        return super().chain(context, k)


def drafted_by_round(delay_then: float, rounds: int, drafter: SleepyOracle, loop: BatchLoop,
                     reports: list[RoundReport]) -> list[int]:
    """The drafts each of the next ``rounds`` rounds verified, the drafter taking ``delay_then``."""
    drafter.delay = delay_then
    start = len(reports)
    while len(reports) < start + rounds:
        loop.step()
    return [report.proposed[0] for report in reports[start:]]


EXPIRE = 40  # rounds after which a replaced price no round refreshed is priced again (128 by default)


def test_depth_goes_to_zero_when_drafting_is_slower_than_priced_and_back_when_it_pays():
    """The target costs 4 ms a call at any width and is priced so; the drafter is priced free.
    Slow (40 ms a drafting round): 5 tokens in 44 ms lose to 1 token in 4 ms, so within 3 rounds
    of the first (the window that replaces a price) the row stops drafting, and is probed once (a
    tag's first probe is exempt), then not again (a probe would cost ten plain rounds, more than a
    tenth of the rounds before it). Fast again: once
    the replaced price expires (EXPIRE rounds after it was last measured) the row drafts again and
    stays. The control: with fixed prices the slow drafter drafts every round."""
    table = random_table(8, seed=3)
    for checked in (True, False):
        drafter = SleepyOracle(table)
        policy = DepthPolicy(lambda tokens: SleepyRunner.delay, lambda k: 0.0, checked=checked)
        if checked:
            policy.prices = RoundPrices(policy.priced, expire=EXPIRE)
        reports: list[RoundReport] = []
        loop = BatchLoop(markov(table, 1024, SleepyRunner), drafter, draft_len=4, eos_ids=frozenset(),
                         on_round=reports.append, adaptive=lambda policy=policy: policy)
        loop.submit(0, Request(np.array([1, 2]), 900))
        slow = drafted_by_round(0.040, 40, drafter, loop, reports)
        if not checked:
            assert all(drafts == 4 for drafts in slow), slow  # the failing control: the price is believed
            continue
        assert slow[:3] == [4, 4, 4] and sum(d > 0 for d in slow[3:]) == 1, slow  # the first probe only
        fast = drafted_by_round(0.0, 60, drafter, loop, reports)
        back = next(i for i in range(len(fast) - 3) if all(d > 0 for d in fast[i : i + 4]))
        assert back <= EXPIRE and all(drafts > 0 for drafts in fast[back:]), fast


class CatchingUpOracle(SleepyOracle):
    """A SleepyOracle whose skipped rounds cost it a catch-up when it drafts again (a draft
    model's), and whose drafts are wrong every ``wrong_every`` rounds' worth of tokens, so
    adaptive depth now and then stops and resumes."""

    catchup = 1e-4

    def catchup_cost(self, skipped):
        return self.catchup * skipped

    def chain(self, context, k):
        draft = super().chain(context, k)
        if k > 0 and (len(context) // 8) % 3 == 0:  # a stretch where every draft is wrong
            draft = type(draft)((draft.tokens + 1) % 8, draft.probs, draft.tag)
        return draft


def test_a_round_that_catches_up_is_not_measured():
    """A drafting round right after rounds at depth 0 (or the first) also catches the drafter up
    on them: not a price of its kind, so not measured. The control: a drafter that skips for free has every
    drafting round measured."""
    table = random_table(8, seed=3)
    for catchup in (1e-4, 0.0):
        drafter = CatchingUpOracle(table)
        drafter.catchup = catchup
        policy = DepthPolicy(lambda tokens: SleepyRunner.delay, drafter.round_cost, drafter.catchup_cost)
        reports: list[RoundReport] = []
        loop = BatchLoop(markov(table, 1024, SleepyRunner), drafter, draft_len=4, eos_ids=frozenset(),
                         on_round=reports.append, adaptive=lambda policy=policy: policy)
        loop.submit(0, Request(np.array([1, 2]), 900))  # more tokens than 120 rounds can make
        drafted = drafted_by_round(0.0, 120, drafter, loop, reports)
        drafting = sum(d > 0 for d in drafted)
        # the first drafting round feeds the drafter the prompt: a resume too, where it catches up
        resumed = sum(d > 0 and before == 0 for before, d in zip([0 if catchup else 1] + drafted, drafted))
        measured = sum(policy.prices.rounds(1, k) for k in range(1, 5))
        assert resumed > 0, drafted  # it stopped and resumed: the comparison below is not vacuous
        assert measured == (drafting - resumed if catchup else drafting), (measured, drafting, resumed)


def test_the_loops_of_a_pipeline_share_what_the_clock_said(tiny_dir):
    """A request starts from the prices the clock checked on the requests before it, not from
    the build's again; with prices fixed (seeded runs repeat), every loop starts afresh."""
    from specexport.runtime import load

    for check, shared in ((True, True), (False, False)):
        pipe = load(tiny_dir, threads=1, check_prices=check)
        pipe.generate(prompt_ids=[1, 2, 3, 4], drafter="ngram", max_new_tokens=12)
        first = pipe.batch_loop(drafter="ngram", max_batch=1).policy.prices
        second = pipe.batch_loop(drafter="ngram", max_batch=1).policy.prices
        assert (first is second) is shared
        assert bool(first.get("ngram") is not None and first["ngram"]._clock > 0) is shared


def test_a_new_request_forgets_what_the_clock_said_long_ago():
    prices = RoundPrices(flat)
    for _ in range(3):
        prices.observe(1, 0, 0.040)  # plain rounds while the machine was busy
    for _ in range(prices.fresh):
        prices.observe(1, 3, 0.010)  # drafting ever since, priced right
    prices.forget_stale()
    assert prices.seconds(1, 0) == pytest.approx(0.040)  # refreshed fresh rounds ago: kept
    prices.observe(1, 3, 0.010)
    prices.forget_stale()
    assert prices.seconds(1, 0) == pytest.approx(0.010)  # older than `fresh`: priced again


def test_the_first_plain_round_after_drafting_is_not_measured(monkeypatch):
    """A plain round right after drafting ones pays for caches they left cold: not a price of the
    target alone, so depth 0 is measured only by plain rounds after plain ones. The control
    (measured regardless) counts every plain round."""
    from specexport.runtime.policy import SpeculationPolicy

    table = random_table(8, seed=3)
    for skip in (True, False):
        monkeypatch.setattr(SpeculationPolicy, "unmeasured_after_draft", skip)
        drafter = CatchingUpOracle(table)
        drafter.catchup = 0.0
        policy = DepthPolicy(lambda tokens: SleepyRunner.delay, drafter.round_cost, drafter.catchup_cost)
        reports: list[RoundReport] = []
        loop = BatchLoop(markov(table, 1024, SleepyRunner), drafter, draft_len=4, eos_ids=frozenset(),
                         on_round=reports.append, adaptive=lambda policy=policy: policy)
        loop.submit(0, Request(np.array([1, 2]), 900))
        drafted = drafted_by_round(0.0, 120, drafter, loop, reports)
        plain = sum(d == 0 for d in drafted)
        after_plain = sum(d == 0 and before == 0 for before, d in zip([0] + drafted, drafted))
        assert 0 < after_plain < plain, drafted  # both kinds ran: the comparison is not vacuous
        assert policy.prices.rounds(1, 0) == (after_plain if skip else plain)


def _checks(verify_two_ms: float, thin: float) -> list[int]:
    """Depths a policy chooses over 40 rounds: a plain round verifies in 10 ms, depth 1 in
    ``verify_two_ms`` with the prior's E(1) = 1.8, depth 0 measured (not young)."""
    policy = DepthPolicy(lambda tokens: 0.010 if tokens == 1 else verify_two_ms / 1e3, lambda k: 0.0, thin=thin)
    assert policy.prices is not None
    for _ in range(policy.prices.window):
        policy.prices.observe(1, 0, 0.010)
    return [policy.best_depth("t", 1) for _ in range(40)]


def test_a_thin_win_is_checked_against_plain_rounds_often_and_two_at_a_time():
    """Drafting expected 1.09x plain decoding (1.8 tokens in 16.5 ms against 1 in 10): within
    ``thin``, a check at every ``plain_every``-th round, two plain rounds each (the first after
    drafting is not measured). A 1.33x win (13.5 ms) is checked only every 32 rounds; so is the
    thin win with ``thin`` off, the control."""
    assert _checks(16.5, 1.15)[:10] == [1, 1, 1, 0, 0] * 2  # the check is the plain_every-th round
    assert _checks(16.5, 0.0)[:33] == [1] * 31 + [0, 0]
    assert _checks(13.5, 1.15)[:33] == [1] * 31 + [0, 0]


def test_unmeasured_drafting_depths_follow_the_target_alone_until_a_drafting_depth_is_measured():
    """Engines costed on a busy machine: every round priced 1.5x what it takes. The target
    alone's plain rounds replace its price; the drafting depths, never run at their high price,
    are scaled with it, until a drafting depth's own rounds say otherwise."""
    prices = RoundPrices(lambda batch, depth: 0.030 + 0.015 * depth)
    for _ in range(3):
        prices.observe(1, 0, 0.020)
    assert prices.seconds(1, 0) == pytest.approx(0.020)
    assert prices.seconds(1, 1) == pytest.approx(0.030)  # 0.045 as the target alone's 2/3
    assert prices.seconds(2, 1) == pytest.approx(0.045)  # another batch size: its own measurements
    for _ in range(3):
        prices.observe(1, 2, 0.060)  # the drafter's own rounds: priced right
    assert prices.seconds(1, 1) == pytest.approx(0.045)


def test_a_slower_target_alone_does_not_raise_unmeasured_drafting_prices():
    """A price too low is run and measured; one raised too high would never be."""
    prices = RoundPrices(lambda batch, depth: 0.020 + 0.010 * depth)
    for _ in range(3):
        prices.observe(1, 0, 0.040)
    assert prices.seconds(1, 0) == pytest.approx(0.040) and prices.seconds(1, 1) == pytest.approx(0.030)
