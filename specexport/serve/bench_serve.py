"""`specexport bench-serve`: load an OpenAI-compatible server with a Poisson stream of requests.

For each rate r (requests/s) the bench sends ``num_requests`` requests from the prompt set,
with exponential gaps of mean 1/r drawn from ``seed`` (the same draws, scaled, at every rate
and for every label, so runs compare like for like); ``inf`` sends them all at once. At most
``max_concurrency`` are in flight: an arrival past that waits for a slot (its wait is
reported, not counted in its TTFT). Every rate ends after ``duration_limit`` seconds whatever
is left: requests not yet sent are "not_sent", those in flight "cancelled".

What is timed, per request, on the client (time.perf_counter):
    TTFT       request sent -> first chunk carrying content
    ITL        per output token after the first chunk: the gap before a chunk shared evenly by
               the tokens it carries (with speculation a chunk holds several). Tokens per chunk:
               the server's per-chunk counts where it sends them ("per-chunk": cumulative usage on
               content chunks, as vLLM's continuous_usage_stats gives; token_ids; logprobs);
               otherwise the request's usage total spread evenly over its chunks ("even");
               without usage, one token per chunk ("chunks").
               Tokens in the first chunk count towards TTFT, not ITL.
    chunk gap  the gaps between content chunks as they are (what a reader of the stream sees)
    TPOT       (e2e - TTFT) / (output tokens - 1)
    e2e        request sent -> end of the stream ([DONE])
Output tokens are the server's usage (stream_options.include_usage), else the content chunks.
Throughput: completed requests and their output tokens over the rate's wall time (first
arrival to the last request's end).

"With and without speculation": a server's drafter is fixed when it starts, so each run has a
label; runs written to the same --out folder merge into bench_serve.json (a later run
replaces the same label and rate), and bench_serve.md compares every label with the
baseline ("none" when present) rate by rate. ``spawn`` starts `specexport serve` on
127.0.0.1 for each drafter in turn and runs the bench against it.

The server's own counters (/metrics, ``specexport_*``) are scraped before and after each rate;
their deltas are reported, with the draft acceptance rate when the spec-decode counters exist.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from specexport.errors import BadInput, SpecexportError

RESULTS_JSON = "bench_serve.json"
RESULTS_MD = "bench_serve.md"
PERCENTILES = (50, 90, 99)
BASELINE_LABEL = "none"  # the drafter-less server: what the speculative labels are compared with
# Settings that must match for two labels' rows to be compared fairly.
_COMPARED_SETTINGS = ("prompts", "num_requests", "max_tokens", "temperature", "seed", "max_concurrency")


@dataclass(frozen=True)
class LoadOptions:
    rates: tuple[float, ...] = (0.5, 1.0, 2.0, math.inf)
    num_requests: int = 32  # per rate
    duration_limit: float = 300.0  # seconds, per rate
    max_concurrency: int = 16
    max_tokens: int = 128
    temperature: float = 0.0
    seed: int = 0
    warmup: int = 1  # requests sent one by one before the first rate, not measured
    model: str | None = None  # None: the first model the server lists
    api_key: str | None = None
    prompts_name: str = ""  # recorded in the results, to tell runs over other prompt sets apart
    # vLLM's stream_options.continuous_usage_stats: usage on every chunk, so exact tokens per
    # chunk for ITL. Off by default: a strict server may refuse a field it does not know.
    continuous_usage: bool = False


# ---------------------------------------------------------------- statistics (pure functions)


def parse_rates(text: str) -> tuple[float, ...]:
    """"0.5,1,2,inf" -> (0.5, 1.0, 2.0, inf), duplicates dropped, order kept."""
    rates: list[float] = []
    for part in text.split(","):
        part = part.strip().lower()
        try:
            rate = math.inf if part in ("inf", "infinity") else float(part)
        except ValueError:
            raise BadInput(f"--rates: '{part}' is not a rate (requests/s, or inf)") from None
        if not rate > 0 or math.isnan(rate):
            raise BadInput(f"--rates: {part} is not a positive rate")
        if rate not in rates:
            rates.append(rate)
    if not rates:
        raise BadInput("--rates: no rate given")
    return tuple(rates)


def rate_label(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def _rate_value(label: str | float) -> float:
    return math.inf if label == "inf" else float(label)


def poisson_gaps(rate: float, n: int, seed: int) -> np.ndarray:
    """(n,) seconds between consecutive arrivals of a Poisson process of ``rate`` per second;
    zeros for an infinite rate."""
    if math.isinf(rate):
        return np.zeros(n)
    # Standard exponential draws scaled by 1/rate: one seed gives the same pattern at every rate.
    return np.random.default_rng(seed).standard_exponential(n) / rate


def arrival_times(rate: float, n: int, seed: int) -> np.ndarray:
    """(n,) seconds from the start of a rate's run: the first request at 0, then Poisson gaps."""
    gaps = poisson_gaps(rate, n, seed)
    return np.concatenate([[0.0], np.cumsum(gaps[:-1])]) if n else np.zeros(0)


