"""The suffix drafter's store in `serve`: shared by the server's requests (the second of two
identical requests drafts from the first's response), reported on /metrics, bounded by
--suffix-store-tokens and off at 0; outputs equal the target alone's."""

from __future__ import annotations

import httpx
import pytest

from specexport.serve.app import create_app
from specexport.serve.config import ServeConfig
from tests.serve.common import metric, running

PROMPT = "Item 3: write about rivers number 21."


@pytest.fixture(scope="module")
def want(batched_engines):
    from specexport.runtime import load

    pipe = load(batched_engines, threads=2)
    return pipe.generate(prompt_ids=pipe.prompt_ids(PROMPT), drafter="none", max_new_tokens=40).token_ids


def complete(url: str) -> dict:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 40, "temperature": 0, "return_token_ids": True}
    reply = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()


def store_metric(url: str, key: str) -> float:
    return metric(httpx.get(f"{url}/metrics").text, f"specexport_suffix_store_{key}", drafter="suffix")


@pytest.mark.parametrize("budget", [None, 16, 0])
def test_the_store_is_shared_by_requests_bounded_and_can_be_turned_off(batched_engines, want, budget):
    config = ServeConfig(str(batched_engines), "tiny", drafter="suffix", threads=2, store_tokens=budget)
    with running(create_app(config)) as url:
        first, again = complete(url), complete(url)
        for reply in (first, again):
            assert reply["choices"][0]["token_ids"] == want
        if budget == 0:
            assert "specexport_suffix_store_tokens" not in httpx.get(f"{url}/metrics").text
            return
        held = store_metric(url, "tokens")
        assert held == min(2 * len(want), budget or 10**9)
        assert store_metric(url, "responses") == (2 if budget is None else 1)
        if budget is None:  # the second request drafted from the first's response
            assert store_metric(url, "hits_total") > 0 and 0 < store_metric(url, "hit_rate") <= 1
            assert store_metric(url, "bytes") > 0
