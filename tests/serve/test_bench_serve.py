"""specexport bench-serve: its statistics, its load loop's bounds, its results file; and a run
against real `specexport serve` processes on the tiny batched engines (127.0.0.1 only)."""

from __future__ import annotations

import asyncio
import json
import math

import numpy as np
import pytest

from specexport.errors import BadInput
from specexport.serve import bench_serve as bench
from specexport.serve.bench_serve import LoadOptions, RequestRecord

# ---------------------------------------------------------------- statistics


def test_percentiles_are_numpys_linear_ones_in_ms():
    stat = bench.percentiles(np.arange(1, 101) / 1e3, 1e3)  # 1..100 ms given in seconds
    assert stat == pytest.approx({"p50": 50.5, "p90": 90.1, "p99": 99.01, "mean": 50.5})
    assert bench.percentiles([]) is None
    assert bench.percentiles([7.0]) == {"p50": 7.0, "p90": 7.0, "p99": 7.0, "mean": 7.0}


def test_inter_token_latency_shares_a_chunks_gap_among_its_tokens():
    # chunks at 0.1 s (1 token), 0.3 s (2 tokens), 0.35 s (1), 0.65 s (3)
    itl = bench.inter_token_latencies([0.1, 0.3, 0.35, 0.65], [1, 2, 1, 3])
    np.testing.assert_allclose(itl, [0.1, 0.1, 0.05, 0.1, 0.1, 0.1])
    # a chunk without tokens passes its wait on to the next one
    np.testing.assert_allclose(bench.inter_token_latencies([0.0, 0.1, 0.4], [1, 0, 3]), [0.4 / 3] * 3)
    assert bench.inter_token_latencies([0.2], [5]).size == 0  # the first chunk's tokens are TTFT's
    assert bench.inter_token_latencies([], []).size == 0


def test_even_counts_spread_a_total_over_chunks():
    assert bench.even_counts(10, 4).tolist() == [2, 2, 3, 3]
    assert bench.even_counts(3, 5).tolist() == [0, 0, 1, 1, 1]
    assert bench.even_counts(8, 0).tolist() == []
    for total, chunks in [(17, 5), (128, 40), (1, 1)]:
        assert bench.even_counts(total, chunks).sum() == total


def test_poisson_gaps_have_the_rates_mean_and_are_seeded():
    n = 200_000
    for rate in (0.5, 2.0, 40.0):
        gaps = bench.poisson_gaps(rate, n, seed=3)
        # exponential: mean 1/rate, standard deviation 1/rate (the mean's error ~ 1/rate/sqrt(n))
        assert gaps.mean() == pytest.approx(1 / rate, rel=0.01)
        assert gaps.std() == pytest.approx(1 / rate, rel=0.02)
    np.testing.assert_array_equal(bench.poisson_gaps(2.0, 50, 1), bench.poisson_gaps(2.0, 50, 1))
    assert not np.array_equal(bench.poisson_gaps(2.0, 50, 1), bench.poisson_gaps(2.0, 50, 2))
    # one seed: the same pattern at every rate, scaled
    np.testing.assert_allclose(bench.poisson_gaps(1.0, 50, 1), 4 * bench.poisson_gaps(4.0, 50, 1))
    assert not bench.poisson_gaps(math.inf, 5, 1).any()
    arrivals = bench.arrival_times(2.0, 100, 0)
    assert arrivals[0] == 0 and (np.diff(arrivals) > 0).all()
    np.testing.assert_allclose(np.diff(arrivals), bench.poisson_gaps(2.0, 100, 0)[:-1])


def test_parse_rates():
    assert bench.parse_rates("0.5, 1,2,inf,1") == (0.5, 1.0, 2.0, math.inf)
    for bad in ("0", "-1", "fast", "", "nan"):
        with pytest.raises(BadInput):
            bench.parse_rates(bad)


def _record(i, *, sent, chunks, ended, usage=None, counts=None, status="ok", error=""):
    return RequestRecord(index=i, scheduled=sent, status=status, error=error, sent=sent, ended=ended,
                         chunk_times=list(chunks), chunk_counts=list(counts or [None] * len(chunks)),
                         usage_completion=usage, usage_prompt=None if usage is None else 10)