def percentiles(values: Sequence[float] | np.ndarray, scale: float = 1.0) -> dict | None:
    """{"p50", "p90", "p99", "mean"} of ``values`` times ``scale`` (numpy's linear
    interpolation); None when there are no values."""
    data = np.asarray(values, dtype=np.float64) * scale
    if data.size == 0:
        return None
    points = np.percentile(data, PERCENTILES)
    return {**{f"p{p}": float(v) for p, v in zip(PERCENTILES, points)}, "mean": float(data.mean())}


def even_counts(total: int, chunks: int) -> np.ndarray:
    """(chunks,) integer tokens per chunk summing to ``total``, as even as can be; the
    remainder goes to the last chunks (the first chunk is the one most likely to be a lone
    prefill token)."""
    if chunks <= 0:
        return np.zeros(0, dtype=np.int64)
    base, extra = divmod(max(total, 0), chunks)
    counts = np.full(chunks, base, dtype=np.int64)
    if extra:
        counts[chunks - extra:] += 1
    return counts


def inter_token_latencies(times: Sequence[float] | np.ndarray, counts: Sequence[int] | np.ndarray) -> np.ndarray:
    """Per-token latencies (seconds) from content chunk arrival ``times`` (C,) and the tokens each
    carried ``counts`` (C,): the gap before each later chunk, divided by its tokens, once per
    token. Chunks with no tokens are skipped (their wait goes to the next chunk with tokens)."""
    t = np.asarray(times, dtype=np.float64)
    k = np.asarray(counts, dtype=np.int64)
    keep = k > 0
    t, k = t[keep], k[keep]
    if t.size < 2:
        return np.zeros(0)
    gaps = np.diff(t)  # (C'-1,) seconds
    return np.repeat(gaps / k[1:], k[1:])


def throughput(completed: int, output_tokens: int, seconds: float) -> tuple[float | None, float | None]:
    """(requests/s, output tokens/s) over ``seconds`` of wall time; None when no time passed."""
    if seconds <= 0:
        return None, None
    return completed / seconds, output_tokens / seconds


# ---------------------------------------------------------------- Prometheus counters


_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{.*\})?\s+(\S+)(?:\s+\S+)?$")


def parse_metrics(text: str, prefix: str = "specexport_") -> dict[str, float]:
    """Prometheus text exposition -> {sample name: value summed over its label sets}, for the
    names starting with ``prefix`` that accumulate (``_total``, ``_sum``, ``_count``)."""
    totals: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line.strip())
        if not m or not m[1].startswith(prefix) or not m[1].endswith(("_total", "_sum", "_count")):
            continue
        try:
            value = float(m[3])
        except ValueError:
            continue
        totals[m[1]] = totals.get(m[1], 0.0) + value
    return totals


def metric_deltas(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, float]:
    if before is None or after is None:
        return {}
    return {name: after[name] - before.get(name, 0.0) for name in sorted(after)}


def histogram_means(deltas: dict[str, float]) -> dict[str, float]:
    """{histogram name: mean of what it observed} from the ``_sum`` and ``_count`` deltas (the
    server's own TTFT, ITL, e2e in seconds, batch sizes)."""
    means = {}
    for name, total in deltas.items():
        if name.endswith("_sum"):
            count = deltas.get(name[:-4] + "_count")
            if count:
                means[name[:-4]] = total / count
    return means


