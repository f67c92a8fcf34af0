"""Logits rules (penalties, biases, min_tokens, min_p) under speculation, with engine-free
Markov models: each rule against a dense definition written here, greedy output against the
ruled target decoding alone, sampled output against its exact distribution (chi-square), and a
failing control that rules every row with the committed output only (the drafts before a
position ignored)."""

import itertools

import numpy as np
import pytest

from specexport.errors import BadInput
from specexport.runtime.acceptance import Sampling, warp_reference, warp_row
from specexport.runtime.drafters import DraftBudget, DraftRow, ModelDrafter
from specexport.runtime.logprobs import Logprobs
from specexport.runtime.loop import BatchLoop, Request
from specexport.runtime.rules import Controls, Penalties, SequenceRules
from tests.lossless import assert_sampled_as_target
from tests.runtime.fakes import markov, random_table
from tests.runtime.test_decode import drafters_for

V = 6
EOS = 5
GREEDY = Sampling()


def ruled_reference(logits, prompt, output, penalties: Penalties, eos=(EOS,), allowed=None) -> np.ndarray:
    """The rules' definition, token by token in float64 (rules.py's order)."""
    x = np.array(logits, dtype=np.float64)
    if allowed is not None:
        x[~np.asarray(allowed)] = -np.inf
    if len(output) < penalties.min_tokens:
        for e in eos:
            x[e] = -np.inf
    for token, bias in penalties.logit_bias.items():
        x[token] += bias
    for token in set(int(t) for t in prompt) | set(int(t) for t in output):
        r = penalties.repetition
        x[token] = x[token] / r if x[token] > 0 else x[token] * r
    for token in set(int(t) for t in output):
        count = sum(1 for t in output if t == token)
        x[token] -= penalties.frequency * count + penalties.presence
    return x


PENALTIES = {
    "repetition": Penalties(repetition=4.0),
    "frequency": Penalties(frequency=1.5),
    "presence": Penalties(presence=-1.2),
    "bias": Penalties(logit_bias={1: 3.0, 4: -100.0}),
    "min_tokens": Penalties(min_tokens=3),
    "all": Penalties(repetition=1.3, frequency=0.7, presence=0.4, logit_bias={2: 2.0}, min_tokens=2),
}


@pytest.mark.parametrize("name", PENALTIES)
def test_each_rule_equals_its_definition(name):
    rng = np.random.default_rng(3)
    penalties = PENALTIES[name]
    for _ in range(20):
        logits = rng.normal(0, 3, size=V).astype(np.float32)
        prompt, output = rng.integers(0, V, size=4), rng.integers(0, V, size=rng.integers(0, 6))
        got = SequenceRules(penalties, prompt, frozenset({EOS})).apply(logits, output)
        want = ruled_reference(logits, prompt, output, penalties)
        assert np.array_equal(np.isinf(got), np.isinf(want))
        assert np.allclose(got[np.isfinite(got)], want[np.isfinite(want)], rtol=1e-5, atol=1e-5)


def test_a_penalty_changes_something():
    # the definition test above must not pass with rules that do nothing
    logits = np.array([2.0, -1.0, 0.5, 3.0, 0.0, 1.0], dtype=np.float32)
    for name, penalties in PENALTIES.items():
        ruled = SequenceRules(penalties, np.array([0, 3]), frozenset({EOS})).apply(logits, np.array([1, 3]))
        assert not np.array_equal(ruled, logits), name


@pytest.mark.parametrize("bad", [dict(repetition=0.0), dict(frequency=2.5), dict(presence=-3.0),
                                 dict(logit_bias={1: 101.0}), dict(min_tokens=-1)])
def test_out_of_range_penalties_are_refused(bad):
    with pytest.raises(BadInput):
        Penalties(**bad)
    with pytest.raises(BadInput, match="top_logprobs"):
        Controls(logprobs=21)


@pytest.mark.parametrize("min_p", [0.05, 0.3, 0.9])
@pytest.mark.parametrize("top_k", [0, 3])
def test_min_p_keeps_tokens_within_its_fraction_of_the_best(min_p, top_k):
    rng = np.random.default_rng(5)
    for _ in range(20):
        logits = rng.normal(0, 2, size=(1, 40)).astype(np.float32)
        sampling = Sampling(0.8, top_k=top_k, top_p=0.95, min_p=min_p)
        want = warp_reference(logits, sampling)[0]
        assert np.allclose(warp_row(logits[0], sampling).dense(40), want, atol=1e-6)
        plain = warp_reference(logits, Sampling(0.8))[0]
        assert np.all(want[plain < min_p * plain.max()] == 0)  # the definition: p >= min_p · max p
        assert want[plain.argmax()] > 0