def test_summary_throughput_and_latencies():
    records = [
        # 9 tokens in 3 chunks (usage only: spread 3, 3, 3), sent at 0, done at 1.0 s
        _record(0, sent=0.0, chunks=[0.2, 0.5, 0.8], ended=1.0, usage=9),
        # the server's own per-chunk counts: 1 then 4 tokens, sent at 1.0, done at 2.0 s
        _record(1, sent=1.0, chunks=[0.4, 0.8], ended=2.0, usage=5, counts=[1, 4]),
        _record(2, sent=1.5, chunks=[], ended=1.6, status="failed", error="HTTP 429: queue full"),
        RequestRecord(index=3, scheduled=9.0),  # never sent (the time limit)
    ]
    row = bench.summarize_rate(records, 2.0)
    assert (row["sent"], row["completed"], row["failed"], row["cancelled"], row["not_sent"]) == (3, 2, 1, 0, 1)
    assert row["duration_s"] == 2.0
    assert row["requests_per_s"] == pytest.approx(1.0)
    assert row["output_tokens"] == 14 and row["output_tokens_per_s"] == pytest.approx(7.0)
    assert row["ttft_ms"]["p50"] == pytest.approx(300.0)  # 200 and 400 ms
    # ITL samples: 0.3/3 x3, 0.3/3 x3 (even), 0.4/4 x4 (per-chunk): all 100 ms
    assert row["itl_ms"]["p50"] == pytest.approx(100.0) and row["itl_ms"]["p99"] == pytest.approx(100.0)
    assert row["itl_basis"] == {"even": 1, "per-chunk": 1}
    assert row["chunk_gap_ms"]["p50"] == pytest.approx(300.0) and row["chunk_gap_ms"]["p99"] == pytest.approx(398.0)
    # TPOT: (1.0 - 0.2) / 8 and (1.0 - 0.4) / 4
    assert row["tpot_ms"]["p50"] == pytest.approx(125.0) and row["tpot_ms"]["p99"] == pytest.approx(149.5)
    assert row["e2e_ms"]["p50"] == pytest.approx(1000.0)
    assert row["tokens_per_chunk"] == pytest.approx(14 / 5)
    assert row["errors"] == {"HTTP 429: queue full": 1}
    assert bench.throughput(3, 30, 0.0) == (None, None)


def test_without_usage_tokens_are_chunks():
    counts, basis = _record(0, sent=0.0, chunks=[0.1, 0.2, 0.3], ended=0.4).token_counts()
    assert basis == "chunks" and counts.tolist() == [1, 1, 1]
    # per-chunk counts that disagree with the usage total are not trusted
    counts, basis = _record(0, sent=0.0, chunks=[0.1, 0.2], ended=0.4, usage=6, counts=[1, 2]).token_counts()
    assert basis == "even" and counts.tolist() == [3, 3]


def _feed(lines, chat):
    record = RequestRecord(index=0, scheduled=0.0)
    reader = bench.StreamReader(record, chat=chat)
    for i, line in enumerate(lines):
        if not reader.feed(line, 0.1 * i):
            break
    return reader, record


def _data(obj) -> str:
    return "data: " + json.dumps(obj)


def test_stream_reader_takes_per_chunk_counts_from_running_usage():
    # vLLM's continuous_usage_stats: usage so far on every chunk, the role chunk included
    def chunk(content, done, reason=None):
        delta = {"role": "assistant", "content": ""} if content is None else {"content": content}
        return _data({"choices": [{"index": 0, "delta": delta, "finish_reason": reason}],
                      "usage": {"prompt_tokens": 7, "completion_tokens": done, "total_tokens": 7 + done}})

    reader, record = _feed([chunk(None, 0), "", chunk("Hel", 1), ": keep-alive", chunk("lo wor", 4),
                            chunk("ld", 5, "length"), _data({"choices": [], "usage": {"prompt_tokens": 7,
                                                                                    "completion_tokens": 5}}),
                            "data: [DONE]", _data({"choices": [{"delta": {"content": "late"}}]})], chat=True)
    assert reader.done and record.chunk_times == pytest.approx([0.2, 0.4, 0.5])
    counts, basis = record.token_counts()
    assert basis == "per-chunk" and counts.tolist() == [1, 3, 1]
    assert (record.usage_completion, record.usage_prompt, record.finish_reason) == (5, 7, "length")