def acceptance(deltas: dict[str, float]) -> float | None:
    """Accepted / proposed draft tokens from the server's counters (vLLM's names under our prefix;
    another server's spellings are looked for by their parts)."""
    def find(*parts: str) -> float | None:
        for name, value in deltas.items():
            if name.endswith("_total") and all(p in name for p in parts) and "per_pos" not in name:
                return value
        return None

    drafted = deltas.get("specexport_num_draft_tokens_total", find("draft_tokens"))
    accepted = deltas.get("specexport_num_accepted_tokens_total", find("accepted_tokens"))
    if drafted is None or accepted is None or drafted <= 0:
        return None
    return accepted / drafted


# ---------------------------------------------------------------- one request


@dataclass
class RequestRecord:
    index: int
    scheduled: float  # seconds from the rate's start
    status: str = "pending"  # pending | ok | failed | cancelled
    error: str = ""
    sent: float | None = None  # seconds from the rate's start
    ended: float | None = None
    chunk_times: list[float] = field(default_factory=list)  # (C,) seconds after sending
    chunk_counts: list[int | None] = field(default_factory=list)  # (C,) tokens per chunk when the server says
    usage_completion: int | None = None
    usage_prompt: int | None = None
    finish_reason: str | None = None

    @property
    def output_tokens(self) -> int:
        return self.usage_completion if self.usage_completion is not None else len(self.chunk_times)

    def token_counts(self) -> tuple[np.ndarray, str]:
        """(C,) tokens per content chunk and where they come from: per-chunk | even | chunks."""
        chunks = len(self.chunk_times)
        known = [c for c in self.chunk_counts if c is not None]
        if chunks and len(known) == chunks and (self.usage_completion is None or sum(known) == self.usage_completion):
            return np.asarray(known, dtype=np.int64), "per-chunk"
        if self.usage_completion is not None:
            return even_counts(self.usage_completion, chunks), "even"
        return np.ones(chunks, dtype=np.int64), "chunks"


def _chunk_tokens(choice: dict, chat: bool) -> int | None:
    """Tokens a streamed choice says it carries, when it says (vLLM's token_ids, logprobs)."""
    if isinstance(choice.get("token_ids"), list):
        return len(choice["token_ids"])
    logprobs = choice.get("logprobs")
    if isinstance(logprobs, dict):
        items = logprobs.get("content") if chat else logprobs.get("tokens")
        if isinstance(items, list):
            return len(items)
    return None


def request_body(prompt: dict, model: str, opts: LoadOptions) -> tuple[str, dict]:
    """(path, JSON body) for one prompt record: chat for {messages}, completions for {prompt}."""
    stream_options = {"include_usage": True, **({"continuous_usage_stats": True} if opts.continuous_usage else {})}
    body: dict = {"model": model, "max_tokens": opts.max_tokens, "temperature": opts.temperature,
                  "stream": True, "stream_options": stream_options}
    if "messages" in prompt:
        return "/v1/chat/completions", {**body, "messages": prompt["messages"]}
    return "/v1/completions", {**body, "prompt": prompt["prompt"]}


@dataclass
class StreamReader:
    """Reads one streamed response's SSE lines into its record."""

    record: RequestRecord
    chat: bool
    done: bool = False  # [DONE] seen
    usage_on_content: bool = True  # cumulative usage on every content chunk so far: per-chunk counts

    def feed(self, line: str, now: float) -> bool:
        """One line, received ``now`` seconds after sending. False once the stream is over:
        [DONE], or a chunk that fails the record (its status and error say why)."""
        record = self.record
        if not line.startswith("data:"):
            return True  # blank separators, ": comments", "event:" lines
        payload = line[5:].strip()
        if payload == "[DONE]":
            self.done = True
            return False
        try:
            chunk = json.loads(payload)
        except ValueError:
            record.status, record.error = "failed", "a stream chunk is not JSON"
            return False
        if not isinstance(chunk, dict):
            record.status, record.error = "failed", "a stream chunk is not a JSON object"
            return False
        if chunk.get("error"):
            record.status, record.error = "failed", f"stream error: {_error_message(json.dumps(chunk))}"
            return False
        usage = chunk.get("usage") or {}
        choices = chunk.get("choices") or []
        choice = choices[0] if choices else {}
        text = ((choice.get("delta") or {}).get("content") if self.chat else choice.get("text")) or ""
        completion = usage.get("completion_tokens")
        if text:
            record.chunk_times.append(now)
            record.chunk_counts.append(_chunk_tokens(choice, self.chat))
            if completion is None:
                self.usage_on_content = False
            elif self.usage_on_content:  # usage so far, on this chunk too: its own tokens are the difference
                record.chunk_counts[-1] = int(completion) - (record.usage_completion or 0)
        if choice.get("finish_reason"):
            record.finish_reason = choice["finish_reason"]
        if completion is not None:
            record.usage_completion = int(completion)
            record.usage_prompt = usage.get("prompt_tokens", record.usage_prompt)
        return True


