"""Speculation seen and steered per request: vLLM's ``metrics.speculative_decoding`` object in
responses (--per-request-spec-decode-metrics), equal to what /metrics counted for the request,
and the request field ``speculation: {drafter, max_depth}``. Servers on 127.0.0.1 only."""

from __future__ import annotations

import json

import httpx
import pytest

from specexport.runtime.spec_metrics import speculative_decoding
from specexport.runtime.stats import DecodeStats
from specexport.serve.app import create_app
from specexport.serve.config import ServeConfig
from tests.serve.common import metric, running, wait_idle

MODEL = "tiny"
PROMPT = "Item 5: write about rivers number 35."


def test_the_object_follows_vllms_definitions():
    """Rounds that kept 2 of 3, 0 of 3, nothing offered, and one cut by a stop after 1 of 3 kept."""
    stats = DecodeStats(draft_len=3)
    for proposed, accepted, emitted in ((3, 2, 3), (3, 0, 1), (0, 0, 1), (3, 3, 1)):
        stats.count_round(proposed, accepted, emitted)
    got = speculative_decoding([stats], detailed=True)
    steps, kept, offered = 4, 2 + 0 + 0 + 1, 3 + 3 + 0 + 1
    assert got["num_spec_steps"] == steps and got["num_spec_tokens"] == 3
    assert got["num_accepted_draft_tokens"] == kept and got["num_draft_tokens"] == offered
    assert got["mean_acceptance_length"] == pytest.approx(1 + kept / steps)
    assert got["draft_acceptance_rate"] == pytest.approx(kept / offered)
    assert got["acceptance_histogram"] == [2, 1, 1, 0]  # rounds that kept exactly 0, 1, 2, 3
    assert got["per_step_accepted"] == [2, 0, 0, 1] and got["per_step_draft_tokens"] == [3, 3, 0, 1]
    assert "per_step_accepted" not in speculative_decoding([stats])  # summary


@pytest.fixture(scope="module")
def server(batched_engines):
    """The int4 self-draft at the full depth every round (not adaptive: the caps below are the
    request's alone), stats in every response."""
    config = ServeConfig(str(batched_engines), MODEL, drafter="quantized-self", threads=2, adaptive=False,
                         spec_metrics="detailed")
    with running(create_app(config)) as url:
        yield url


def complete(url: str, **fields) -> httpx.Response:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 24, "temperature": 0, "return_token_ids": True, **fields}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=120)


def counted(url: str) -> tuple[float, float]:
    text = httpx.get(f"{url}/metrics").text
    return metric(text, "specexport_num_draft_tokens_total"), metric(text, "specexport_num_accepted_tokens_total")


def test_a_request_reports_what_metrics_counted_for_it(server):
    wait_idle(server)
    before = counted(server)
    reply = complete(server)
    after = counted(server)
    spec = reply.json()["metrics"]["speculative_decoding"]
    assert spec["num_draft_tokens"] > 0, spec  # it drafted: the comparison below is not 0 == 0
    assert spec["num_draft_tokens"] == after[0] - before[0]
    assert spec["num_accepted_draft_tokens"] == after[1] - before[1]
    assert sum(spec["acceptance_histogram"]) == spec["num_spec_steps"] == len(spec["per_step_accepted"])


def test_drafter_none_drafts_nothing_and_gives_the_same_tokens(server):
    drafted = complete(server).json()
    alone = complete(server, speculation={"drafter": "none"}).json()
    spec = alone["metrics"]["speculative_decoding"]
    assert spec["num_draft_tokens"] == 0 and spec["num_spec_steps"] == len(alone["choices"][0]["token_ids"])
    assert alone["choices"][0]["token_ids"] == drafted["choices"][0]["token_ids"]
    assert drafted["metrics"]["speculative_decoding"]["num_draft_tokens"] > 0  # the control drafted


