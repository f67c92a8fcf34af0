"""`specexport serve` on a batched hybrid target (issue 54): a tiny Qwen3.5-architecture model
(Gated DeltaNet layers beside full-attention ones) built with `shapes.batch: [1, 4]` answers
eight concurrent requests over its four slots, each row carrying its own recurrent state, and
every answer is the request's batch-1 output. The server listens on 127.0.0.1 only."""

from __future__ import annotations

import httpx
import pytest

from specexport.serve.app import create_app
from specexport.serve.config import ServeConfig
from tests.serve.common import concurrent_token_ids, metric, running

MODEL = "tiny-hybrid"
PROMPTS = [f"Note {i}: {'the tide came in, the tide came in' if i % 2 else 'seven owls'} and {i * 5}." for i in range(8)]
MAX_TOKENS = [10 + 2 * (i % 4) for i in range(8)]


@pytest.mark.parametrize("drafter", ["ngram", "quantized-self"])  # the int4 copy: a recurrent drafter
def test_eight_concurrent_requests_on_a_batched_hybrid_equal_their_batch_1_outputs(batched_hybrid, drafter):
    """Eight concurrent greedy completions over four slots (tests/conftest.py batched_hybrid: the tiny
    qwen3_5, standard attention, batch sizes 1 and 4): each the request's batch-1 tokens."""
    from specexport.cli.serve import check_servable
    from specexport.runtime import load

    assert check_servable(batched_hybrid, drafter, None) == drafter
    pipe = load(batched_hybrid, threads=2)
    assert pipe.manifest.models["target"].state is not None and pipe.manifest.batch_sizes("target") == [1, 4]
    wants = [pipe.generate(prompt_ids=pipe.prompt_ids(p), drafter=drafter, max_new_tokens=n, temperature=0.0).token_ids
             for p, n in zip(PROMPTS, MAX_TOKENS)]
    config = ServeConfig(str(batched_hybrid), MODEL, drafter=drafter, threads=2)
    with running(create_app(config)) as url:
        got = concurrent_token_ids(url, MODEL, PROMPTS, MAX_TOKENS)
        exposition = httpx.get(f"{url}/metrics").text
    assert got == wants
    # the rows were batched (rounds of more than one row), and drafts were verified
    assert metric(exposition, "specexport_round_batch_size_sum") > metric(exposition, "specexport_round_batch_size_count")
    assert metric(exposition, "specexport_num_draft_tokens_total") > 0