async def send_request(client, base: str, path: str, body: dict, record: RequestRecord, t0: float,
                       headers: dict) -> None:
    """Send one streamed request and fill ``record`` (times relative to ``t0``). Never raises but
    for cancellation: a failure is the record's status."""
    reader = StreamReader(record, chat=path.endswith("chat/completions"))
    sent = time.perf_counter()
    record.sent = sent - t0
    try:
        async with client.stream("POST", base + path, json=body, headers=headers) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                record.status, record.error = "failed", f"HTTP {response.status_code}: {_error_message(text)}"
                return
            async for line in response.aiter_lines():
                if not reader.feed(line, time.perf_counter() - sent):
                    break
    except asyncio.CancelledError:
        record.status = "cancelled"
        raise
    except Exception as err:  # noqa: BLE001 - a transport error fails this request, not the bench
        record.status, record.error = "failed", f"{type(err).__name__}: {err}"[:200]
        return
    finally:
        record.ended = time.perf_counter() - t0
    if record.status == "failed":
        return
    if reader.done:
        record.status = "ok"
    else:
        record.status, record.error = "failed", "the stream ended without [DONE]"


def _error_message(text: str) -> str:
    """The message of an OpenAI error body, else the text's start."""
    try:
        body = json.loads(text)
        error = body.get("error", body) if isinstance(body, dict) else body
        message = error.get("message", error) if isinstance(error, dict) else error
        return str(message)[:200]
    except ValueError:
        return text.strip()[:200]


# ---------------------------------------------------------------- one rate


async def run_rate(client, base: str, model: str, prompts: list[dict], rate: float, opts: LoadOptions,
                   headers: dict) -> list[RequestRecord]:
    """Send ``opts.num_requests`` requests at Poisson ``rate`` within ``opts.duration_limit``."""
    n = opts.num_requests
    arrivals = arrival_times(rate, n, opts.seed)  # (n,) seconds
    # The same prompt order at every rate and label (seeded), cycling through the set.
    order = np.random.default_rng(opts.seed + 1).permutation(len(prompts))
    slots = asyncio.Semaphore(opts.max_concurrency)
    t0 = time.perf_counter()
    deadline = t0 + opts.duration_limit
    records = [RequestRecord(index=i, scheduled=float(arrivals[i])) for i in range(n)]
    tasks: list[asyncio.Task] = []

    async def one(record: RequestRecord, path: str, body: dict) -> None:
        async with slots:
            await send_request(client, base, path, body, record, t0, headers)

    for i, record in enumerate(records):
        start = t0 + record.scheduled
        if start >= deadline:
            break
        await asyncio.sleep(max(0.0, start - time.perf_counter()))
        path, body = request_body(prompts[int(order[i % len(prompts)])], model, opts)
        tasks.append(asyncio.create_task(one(record, path, body)))
    if tasks:
        _, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - time.perf_counter()))
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    end = time.perf_counter() - t0
    for record in records[:len(tasks)]:
        if record.status in ("pending", "cancelled"):
            # cancelled while waiting for a slot, or in flight, at the time limit
            record.status, record.ended = "cancelled", record.ended if record.ended is not None else end
    return records


