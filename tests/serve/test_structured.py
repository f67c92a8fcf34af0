"""What users send, served exactly under speculation (the tiny batched build, n-gram drafter,
a server on 127.0.0.1): structured output, logprobs, penalties and n > 1, each equal to what
the target alone gives for the same request (runtime Pipeline, no drafter)."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest

from specexport.runtime.grammar import GrammarSpec
from specexport.runtime.rules import Controls, Penalties
from specexport.serve.app import create_app
from specexport.serve.config import ServeConfig
from tests.serve.common import running

pytest.importorskip("llguidance")

MODEL = "tiny"
MESSAGES = [{"role": "user", "content": "Name a river."}]
SCHEMA = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "tag": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
          "required": ["id", "tag", "ok"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server(batched_engines):
    config = ServeConfig(str(batched_engines), MODEL, drafter="ngram", threads=2)
    with running(create_app(config)) as url:
        yield url


@pytest.fixture(scope="module")
def alone(batched_engines):
    """The target alone (no drafter) on the same request: token ids and the generation."""
    from specexport.runtime import load

    pipe = load(batched_engines, threads=2)

    def generate(max_tokens: int, controls: Controls | None = None, **kw):
        ids = pipe.prompt_ids(messages=MESSAGES)
        return pipe.generate(prompt_ids=ids, drafter="none", max_new_tokens=max_tokens, controls=controls, **kw)

    return generate


def chat(url: str, **body) -> dict:
    reply = httpx.post(f"{url}/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES,
                                                           "return_token_ids": True, **body}, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()


def stream_chat(url: str, **body) -> list[dict]:
    chunks = []
    with httpx.stream("POST", f"{url}/v1/chat/completions",
                      json={"model": MODEL, "messages": MESSAGES, "stream": True, "return_token_ids": True, **body},
                      timeout=120) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: "):]))
    return chunks


@pytest.mark.parametrize("response_format", [
    {"type": "json_schema", "json_schema": {"name": "item", "schema": SCHEMA, "strict": True}},
    {"type": "json_object"},
])
def test_json_output_parses_and_equals_the_constrained_target_alone(server, alone, response_format):
    body = chat(server, max_tokens=80, temperature=0, response_format=response_format)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    value = json.loads(choice["message"]["content"])
    assert isinstance(value, dict)
    if response_format["type"] == "json_schema":
        assert set(value) == {"id", "tag", "ok"} and value["tag"] in {"red", "green", "blue"}
        assert isinstance(value["id"], int) and 0 <= value["id"] <= 999 and isinstance(value["ok"], bool)
        spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
    else:
        spec = GrammarSpec("json_object", "")
    want = alone(80, Controls(grammar=spec))
    assert choice["token_ids"] == want.token_ids
    free = alone(80)
    assert free.token_ids != want.token_ids  # the constraint changed the output


@pytest.mark.parametrize("field, value, check", [
    ("guided_choice", ["Nile", "Amazon", "Danube"], lambda text: text in {"Nile", "Amazon", "Danube"}),
    ("guided_regex", "[A-Z][a-z]{2,6} River", lambda text: text.endswith(" River") and text[0].isupper()),
    ("structured_outputs", {"choice": ["yes", "no"]}, lambda text: text in {"yes", "no"}),
    ("guided_grammar", 'start: "(" item "," item ")"\nitem: /[xyz]/',
     lambda text: len(text) == 5 and text[0] == "(" and text[2] == ","),
])
def test_vllm_guided_fields_constrain_the_output(server, field, value, check):
    for temperature in (0.0, 1.0):
        text = chat(server, max_tokens=40, temperature=temperature, seed=3, **{field: value})["choices"][0]
        assert text["finish_reason"] == "stop" and check(text["message"]["content"]), text


def test_logprobs_equal_the_target_alone_whole_and_streamed(server, alone):
    body = chat(server, max_tokens=12, temperature=0, logprobs=True, top_logprobs=3)
    content = body["choices"][0]["logprobs"]["content"]
    want = alone(12, Controls(logprobs=3))
    assert body["choices"][0]["token_ids"] == want.token_ids and len(content) == len(want.token_ids)
    for entry, ref in zip(content, want.logprobs):
        assert entry["logprob"] == pytest.approx(ref.logprob, abs=1e-4)
        assert len(entry["top_logprobs"]) == 3 and entry["top_logprobs"][0]["logprob"] >= entry["logprob"] - 1e-6
        assert [t["logprob"] for t in entry["top_logprobs"]] == pytest.approx([lp for _, lp in ref.top], abs=1e-4)
        assert entry["bytes"] == list(entry["token"].encode())
    streamed = [e for c in stream_chat(server, max_tokens=12, temperature=0, logprobs=True, top_logprobs=3)
                for choice in c["choices"] if choice.get("logprobs") for e in choice["logprobs"]["content"]]
    # two runs may verify a position at different depths (adaptive, by the clock): the same
    # token, its logprob equal to float32's rounding
    assert [e["logprob"] for e in streamed] == pytest.approx([e["logprob"] for e in content], abs=1e-4)


def test_completions_logprobs_in_the_legacy_shape(server):
    body = {"model": MODEL, "prompt": "Name a river.", "max_tokens": 6, "temperature": 0, "logprobs": 2}
    reply = httpx.post(f"{server}/v1/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 6
    assert "".join(lp["tokens"]).startswith(choice["text"][:1])
    assert lp["text_offset"] == list(np.cumsum([0, *map(len, lp["tokens"][:-1])]))
    assert all(len(top) <= 2 for top in lp["top_logprobs"])


def test_penalties_and_bias_equal_the_penalised_target_alone(server, alone):
    asked = dict(frequency_penalty=1.5, presence_penalty=0.5, repetition_penalty=1.3, logit_bias={"40": 5.0},
                 min_tokens=4)
    body = chat(server, max_tokens=24, temperature=0, **asked)
    want = alone(24, Controls(Penalties(1.3, 1.5, 0.5, {40: 5.0}, 4)))
    assert body["choices"][0]["token_ids"] == want.token_ids
    assert want.token_ids != alone(24).token_ids  # the penalties changed the output


def test_min_p_is_honoured(server):
    # min_p 1 keeps only the most likely token: sampled output is then the greedy output
    greedy = chat(server, max_tokens=10, temperature=0)["choices"][0]["token_ids"]
    for seed in range(3):
        assert chat(server, max_tokens=10, temperature=1.5, min_p=1.0, seed=seed)["choices"][0]["token_ids"] == greedy


def test_n_choices_share_the_prompt_and_each_is_a_full_completion(server, alone):
    want = alone(10).token_ids
    body = chat(server, max_tokens=10, temperature=0, n=3)
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert all(c["token_ids"] == want for c in body["choices"])  # greedy: every choice is the target's
    assert body["usage"]["completion_tokens"] == 3 * len(want)
    sampled = chat(server, max_tokens=10, temperature=1.0, n=4, seed=7)["choices"]
    assert len({tuple(c["token_ids"]) for c in sampled}) > 1  # seeds seed + i: different draws
    chunks = stream_chat(server, max_tokens=10, temperature=1.0, n=3, seed=7)
    by_choice: dict[int, list[int]] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            by_choice.setdefault(choice["index"], []).extend(choice.get("token_ids", []))
    assert sorted(by_choice) == [0, 1, 2] and all(len(t) == 10 for t in by_choice.values())
    finished = [c["choices"][0]["index"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert sorted(finished) == [0, 1, 2]


def test_n_choices_pay_for_one_prefill(batched_engines):
    # choices 2..n copy the first one's cache row: the target's slot runners 1.. run no prefill
    from specexport.runtime import load

    pipe = load(batched_engines, threads=2)
    ids = pipe.prompt_ids(messages=MESSAGES)
    loop = pipe.batch_loop(drafter="ngram", max_batch=4)
    calls = {slot: 0 for slot in range(4)}
    for slot, runner in enumerate(loop.target.runners):
        forward = runner.forward

        def counted(*args, _slot=slot, _forward=forward, **kw):
            calls[_slot] += 1
            return _forward(*args, **kw)

        runner.forward = counted
    alone = pipe.generate(prompt_ids=ids, max_new_tokens=8).token_ids
    requests = [pipe.batch_request(ids, max_new_tokens=8)[0] for _ in range(3)]
    outs: dict[int, list[int]] = {0: [], 1: [], 2: []}
    loop.on_token = lambda key, token: outs[key].append(token)
    for key, request in enumerate(requests):
        loop.submit(key, request)
    for _ in loop.run():
        pass
    assert all(out == alone for out in outs.values())  # the copied rows decode as the prefilled one
    assert calls[0] >= 1 and calls[1] == 0 and calls[2] == 0, calls
