"""`specexport serve`: the OpenAI-compatible server (specexport/serve/).

Kept apart from cli.py, which registers it; FastAPI, uvicorn and Ray load only when it runs.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import click

from specexport.errors import BadInput, missing_extra


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


def check_servable(engine_dir: Path, drafter: str, max_batch: int | None) -> str:
    """Fail before the port opens on what would fail while loading: the directory, a target
    that cannot batch, the drafter, batched engines. Returns the drafter to run."""
    from specexport.runtime.batch_drafter import batched_refusal
    from specexport.runtime.manifest import Manifest
    from specexport.serve.config import refuse_recurrent_target

    manifest = Manifest.load(engine_dir)
    refuse_recurrent_target(manifest, engine_dir)  # first: rebuilding with ort-gqa would not help it
    info = manifest.models["target"]
    if info.attention != "ort-gqa" or "onnxruntime" not in manifest.backends():
        raise BadInput(f"{engine_dir}: serve batches requests and needs onnxruntime engines built with "
                       "attention: ort-gqa (set it in the recipe and rebuild)")
    built = manifest.batch_sizes("target")
    if max_batch is not None and max_batch < min(built):
        raise BadInput(f"--max-batch: {max_batch} is below the smallest batch size built ({min(built)})")
    if drafter != "none":
        entry = manifest.drafters.get(drafter)
        if entry is None:
            raise BadInput(f"--drafter: unknown drafter '{drafter}'; this engine directory has: "
                           f"{', '.join(['none', *manifest.drafters])}")
        reason = batched_refusal(manifest, drafter, max_batch)
        if reason is not None:
            raise BadInput(f"--drafter: '{drafter}' ({entry.kind}) cannot run batched: {reason}")
    return drafter


@click.command()
@click.argument("engine_dir", type=click.Path(path_type=Path))
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind (0.0.0.0: every interface).")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True, help="Port to bind.")
@click.option("--drafter", default="ngram", show_default=True,
              help="none, or any drafter the directory has (ngram, quantized-self, a draft model, or a head: "
                   "eagle3, mtp, dflash, dspark); every one runs batched.")
@click.option("--max-batch", type=click.IntRange(min=1), default=None,
              help="Sequences per round (default: the largest batch size built).")
@click.option("--max-waiting", type=click.IntRange(min=0), default=64, show_default=True,
              help="Requests queued beyond the running ones; more are answered 429.")
@click.option("--threads", type=click.IntRange(min=1), default=None, help="onnxruntime threads (default: all cores).")
@click.option("--api-key", default=None, envvar="SPECEXPORT_API_KEY",
              help="Require 'Authorization: Bearer KEY' on /v1 routes (or set SPECEXPORT_API_KEY).")
@click.option("--served-model-name", default="", help="The model name clients ask for (default: the directory's name).")
@click.option("--no-schedule", is_flag=True, help="Draft the full depth at every batch size (ignore draft.schedule).")
@click.option("--per-sequence", is_flag=True, help="Each round's width from the rows' own acceptance and costs.")
@click.option("--adaptive/--fixed-depth", default=True, show_default=True,
              help="Each request's own adaptive depth under the schedule, as `generate` chooses it alone.")
@click.option("--ray", "use_ray", is_flag=True, help="Serve through Ray Serve: one engine loop per replica.")
@click.option("--replicas", type=click.IntRange(min=1), default=1, show_default=True, help="With --ray.")
@click.option("--autoscale", default=None, help="With --ray: MIN:MAX replicas, scaled by ongoing requests.")
@click.option("--ray-address", default=None, help="With --ray: an existing cluster (default: RAY_ADDRESS, else local).")
@click.option("--log-level", default="warning", show_default=True,
              type=click.Choice(["critical", "error", "warning", "info", "debug"]), help="uvicorn's log level.")
def serve(engine_dir: Path, host: str, port: int, drafter: str, max_batch: int | None, max_waiting: int,
          threads: int | None, api_key: str | None, served_model_name: str, no_schedule: bool, per_sequence: bool,
          adaptive: bool, use_ray: bool, replicas: int, autoscale: str | None, ray_address: str | None, log_level: str) -> None:
    """Serve ENGINE_DIR over OpenAI's API: /v1/completions, /v1/chat/completions (streamed or
    not), /v1/models, /health and /metrics (Prometheus). One engine thread batches every
    request; depth follows the plan's draft.schedule, and each request's adaptive depth under it.
    Targets with linear-attention layers (Qwen3-Next, Qwen3.5) run at batch 1 only: refused."""
    for package, extra in (("fastapi", "serve"), ("uvicorn", "serve"), ("prometheus_client", "serve")):
        if importlib.util.find_spec(package) is None:
            raise missing_extra(package, extra)
    if not use_ray and (replicas != 1 or autoscale or ray_address):
        raise BadInput("--replicas, --autoscale and --ray-address need --ray")
    check_servable(engine_dir, drafter, max_batch)
    from specexport.serve.config import ServeConfig

    config = ServeConfig(str(engine_dir.resolve()), served_model_name, drafter, max_batch, max_waiting, threads,
                         api_key, not no_schedule, per_sequence, adaptive)
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
               f"max batch {max_batch or 'as built'}); Ctrl-C stops", err=True)
    uvicorn.run(create_app(config), host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