def summarize_rate(records: list[RequestRecord], rate: float) -> dict:
    """The statistics of one rate's records (times in ms)."""
    sent = [r for r in records if r.status != "pending"]
    ok = [r for r in sent if r.status == "ok"]
    ttft = [r.chunk_times[0] for r in ok if r.chunk_times]
    e2e = [r.ended - r.sent for r in ok if r.ended is not None and r.sent is not None]
    itl: list[np.ndarray] = []
    gaps: list[np.ndarray] = []
    tpot: list[float] = []
    bases: Counter[str] = Counter()
    for r in ok:
        counts, basis = r.token_counts()
        bases[basis] += 1
        itl.append(inter_token_latencies(r.chunk_times, counts))
        gaps.append(np.diff(np.asarray(r.chunk_times, dtype=np.float64)))
        if r.output_tokens > 1 and r.chunk_times and r.ended is not None and r.sent is not None:
            tpot.append(((r.ended - r.sent) - r.chunk_times[0]) / (r.output_tokens - 1))
    output_tokens = sum(r.output_tokens for r in ok)
    chunks = sum(len(r.chunk_times) for r in ok)
    # Wall time: the first arrival (0) to the last end, or to the time limit's cancellations.
    seconds = max((r.ended for r in sent if r.ended is not None), default=0.0)
    req_s, tok_s = throughput(len(ok), output_tokens, seconds)
    errors = Counter(r.error for r in sent if r.status == "failed")
    return {
        "rate": rate_label(rate),
        "sent": len(sent),
        "completed": len(ok),
        "failed": sum(r.status == "failed" for r in sent),
        "cancelled": sum(r.status == "cancelled" for r in sent),
        "not_sent": len(records) - len(sent),
        "duration_s": seconds,
        "requests_per_s": req_s,
        "output_tokens": output_tokens,
        "output_tokens_per_s": tok_s,
        "prompt_tokens": sum(r.usage_prompt or 0 for r in ok),
        "tokens_per_chunk": output_tokens / chunks if chunks else None,
        "ttft_ms": percentiles(ttft, 1e3),
        "itl_ms": percentiles(np.concatenate(itl) if itl else [], 1e3),
        "chunk_gap_ms": percentiles(np.concatenate(gaps) if gaps else [], 1e3),
        "tpot_ms": percentiles(tpot, 1e3),
        "e2e_ms": percentiles(e2e, 1e3),
        # how ITL's tokens per chunk were known, by request: per-chunk | even | chunks
        "itl_basis": dict(sorted(bases.items())),
        "client_wait_ms": percentiles([r.sent - r.scheduled for r in sent if r.sent is not None], 1e3),
        "finish_reasons": dict(Counter(r.finish_reason or "none" for r in ok)),
        "errors": dict(errors.most_common(5)),
    }


# ---------------------------------------------------------------- against a running server


def base_url(url: str) -> str:
    """The server root: http://host:port (a trailing /v1 or / dropped)."""
    url = url.strip().rstrip("/")
    if not re.match(r"^https?://", url):
        raise BadInput(f"{url}: the URL needs http:// or https://")
    return url[:-3] if url.endswith("/v1") else url


def _headers(opts: LoadOptions) -> dict:
    return {"Authorization": f"Bearer {opts.api_key}"} if opts.api_key else {}


async def _scrape(client, base: str, headers: dict) -> dict[str, float] | None:
    try:
        response = await client.get(base + "/metrics", headers=headers, timeout=10.0)
    except Exception:  # noqa: BLE001 - a server without /metrics is still benched
        return None
    return parse_metrics(response.text) if response.status_code == 200 else None


async def _model(client, base: str, headers: dict) -> str:
    try:
        response = await client.get(base + "/v1/models", headers=headers, timeout=10.0)
    except Exception as err:  # noqa: BLE001
        raise BadInput(f"{base}: not reachable ({type(err).__name__}: {err})") from None
    if response.status_code != 200:
        raise BadInput(f"{base}/v1/models: HTTP {response.status_code}: {_error_message(response.text)}")
    try:
        return str(response.json()["data"][0]["id"])
    except (ValueError, KeyError, IndexError, TypeError):
        raise BadInput(f"{base}/v1/models: no model listed; pass --model") from None