def test_chain_greedy_reads_the_graphs_argmax_or_the_ruled_rows():
    # without rules, the verify graph's own argmax; with them, each row ruled with the output and
    # the drafts before it (a bias toward token 2 makes it every row's choice)
    from specexport.contract import LOGITS, NEXT_TOKENS
    from specexport.runtime.acceptance import chain_greedy
    from specexport.runtime.target_rows import TargetRows
    from specexport.runtime.tree import DraftTree

    logits = np.array([[0, 3, 1], [2, 0, 1], [0, 0, 5]], dtype=np.float32)  # [1+k, V]
    out = {NEXT_TOKENS: logits.argmax(axis=1), LOGITS: logits}
    biased = SequenceRules(Penalties(logit_bias={2: 10.0}), np.array([0]), frozenset())

    def walk(drafts, rules=None):
        chain = DraftTree.chain(np.array(drafts))
        return chain_greedy(chain.tokens, TargetRows(out, chain, Sampling(), rules, np.zeros(0, dtype=np.int64)))

    assert walk([1, 0]) == (2, 2) and walk([1, 2]) == (1, 0) and walk([0]) == (0, 1)
    assert walk([2, 2], biased) == (2, 2) and walk([1, 2], biased) == (0, 2)
    assert biased.rows == 3 + 1  # ruled one row at a time: all three, then up to the first mismatch


class StaleRules(SequenceRules):
    """The failing control: every row ruled with the committed output only, as if the drafts
    before a position were not part of its context."""

    def apply(self, logits, output):
        return super().apply(logits, output[: self.committed])


def decode_ruled(table, drafter, prompt, penalties, *, sampling=GREEDY, max_new=12, seed=0, draft_len=3,
                 rules_class=SequenceRules, logprobs=None):
    out: list[int] = []
    loop = BatchLoop(markov(table), drafter, draft_len=draft_len, eos_ids=frozenset({EOS}),
                     on_token=lambda key, token: out.append(token))
    prompt = np.asarray(prompt, dtype=np.int64)
    request = Request(prompt, max_new, sampling, np.random.default_rng(seed), None,
                      rules_class(penalties, prompt, frozenset({EOS})), logprobs)
    loop.submit(0, request)
    finished = []
    for ended in loop.run():
        finished += ended
    return out, finished[0][1].stats


@pytest.fixture
def table():
    return random_table(V, seed=0)


def greedy_ruled_reference(table, prompt, penalties, n):
    out: list[int] = []
    for _ in range(n):
        token = int(np.argmax(ruled_reference(table[([*prompt, *out])[-1]], prompt, out, penalties)))
        out.append(token)
        if token == EOS:
            break
    return out


@pytest.mark.parametrize("drafter", ["none", "ngram", "model", "near-model", "oracle"])
@pytest.mark.parametrize("name", ["frequency", "repetition", "all"])
def test_greedy_with_rules_equals_the_ruled_target_alone(table, drafter, name):
    prompt = [1, 2, 1, 3]
    want = greedy_ruled_reference(table, prompt, PENALTIES[name], 16)
    got, stats = decode_ruled(table, drafters_for(table)[drafter], prompt, PENALTIES[name], max_new=16)
    assert got == want
    assert got != greedy_ruled_reference(table, prompt, Penalties(), 16)  # the rule changed the output
    if drafter == "near-model" and name != "repetition":  # (a strong repetition penalty rejects its every guess)
        assert stats.accepted > 0  # drafts were verified and kept, not only the target's own tokens


def test_greedy_rules_with_drafts_fail_when_rows_ignore_the_drafts(table):
    # the failing control of the test above: the same decode with stale rows differs
    prompt, penalties = [1, 2, 1, 3], PENALTIES["all"]
    want = greedy_ruled_reference(table, prompt, penalties, 16)
    got, _ = decode_ruled(table, drafters_for(table)["near-model"], prompt, penalties, max_new=16,
                          rules_class=StaleRules)
    assert got != want


