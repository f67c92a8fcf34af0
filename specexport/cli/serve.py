"""The OpenAI-compatible server (specexport/serve/): `serve`, and `bench-serve`, a Poisson load
on such a server (specexport/serve/bench_serve.py).

FastAPI, uvicorn, Ray and httpx load only when a command runs.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import click

from specexport.backends import BACKENDS, DEFAULT_BACKEND
from specexport.errors import BadInput, missing_extra
from specexport.runtime.spec_metrics import LEVELS


def _autoscale(value: str | None) -> tuple[int, int] | None:
    if value is None:
        return None
    try:
        low, high = (int(x) for x in value.split(":"))
    except ValueError:
        raise BadInput(f"--autoscale: '{value}' is not MIN:MAX (two replica counts, e.g. 1:4)") from None
    if not 0 <= low <= high or high < 1:
        raise BadInput(f"--autoscale: need 0 <= MIN <= MAX and MAX >= 1 (got {value})")
    return low, high


def check_servable(engine_dir: Path, drafter: str, max_batch: int | None, tree_nodes: int | None = None,
                   backend: str | None = None) -> str:
    """Fail before the port opens on what would fail while loading: the directory, a target
    that cannot batch, the backend's engines, the drafter, batched engines, a tree size without
    its graph. Returns the drafter to run."""
    from specexport.contract import Manifest
    from specexport.runtime.input_checks import batched_refusal, check_drafter, check_tree_nodes
    from specexport.serve.config import refuse_recurrent_backend

    manifest = Manifest.load(engine_dir)
    refuse_recurrent_backend(manifest, engine_dir, backend)  # first: rebuilding for TensorRT would not help it
    backend = backend or DEFAULT_BACKEND  # the backend load() picks
    if backend not in manifest.backends():
        raise BadInput(f"{engine_dir}: serve runs {backend} engines and this directory has none (it has "
                       f"{', '.join(manifest.backends())}: give --backend), or rebuild it with backend: {backend} "
                       "in the recipe")
    built = manifest.batch_sizes("target")
    if max_batch is not None and max_batch < min(built):
        raise BadInput(f"--max-batch: {max_batch} is below the smallest batch size built ({min(built)})")
    target = batched_refusal(manifest, "none", max_batch, backend)
    if target is not None:
        raise BadInput(f"{engine_dir}: {target}")
    for name in _names("--drafter", drafter):
        check_drafter(manifest, name, max_batch, "--drafter", backend)
    check_tree_nodes(manifest, tree_nodes)
    return drafter


@click.command()
@click.argument("engine_dir", type=click.Path(path_type=Path))
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind (0.0.0.0: every interface).")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True, help="Port to bind.")
@click.option("--drafter", default="ngram", show_default=True,
              help="none, or any drafter the directory has (ngram, quantized-self, a draft model, or a head: "
                   "eagle3, mtp, dflash, dspark); every one runs batched. Several, comma-separated: each request "
                   "drafts with the one its speculation.drafter field names (default the first).")
@click.option("--max-batch", type=click.IntRange(min=1), default=None,
              help="Sequences per round (default: the largest batch size built).")
@click.option("--max-waiting", type=click.IntRange(min=0), default=64, show_default=True,
              help="Requests queued beyond the running ones; more are answered 429.")
@click.option("--threads", type=click.IntRange(min=1), default=None, help="onnxruntime threads (default: all cores).")
@click.option("--backend", type=click.Choice(list(BACKENDS)), default=None,
              help="The engines to serve (default: onnxruntime; tensorrt: the directory's TensorRT plans, batched "
                   "over one KV cache on the GPU).")
@click.option("--api-key", default=None, envvar="SPECEXPORT_API_KEY",
              help="Require 'Authorization: Bearer KEY' on /v1 routes (or set SPECEXPORT_API_KEY).")
@click.option("--served-model-name", default="", help="The model name clients ask for (default: the directory's name).")
@click.option("--no-schedule", is_flag=True, help="Draft the full depth at every batch size (ignore draft.schedule).")
@click.option("--per-sequence", is_flag=True, help="Each round's width from the rows' own acceptance and costs.")
@click.option("--adaptive/--fixed-depth", default=True, show_default=True,
              help="Each request's own adaptive depth under the schedule, as `generate` chooses it alone.")
@click.option("--fixed-prices", is_flag=True,
              help="Adaptive depth prices rounds from the engines' costs only, never from the clock (a seeded "
                   "sampled run then repeats its depth choices, and so its draws; default: prices checked "
                   "against the clock while decoding).")
@click.option("--tree-nodes", type=click.IntRange(min=0), default=None,
              help="Draft nodes per round as a token tree, for drafters that build trees (at B > 1 at most the "
                   "schedule's depth per row; 0: chains; default: the recipe's draft.tree for its drafters).")
@click.option("--per-request-spec-decode-metrics", "spec_metrics", type=click.Choice(LEVELS),
              default=None, help="Add vLLM's metrics.speculative_decoding object to every response (the final chunk "
                                 "when streamed): acceptance length and rate, histogram, steps, draft and accepted "
                                 "tokens; detailed adds them per round.")
@click.option("--ray", "use_ray", is_flag=True, help="Serve through Ray Serve: one engine loop per replica.")
@click.option("--replicas", type=click.IntRange(min=1), default=1, show_default=True, help="With --ray.")
@click.option("--autoscale", default=None, help="With --ray: MIN:MAX replicas, scaled by ongoing requests.")
@click.option("--ray-address", default=None, help="With --ray: an existing cluster (default: RAY_ADDRESS, else local).")
@click.option("--log-level", default="warning", show_default=True,
              type=click.Choice(["critical", "error", "warning", "info", "debug"]), help="uvicorn's log level.")
@click.option("--special-tokens-in-content", is_flag=True,
              help="Encode a special token's text inside a message as that token, as transformers does (default: "
                   "messages are encoded as text, so content cannot forge a turn).")
@click.option("--suffix-store-tokens", type=click.IntRange(min=0), default=None,
              help="The suffix drafter's store of earlier responses, shared by every request: at most this many "
                   "tokens, the oldest responses evicted first (0: no store, each request's own context only; "
                   "default: the recipe's store_tokens, 16384 for a directory without a suffix entry).")
def serve(engine_dir: Path, host: str, port: int, drafter: str, max_batch: int | None, max_waiting: int,
          threads: int | None, backend: str | None, api_key: str | None, served_model_name: str, no_schedule: bool, per_sequence: bool,
          adaptive: bool, fixed_prices: bool, use_ray: bool, replicas: int, autoscale: str | None, ray_address: str | None, log_level: str,
          special_tokens_in_content: bool, tree_nodes: int | None, spec_metrics: str | None,
          suffix_store_tokens: int | None) -> None:
    """Serve ENGINE_DIR over OpenAI's API: /v1/completions, /v1/chat/completions (streamed or
    not), /v1/models, /health and /metrics (Prometheus). One engine thread batches every
    request; depth follows the plan's draft.schedule, and each request's adaptive depth under it.
    Targets with linear-attention layers (Qwen3-Next, Qwen3.5) are served on onnxruntime (each
    row its own recurrent state); their TensorRT path is refused."""
    for package, extra in (("fastapi", "serve"), ("uvicorn", "serve"), ("prometheus_client", "serve")):
        if importlib.util.find_spec(package) is None:
            raise missing_extra(package, extra)
    if not use_ray and (replicas != 1 or autoscale or ray_address):
        raise BadInput("--replicas, --autoscale and --ray-address need --ray")
    check_servable(engine_dir, drafter, max_batch, tree_nodes, backend)
    from specexport.serve.config import ServeConfig

    config = ServeConfig(str(engine_dir.resolve()), served_model_name, drafter, max_batch, max_waiting, threads,
                         api_key, not no_schedule, per_sequence, adaptive, special_tokens_in_content, tree_nodes,
                         check_prices=not fixed_prices, spec_metrics=spec_metrics, backend=backend,
                         store_tokens=suffix_store_tokens)
    if use_ray:
        if importlib.util.find_spec("ray") is None:
            raise missing_extra("ray", "ray")
        from specexport.serve import ray_app

        scaling = _autoscale(autoscale)
        ray_app.run(config, host=host, port=port, replicas=replicas,
                    autoscaling=None if scaling is None else {"min_replicas": scaling[0], "max_replicas": scaling[1]},
                    address=ray_address or os.environ.get("RAY_ADDRESS"))
        return
    import uvicorn

    from specexport.serve.app import create_app

    click.echo(f"serving '{config.served_name}' on http://{host}:{port}/v1 (drafter {drafter}, "
               f"max batch {max_batch or 'as built'}, on {backend or DEFAULT_BACKEND}); Ctrl-C stops", err=True)
    uvicorn.run(create_app(config), host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)


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