def test_stream_reader_final_usage_and_failures():
    text = [_data({"choices": [{"index": 0, "text": t, "finish_reason": None}]}) for t in ("a", "", "bc", "d")]
    reader, record = _feed([*text, _data({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 7}}),
                            "data: [DONE]"], chat=False)
    counts, basis = record.token_counts()
    assert reader.done and len(record.chunk_times) == 3  # the empty text is no content chunk
    assert basis == "even" and counts.tolist() == [2, 2, 3] and record.output_tokens == 7
    reader, record = _feed([text[0], _data({"error": {"message": "engine thread stopped"}}), text[2]], chat=False)
    assert not reader.done and record.status == "failed" and "engine thread stopped" in record.error
    assert len(record.chunk_times) == 1
    reader, record = _feed([text[0], "data: {not json"], chat=False)
    assert record.status == "failed" and "not JSON" in record.error
    reader, record = _feed(text, chat=False)  # cut off: no [DONE]
    assert not reader.done and record.status == "pending"


# ---------------------------------------------------------------- the server's counters

EXPOSITION = """\
# HELP specexport_num_draft_tokens_total Draft tokens verified.
# TYPE specexport_num_draft_tokens_total counter
specexport_num_draft_tokens_total{model_name="tiny"} 120.0
specexport_num_draft_tokens_created{model_name="tiny"} 1.7e+09
specexport_num_accepted_tokens_total{model_name="tiny"} 45.0
specexport_num_accepted_tokens_per_pos_total{model_name="tiny",position="0"} 30.0
specexport_request_success_total{finished_reason="length",model_name="tiny"} 3.0
specexport_request_success_total{finished_reason="stop",model_name="tiny"} 2.0
specexport_time_to_first_token_seconds_bucket{le="0.1",model_name="tiny"} 4.0
specexport_time_to_first_token_seconds_sum{model_name="tiny"} 0.5
specexport_time_to_first_token_seconds_count{model_name="tiny"} 5.0
specexport_num_requests_running{model_name="tiny"} 2.0
python_gc_objects_collected_total{generation="0"} 123.0
"""


def test_metrics_parse_sum_labels_and_give_acceptance():
    before = bench.parse_metrics(EXPOSITION)
    assert before == {"specexport_num_draft_tokens_total": 120.0, "specexport_num_accepted_tokens_total": 45.0,
                      "specexport_num_accepted_tokens_per_pos_total": 30.0,
                      "specexport_request_success_total": 5.0,
                      "specexport_time_to_first_token_seconds_sum": 0.5,
                      "specexport_time_to_first_token_seconds_count": 5.0}
    after = {**before, "specexport_num_draft_tokens_total": 220.0, "specexport_num_accepted_tokens_total": 105.0,
             "specexport_time_to_first_token_seconds_sum": 1.5, "specexport_time_to_first_token_seconds_count": 9.0}
    deltas = bench.metric_deltas(before, after)
    assert deltas["specexport_num_draft_tokens_total"] == 100.0
    assert bench.acceptance(deltas) == pytest.approx(0.6)
    assert bench.histogram_means(deltas) == {"specexport_time_to_first_token_seconds": pytest.approx(0.25)}
    # absent counters (another server, or none drafted): no rate, no error
    assert bench.acceptance(bench.metric_deltas(None, after)) is None
    assert bench.acceptance({"specexport_num_draft_tokens_total": 0.0,
                             "specexport_num_accepted_tokens_total": 0.0}) is None


# ---------------------------------------------------------------- results file


def _row(label, rate, tok_s, ttft=100.0, **settings):
    stat = {"p50": ttft, "p90": ttft, "p99": ttft, "mean": ttft}
    return {"label": label, "rate": rate, "sent": 4, "completed": 4, "failed": 0, "cancelled": 0, "not_sent": 0,
            "requests_per_s": tok_s / 10, "output_tokens_per_s": tok_s, "ttft_ms": stat, "itl_ms": stat,
            "e2e_ms": stat, "itl_basis": {"even": 4}, "errors": {}, "acceptance_rate": 0.5 if label != "none" else None,
            "settings": {"prompts": "p.jsonl", "num_requests": 4, "max_tokens": 8, "temperature": 0.0, "seed": 0,
                         "max_concurrency": 4, **settings}}