def exact_ruled_probs(table, prompt, penalties, sampling, length):
    """Every sequence's exact probability under the ruled, warped target (EOS ends one early)."""
    result: dict[tuple[int, ...], float] = {}

    def walk(out, p):
        if len(out) == length or (out and out[-1] == EOS):
            result[tuple(out)] = result.get(tuple(out), 0.0) + p
            return
        row = ruled_reference(table[([*prompt, *out])[-1]], prompt, out, penalties)
        probs = warp_reference(row[None], sampling)[0]
        for token in np.flatnonzero(probs):
            walk([*out, int(token)], p * probs[token])

    walk([], 1.0)
    return result


SAMPLED_PENALTIES = Penalties(repetition=1.5, frequency=1.5, presence=1.0, logit_bias={0: 1.0}, min_tokens=2)


@pytest.mark.parametrize("drafter, rules_class", [
    pytest.param("model", SequenceRules, id="model-right"),
    pytest.param("near-model", SequenceRules, id="near-model-right"),
    pytest.param("ngram", SequenceRules, id="ngram-right"),
    pytest.param("near-model", StaleRules, id="near-model-control-stale-rows"),
])
def test_sampled_with_rules_follows_the_ruled_target(table, drafter, rules_class):
    prompt, length, draws = [1, 2, 1], 3, 4000
    sampling = Sampling(1.0, min_p=0.02)
    exact = exact_ruled_probs(table, prompt, SAMPLED_PENALTIES, sampling, length)
    counts: dict[tuple[int, ...], int] = {}
    drafters = drafters_for(table)
    for seed in range(draws):
        out, _ = decode_ruled(table, drafters[drafter], prompt, SAMPLED_PENALTIES, sampling=sampling,
                              max_new=length, seed=seed, rules_class=rules_class)
        counts[tuple(out)] = counts.get(tuple(out), 0) + 1
    assert_sampled_as_target(counts, exact, draws, right_rule=rules_class is SequenceRules)


def test_a_sampling_drafter_draws_from_the_ruled_distribution(table):
    # its q is ruled as the target's row will be: a token the rules forbid is never drafted
    draft_table = random_table(V, seed=9)
    penalties = Penalties(logit_bias={int(draft_table[3].argmax()): -100.0}, min_tokens=4)
    prompt = np.array([1, 2, 3])
    rules = SequenceRules(penalties, prompt, frozenset({EOS}))
    drafter = ModelDrafter("model", markov(draft_table), {})
    drafter.join(0, prompt, {})
    sampling = Sampling(1.0)
    draft = drafter.propose([DraftRow(prompt, sampling, np.random.default_rng(0), rules, len(prompt))], DraftBudget([1]))[0]
    want = warp_reference(ruled_reference(draft_table[3], prompt, [], penalties)[None], sampling)[0]
    assert np.allclose(draft.probs[0].dense(V), want, atol=1e-6)
    assert want[int(draft_table[3].argmax())] == 0 and want[EOS] == 0


@pytest.mark.parametrize("drafter", ["none", "near-model", "ngram"])
def test_logprobs_are_the_raw_target_distribution_at_each_token(table, drafter):
    prompt = [1, 2, 1, 3]
    logprobs = Logprobs(top=3)
    got, _ = decode_ruled(table, drafters_for(table)[drafter], prompt, PENALTIES["all"], max_new=10,
                          sampling=Sampling(0.9), seed=4, logprobs=logprobs)
    assert [e.token for e in logprobs.entries] == got
    for entry, before in zip(logprobs.entries, [prompt[-1], *got[:-1]]):
        row = table[before].astype(np.float64)
        want = row - np.log(np.exp(row - row.max()).sum()) - row.max()  # log-softmax, before any rule
        assert entry.logprob == pytest.approx(want[entry.token], abs=1e-5)
        order = sorted(range(V), key=lambda t: (-want[t], t))[:3]
        assert [t for t, _ in entry.top] == order
        assert [lp for _, lp in entry.top] == pytest.approx([want[t] for t in order], abs=1e-5)


def test_rules_decode_every_combination_exactly(table):
    # greedy, every drafter, every rule: a wide net under the focused tests above
    for drafter, (name, penalties) in itertools.product(["ngram", "near-model"], PENALTIES.items()):
        prompt = [2, 0, 2]
        got, _ = decode_ruled(table, drafters_for(table)[drafter], prompt, penalties, max_new=10)
        assert got == greedy_ruled_reference(table, prompt, penalties, 10), (drafter, name)