def test_max_depth_caps_every_round(server):
    deep = complete(server).json()["metrics"]["speculative_decoding"]
    capped_reply = complete(server, speculation={"max_depth": 1}).json()
    capped = capped_reply["metrics"]["speculative_decoding"]
    assert max(deep["per_step_draft_tokens"]) > 1, deep  # the control drafts deeper
    assert max(capped["per_step_draft_tokens"]) == 1 and capped["num_spec_tokens"] == 1, capped
    assert capped_reply["choices"][0]["token_ids"] == complete(server).json()["choices"][0]["token_ids"]


def test_a_streamed_request_carries_the_object_in_its_final_chunk(server):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=60) as reply:
        chunks = [json.loads(line[6:]) for line in reply.iter_lines() if line.startswith("data: {")]
    assert "metrics" in chunks[-1] and all("metrics" not in c for c in chunks[:-1])
    assert chunks[-1]["metrics"]["speculative_decoding"]["num_spec_steps"] >= 1


@pytest.mark.parametrize("speculation, param", [
    ({"drafter": "draft-model"}, "speculation.drafter"),  # the directory has it; this server does not run it
    ({"max_depth": 99}, "speculation.max_depth"),
    ({"max_depth": -1}, "speculation.max_depth"),
    ({"depth": 2}, "speculation.depth"),
])
def test_bad_speculation_is_a_400_naming_the_field(server, speculation, param):
    reply = complete(server, speculation=speculation)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == param, reply.text


def test_responses_are_openais_without_the_flag(batched_engines):
    config = ServeConfig(str(batched_engines), MODEL, drafter="ngram", threads=2)
    with running(create_app(config)) as url:
        reply = complete(url, max_tokens=4)
    assert reply.status_code == 200 and "metrics" not in reply.json()


def test_generate_results_carry_the_same_object(batched_engines):
    """Pipeline.generate (and generate --json, its to_dict) and generate_batch results."""
    from specexport.runtime import load

    pipe = load(batched_engines, threads=2)
    alone = pipe.generate(PROMPT, drafter="quantized-self", max_new_tokens=16, adaptive=False)
    batch = pipe.generate_batch([PROMPT, PROMPT + " Then stars."], drafter="quantized-self", max_new_tokens=16)
    for result in (alone, *batch):
        spec = result.to_dict()["speculative_decoding"]
        assert spec["num_draft_tokens"] == result.stats.proposed > 0
        assert spec["num_spec_steps"] == result.stats.rounds
        assert spec["mean_acceptance_length"] == pytest.approx(1 + result.stats.accepted / result.stats.rounds)


def test_a_server_of_two_drafters_drafts_with_the_one_each_request_names(batched_engines):
    """--drafter quantized-self,ngram: a request naming ngram gets prompt lookup's drafts, one
    naming nothing the first drafter's (their per-round drafts differ), and each gets its solo
    tokens; a drafter the server does not run is a 400."""
    from specexport.runtime import load

    pipe = load(batched_engines, threads=2)
    solo = {name: pipe.generate(PROMPT, drafter=name, max_new_tokens=24, adaptive=False)
            for name in ("quantized-self", "ngram")}
    config = ServeConfig(str(batched_engines), MODEL, drafter="quantized-self,ngram", threads=2, adaptive=False,
                         spec_metrics="detailed")
    with running(create_app(config)) as url:
        by_name = {"ngram": complete(url, speculation={"drafter": "ngram"}).json(),
                   "quantized-self": complete(url).json()}
        refused = complete(url, speculation={"drafter": "draft-model"})
    for name, reply in by_name.items():
        assert reply["choices"][0]["token_ids"] == solo[name].token_ids
        assert reply["metrics"]["speculative_decoding"]["per_step_draft_tokens"] == solo[name].stats.round_drafts
    assert solo["ngram"].stats.round_drafts != solo["quantized-self"].stats.round_drafts  # the control differs
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "speculation.drafter"