def test_results_merge_replace_and_compare_with_the_baseline(tmp_path):
    first = bench.write_results(tmp_path, [_row("ngram", "1", 60.0), _row("ngram", "inf", 90.0)])
    assert [r["rate"] for r in first["rows"]] == ["1", "inf"]
    assert bench.compare(first["rows"]) == []
    merged = bench.write_results(tmp_path, [_row("none", "inf", 45.0, ttft=200.0), _row("none", "1", 40.0)])
    assert [(r["label"], r["rate"]) for r in merged["rows"]] == [("ngram", "1"), ("ngram", "inf"), ("none", "1"),
                                                                 ("none", "inf")]
    # a rerun replaces its (label, rate) and keeps the rest
    merged = bench.write_results(tmp_path, [_row("ngram", "1", 50.0, max_tokens=16)])
    assert json.loads((tmp_path / bench.RESULTS_JSON).read_text()) == merged
    assert len(merged["rows"]) == 4
    ratios = {c["rate"]: c for c in bench.compare(merged["rows"])}
    assert set(ratios) == {"1", "inf"} and all(c["baseline"] == "none" for c in ratios.values())
    assert ratios["1"]["output_tokens_per_s"] == pytest.approx(50 / 40)
    assert ratios["1"]["settings_differ"] == ["max_tokens"]
    assert ratios["inf"]["output_tokens_per_s"] == pytest.approx(2.0)
    assert ratios["inf"]["ttft_p50"] == pytest.approx(0.5)
    md = (tmp_path / bench.RESULTS_MD).read_text()
    assert "| ngram | none | inf | 2.00× |" in md and "settings differ: max_tokens" in md
    assert md.count("\n| ngram | 1 |") == md.count("\n| none | inf |") == 1
    (tmp_path / bench.RESULTS_JSON).write_text("{oops")
    with pytest.raises(BadInput, match="not JSON"):
        bench.write_results(tmp_path, [_row("none", "1", 1.0)])


# ---------------------------------------------------------------- the load loop's bounds


def _run(rate: float, **kw) -> list[RequestRecord]:
    import httpx

    async def go():
        async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=2.0)) as client:
            return await bench.run_rate(client, f"http://127.0.0.1:{bench.free_port()}", "m",
                                        [{"prompt": "hi"}, {"messages": [{"role": "user", "content": "hi"}]}],
                                        rate, LoadOptions(rates=(rate,), **kw), {})

    return asyncio.run(go())


def test_failures_are_counted_not_raised():
    # nothing listens on a fresh free port: every request fails (connection refused), quickly
    records = _run(math.inf, num_requests=6, max_concurrency=2, duration_limit=20.0)
    row = bench.summarize_rate(records, math.inf)
    assert (row["sent"], row["completed"], row["failed"]) == (6, 0, 6)
    assert row["ttft_ms"] is None and row["output_tokens"] == 0 and row["requests_per_s"] == 0.0
    assert all("Connect" in e for e in row["errors"])


