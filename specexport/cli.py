"""The `specexport` command: plan | build | generate | bench | tune | verify | lint.

Exit codes: 0 ok, 1 runtime failure, 2 bad input. Errors the user can fix are one line on
stderr, never a traceback. `build` imports the exporter lazily, so a runtime-only install
can still `generate`.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import click

from specexport import __version__
from specexport.errors import SpecexportError, missing_module


def _fail(message: str, code: int) -> None:
    click.echo(f"specexport: error: {message}", err=True)
    sys.exit(code)


def _print_json(data) -> None:
    click.echo(json.dumps(data, indent=2, default=str))


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="specexport")
def cli() -> None:
    """Compile LLMs and their drafters into static-shape engines; run them as a lossless speculative decoder."""


@cli.command()
@click.argument("recipe", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
@click.option("--calibrate", is_flag=True,
              help="Measure this machine's verify costs and the drafters' acceptance at the tile rule's depth, "
                   "choose D and the depth by batch size (batched verify costs t(B, T)), and write RECIPE's "
                   ".calibration.json (builds a calibration engine directory).")
@click.option("--prompts", type=click.Path(path_type=Path), default=Path("bench/prompts/dev.jsonl"),
              show_default=True, help="With --calibrate: the prompt set.")
@click.option("--max-new-tokens", type=click.IntRange(2), default=48, show_default=True,
              help="With --calibrate: tokens per prompt.")
@click.option("--threads", type=click.IntRange(1), default=2, show_default=True,
              help="With --calibrate: onnxruntime intra-op threads.")
def plan(recipe: Path, as_json: bool, calibrate: bool, prompts: Path, max_new_tokens: int, threads: int) -> None:
    """Show G, the tile arithmetic and the draft length a RECIPE builds for (or, given an
    engine directory, its plan and the engine costs the runtime uses: tuned or the build's)."""
    if (recipe / "manifest.json").is_file():  # an engine directory: the runtime's view, no exporter
        from specexport.errors import BadInput
        from specexport.runtime.costs import costs_in_use, render_costs

        if calibrate:
            raise BadInput(f"{recipe}: --calibrate takes a RECIPE, not an engine directory")
        result = costs_in_use(recipe)
        if as_json:
            _print_json(result)
        else:
            render_costs(result)
        return
    from specexport.exporter.plan_command import plan_recipe, render_plan

    if calibrate:
        from specexport.bench.calibrate import calibrate as run_calibration
        from specexport.bench.render import print_calibration
        from specexport.exporter.progress import Reporter

        choice = run_calibration(recipe, prompts, max_new_tokens, threads, Reporter(quiet=as_json))
        if as_json:
            _print_json(choice)
        else:
            from specexport.bench.calibrate import print_schedule

            print_calibration(choice)
            print_schedule(choice)
        return
    result = plan_recipe(recipe)
    if as_json:
        _print_json(result)
    else:
        render_plan(result)


@cli.command()
@click.argument("recipe", type=click.Path(path_type=Path), required=False)
@click.option("-o", "--out", type=click.Path(path_type=Path), default=None,
              help="Engine directory to write (default: engines/<recipe name>).")
@click.option("--from-onnx", "from_onnx", type=click.Path(path_type=Path), default=None,
              help="Compile an engine directory's ONNX graphs into TensorRT engines on this machine.")
@click.option("--precision", type=click.Choice(["fp32", "fp16", "bf16"]), default=None,
              help="With --from-onnx: override the recipe's precision.")
@click.option("--force", is_flag=True, help="Rebuild even when the inputs are unchanged.")
@click.option("--threads", type=click.IntRange(1), default=None, help="onnxruntime threads for validation.")
@click.option("--quiet", "-q", is_flag=True, help="No progress display.")
@click.option("--json", "as_json", is_flag=True, help="Print the build result as JSON.")
def build(recipe: Path | None, out: Path | None, from_onnx: Path | None, precision: str | None, force: bool,
          threads: int | None, quiet: bool, as_json: bool) -> None:
    """Export, validate and write the engines a RECIPE describes (or compile an existing
    directory's ONNX graphs for TensorRT with --from-onnx DIR)."""
    from specexport.errors import BadInput
    from specexport.exporter.builder import build as run_build
    from specexport.exporter.progress import Reporter

    if from_onnx is not None:
        if recipe is not None or out is not None:
            raise BadInput("give a RECIPE or --from-onnx DIR, not both (--from-onnx rebuilds DIR in place)")
        from specexport.cli_trt import build_from_onnx

        manifest = build_from_onnx(from_onnx, Reporter(quiet=quiet or as_json), precision=precision)
        built = [e["name"] for e in manifest["engines"] if e["backend"] == "tensorrt"]
        if as_json:
            _print_json({"out": str(from_onnx), "tensorrt_engines": built})
        elif not quiet:
            click.echo(f"built {len(built)} TensorRT engines in {from_onnx}")
        return
    if recipe is None:
        raise BadInput("give a RECIPE to build, or --from-onnx DIR")

    reporter = Reporter(quiet=quiet or as_json)
    result = run_build(recipe, out, force, reporter, threads)
    summary = {
        "out": str(result.out),
        "reused": result.reused,
        "seconds": round(result.seconds, 1),
        "plan": result.manifest["plan"],
        "engines": [
            {"name": e["name"], "tokens": e["tokens"], "parity": e.get("parity", {})}
            for e in result.manifest["engines"]
        ],
        "steps": [{"kind": t.kind, "what": t.what, "seconds": round(t.seconds, 2)} for t in reporter.timings],
        "disk_bytes": sum(p.stat().st_size for p in result.out.iterdir() if p.is_file()),
    }
    if as_json:
        _print_json(summary)
    elif not quiet:
        state = "reused" if result.reused else "built"
        click.echo(f"{state} {result.out} in {result.seconds:.1f} s ({summary['disk_bytes'] / 1e6:.1f} MB)")


@cli.command()
@click.argument("engine_dir", type=click.Path(path_type=Path))
@click.option("--prompt", "-p", default=None, help="Prompt text.")
@click.option("--prompt-file", type=click.Path(path_type=Path), default=None, help="Read the prompt from a file.")
@click.option("--chat", is_flag=True, help="Wrap the prompt as a user message in the model's chat template.")
@click.option("--drafter", "-d", default="none", show_default=True, help="Drafter name from the manifest, or none.")
@click.option("--draft-len", type=int, default=None, help="Draft tokens per round at most (default: the plan's D).")
@click.option("--adaptive/--fixed-depth", default=True, show_default=True,
              help="Choose each round's depth from measured costs and acceptance, or always draft --draft-len.")
@click.option("--max-new-tokens", "-n", type=int, default=128, show_default=True, help="Tokens to generate at most.")
@click.option("--temperature", "-t", type=float, default=0.0, show_default=True, help="0 is greedy.")
@click.option("--top-k", type=int, default=0, show_default=True, help="0 is off.")
@click.option("--top-p", type=float, default=1.0, show_default=True, help="1 is off.")
@click.option("--seed", type=int, default=None, help="Seed for sampling (reproducible runs).")
@click.option("--stop", multiple=True, help="Stop string (repeatable); it is cut from the output.")
@click.option("--threads", type=click.IntRange(1), default=None, help="onnxruntime intra-op threads.")
@click.option("--backend", type=click.Choice(["onnxruntime", "tensorrt"]), default=None,
              help="Engines to run (default: onnxruntime when the directory has them).")
@click.option("--device", type=click.Choice(["cpu", "cuda", "tensorrt"]), default="cpu", show_default=True,
              help="onnxruntime execution provider for the ONNX graphs.")
@click.option("--host-kv", is_flag=True,
              help="tensorrt: keep the KV cache in host memory, copied to the GPU on every run "
                   "(default: on the GPU, read and appended in place).")
@click.option("--stream", is_flag=True, help="Print text as tokens are accepted.")
@click.option("--json", "as_json", is_flag=True, help="Print text, token ids, stop reason and stats as JSON.")
@click.option("--prompts-file", type=click.Path(path_type=Path), default=None,
              help="JSONL prompts ({id, messages} or {id, prompt}, the bench's format), decoded together in "
                   "batches (engines built with shapes.batch); with --json one line per prompt.")
@click.option("--max-batch", type=click.IntRange(1), default=None,
              help="With --prompts-file: sequences decoded together at most (default: the largest batch built).")
def generate(engine_dir: Path, prompt: str | None, prompt_file: Path | None, chat: bool, drafter: str,
             draft_len: int | None, adaptive: bool, max_new_tokens: int, temperature: float, top_k: int, top_p: float,
             seed: int | None, stop: tuple[str, ...], threads: int | None, backend: str | None, device: str,
             host_kv: bool, stream: bool, as_json: bool, prompts_file: Path | None, max_batch: int | None) -> None:
    """Generate text from ENGINE_DIR with a drafter, losslessly."""
    from specexport.errors import BadInput
    from specexport.runtime import load

    if prompts_file is not None:
        if prompt is not None or prompt_file is not None:
            raise BadInput("give --prompts-file alone, without --prompt or --prompt-file")
        _generate_batch(engine_dir, prompts_file, max_batch, as_json, dict(
            chat=chat, drafter=drafter, draft_len=draft_len, adaptive=adaptive, max_new_tokens=max_new_tokens,
            temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, stop=stop), dict(threads=threads, backend=backend, device=device))
        return
    if prompt_file is not None:
        if prompt is not None:
            raise BadInput("give --prompt or --prompt-file, not both")
        try:
            prompt = prompt_file.read_text()
        except OSError as err:
            raise BadInput(f"{prompt_file}: cannot read the prompt file ({err.strerror})") from None
    pipe = load(engine_dir, threads=threads, backend=backend, device=device, device_kv=not host_kv)
    pieces = pipe.stream(prompt, chat=chat, drafter=drafter, draft_len=draft_len, adaptive=adaptive,
                         max_new_tokens=max_new_tokens,
                         temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, stop=stop)
    while True:
        try:
            piece = next(pieces)
        except StopIteration as done:
            result = done.value
            break
        if stream and not as_json:
            click.echo(piece, nl=False)
    if as_json:
        _print_json(result.to_dict())
    elif stream:
        click.echo()
    else:
        click.echo(result.text)
    if not as_json:
        st = result.stats
        # a model on another backend than asked (the int4 drafter on onnxruntime beside TensorRT)
        label = "; ".join([result.drafter, *(f"{m} on {b}" for m, b in result.backends.items() if b != pipe.backend)])
        click.echo(
            f"[{label}] {st.tokens} tokens, {st.tokens / st.total_s if st.total_s else 0:.1f} tok/s, "
            f"E[L] {st.acceptance_length:.2f}, stop: {result.stop_reason}; "
            f"engines: draft {st.draft_engine_s * 1e3:.0f} ms, verify {st.verify_s * 1e3:.0f} ms; "
            f"host {st.host_s * 1e3:.0f} ms ({st.host_s / st.total_s if st.total_s else 0:.1%})",
            err=True,
        )




def _generate_batch(engine_dir: Path, prompts_file: Path, max_batch: int | None, as_json: bool, settings: dict,
                    load_options: dict) -> None:
    """`generate --prompts-file`: every prompt through the batched loop, one result per prompt."""
    from specexport.bench.harness import load_prompts
    from specexport.runtime import load

    records = load_prompts(prompts_file)
    pipe = load(engine_dir, **load_options)
    results = pipe.generate_batch(records, max_batch=max_batch, **settings)
    for record, result in zip(records, results):
        if as_json:
            click.echo(json.dumps({"id": record["id"], **result.to_dict()}, default=str))
        else:
            click.echo(f"[{record['id']}] {result.text}")
    if not as_json:
        tokens = sum(r.stats.tokens for r in results)
        click.echo(f"{len(results)} prompts, {tokens} tokens ({results[0].drafter})", err=True)
@cli.command()
@click.argument("engine_dir", type=click.Path(path_type=Path))
@click.option("--prompts", type=click.Path(path_type=Path), default=Path("bench/prompts/dev.jsonl"),
              show_default=True, help="JSONL prompts: {id, category, messages} (chat) or {id, category, prompt}.")
@click.option("--max-new-tokens", "-n", type=click.IntRange(2), default=128, show_default=True,
              help="Tokens per prompt and run.")
@click.option("--repeats", type=click.IntRange(1), default=3, show_default=True,
              help="Runs of each prompt per runner, interleaved; tokens/s is their median.")
@click.option("--drafters", default=None, help="Comma-separated drafter names (default: all in the manifest).")
@click.option("--peers", default="", help="Comma-separated peers: transformers-greedy, transformers-prompt-lookup, "
              "ort-genai, ort-genai-ngram, or 'all'. With --batch: the target-alone peers that batch "
              "(transformers-greedy, ort-genai) at each batch size.")
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0 is greedy.")
@click.option("--threads", type=click.IntRange(1), default=2, show_default=True, help="onnxruntime intra-op threads (and each peer's).")
@click.option("--draft-len", type=int, default=None, help="Maximum draft length (default: the plan's D).")
@click.option("--adaptive/--fixed-depth", default=True, show_default=True,
              help="Choose each round's depth from measured costs and acceptance, or always draft --draft-len.")
@click.option("--backend", type=click.Choice(["onnxruntime", "tensorrt"]), default=None,
              help="Engines to run (default: onnxruntime when the directory has them).")
@click.option("--host-kv", is_flag=True,
              help="tensorrt: keep the KV cache in host memory, copied to the GPU on every run.")
@click.option("--out", type=click.Path(path_type=Path), default=Path("bench/out"), show_default=True,
              help="Folder for bench.json, bench.md and the plots.")
@click.option("--baseline", type=click.Path(path_type=Path), default=None,
              help="Compare ratios with this baseline; exit 1 on a regression.")
@click.option("--update-baseline", is_flag=True, help="Write the results as the new --baseline.")
@click.option("--json", "as_json", is_flag=True, help="Print the result JSON.")
@click.option("--batch", "batch", default=None,
              help="Batch sizes (1,2,4,8): throughput of the batched loop by batch size, the target alone against "
                   "the ngram drafters (or those of --drafters: every kind runs batched) at fixed depths and the "
                   "manifest's schedule, instead of the "
                   "single-sequence bench.")
def bench(engine_dir: Path, prompts: Path, max_new_tokens: int, repeats: int, drafters: str | None, peers: str,
          temperature: float, threads: int, draft_len: int | None, adaptive: bool, backend: str | None, host_kv: bool,
          out: Path, baseline: Path | None, update_baseline: bool, as_json: bool, batch: str | None) -> None:
    """Benchmark every drafter against the target alone (and peers) on ENGINE_DIR."""
    from specexport.bench.harness import BenchOptions, run_bench
    from specexport.bench.render import print_checks, print_summary
    from specexport.bench.report import write
    from specexport.errors import BadInput
    from specexport.progress import Reporter

    if batch is not None:
        from specexport.bench.batched import parse_batches, run_batched, write_batched
        from specexport.runtime import load

        sizes = parse_batches(batch)
        pipe = load(engine_dir, threads=threads, backend=backend)
        names = drafters.split(",") if drafters else [
            n for n, d in pipe.manifest.drafters.items() if d.kind == "ngram"]
        batch_peers, batch_skipped = [], []
        if peers:
            from specexport.bench.peer_process import start_peers
            from specexport.bench.peers import PEER_NAMES

            wanted = list(PEER_NAMES) if peers == "all" else [p for p in peers.split(",") if p]
            unknown = sorted(set(wanted) - set(PEER_NAMES))
            if unknown:
                raise BadInput(f"--peers: unknown peer {unknown[0]!r}; choose from {', '.join(PEER_NAMES)} or all")
            batch_peers, batch_skipped = start_peers(
                pipe.manifest.raw["recipe"]["target"], Path(pipe.manifest.raw.get("recipe_dir", ".")), wanted,
                threads, engine_dir.parent / f".{engine_dir.name}.peers")
        from specexport.bench.peer_process import close_peers

        try:
            result = run_batched(pipe, prompts, sizes, names, max_new_tokens, Reporter(quiet=as_json),
                                 batch_peers, batch_skipped, repeats)
        finally:
            close_peers(batch_peers)
        files = write_batched(result, out)
        if as_json:
            _print_json(result)
        else:
            click.echo((out / "bench_batched.md").read_text())
            click.echo(f"wrote {', '.join(str(f) for f in files)}", err=True)
        return

    peer_names = ["transformers-greedy", "transformers-prompt-lookup", "ort-genai", "ort-genai-ngram"]
    chosen_peers = peer_names if peers == "all" else [p for p in peers.split(",") if p]
    unknown = sorted(set(chosen_peers) - set(peer_names))
    if unknown:
        raise BadInput(f"--peers: unknown peer {unknown[0]!r}; choose from {', '.join(peer_names)} or all")
    if update_baseline and baseline is None:
        raise BadInput("--update-baseline needs --baseline FILE")
    options = BenchOptions(prompts=prompts, max_new_tokens=max_new_tokens, repeats=repeats,
                           drafters=drafters.split(",") if drafters else None, temperature=temperature,
                           threads=threads, adaptive=adaptive, peers=chosen_peers, draft_len=draft_len,
                           backend=backend, device_kv=not host_kv)
    result = run_bench(engine_dir, options, Reporter(quiet=as_json))
    files = write(result, out)
    if as_json:
        _print_json(result)
    else:
        print_summary(result)
        click.echo(f"wrote {', '.join(str(f) for f in files)}", err=True)
    if baseline is not None:
        from specexport.bench.gate import compare, load_baseline, write_baseline

        if update_baseline:
            write_baseline(baseline, result)
            click.echo(f"baseline written to {baseline}", err=True)
            return
        if not baseline.is_file():
            raise BadInput(f"{baseline}: baseline not found; create it with --update-baseline")
        checks = compare(result, load_baseline(baseline))
        print_checks(checks)
        if not all(c.ok for c in checks):
            sys.exit(1)


@cli.command()
@click.argument("engine_dir", type=click.Path(path_type=Path))
@click.option("--rounds", type=click.IntRange(1), default=9, show_default=True,
              help="Timed rounds (after one warm-up); each round runs every graph once, medians kept.")
@click.option("--threads", type=click.IntRange(1), default=None, help="onnxruntime intra-op threads.")
@click.option("--backend", type=click.Choice(["onnxruntime", "tensorrt"]), default=None,
              help="Engines to time (default: onnxruntime when the directory has them).")
@click.option("--json", "as_json", is_flag=True, help="Print what was written as JSON.")
def tune(engine_dir: Path, rounds: int, threads: int | None, backend: str | None, as_json: bool) -> None:
    """Measure every graph's cost on this machine; the runtime then prefers them (costs.json)."""
    from specexport.runtime import load
    from specexport.runtime.costs import costs_in_use, render_costs
    from specexport.runtime.costs import tune as run_tune

    pipe = load(engine_dir, threads=threads, backend=backend, tuned_costs=False)
    data = run_tune(pipe, rounds)
    if as_json:
        _print_json(data)
        return
    render_costs(costs_in_use(engine_dir))
    click.echo(f"wrote {data['written_to']}", err=True)


@cli.command()
@click.argument("engine_dir", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print each file's check as JSON.")
def verify(engine_dir: Path, as_json: bool) -> None:
    """Hash every file of ENGINE_DIR against its manifest (loads re-hash only changed files)."""
    from rich.console import Console
    from rich.table import Table

    from specexport.errors import BadInput
    from specexport.runtime.integrity import verify_all
    from specexport.runtime.manifest import Manifest

    manifest = Manifest.load(engine_dir)
    checks = verify_all(manifest)
    bad = [c for c in checks if not c.ok]
    if as_json:
        _print_json({"engine_dir": str(engine_dir), "ok": not bad,
                     "files": [{"file": c.path, "size": c.size, "ok": c.ok, "note": c.note} for c in checks]})
    else:
        table = Table(title=f"{engine_dir}: sha256 of every file against the manifest")
        for column in ("file", "size", "ok"):
            table.add_column(column, justify="right" if column == "size" else "left")
        for c in checks:
            table.add_row(c.path, f"{c.size:,}", ("[green]ok[/]" if c.ok else "[red]CHANGED[/]")
                          + (f" ({c.note})" if c.note else ""))
        Console().print(table)
    if bad:
        what = bad[0].note or "sha256 does not match the manifest"
        raise BadInput(f"{Path(engine_dir) / bad[0].path}: {what} ({len(bad)} of {len(checks)} files changed "
                       "after the build); rebuild the engine directory with specexport build --force")


from specexport.cli_trt import lint  # noqa: E402  (click only; onnx and TensorRT load lazily)

cli.add_command(lint)


def _terminated(signum, frame) -> None:
    raise KeyboardInterrupt


def main() -> None:
    # A terminated build cleans up like an interrupted one.
    signal.signal(signal.SIGTERM, _terminated)
    try:
        code = cli.main(standalone_mode=False)
        if isinstance(code, int) and code:  # a command's ctx.exit(code)
            sys.exit(code)
    except click.exceptions.Exit as done:
        sys.exit(done.exit_code)
    except click.exceptions.Abort:
        _fail("interrupted", 130)
    except click.ClickException as err:
        err.show()
        sys.exit(err.exit_code)
    except SpecexportError as err:
        _fail(str(err), err.exit_code)
    except KeyboardInterrupt:
        _fail("interrupted; nothing was written", 130)
    except Exception as err:  # noqa: BLE001 - the last line of defence against tracebacks
        missing = missing_module(err)  # an extra's package, imported when the command runs
        if missing is not None:
            _fail(str(missing), missing.exit_code)
        if os.environ.get("SPECEXPORT_DEBUG"):
            raise
        _fail(f"internal error: {type(err).__name__}: {err} (set SPECEXPORT_DEBUG=1 for the traceback)", 1)

from specexport.cli_distill import distill  # noqa: E402  (click only; torch loads when it runs)

cli.add_command(distill)
from specexport.cli_serve import serve  # noqa: E402  (click only; FastAPI and uvicorn load when it runs)

cli.add_command(serve)
from specexport.cli_bench_serve import bench_serve  # noqa: E402  (click only; httpx loads when it runs)

cli.add_command(bench_serve)
