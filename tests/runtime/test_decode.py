"""The decode loop with engine-free Markov models: losslessness, stops, stats."""

import itertools

import numpy as np
import pytest

from specexport.runtime.acceptance import Sampling, as_kept, warp_reference
from specexport.runtime.drafters import ModelDrafter, NgramDrafter, NoDrafter
from tests.lossless import chi_square_limit, use_rule
from tests.runtime.fakes import FixedDrafter, MarkovRunner, OracleDrafter, decode, markov, random_table

V = 6


GREEDY = Sampling()


def run(target, drafter, prompt, *, draft_len=4, max_new=20, sampling=GREEDY, eos=(), seed=0, stop=None, policy=None):
    return decode(target, drafter, prompt, draft_len=draft_len, max_new_tokens=max_new, sampling=sampling,
                  eos_ids=frozenset(eos), rng=np.random.default_rng(seed), stop=stop, policy=policy)


def greedy_reference(table, prompt, n):
    out, last = [], prompt[-1]
    for _ in range(n):
        last = int(table[last].argmax())
        out.append(last)
    return out


@pytest.fixture
def table():
    return random_table(V, seed=0)


def drafters_for(table):
    return {
        "none": NoDrafter(),
        "ngram": NgramDrafter(max_ngram=2),
        "model": ModelDrafter("model", markov(random_table(V, seed=9)), {}),
        "near-model": ModelDrafter("near", markov(table + random_table(V, 4, spread=0.3)), {}),
        "oracle": OracleDrafter(table),
    }


@pytest.mark.parametrize("name", ["none", "ngram", "model", "near-model", "oracle"])
def test_greedy_equals_target_alone(table, name):
    drafter = drafters_for(table)[name]
    prompt = [1, 2, 3, 1, 2]
    out, stats = run(markov(table), drafter, prompt, max_new=30)
    assert out == greedy_reference(table, prompt, 30)
    assert stats.stop_reason == "max_new_tokens" and stats.tokens == 30


def test_all_drafts_accepted_every_round(table):
    target = markov(table)
    out, stats = run(target, OracleDrafter(table), [0], draft_len=4, max_new=20)
    assert out == greedy_reference(table, [0], 20)
    assert stats.rounds == 4 and stats.acceptance_length == 5.0
    assert stats.accepted_at == [4, 4, 4, 4] and stats.proposed_at == [4, 4, 4, 4]
    # target cache: all committed tokens but the last, after the final round
    assert target.runners[0].length == 20


def test_model_drafter_cache_stays_in_step_after_full_acceptance(table):
    draft = markov(table)  # the same model: it always agrees
    draft_runner = draft.runners[0]
    drafter = ModelDrafter("same", draft, {})
    prompt = [3, 1]
    out, stats = run(markov(table), drafter, prompt, draft_len=3, max_new=13)
    assert out == greedy_reference(table, prompt, 13)
    assert stats.acceptance_length == 13 / 4  # 3 full rounds of 4, then one of 1
    # the drafter fed exactly the committed sequence, in order, never a token twice
    committed = prompt + out
    assert draft_runner.fed == committed[: len(draft_runner.fed)]


def test_drafter_that_proposes_nothing(table):
    out, stats = run(markov(table), NoDrafter(), [2], max_new=7)
    assert out == greedy_reference(table, [2], 7)
    assert stats.rounds == 7 and stats.proposed == 0 and stats.acceptance_length == 1.0


def test_eos_inside_accepted_drafts_stops_exactly_there(table):
    ref = greedy_reference(table, [0], 12)
    eos = ref[2]
    out, stats = run(markov(table), OracleDrafter(table), [0], draft_len=6, max_new=12, eos=[eos])
    assert out == ref[: ref.index(eos) + 1] and out[-1] == eos
    assert stats.stop_reason == "eos"
    # the stats describe what was emitted: the drafts after EOS were accepted but never output
    emitted = len(out)
    assert stats.rounds == 1 and stats.tokens == emitted
    assert stats.accepted == stats.proposed == emitted
    assert stats.accepted_at == [1] * emitted + [0] * (6 - emitted) == stats.proposed_at
    assert stats.acceptance_length == emitted