class VirtualClock:
    """bench_serve's clock and its asyncio for a test: sleeping moves the clock on at once, so
    the load loop's bounds are checked on its own account of time, not the machine's."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.now += max(0.0, seconds)
        await asyncio.sleep(0)

    def __getattr__(self, name: str):  # the rest of asyncio, as it is
        return getattr(asyncio, name)


def test_a_rate_stops_at_its_duration_limit(monkeypatch):
    """What arrives before the limit is sent; the loop then stops, neither sending the next
    arrival nor waiting for it."""
    clock = VirtualClock()
    monkeypatch.setattr(bench, "time", clock)
    monkeypatch.setattr(bench, "asyncio", clock)
    rate, limit = 2.0, 3.0
    records = _run(rate, num_requests=50, duration_limit=limit)
    before = [r.scheduled < limit for r in records]  # arrivals at the seeded Poisson times
    assert 0 < sum(before) < 50
    assert [r.status != "pending" for r in records] == before
    row = bench.summarize_rate(records, rate)
    assert (row["sent"], row["not_sent"]) == (sum(before), 50 - sum(before))
    assert clock.now == pytest.approx(max(r.scheduled for r in records if r.scheduled < limit))  # and no longer


def test_cli_refuses_bad_arguments(tmp_path):
    from specexport.cli.serve import bench_serve

    with pytest.raises(BadInput, match="one of them"):
        bench_serve.main([], standalone_mode=False)
    with pytest.raises(BadInput, match="one of them"):
        bench_serve.main(["http://127.0.0.1:1", "--spawn", str(tmp_path)], standalone_mode=False)
    with pytest.raises(BadInput, match="--rates"):
        bench_serve.main(["http://127.0.0.1:1", "--rates", "1,x"], standalone_mode=False)
    with pytest.raises(BadInput, match="not an engine directory"):
        bench_serve.main(["--spawn", str(tmp_path)], standalone_mode=False)
    with pytest.raises(BadInput, match="not reachable"):
        bench_serve.main([f"http://127.0.0.1:{bench.free_port()}", "--prompts", str(_prompts(tmp_path))],
                         standalone_mode=False)


def test_cli_prints_one_line_on_bad_input():
    from tests.conftest import check_one_line, run_cli

    code, out, err = run_cli("bench-serve")
    check_one_line(code, err, "one of them")
    assert err.strip().count("\n") == 0, err


# ---------------------------------------------------------------- against the real server


def _prompts(tmp_path):
    # short: the tiny engines hold 160 tokens (byte tokenizer)
    lines = [{"id": "a", "prompt": "Item 1: write about rivers."},
             {"id": "b", "messages": [{"role": "user", "content": "Write about stars number 7."}]},
             {"id": "c", "prompt": "The river runs to the sea, the river runs"},
             {"id": "d", "messages": [{"role": "system", "content": "Be brief."},
                                      {"role": "user", "content": "Count: 1 2 3"}]}]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_bench_against_spawned_servers(batched_engines, tmp_path):
    """Both drafters' servers, two rates, a handful of requests: every request answered, and the
    tokens the bench counted are the server's own totals."""
    from specexport.cli.serve import bench_serve

    out = tmp_path / "out"
    bench_serve.main(["--spawn", str(batched_engines), "--drafters", "ngram,none", "--rates", "4,inf",
                      "--num-requests", "4", "--max-tokens", "12", "--max-concurrency", "4",
                      "--duration-limit", "60", "--threads", "1", "--startup-timeout", "120",
                      "--prompts", str(_prompts(tmp_path)), "--out", str(out), "--quiet"], standalone_mode=False)
    results = json.loads((out / bench.RESULTS_JSON).read_text())
    rows = {(r["label"], r["rate"]): r for r in results["rows"]}
    assert set(rows) == {("ngram", "4"), ("ngram", "inf"), ("none", "4"), ("none", "inf")}
    for (label, rate), row in rows.items():
        assert (row["sent"], row["completed"], row["failed"], row["cancelled"]) == (4, 4, 0, 0), row
        server = row["server"]
        assert row["output_tokens"] == server["specexport_generation_tokens_total"], (label, rate, server)
        assert row["prompt_tokens"] == server["specexport_prompt_tokens_total"]
        assert row["completed"] == server["specexport_request_success_total"]
        assert 0 < row["output_tokens"] <= 4 * 12
        assert row["ttft_ms"]["p50"] > 0 and row["e2e_ms"]["p99"] >= row["ttft_ms"]["p99"]
        assert sum(row["itl_basis"].values()) == 4
        if label == "none":
            assert not server.get("specexport_num_draft_tokens_total") and row["acceptance_rate"] is None
    assert any(rows[("ngram", r)]["server"]["specexport_num_draft_tokens_total"] > 0 for r in ("4", "inf"))
    md = (out / bench.RESULTS_MD).read_text()
    assert "| ngram | none | 4 |" in md and "| ngram | none | inf |" in md
    assert (out / "serve-ngram.log").is_file() and (out / "serve-none.log").is_file()


def test_a_server_that_refuses_to_start_is_one_line(batched_engines, tmp_path):
    with pytest.raises(BadInput, match=r"exited \(2\).*unknown drafter 'bogus'"):
        bench.spawn_bench(batched_engines, ["bogus"], [{"prompt": "hi"}], LoadOptions(), log_dir=tmp_path,
                          startup_timeout=60)