async def bench_server(url: str, label: str, prompts: list[dict], opts: LoadOptions,
                       report: Callable[[str], None] = lambda line: None) -> list[dict]:
    """One row per rate of ``opts``: the load statistics and the server's counter deltas."""
    import httpx

    if not prompts:
        raise BadInput("no prompts")
    base = base_url(url)
    headers = _headers(opts)
    limits = httpx.Limits(max_connections=opts.max_concurrency, max_keepalive_connections=opts.max_concurrency)
    # No read timeout: the rate's duration limit bounds every request.
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(None, connect=10.0)) as client:
        model = opts.model or await _model(client, base, headers)
        for i in range(opts.warmup):
            path, body = request_body(prompts[i % len(prompts)], model, opts)
            record = RequestRecord(index=-1, scheduled=0.0)
            try:
                await asyncio.wait_for(send_request(client, base, path, body, record, time.perf_counter(), headers),
                                       timeout=opts.duration_limit)
            except asyncio.TimeoutError:
                record.error = f"no answer within --duration-limit ({opts.duration_limit:g} s)"
            if record.status != "ok":
                raise SpecexportError(f"{base}: the warm-up request failed: {record.error}")
        settings = {"url": base, "model": model, "prompts": opts.prompts_name, "num_prompts": len(prompts),
                    "num_requests": opts.num_requests, "max_tokens": opts.max_tokens,
                    "temperature": opts.temperature, "seed": opts.seed, "max_concurrency": opts.max_concurrency,
                    "duration_limit_s": opts.duration_limit, "warmup": opts.warmup,
                    "continuous_usage": opts.continuous_usage}
        rows = []
        for rate in opts.rates:
            before = await _scrape(client, base, headers)
            records = await run_rate(client, base, model, prompts, rate, opts, headers)
            after = await _scrape(client, base, headers)
            row = {"label": label, **summarize_rate(records, rate)}
            deltas = metric_deltas(before, after)
            row["server"] = deltas
            row["acceptance_rate"] = acceptance(deltas)
            row["server_means"] = histogram_means(deltas)
            row["settings"] = settings
            rows.append(row)
            report(progress_line(row))
    return rows


def run_bench(url: str, label: str, prompts: list[dict], opts: LoadOptions,
              report: Callable[[str], None] = lambda line: None) -> list[dict]:
    return asyncio.run(bench_server(url, label, prompts, opts, report))


def progress_line(row: dict) -> str:
    def ms(stat: dict | None) -> str:
        return _ms(stat["p50"] if stat else None)

    return (f"{row['label']} @ {row['rate']} req/s: {row['completed']}/{row['sent']} ok, {row['failed']} failed, "
            f"{_num(row['output_tokens_per_s'])} tok/s, TTFT p50 {ms(row['ttft_ms'])} ms, "
            f"ITL p50 {ms(row['itl_ms'])} ms")


# ---------------------------------------------------------------- spawned servers


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _last_line(path: Path) -> str:
    """The last non-empty line of a server's log: its one-line error, when it failed on one."""
    try:
        lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    return lines[-1][:300] if lines else ""


def stop_server(process: subprocess.Popen, timeout: float = 20.0) -> None:
    """SIGTERM (uvicorn finishes its requests and shuts down), SIGKILL after ``timeout``."""
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def wait_healthy(url: str, process: subprocess.Popen, timeout: float, log: Path) -> None:
    """Poll GET /health until 200; fail if the server exits or ``timeout`` passes."""
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None:
            why = f"specexport serve exited ({process.returncode}) before it was healthy: {_last_line(log)} (log: {log})"
            # exit code 2: the server refused its arguments (a drafter the directory lacks, ...)
            raise BadInput(why) if process.returncode == BadInput.exit_code else SpecexportError(why)
        try:
            if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass  # not listening yet
        if time.monotonic() > deadline:
            raise SpecexportError(f"specexport serve was not healthy after {timeout:g} s: {_last_line(log)} "
                                  f"(log: {log})")
        time.sleep(0.25)


