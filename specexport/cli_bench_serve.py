"""`specexport bench-serve`: a Poisson load on an OpenAI-compatible server (specexport/serve/bench_serve.py).

Kept apart from cli.py, which registers it; httpx loads only when it runs.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import click

from specexport.errors import BadInput, missing_extra


def _names(option: str, value: str) -> list[str]:
    names = list(dict.fromkeys(x.strip() for x in value.split(",") if x.strip()))
    if not names:
        raise BadInput(f"{option}: give at least one name")
    return names


@click.command("bench-serve")
@click.argument("url", required=False)
@click.option("--spawn", "engine_dir", type=click.Path(path_type=Path), default=None,
              help="Instead of URL: start `specexport serve ENGINE_DIR` on 127.0.0.1 for each of --drafters "
                   "in turn, bench it, stop it.")
@click.option("--drafters", default="ngram,none", show_default=True,
              help="With --spawn: the servers' drafters, one server each (each run's label).")
@click.option("--label", default=None,
              help="This run's name in the results (default: server), e.g. the server's drafter; runs of other "
                   "labels in --out are compared with it (with 'none' as the baseline when present).")
@click.option("--rates", default="0.5,1,2,inf", show_default=True,
              help="Request rates (requests/s, Poisson arrivals); inf: all at once, up to --max-concurrency.")
@click.option("--num-requests", type=click.IntRange(1), default=32, show_default=True, help="Requests per rate.")
@click.option("--duration-limit", type=click.FloatRange(min=0.0, min_open=True), default=300.0, show_default=True,
              help="Seconds per rate at most: requests not sent by then are dropped, those in flight cancelled.")
@click.option("--max-concurrency", type=click.IntRange(1), default=16, show_default=True,
              help="Requests in flight at most; more wait for a slot on the client.")
@click.option("--max-tokens", type=click.IntRange(1), default=128, show_default=True, help="Tokens per response.")
@click.option("--temperature", type=click.FloatRange(0.0, 2.0), default=0.0, show_default=True,
              help="0: greedy.")
@click.option("--seed", type=int, default=0, show_default=True, help="Arrival gaps and prompt order.")
@click.option("--prompts", type=click.Path(path_type=Path), default=Path("bench/prompts/dev.jsonl"),
              show_default=True, help="JSONL: {messages} lines go to /v1/chat/completions, {prompt} to /v1/completions.")
@click.option("--warmup", type=click.IntRange(0), default=1, show_default=True,
              help="Requests sent one by one before the first rate, not measured.")
@click.option("--model", default=None, help="The model name sent (default: the first the server lists).")
@click.option("--api-key", envvar="SPECEXPORT_API_KEY", default=None,
              help="Sent as 'Authorization: Bearer KEY' (or set SPECEXPORT_API_KEY).")
@click.option("-o", "--out", type=click.Path(path_type=Path, file_okay=False), default=None,
              help="Folder: merge this run into OUT/bench_serve.json and rewrite OUT/bench_serve.md "
                   "(with --spawn, the servers' logs go there too).")
@click.option("--continuous-usage", is_flag=True,
              help="Ask for usage on every chunk (vLLM's stream_options.continuous_usage_stats): exact tokens "
                   "per chunk for ITL instead of the usage total spread over the chunks.")
@click.option("--json", "as_json", is_flag=True, help="Print this run's rows as JSON.")
@click.option("--max-batch", type=click.IntRange(1), default=None, help="With --spawn: the server's --max-batch.")
@click.option("--threads", type=click.IntRange(1), default=None, help="With --spawn: the server's --threads.")
@click.option("--startup-timeout", type=click.FloatRange(min=0.0, min_open=True), default=600.0,
              show_default=True, help="With --spawn: seconds for a server to answer /health.")
@click.option("--quiet", "-q", is_flag=True, help="No progress lines.")
def bench_serve(url: str | None, engine_dir: Path | None, drafters: str, label: str | None, rates: str,
                num_requests: int, duration_limit: float, max_concurrency: int, max_tokens: int,
                temperature: float, seed: int, prompts: Path, warmup: int, model: str | None,
                api_key: str | None, out: Path | None, continuous_usage: bool, as_json: bool, max_batch: int | None,
                threads: int | None, startup_timeout: float, quiet: bool) -> None:
    """Send Poisson streams of requests from the prompt set to the OpenAI-compatible server at URL
    (http://host:port) at several rates; report throughput, TTFT, inter-token latency and the
    server's draft acceptance. Compare with and without speculation by running it against two
    servers with --label and one --out, or with --spawn ENGINE_DIR --drafters ngram,none."""
    if importlib.util.find_spec("httpx") is None:
        raise missing_extra("httpx", "serve")
    from specexport.bench.harness import load_prompts
    from specexport.serve import bench_serve as bench

    if (url is None) == (engine_dir is None):
        raise BadInput("give a server URL or --spawn ENGINE_DIR (one of them)")
    if engine_dir is not None and label is not None:
        raise BadInput("--label names a URL's run; with --spawn each run is named after its drafter")
    opts = bench.LoadOptions(rates=bench.parse_rates(rates), num_requests=num_requests,
                             duration_limit=duration_limit, max_concurrency=max_concurrency,
                             max_tokens=max_tokens, temperature=temperature, seed=seed, warmup=warmup,
                             model=model, api_key=api_key, prompts_name=str(prompts),
                             continuous_usage=continuous_usage)
    records = load_prompts(prompts)
    say = (lambda line: None) if quiet or as_json else (lambda line: click.echo(line, err=True))
    if engine_dir is not None:
        rows = bench.spawn_bench(engine_dir, _names("--drafters", drafters), records, opts, log_dir=out,
                                 max_batch=max_batch, threads=threads, startup_timeout=startup_timeout,
                                 report=say)
    else:
        rows = bench.run_bench(url or "", label or "server", records, opts, say)
    shown = rows
    if out is not None:
        merged = bench.write_results(out, rows)
        # the table shows every label in OUT, so this run is read against the others
        shown = merged["rows"]
        say(f"wrote {out / bench.RESULTS_JSON} and {out / bench.RESULTS_MD}")
    if as_json:
        click.echo(json.dumps(rows, indent=2))
    elif not quiet:
        bench.print_table(shown)
