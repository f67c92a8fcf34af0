"""Structured output under speculation, engine-free: a Markov "model" over the tiny byte
tokenizer (259 tokens), constrained by llguidance grammars. Greedy output equals the
constrained target decoding alone; sampled output follows the constrained target's exact
distribution; drafts the grammar forbids are never verified."""

import json

import numpy as np
import pytest

from specexport.errors import BadInput
from specexport.runtime.acceptance import Sampling, warp_reference
from specexport.runtime.drafters import ModelDrafter, NgramDrafter, NoDrafter
from specexport.runtime.grammar import Grammars, GrammarSpec
from specexport.runtime.loop import BatchLoop, Request
from specexport.runtime.rules import Penalties, SequenceRules
from tests.lossless import assert_sampled_as_target
from tests.runtime.fakes import FixedDrafter, markov, random_table

pytest.importorskip("llguidance")

EOS = 2  # the byte tokenizer's <|im_end|>
GREEDY = Sampling()


@pytest.fixture(scope="module")
def grammars() -> Grammars:
    from specexport.exporter.tiny import byte_tokenizer

    tokenizer = byte_tokenizer()
    return Grammars(tokenizer.backend_tokenizer.to_str(), len(tokenizer), frozenset({EOS}))


@pytest.fixture(scope="module")
def table(grammars) -> np.ndarray:
    return random_table(grammars.vocab, seed=1, spread=3.0)


def byte_ids(text: str) -> list[int]:
    from specexport.exporter.tiny import byte_tokenizer

    return byte_tokenizer()(text)["input_ids"]


def text_of(tokens: list[int]) -> str:
    from specexport.exporter.tiny import byte_tokenizer

    return byte_tokenizer().decode([t for t in tokens if t != EOS])


SCHEMA = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "tag": {"enum": ["red", "green", "blue"]},
                                           "ok": {"type": "boolean"}},
          "required": ["id", "tag", "ok"], "additionalProperties": False}
SPECS = {
    "json_schema": GrammarSpec("json_schema", json.dumps(SCHEMA)),
    "regex": GrammarSpec("regex", "[0-9]{2,4}-[a-c]{1,3}"),
    "choice": GrammarSpec("choice", json.dumps(["alpha", "beta", "gamma"])),
    "grammar": GrammarSpec("grammar", 'start: "(" pair ")"\npair: item "," item\nitem: /[xyz]/'),
}


def constrained_reference(table, grammars, spec, prompt, n) -> list[int]:
    """The constrained target alone: one fresh matcher, one token at a time, no rollback."""
    state, out = grammars.start(spec), []
    for _ in range(n):
        row = np.where(state.allowed(), table[([*prompt, *out])[-1]], -np.inf)
        token = int(np.argmax(row))
        out.append(token)
        if token == EOS:
            break
        state.commit([token])
    return out


def decode_constrained(table, grammars, spec, drafter, prompt, *, max_new=40, sampling=GREEDY, seed=0):
    out: list[int] = []
    loop = BatchLoop(markov(table), drafter, draft_len=4, eos_ids=frozenset({EOS}),
                     on_token=lambda key, token: out.append(token))
    prompt = np.asarray(prompt, dtype=np.int64)
    rules = SequenceRules(Penalties(), prompt, frozenset({EOS}), grammars.start(spec))
    loop.submit(0, Request(prompt, max_new, sampling, np.random.default_rng(seed), None, rules))
    finished = []
    for ended in loop.run():
        finished += ended
    return out, finished[0][1].stats


def drafters(table):
    return {"none": NoDrafter(), "ngram": NgramDrafter(max_ngram=3),
            "near-model": ModelDrafter("near", markov(table + random_table(len(table), 4, spread=0.5)), {})}