def test_stop_string_inside_accepted_drafts_counts_only_emitted_drafts(table):
    seen = []

    def stop(token):
        seen.append(token)
        return len(seen) == 2  # the stop string completes at the second token of round one

    out, stats = run(markov(table), OracleDrafter(table), [0], draft_len=5, max_new=20, stop=stop)
    assert len(out) == 2 and stats.stop_reason == "stop_string"
    assert (stats.tokens, stats.accepted, stats.proposed) == (2, 2, 2)
    assert sum(stats.accepted_at) == stats.accepted and sum(stats.proposed_at) == stats.proposed


@pytest.mark.parametrize("name", ["ngram", "near-model", "oracle"])
def test_stats_agree_with_the_output(table, name):
    # every round emits its accepted drafts and the target's token, unless a stop cut it
    for seed in range(20):
        eos = [seed % V]
        out, stats = run(markov(table), drafters_for(table)[name], [1, 2, 1, 2], draft_len=4, max_new=30,
                         sampling=Sampling(1.0), eos=eos, seed=seed)
        assert stats.tokens == len(out)
        assert sum(stats.accepted_at) == stats.accepted <= stats.proposed == sum(stats.proposed_at)
        cut = stats.stop_reason == "eos" and stats.tokens == stats.accepted + stats.rounds - 1
        assert stats.tokens == stats.accepted + stats.rounds or cut


class _ClockedRunner(MarkovRunner):
    """A Markov runner whose every forward counts 1 s of engine time (a fake clock)."""

    def forward(self, tokens, want_logits=False, inputs=None, want=(), verify=False):
        self.seconds += 1.0
        return super().forward(tokens, want_logits)


def test_stats_split_drafter_engine_time_from_host_time(table):
    draft = markov(table + random_table(V, 4, spread=0.3), runner_class=_ClockedRunner)
    draft_runner = draft.runners[0]
    target = markov(table, runner_class=_ClockedRunner)
    out, stats = run(target, ModelDrafter("m", draft, {}), [0, 1, 2], draft_len=3, max_new=12)
    prefill_calls = 1  # the drafter's reset feeds the prompt once; that is prefill, not drafting
    assert stats.draft_engine_s == draft_runner.calls - prefill_calls
    assert stats.verify_s == stats.rounds  # one target forward per round
    d = stats.to_dict()
    assert d["draft_engine_s"] == stats.draft_engine_s and d["draft_host_s"] == stats.draft_host_s
    assert d["host_s"] == pytest.approx(max(stats.total_s - stats.draft_engine_s - stats.verify_s, 0.0))


def test_rejected_drafts_are_never_emitted(table):
    ref = greedy_reference(table, [0], 10)
    wrong = [(t + 1) % V for t in ref[:4]]
    out, stats = run(markov(table), FixedDrafter(wrong), [0], draft_len=4, max_new=10)
    assert out == ref and stats.accepted <= stats.proposed


def test_kv_full(table):
    target = markov(table, max_seq_len=12)
    prompt = [1, 2, 3, 4, 5]
    out, stats = run(target, OracleDrafter(table), prompt, draft_len=4, max_new=100)
    # the cache holds 12 positions: 5 prompt + 7 generated, and the token after the last
    assert len(prompt) + len(out) == 13 and stats.stop_reason == "kv_full"
    assert out == greedy_reference(table, prompt, 8)


def test_max_new_tokens_is_exact_with_long_drafts(table):
    out, stats = run(markov(table), OracleDrafter(table), [0], draft_len=4, max_new=3)
    assert len(out) == 3 and stats.stop_reason == "max_new_tokens"


def test_stop_callback_ends_after_that_token(table):
    ref = greedy_reference(table, [0], 10)
    seen = []

    def stop(token):
        seen.append(token)
        return len(seen) == 4

    out, stats = run(markov(table), OracleDrafter(table), [0], max_new=10, stop=stop)
    assert out == ref[:4] and stats.stop_reason == "stop_string"