@contextmanager
def spawned_server(engine_dir: Path, drafter: str, log: Path, *, max_batch: int | None = None,
                   threads: int | None = None, startup_timeout: float = 600.0,
                   extra_args: Sequence[str] = ()) -> Iterator[str]:
    """`specexport serve ENGINE_DIR --drafter DRAFTER` on 127.0.0.1 and a free port; yields its URL
    once /health answers, and stops it on leaving (errors and interrupts included)."""
    port = free_port()
    command = [sys.executable, "-m", "specexport", "serve", str(engine_dir), "--host", "127.0.0.1",
               "--port", str(port), "--drafter", drafter]
    if max_batch is not None:
        command += ["--max-batch", str(max_batch)]
    if threads is not None:
        command += ["--threads", str(threads)]
    command += list(extra_args)
    log.parent.mkdir(parents=True, exist_ok=True)
    url = f"http://127.0.0.1:{port}"
    with open(log, "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            wait_healthy(url, process, startup_timeout, log)
            yield url
        finally:
            stop_server(process)


def spawn_bench(engine_dir: Path, drafters: Sequence[str], prompts: list[dict], opts: LoadOptions, *,
                log_dir: Path | None = None, max_batch: int | None = None, threads: int | None = None,
                startup_timeout: float = 600.0, report: Callable[[str], None] = lambda line: None) -> list[dict]:
    """For each drafter in turn: start a server, bench it (label = the drafter), stop it."""
    if not (engine_dir / "manifest.json").is_file():
        raise BadInput(f"{engine_dir}: not an engine directory (no manifest.json)")
    rows: list[dict] = []
    # Without log_dir the logs go to a scratch folder, removed after a run that succeeded and
    # kept after a failure (its error names the log).
    logs = log_dir or Path(tempfile.mkdtemp(prefix="bench-serve-"))
    for drafter in drafters:
        log = logs / f"serve-{drafter}.log"
        report(f"starting specexport serve --drafter {drafter} (log: {log})")
        with spawned_server(engine_dir, drafter, log, max_batch=max_batch, threads=threads,
                            startup_timeout=startup_timeout) as url:
            rows += run_bench(url, drafter, prompts, opts, report)
    if log_dir is None:
        shutil.rmtree(logs, ignore_errors=True)
    return rows


# ---------------------------------------------------------------- results: merge, compare, render


def merge_results(existing: dict | None, rows: list[dict]) -> dict:
    """The results file with ``rows`` in: a (label, rate) already there is replaced."""
    kept = list((existing or {}).get("rows", []))
    new = {(r["label"], r["rate"]) for r in rows}
    merged = [r for r in kept if (r["label"], r["rate"]) not in new] + rows
    labels = list(dict.fromkeys(r["label"] for r in merged))  # first appearance order
    merged.sort(key=lambda r: (labels.index(r["label"]), _rate_value(r["rate"])))
    return {"version": 1, "rows": merged}


def load_results(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except ValueError as err:
        raise BadInput(f"{path}: not JSON ({err}); move it away to start a new results file") from None
    if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
        raise BadInput(f"{path}: not a bench-serve results file (no 'rows')")
    return data


def compare(rows: list[dict]) -> list[dict]:
    """Each label against the baseline (label "none" when present, else the first label), at
    each rate both have: throughput ratios (label / baseline) and latency ratios."""
    labels = list(dict.fromkeys(r["label"] for r in rows))
    if len(labels) < 2:
        return []
    baseline = BASELINE_LABEL if BASELINE_LABEL in labels else labels[0]
    by_key = {(r["label"], r["rate"]): r for r in rows}

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b else None

    def p50(row: dict, key: str) -> float | None:
        return row[key]["p50"] if row.get(key) else None

    out = []
    for label in labels:
        if label == baseline:
            continue
        for row in rows:
            base = by_key.get((baseline, row["rate"]))
            if row["label"] != label or base is None:
                continue
            differ = [k for k in _COMPARED_SETTINGS if row["settings"].get(k) != base["settings"].get(k)]
            out.append({"label": label, "baseline": baseline, "rate": row["rate"],
                        "output_tokens_per_s": ratio(row["output_tokens_per_s"], base["output_tokens_per_s"]),
                        "requests_per_s": ratio(row["requests_per_s"], base["requests_per_s"]),
                        "ttft_p50": ratio(p50(row, "ttft_ms"), p50(base, "ttft_ms")),
                        "itl_p50": ratio(p50(row, "itl_ms"), p50(base, "itl_ms")),
                        "settings_differ": differ})
    return out


def _num(value: float | None, digits: int = 1) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def _ms(value: float | None) -> str:
    """Milliseconds with the digits that matter: 1234, 12.3, 0.12."""
    if value is None:
        return "–"
    return _num(value, 0 if value >= 100 else 1 if value >= 1 else 2)


def _pcts(stat: dict | None, keys: Sequence[str] = ("p50", "p90", "p99")) -> list[str]:
    return [_ms(stat[k] if stat else None) for k in keys]


TABLE_COLUMNS = ("label", "rate", "completed", "failed", "req/s", "out tok/s", "TTFT p50", "TTFT p90",
                 "TTFT p99", "ITL p50", "ITL p90", "ITL p99", "e2e p50", "e2e p99", "accept")


def table_rows(rows: list[dict]) -> list[list[str]]:
    """The cells of the results table (times in ms), one list per row."""
    out = []
    for r in rows:
        accept = r.get("acceptance_rate")
        out.append([r["label"], r["rate"], f"{r['completed']}/{r['sent']}", str(r["failed"] + r["cancelled"]),
                    _num(r["requests_per_s"], 2), _num(r["output_tokens_per_s"]),
                    *_pcts(r["ttft_ms"]), *_pcts(r["itl_ms"]), *_pcts(r["e2e_ms"], ("p50", "p99")),
                    "–" if accept is None else f"{accept:.1%}"])
    return out


def _ratio_cell(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}×"


def render_markdown(results: dict) -> str:
    rows = results["rows"]
    lines = ["# specexport bench-serve", "",
             "Times in ms. failed: failed + cancelled at the time limit. ITL: per output token after the "
             "first chunk (a chunk's gap shared by its tokens); accept: the server's accepted / drafted tokens.",
             "", "| " + " | ".join(TABLE_COLUMNS) + " |", "|" + "---|" * len(TABLE_COLUMNS)]
    lines += ["| " + " | ".join(cells) + " |" for cells in table_rows(rows)]
    bases: Counter[str] = Counter()
    for r in rows:
        bases.update(r.get("itl_basis", {}))
    if bases:
        lines += ["", "ITL tokens per chunk, by request: " + ", ".join(f"{k}: {v}" for k, v in sorted(bases.items()))
                  + " (per-chunk: the server's counts; even: its usage total spread over the chunks; "
                    "chunks: one token per chunk, no usage sent)."]
    comparisons = compare(rows)
    if comparisons:
        lines += ["", "## Against the baseline", "",
                  "| label | baseline | rate | out tok/s | req/s | TTFT p50 | ITL p50 | note |", "|---|---|---|---|---|---|---|---|"]
        for c in comparisons:
            note = ("settings differ: " + ", ".join(c["settings_differ"])) if c["settings_differ"] else ""
            lines.append(f"| {c['label']} | {c['baseline']} | {c['rate']} | {_ratio_cell(c['output_tokens_per_s'])} | "
                         f"{_ratio_cell(c['requests_per_s'])} | {_ratio_cell(c['ttft_p50'])} | "
                         f"{_ratio_cell(c['itl_p50'])} | {note} |")
        lines += ["", "Ratios are label / baseline: above 1× is faster for throughput, slower for latency."]
    errors = [(r["label"], r["rate"], msg, n) for r in rows for msg, n in r.get("errors", {}).items()]
    if errors:
        lines += ["", "## Errors", ""] + [f"- {label} @ {rate}: {n}× {msg}" for label, rate, msg, n in errors]
    return "\n".join(lines) + "\n"


def write_results(out: Path, rows: list[dict]) -> dict:
    """Merge ``rows`` into OUT/bench_serve.json and rewrite OUT/bench_serve.md; the merged results."""
    from specexport.atomic import write_text

    if out.exists() and not out.is_dir():
        raise BadInput(f"{out}: --out must be a folder")
    results = merge_results(load_results(out / RESULTS_JSON), rows)
    write_text(out / RESULTS_JSON, json.dumps(results, indent=2) + "\n")
    write_text(out / RESULTS_MD, render_markdown(results))
    return results


def print_table(rows: list[dict]) -> None:
    """The results on the terminal: the markdown table's columns, percentiles grouped per cell."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not console.is_terminal:
        console = Console(width=160)  # a pipe or a file: no terminal to fit, keep the rows whole
    table = Table(title="bench-serve (times in ms)")
    for column in ("label", "rate", "completed", "failed", "req/s", "out tok/s", "TTFT p50/p90/p99",
                   "ITL p50/p90/p99", "e2e p50/p99", "accept"):
        table.add_column(column, justify="left" if column == "label" else "right")
    for cells in table_rows(rows):
        table.add_row(*cells[:6], "/".join(cells[6:9]), "/".join(cells[9:12]), "/".join(cells[12:14]), cells[14])
    console.print(table)
    for c in compare(rows):
        note = f" (settings differ: {', '.join(c['settings_differ'])})" if c["settings_differ"] else ""
        console.print(f"{c['label']} vs {c['baseline']} @ {c['rate']} req/s: output tok/s "
                      f"{_ratio_cell(c['output_tokens_per_s'])}, TTFT p50 {_ratio_cell(c['ttft_p50'])}, "
                      f"ITL p50 {_ratio_cell(c['itl_p50'])}{note}", soft_wrap=True)
