"""specexport serve on the tiny batched engines: the openai client, concurrency, every error
status, metrics. Each server listens on 127.0.0.1 only."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from specexport.serve.app import create_app
from specexport.serve.config import ServeConfig
from tests.serve.common import metric, running, wait_idle

MODEL = "tiny"
KEY = "sk-test"
PROMPTS = [f"Item {i}: write about {'rivers' if i % 2 else 'stars'} number {i * 7}." for i in range(16)]


@pytest.fixture(scope="module")
def solo(batched_engines):
    """The batch-1 single-sequence loop (Pipeline.generate) on the same directory: the reference."""
    from specexport.runtime import load

    pipe = load(batched_engines, threads=2)

    def generate(*, prompt: str | None = None, messages: list[dict] | None = None, max_tokens: int, **kw):
        ids = pipe.prompt_ids(prompt, messages=messages)
        return pipe.generate(prompt_ids=ids, drafter="ngram", max_new_tokens=max_tokens, temperature=0.0, **kw)

    return generate


def config(engines, **kw) -> ServeConfig:
    return ServeConfig(str(engines), MODEL, **{"drafter": "ngram", "threads": 2, **kw})


@pytest.fixture(scope="module")
def server(batched_engines):
    # the prices as built, not the clock's: a seeded request alone repeats generate's draws
    with running(create_app(config(batched_engines, api_key=KEY, check_prices=False))) as url:
        yield url


def test_openai_client_completions_and_chat(server, solo):
    from openai import OpenAI

    client = OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=60)
    assert [m.id for m in client.models.list().data] == [MODEL]

    want = solo(prompt=PROMPTS[0], max_tokens=20)
    done = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=20, temperature=0)
    assert done.choices[0].text == want.text
    assert done.usage.completion_tokens == len(want.token_ids)
    assert done.usage.prompt_tokens == len(want.prompt_ids)
    assert done.choices[0].finish_reason == ("length" if want.stop_reason == "max_new_tokens" else "stop")
    pieces = list(client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=20, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(p.choices[0].text for p in pieces if p.choices) == want.text
    assert pieces[-1].usage.completion_tokens == len(want.token_ids)

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPTS[1]}]
    want = solo(messages=messages, max_tokens=24)
    done = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    assert done.choices[0].message.content == want.text and done.choices[0].message.role == "assistant"
    assert done.usage.completion_tokens == len(want.token_ids)
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=24,
                                            temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")


def test_stop_strings_cut_the_text(server, solo):
    full = solo(prompt=PROMPTS[2], max_tokens=30).text
    stop = full[8:10]
    assert stop and full.find(stop) >= 0
    body = {"model": MODEL, "prompt": PROMPTS[2], "max_tokens": 30, "temperature": 0, "stop": [stop]}
    reply = httpx.post(f"{server}/v1/completions", json=body, headers=_auth(), timeout=60).json()
    assert reply["choices"][0]["text"] == full[: full.find(stop)]
    assert reply["choices"][0]["finish_reason"] == "stop"


def test_sixteen_concurrent_streams_equal_their_solo_outputs(batched_engines, solo):
    """16 streaming clients over 4 slots (batch sizes 1, 2, 4): joins and leaves every few
    rounds; every output is its batch-1 output, and the metrics add up to the responses."""
    wants = [solo(prompt=p, max_tokens=12 + 3 * (i % 5)) for i, p in enumerate(PROMPTS)]
    with running(create_app(config(batched_engines))) as url:
        def stream(i: int) -> tuple[str, int, list[int]]:
            body = {"model": MODEL, "prompt": PROMPTS[i], "max_tokens": 12 + 3 * (i % 5), "temperature": 0,
                    "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
            text, usage, ids = [], 0, []
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as reply:
                assert reply.status_code == 200
                for line in reply.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if chunk["choices"]:
                        text.append(chunk["choices"][0]["text"])
                        ids += chunk["choices"][0]["token_ids"]
                    if chunk.get("usage"):
                        usage = chunk["usage"]["completion_tokens"]
            return "".join(text), usage, ids

        with ThreadPoolExecutor(16) as pool:
            got = list(pool.map(stream, range(16)))
        for (text, tokens, ids), want in zip(got, wants):
            assert ids == want.token_ids and text == want.text and tokens == len(ids)
        exposition = httpx.get(f"{url}/metrics").text
    served = sum(tokens for _, tokens, _ in got)
    assert metric(exposition, "specexport_generation_tokens_total") == served
    assert metric(exposition, "specexport_prompt_tokens_total") == sum(len(w.prompt_ids) for w in wants)
    finished = sum(metric(exposition, "specexport_request_success_total", finished_reason=r) for r in ("stop", "length"))
    assert finished == 16
    drafted = metric(exposition, "specexport_num_draft_tokens_total")
    accepted = metric(exposition, "specexport_num_accepted_tokens_total")
    per_pos = [metric(exposition, "specexport_num_accepted_tokens_per_pos_total", position=str(k)) for k in range(8)]
    assert 0 <= accepted <= drafted and sum(per_pos) == accepted
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:]))  # position k+1 is kept only after k
    assert metric(exposition, "specexport_round_batch_size_sum") > metric(exposition, "specexport_round_batch_size_count")
    assert metric(exposition, "specexport_num_requests_running") == 0
    assert metric(exposition, "specexport_time_to_first_token_seconds_count") == 16


def _auth() -> dict:
    return {"authorization": f"Bearer {KEY}"}


@pytest.mark.parametrize("case, status, param", [
    ({"temperature": 5}, 400, "temperature"),
    ({"n": 0}, 400, "n"),
    ({"n": 17}, 400, "n"),
    ({"max_tokens": 0}, 400, "max_tokens"),
    ({"max_tokens": 150}, 400, "max_tokens"),  # prompt + max_tokens past the 160-token context
    ({"prompt": "x" * 400}, 413, "prompt"),
    ({"prompt": [10**9]}, 400, "prompt"),
    ({"model": "gpt-4"}, 404, "model"),
    ({"logprobs": 21}, 400, "logprobs"),
    ({"frequency_penalty": 3}, 400, "frequency_penalty"),
    ({"stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
])
def test_bad_requests_get_openai_errors(server, case, status, param):
    body = {"model": MODEL, "prompt": PROMPTS[3], "max_tokens": 4, **case}
    reply = httpx.post(f"{server}/v1/completions", json=body, headers=_auth(), timeout=30)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and error["message"] and "Traceback" not in reply.text


def test_bad_bodies_keys_and_routes(server):
    post = f"{server}/v1/chat/completions"
    assert httpx.post(post, content=b"{not json", headers=_auth()).status_code == 400
    assert httpx.post(post, json={"model": MODEL, "messages": []}, headers=_auth()).json()["error"]["param"] == "messages"
    assert httpx.post(post, json={"model": MODEL}, headers=_auth()).status_code == 400
    assert httpx.post(post, content=b"x" * (5 * 1024 * 1024), headers=_auth()).status_code == 413
    for headers in ({}, {"authorization": "Bearer wrong"}):
        reply = httpx.post(post, json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}, headers=headers)
        assert reply.status_code == 401 and reply.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server}/v1/models").status_code == 401
    missing = httpx.get(f"{server}/v2/nothing", headers=_auth())
    assert missing.status_code == 404 and "error" in missing.json()


def test_bad_requests_do_not_disturb_a_running_stream(server, solo):
    want = solo(prompt=PROMPTS[4], max_tokens=40)
    body = {"model": MODEL, "prompt": PROMPTS[4], "max_tokens": 40, "temperature": 0, "stream": True}
    text = []
    with httpx.stream("POST", f"{server}/v1/completions", json=body, headers=_auth(), timeout=60) as reply:
        for n, line in enumerate(reply.iter_lines()):
            if n == 1:  # mid-stream: a volley of bad requests
                for bad in ({"temperature": -1}, {"prompt": [10**9]}, {"prompt": "x" * 400}, {"n": 0},
                            {"guided_regex": "("}):
                    assert httpx.post(f"{server}/v1/completions", json={"model": MODEL, "prompt": "a", **bad},
                                      headers=_auth()).status_code in (400, 413)
            if line.startswith("data: {"):
                text.append(json.loads(line[6:])["choices"][0]["text"])
    assert "".join(text) == want.text


def test_queue_full_is_429_and_loading_is_503(batched_engines):
    gate = threading.Event()

    def slow_loader(cfg: ServeConfig):
        from specexport.runtime import load

        gate.wait(60)
        return load(cfg.engine_dir, threads=cfg.threads)

    # one slot and no queue: a second request while the first runs is refused
    app = create_app(config(batched_engines, max_batch=1, max_waiting=0), loader=slow_loader)
    with running(app, ready=False) as url:
        health = httpx.get(f"{url}/health")
        assert health.status_code == 503 and health.json()["error"]["code"] == "loading"
        reply = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "hello", "max_tokens": 2})
        assert reply.status_code == 503
        gate.set()
        for _ in range(600):
            if httpx.get(f"{url}/health").status_code == 200:
                break
            threading.Event().wait(0.05)
        # eight at once: while one runs, the others find no room
        body = {"model": MODEL, "prompt": PROMPTS[5], "max_tokens": 110, "temperature": 0}
        with ThreadPoolExecutor(8) as pool:
            replies = list(pool.map(lambda _: httpx.post(f"{url}/v1/completions", json=body, timeout=60), range(8)))
        statuses = sorted(r.status_code for r in replies)
        assert set(statuses) == {200, 429} and statuses.count(200) >= 1, statuses
        assert all(r.json()["error"]["code"] == "queue_full" for r in replies if r.status_code == 429)
        exposition = httpx.get(f"{url}/metrics").text
        assert metric(exposition, "specexport_request_rejected_total", status="429") == statuses.count(429)
        # the slot is free again
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200


def test_what_cannot_be_served_fails_before_serving(batched_engines, tmp_path):
    from tests.conftest import run_cli

    code, _, err = run_cli("serve", str(tmp_path), "--port", "0")
    assert code == 2 and "manifest" in err and "Traceback" not in err
    code, _, err = run_cli("serve", str(batched_engines), "--drafter", "eagle3", "--port", "0")
    assert code == 2 and "unknown drafter" in err


def test_continuous_usage_counts_every_chunk(server, solo):
    want = solo(prompt=PROMPTS[6], max_tokens=20)
    body = {"model": MODEL, "prompt": PROMPTS[6], "max_tokens": 20, "temperature": 0, "stream": True,
            "return_token_ids": True, "stream_options": {"continuous_usage_stats": True}}
    with httpx.stream("POST", f"{server}/v1/completions", json=body, headers=_auth(), timeout=60) as reply:
        chunks = [json.loads(line[6:]) for line in reply.iter_lines() if line.startswith("data: {")]
    ids, counts = [], []
    for chunk in chunks:
        ids += chunk["choices"][0]["token_ids"]
        counts.append(chunk["usage"]["completion_tokens"])
    assert ids == want.token_ids and counts[-1] == len(ids)
    assert counts == sorted(counts) and all(c == len(sum((ch["choices"][0]["token_ids"] for ch in chunks[: i + 1]), []))
                                            for i, c in enumerate(counts))


def test_a_server_with_the_int4_drafter_gives_the_solo_tokens(batched_engines):
    """A drafter with its own cache (the int4 copy, batched): four at once, each its batch-1 output."""
    from specexport.runtime import load

    pipe = load(batched_engines, threads=2)
    wants = [pipe.generate(prompt_ids=pipe.prompt_ids(p), drafter="quantized-self", max_new_tokens=16,
                           temperature=0.0) for p in PROMPTS[:4]]
    with running(create_app(config(batched_engines, drafter="quantized-self"))) as url:
        def complete(i: int) -> dict:
            body = {"model": MODEL, "prompt": PROMPTS[i], "max_tokens": 16, "temperature": 0, "return_token_ids": True}
            return httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()

        with ThreadPoolExecutor(4) as pool:
            replies = list(pool.map(complete, range(4)))
        exposition = httpx.get(f"{url}/metrics").text
    assert [r["choices"][0]["token_ids"] for r in replies] == [w.token_ids for w in wants]
    assert metric(exposition, "specexport_num_draft_tokens_total") > 0  # the int4 copy drafted


def test_sampling_fields_reach_the_sampler(server, batched_engines):
    """temperature, top_p, top_k and seed: a seeded sampled request alone in the batch is the
    seeded batch-1 run (each request samples with its own generator; with other rows in the
    batch the schedule's depth, and so the number of draws, follows the batch size)."""
    from specexport.runtime import load

    pipe = load(batched_engines, threads=2, check_prices=False)
    settings = {"temperature": 0.8, "top_p": 0.9, "top_k": 20, "seed": 1234}
    want = pipe.generate(prompt_ids=pipe.prompt_ids(PROMPTS[7]), drafter="ngram", max_new_tokens=24, **settings)
    body = {"model": MODEL, "prompt": PROMPTS[7], "max_tokens": 24, "return_token_ids": True, **settings}
    wait_idle(server)
    replies = [httpx.post(f"{server}/v1/completions", json=body, headers=_auth(), timeout=60).json() for _ in range(2)]
    assert [r["choices"][0]["token_ids"] for r in replies] == [want.token_ids] * 2
    other = httpx.post(f"{server}/v1/completions", json={**body, "seed": 99}, headers=_auth(), timeout=60).json()
    greedy = pipe.generate(prompt_ids=pipe.prompt_ids(PROMPTS[7]), drafter="ngram", max_new_tokens=24)
    assert want.token_ids != greedy.token_ids or other["choices"][0]["token_ids"] != want.token_ids  # it sampled