def _sequence_probs(table, prompt_last, sampling, length):
    """Exact probability of every output sequence of the given length."""
    probs = warp_reference(table, sampling)  # [V, V] next | current: the definition, not the fast path
    result = {}
    for seq in itertools.product(range(V), repeat=length):
        p, last = 1.0, prompt_last
        for token in seq:
            p *= probs[last, token]
            last = token
        result[seq] = p
    return result


SAMPLINGS = [Sampling(1.0), Sampling(0.7, top_k=3), Sampling(1.3, top_p=0.8), Sampling(1.0, top_k=4, top_p=0.9)]


@pytest.mark.parametrize("name", ["none", "ngram", "model", "near-model"])
@pytest.mark.parametrize("sampling", SAMPLINGS, ids=lambda s: f"t{s.temperature}-k{s.top_k}-p{s.top_p}")
def test_sampled_output_follows_the_target_distribution(table, name, sampling):
    prompt, length, draws = [1, 2, 1], 3, 6000
    exact = _sequence_probs(table, prompt[-1], sampling, length)
    counts = dict.fromkeys(exact, 0)
    target = markov(table)
    drafter = drafters_for(table)[name]
    rng_seed = np.random.SeedSequence(42)
    for child in rng_seed.spawn(draws):
        out, _ = run(target, drafter, prompt, draft_len=3, max_new=length, sampling=sampling,
                     seed=int(child.generate_state(1)[0]))
        counts[tuple(out)] += 1
    # sequences the target can never produce (cut by top-k / top-p) never appear
    assert all(counts[s] == 0 for s, p in exact.items() if p == 0)
    # chi-square over the possible sequences, against the exact tail at ALPHA (tests/lossless.py)
    cells = [(counts[s], p * draws) for s, p in exact.items() if p > 0]
    chi2 = sum((c - e) ** 2 / e for c, e in cells)
    df = len(cells) - 1
    assert chi2 < chi_square_limit(df), (chi2, df)


def test_a_biased_acceptance_rule_would_be_caught(table, monkeypatch):
    # The statistical test must be able to fail: accept every draft and it does.
    use_rule(monkeypatch, lambda draft, p, rng: (draft.size, as_kept(p[draft.size]).draw(rng)))
    sampling, prompt, length, draws = Sampling(1.0), [1, 2, 1], 3, 3000
    exact = _sequence_probs(table, prompt[-1], sampling, length)
    counts = dict.fromkeys(exact, 0)
    drafter = drafters_for(table)["model"]
    for seed in range(draws):
        out, _ = run(markov(table), drafter, prompt, draft_len=3, max_new=length, sampling=sampling, seed=seed)
        counts[tuple(out)] += 1
    cells = [(counts[s], p * draws) for s, p in exact.items() if p > 0]
    chi2 = sum((c - e) ** 2 / e for c, e in cells)
    df = len(cells) - 1
    assert chi2 > 2 * chi_square_limit(df), (chi2, df)


@pytest.mark.parametrize("name", ["none", "ngram", "model"])
def test_seeded_runs_are_reproducible(table, name):
    sampling = Sampling(1.0, top_k=4)
    a, _ = run(markov(table), drafters_for(table)[name], [1, 2], max_new=25, sampling=sampling, seed=5)
    b, _ = run(markov(table), drafters_for(table)[name], [1, 2], max_new=25, sampling=sampling, seed=5)
    c, _ = run(markov(table), drafters_for(table)[name], [1, 2], max_new=25, sampling=sampling, seed=6)
    assert a == b and a != c


def test_stats_split_and_acceptance_by_position(table):
    out, stats = run(markov(table), drafters_for(table)["near-model"], [0, 1], draft_len=4, max_new=40)
    d = stats.to_dict()
    assert d["tokens"] == 40 and d["rounds"] == stats.rounds
    assert d["acceptance_length"] == pytest.approx(40 / stats.rounds)
    rates = [r for r in d["acceptance_by_position"] if r is not None]
    assert all(0 <= r <= 1 for r in rates)
    # a later draft is accepted only if every earlier one was
    assert all(a >= b for a, b in zip(stats.accepted_at, stats.accepted_at[1:]))
    assert d["total_s"] >= d["draft_s"] + d["verify_s"] - 1e-9 and d["host_s"] >= 0
