"""`bench --batch --peers`: the target-alone peers at each batch size, beside our batched loop."""

from __future__ import annotations

import json

import pytest

from specexport.bench.batched import run_batched, write_batched
from specexport.bench.peers import BatchPeerRun, _cut
from specexport.progress import Reporter
from tests.bench.short_prompts import short_prompts


class FakePeer:
    """Answers with given tokens per prompt, in a fixed time per batch call; records its batches."""

    def __init__(self, name: str, answers: dict[tuple, list[int]], seconds: float):
        self.name, self.threads, self.settings = name, 1, {}
        self.answers, self.seconds, self.batches = answers, seconds, []

    def run_batch(self, prompts, max_new_tokens):
        self.batches.append((len(prompts), max_new_tokens))
        return BatchPeerRun([list(self.answers[tuple(p)])[:max_new_tokens] for p in prompts], self.seconds)


class SingleOnly:
    name, threads, settings = "transformers-prompt-lookup", 1, {}




def test_peer_rows_per_batch_size_with_matches_and_ratio(batched_engines, tmp_path):
    from specexport.bench.harness import load_prompts
    from specexport.runtime import load

    pipe = load(batched_engines, threads=1)
    prompts = short_prompts(tmp_path / "prompts.jsonl", 3)
    records = load_prompts(prompts)
    ids = [pipe.prompt_ids(r.get("prompt"), messages=r.get("messages")) for r in records]
    ours = {tuple(i): pipe.generate(prompt_ids=i, max_new_tokens=6).token_ids for i in ids}
    same = FakePeer("transformers-greedy", ours, 0.5)
    wrong = dict(ours)
    wrong[tuple(ids[1])] = [t + 1 for t in ours[tuple(ids[1])]]
    other = FakePeer("ort-genai", wrong, 0.25)
    result = run_batched(pipe, prompts, [1, 2], [], 6, Reporter(quiet=True), [same, other, SingleOnly()],
                         [{"peer": "ort-genai-ngram", "skipped": "not installed"}])
    peer_rows = [r for r in result["rows"] if r["loop"] == "peer"]
    assert [(r["batch"], r["peer"]) for r in peer_rows] == [(1, "transformers-greedy"), (1, "ort-genai"),
                                                            (2, "transformers-greedy"), (2, "ort-genai")]
    # warm-up (2 tokens), then the prompts in static batches of B, in order: 3 at B=1, 2 at B=2
    assert same.batches == [(1, 2), (1, 6), (1, 6), (1, 6), (2, 2), (2, 6), (1, 6)]
    tokens = sum(len(t) for t in ours.values())
    for row in peer_rows:
        calls = 3 if row["batch"] == 1 else 2
        seconds = calls * (0.5 if row["peer"] == "transformers-greedy" else 0.25)
        assert row["tokens"] == tokens and row["aggregate_tokens_per_s"] == pytest.approx(tokens / seconds, rel=1e-2)
        alone = next(r for r in result["rows"] if r["loop"] == "batched" and r["batch"] == row["batch"]
                     and r["drafter"] == "none")
        assert row["speedup"] == pytest.approx(row["aggregate_tokens_per_s"] / alone["aggregate_tokens_per_s"], abs=1e-3)
        if row["peer"] == "transformers-greedy":
            assert row["matches_baseline"] is True and row["prompts_matching"] == "3/3"
        else:
            assert row["matches_baseline"] is False and row["prompts_matching"] == "2/3"
    skipped = {s["peer"]: s["skipped"] for s in result["peers_skipped"]}
    assert skipped == {"ort-genai-ngram": "not installed",
                       "transformers-prompt-lookup": "runs one sequence at a time (not a batched peer)"}
    # the batched loop's own rows and schedule are untouched by the peers
    assert all(r["drafter"] == "none" for r in result["rows"] if r["loop"] != "peer")
    files = write_batched(result, tmp_path / "out")
    text = files[1].read_text()
    assert "peer ort-genai (target alone, static batches)" in text and "NO (2/3 prompts equal ours)" in text
    assert "Peer transformers-prompt-lookup: skipped" in text
    assert json.loads(files[0].read_text())["rows"][-1]["peer"] == "ort-genai"


def test_rows_are_cut_after_their_first_eos():
    assert _cut([5, 6, 2, 2, 2], {2}, 8) == [5, 6, 2]
    assert _cut([5, 6, 7], {2}, 2) == [5, 6]
    assert _cut([], {2}, 4) == []


def test_transformers_batched_greedy_equals_its_single_runs(batched_engines, tmp_path):
    from specexport.bench.peers import make_peers
    from specexport.runtime import load

    pipe = load(batched_engines, threads=1)
    peers, skipped = make_peers(pipe.manifest.target_source, pipe.manifest.recipe_root,
                                ["transformers-greedy"], 1, tmp_path / "peers")
    assert not skipped, skipped
    peer = peers[0]
    prompts = [list(range(3, 20)), list(range(40, 45)), [7, 8, 9, 10, 11, 12, 13]]  # ragged: left padding
    batch = peer.run_batch(prompts, 8)
    single = [peer.run(p, 8).token_ids for p in prompts]
    assert batch.token_ids == single and batch.total_s > 0
    # and our engines agree with both (greedy, fp32)
    assert [pipe.generate(prompt_ids=p, max_new_tokens=8).token_ids for p in prompts] == single