@pytest.mark.parametrize("drafter", ["none", "ngram", "near-model"])
@pytest.mark.parametrize("kind", SPECS)
def test_greedy_constrained_equals_the_constrained_target_alone(table, grammars, kind, drafter):
    prompt = byte_ids("Answer: ")
    want = constrained_reference(table, grammars, SPECS[kind], prompt, 40)
    got, stats = decode_constrained(table, grammars, SPECS[kind], drafters(table)[drafter], prompt)
    assert got == want
    assert got[-1] == EOS, text_of(got)  # the grammar completed and ended the output
    text = text_of(got)
    if kind == "json_schema":
        value = json.loads(text)
        assert set(value) == {"id", "tag", "ok"} and value["tag"] in {"red", "green", "blue"}
    elif kind == "choice":
        assert text in {"alpha", "beta", "gamma"}
    elif kind == "regex":
        import re

        assert re.fullmatch("[0-9]{2,4}-[a-c]{1,3}", text)
    unconstrained = [int(np.argmax(table[t])) for t in [prompt[-1], *got[:-1]]]
    assert unconstrained != got  # the grammar changed the output


def test_drafts_the_grammar_forbids_are_not_verified(table, grammars):
    # "{" then junk: only the first draft can be verified each round
    spec = SPECS["json_schema"]
    prompt = byte_ids("Answer: ")
    junk = byte_ids("{!!!")
    got, stats = decode_constrained(table, grammars, spec, FixedDrafter(junk), prompt, max_new=30)
    assert got == constrained_reference(table, grammars, spec, prompt, 30)
    assert stats.proposed <= stats.rounds  # at most "{" per round, never the junk after it


def exact_constrained_probs(table, grammars, spec, prompt, sampling, length):
    """Every output's exact probability under the constrained, warped target."""
    result: dict[tuple[int, ...], float] = {}

    def walk(out, state, p):
        if len(out) == length or (out and out[-1] == EOS):
            result[tuple(out)] = p
            return
        row = np.where(state.allowed(out), table[([*prompt, *out])[-1]], -np.inf)
        probs = warp_reference(row[None], sampling)[0]
        for token in np.flatnonzero(probs):
            walk([*out, int(token)], state, p * probs[token])

    walk([], grammars.start(spec), 1.0)
    return result


def filtered_probs(table, prompt, sampling, exact, length):
    """A wrong idea of constrained sampling, the distribution test's control: sample the
    unconstrained target and keep only outputs the grammar allows."""
    probs = warp_reference(table, sampling)
    weights = {}
    for seq in exact:
        p, last = 1.0, prompt[-1]
        for token in seq:
            p, last = p * probs[last, token], token
        weights[seq] = p
    total = sum(weights.values())
    return {s: w / total for s, w in weights.items()}


@pytest.mark.parametrize("drafter", ["near-model", "ngram"])
def test_sampled_constrained_follows_the_constrained_target(table, grammars, drafter):
    spec = GrammarSpec("regex", "[ab]{1,2}[xy]")
    prompt, length, draws = byte_ids("Go: "), 4, 3000
    sampling = Sampling(1.5)  # flat enough that every output is drawn
    exact = exact_constrained_probs(table, grammars, spec, prompt, sampling, length)
    assert len(exact) == 12  # (2 + 4) · 2 strings, each ended by EOS
    counts: dict[tuple[int, ...], int] = {}
    for seed in range(draws):
        out, _ = decode_constrained(table, grammars, spec, drafters(table)[drafter], prompt, max_new=length,
                                    sampling=sampling, seed=seed)
        counts[tuple(out)] = counts.get(tuple(out), 0) + 1
    assert_sampled_as_target(counts, exact, draws, right_rule=True)
    assert_sampled_as_target(counts, filtered_probs(table, prompt, sampling, exact, length), draws, right_rule=False)


@pytest.mark.parametrize("spec, message", [
    (GrammarSpec("json_schema", "{not json", "response_format.json_schema"), "response_format.json_schema"),
    (GrammarSpec("json_schema", json.dumps({"type": "bogus"}), "response_format"), "bogus"),
    (GrammarSpec("regex", "(unclosed", "guided_regex"), "guided_regex"),
    (GrammarSpec("grammar", "start: missing_rule", "guided_grammar"), "guided_grammar"),
    (GrammarSpec("choice", json.dumps([]), "guided_choice"), "guided_choice"),
])
def test_a_bad_grammar_is_refused_naming_its_field(grammars, spec, message):
    with pytest.raises(BadInput, match=message):
        grammars.start(spec)


def test_unknown_kind_is_refused():
    with pytest.raises(BadInput, match="unknown grammar kind"):
        GrammarSpec("xml", "<a/>")
