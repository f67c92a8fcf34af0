"""`specexport bench`: every drafter against the target alone (and peers) on an engine
directory, one sequence at a time or, with --batch, the batched loop by batch size.

The bench harness, the runtime and the peers load when it runs.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from specexport.backends import BACKENDS, DEFAULT_BACKEND
from specexport.cli.output import print_json


@click.command()
@click.argument("engine_dir", type=click.Path(path_type=Path))
@click.option("--prompts", type=click.Path(path_type=Path), default=Path("bench/prompts/dev.jsonl"),
              show_default=True, help="JSONL prompts: {id, category, messages} (chat) or {id, category, prompt}.")
@click.option("--max-new-tokens", "-n", type=click.IntRange(2), default=128, show_default=True,
              help="Tokens per prompt and run.")
@click.option("--repeats", type=click.IntRange(1), default=3, show_default=True,
              help="Runs of each prompt per runner, interleaved; tokens/s is their median.")
@click.option("--drafters", default=None, help="Comma-separated drafter names (default: all in the manifest).")
@click.option("--peers", default=None, help="Comma-separated peers: transformers-greedy, transformers-prompt-lookup, "
              "transformers-assistant (the recipe's draft model), ort-genai, ort-genai-ngram, ort-genai-int4, "
              "ort-genai-int4-ngram, llama-cpp, llama-cpp-lookup (the llama.cpp peers need a GGUF target), or "
              "'all'. Default: none on the CPU; with --device cuda the three transformers peers, fp16 on the same "
              "GPU. With --batch: the target-alone peers that batch (transformers-greedy, ort-genai) at each "
              "batch size.")
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0 is greedy.")
@click.option("--threads", type=click.IntRange(1), default=2, show_default=True, help="onnxruntime intra-op threads (and each peer's).")
@click.option("--draft-len", type=int, default=None, help="Maximum draft length (default: the plan's D).")
@click.option("--adaptive/--fixed-depth", default=True, show_default=True,
              help="Choose each round's depth from measured costs and acceptance, or always draft --draft-len.")
@click.option("--tree-nodes", default=None,
              help="Comma-separated tree sizes (0,6): each drafter that builds token trees runs at each, side by "
                   "side, labelled DRAFTER+treeN (0: its chain). Default: the recipe's draft.tree for its drafters.")
@click.option("--backend", type=click.Choice(list(BACKENDS)), default=None,
              help=f"Engines to run (default: {DEFAULT_BACKEND} when the directory has them).")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True,
              help="onnxruntime's execution provider for the engines; cuda also runs the transformers peers in "
                   "fp16 on the same GPU and shows the CPU's verify cost curve beside the GPU's.")
@click.option("--cpu-curve", type=click.Path(path_type=Path), default=None,
              help="With --device cuda: the CPU curve from this earlier CPU bench.json (default: measured in "
                   "this run on onnxruntime's CPU provider).")
@click.option("--host-kv", is_flag=True,
              help="tensorrt: keep the KV cache in host memory, copied to the GPU on every run.")
@click.option("--suffix-store-tokens", type=click.IntRange(min=0), default=None,
              help="The suffix drafter's store of earlier responses: its token budget (0: none, each request's "
                   "own context only; default: the recipe's). Runs of one drafter share it, in prompt order; "
                   "with --repeats above 1 a repeat drafts from the earlier repeats' answers.")
@click.option("--out", type=click.Path(path_type=Path), default=Path("bench/out"), show_default=True,
              help="Folder for bench.json, bench.md and the plots.")
@click.option("--baseline", type=click.Path(path_type=Path), default=None,
              help="Compare ratios with this file's baseline for this CPU class; exit 1 on a regression.")
@click.option("--update-baseline", is_flag=True, help="Write the results as --baseline's baseline for this CPU class (other classes kept).")
@click.option("--json", "as_json", is_flag=True, help="Print the result JSON.")
@click.option("--batch", "batch", default=None,
              help="Batch sizes (1,2,4,8): throughput of the batched loop by batch size, the target alone against "
                   "the ngram drafters (or those of --drafters: every kind runs batched) at fixed depths and the "
                   "manifest's schedule, instead of the "
                   "single-sequence bench.")
def bench(engine_dir: Path, prompts: Path, max_new_tokens: int, repeats: int, drafters: str | None,
          peers: str | None, temperature: float, threads: int, draft_len: int | None, adaptive: bool,
          tree_nodes: str | None, backend: str | None, device: str, cpu_curve: Path | None, host_kv: bool,
          suffix_store_tokens: int | None,
          out: Path, baseline: Path | None, update_baseline: bool, as_json: bool, batch: str | None) -> None:
    """Benchmark every drafter against the target alone (and peers) on ENGINE_DIR."""
    from specexport.bench.device import default_peers, load_options, peer_device
    from specexport.bench.harness import BenchOptions, run_bench
    from specexport.bench.render import print_checks, print_summary
    from specexport.bench.report import write
    from specexport.errors import BadInput
    from specexport.progress import Reporter

    if cpu_curve is not None and device == "cpu":
        raise BadInput("--cpu-curve: give it with --device cuda (on the CPU the curve is this run's own)")
    if peers is None:
        peers = default_peers(device, batched=batch is not None)
    if batch is not None:
        from specexport.bench.batched import parse_batches, run_batched, write_batched
        from specexport.runtime import load

        sizes = parse_batches(batch)
        pipe = load(engine_dir, threads=threads, backend=backend, **load_options(device))
        names = drafters.split(",") if drafters else [
            n for n, d in pipe.manifest.drafters.items() if d.kind == "ngram"]
        batch_peers, batch_skipped = [], []
        if peers:
            from specexport.bench.peer_process import start_peers
            from specexport.bench.peers import parse_peer_names

            wanted = parse_peer_names(peers)
            batch_peers, batch_skipped = start_peers(
                pipe.manifest.target_source, pipe.manifest.recipe_root, wanted,
                threads, engine_dir.parent / f".{engine_dir.name}.peers", peer_device(device))
        from specexport.bench.peer_process import close_peers

        try:
            result = run_batched(pipe, prompts, sizes, names, max_new_tokens, Reporter(quiet=as_json),
                                 batch_peers, batch_skipped, repeats)
        finally:
            close_peers(batch_peers)
        files = write_batched(result, out)
        if as_json:
            print_json(result)
        else:
            click.echo((out / "bench_batched.md").read_text())
            click.echo(f"wrote {', '.join(str(f) for f in files)}", err=True)
        return

    from specexport.bench.peers import parse_peer_names

    chosen_peers = parse_peer_names(peers)
    if update_baseline and baseline is None:
        raise BadInput("--update-baseline needs --baseline FILE")
    if baseline is not None:  # a missing or unreadable baseline is refused before minutes of runs
        from specexport.bench.gate import baseline_for, compare, load_baseline, machine_class, write_baseline

        if not update_baseline and not baseline.is_file():
            raise BadInput(f"{baseline}: baseline not found; create it with --update-baseline")
        stored = load_baseline(baseline) if baseline.is_file() else None
    options = BenchOptions(prompts=prompts, max_new_tokens=max_new_tokens, repeats=repeats,
                           drafters=drafters.split(",") if drafters else None, temperature=temperature,
                           threads=threads, adaptive=adaptive, peers=chosen_peers, draft_len=draft_len,
                           backend=backend, device_kv=not host_kv, tree_nodes=_sizes(tree_nodes),
                           device=device, cpu_curve=cpu_curve, store_tokens=suffix_store_tokens)
    result = run_bench(engine_dir, options, Reporter(quiet=as_json))
    files = write(result, out)
    if as_json:
        print_json(result)
    else:
        print_summary(result)
        click.echo(f"wrote {', '.join(str(f) for f in files)}", err=True)
    if baseline is not None:
        machine = machine_class()
        if update_baseline:
            write_baseline(baseline, result, machine)
            click.echo(f"baseline for this CPU class ({machine}) written to {baseline}", err=True)
            return
        entry, same_class = baseline_for(stored, machine)
        if not same_class:
            click.echo(f"{baseline} has no baseline for this CPU class ({machine}): speedups are not gated here, "
                       "E[L] and exactness are; record one with --update-baseline (make bench-update)", err=True)
        checks = compare(result, entry, speedups=same_class)
        print_checks(checks, machine)
        if not all(c.ok for c in checks):
            sys.exit(1)


def _sizes(text: str | None) -> list[int] | None:
    """--tree-nodes 0,6 -> [0, 6]."""
    from specexport.errors import BadInput

    if text is None:
        return None
    try:
        sizes = [int(part) for part in text.split(",")]
    except ValueError:
        raise BadInput(f"--tree-nodes: '{text}' is not comma-separated numbers (0,6)") from None
    if any(size < 0 for size in sizes):
        raise BadInput("--tree-nodes: sizes are >= 0")
    return sizes
