"""Commands that run an engine directory: `generate` (text, one prompt or a JSONL of them
batched), `tune` (measure its graphs' costs on this machine) and `verify` (hash its files).

onnxruntime and the runtime load when a command runs; none of them imports torch.
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from specexport.backends import BACKENDS, DEFAULT_BACKEND
from specexport.cli.controls import output_options
from specexport.cli.output import noise_reported, print_json


@click.command()
@click.argument("engine_dir", type=click.Path(path_type=Path))
@click.option("--prompt", "-p", default=None, help="Prompt text.")
@click.option("--prompt-file", type=click.Path(path_type=Path), default=None, help="Read the prompt from a file.")
@click.option("--chat", is_flag=True, help="Wrap the prompt as a user message in the model's chat template.")
@click.option("--drafter", "-d", default="none", show_default=True, help="Drafter name from the manifest, or none.")
@click.option("--draft-len", type=int, default=None, help="Draft tokens per round at most (default: the plan's D).")
@click.option("--adaptive/--fixed-depth", default=True, show_default=True,
              help="Choose each round's depth from measured costs and acceptance, or always draft --draft-len.")
@click.option("--fixed-prices", is_flag=True,
              help="Adaptive depth prices rounds from the engines' costs only, never from the clock (a seeded "
                   "sampled run then repeats its depth choices, and so its draws; default: prices checked "
                   "against the clock while decoding).")
@click.option("--tree-nodes", type=click.IntRange(0), default=None,
              help="Draft up to N nodes per round as a token tree where the drafter builds trees (0: chains; "
                   "default: the recipe's draft.tree.max_nodes for the drafters in draft.tree.drafters, else 0). "
                   "With --prompts-file a row's tree has at most the batch's depth in nodes.")
@click.option("--max-new-tokens", "-n", type=int, default=128, show_default=True, help="Tokens to generate at most.")
@click.option("--temperature", "-t", type=float, default=0.0, show_default=True, help="0 is greedy.")
@click.option("--top-k", type=int, default=0, show_default=True, help="0 is off.")
@click.option("--top-p", type=float, default=1.0, show_default=True, help="1 is off.")
@click.option("--seed", type=int, default=None,
              help="Seed for sampling: runs repeat with --fixed-prices or --fixed-depth (adaptive depth by the clock may choose other depths, and so other draws).")
@click.option("--stop", multiple=True, help="Stop string (repeatable); it is cut from the output.")
@click.option("--threads", type=click.IntRange(1), default=None, help="onnxruntime intra-op threads.")
@click.option("--backend", type=click.Choice(list(BACKENDS)), default=None,
              help=f"Engines to run (default: {DEFAULT_BACKEND} when the directory has them).")
@click.option("--device", type=click.Choice(["cpu", "cuda", "tensorrt"]), default="cpu", show_default=True,
              help="onnxruntime execution provider for the ONNX graphs (tensorrt: the old spelling of "
                   "--backend tensorrt).")
@click.option("--host-kv", is_flag=True,
              help="tensorrt: keep the KV cache in host memory, copied to the GPU on every run "
                   "(default: on the GPU, read and appended in place).")
@click.option("--device-store", is_flag=True,
              help="onnxruntime: keep the caches as OrtValues bound by address (the device store), on the CPU "
                   "too (always on with --device cuda); a run moves only tokens in and outputs out.")
@click.option("--cuda-graphs", is_flag=True,
              help="On a GPU: capture each static shape's run once as a CUDA graph and replay it "
                   "(onnxruntime --device cuda, or --backend tensorrt).")
@click.option("--stream", is_flag=True, help="Print text as tokens are accepted.")
@click.option("--json", "as_json", is_flag=True, help="Print text, token ids, stop reason and stats as JSON.")
@click.option("--prompts-file", type=click.Path(path_type=Path), default=None,
              help="JSONL prompts ({id, messages} or {id, prompt}, the bench's format), decoded together in "
                   "batches (engines built with shapes.batch); with --json one line per prompt.")
@click.option("--max-batch", type=click.IntRange(1), default=None,
              help="With --prompts-file: sequences decoded together at most (default: the largest batch built).")
@output_options
def generate(engine_dir: Path, prompt: str | None, prompt_file: Path | None, chat: bool, drafter: str,
             draft_len: int | None, adaptive: bool, fixed_prices: bool, tree_nodes: int | None, max_new_tokens: int, temperature: float, top_k: int, top_p: float,
             seed: int | None, stop: tuple[str, ...], threads: int | None, backend: str | None, device: str,
             host_kv: bool, device_store: bool, cuda_graphs: bool, stream: bool, as_json: bool,
             prompts_file: Path | None, max_batch: int | None,
             controls, min_p: float) -> None:
    """Generate text from ENGINE_DIR with a drafter, losslessly."""
    from specexport.errors import BadInput
    from specexport.runtime import load

    if prompts_file is not None:
        if prompt is not None or prompt_file is not None:
            raise BadInput("give --prompts-file alone, without --prompt or --prompt-file")
        _generate_batch(engine_dir, prompts_file, max_batch, as_json, dict(
            chat=chat, drafter=drafter, draft_len=draft_len, adaptive=adaptive, max_new_tokens=max_new_tokens,
            temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed, stop=stop, controls=controls,
            tree_nodes=tree_nodes),
            dict(threads=threads, backend=backend, device=device, device_kv=not host_kv, check_prices=not fixed_prices,
                 device_store=device_store, cuda_graphs=cuda_graphs))
        return
    if prompt_file is not None:
        if prompt is not None:
            raise BadInput("give --prompt or --prompt-file, not both")
        try:
            prompt = prompt_file.read_text()
        except OSError as err:
            raise BadInput(f"{prompt_file}: cannot read the prompt file ({err.strerror})") from None
    pipe = load(engine_dir, threads=threads, backend=backend, device=device, device_kv=not host_kv,
                check_prices=not fixed_prices, device_store=device_store, cuda_graphs=cuda_graphs)
    pieces = pipe.stream(prompt, chat=chat, drafter=drafter, draft_len=draft_len, adaptive=adaptive,
                         max_new_tokens=max_new_tokens, tree_nodes=tree_nodes,
                         temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed, stop=stop,
                         controls=controls)
    while True:
        try:
            piece = next(pieces)
        except StopIteration as done:
            result = done.value
            break
        if stream and not as_json:
            click.echo(piece, nl=False)
    if as_json:
        print_json(result.to_dict())
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
            + (f"tree nodes verified: {st.tree_nodes}; " if st.tree_nodes else "") +
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


@click.command()
@click.argument("engine_dir", type=click.Path(path_type=Path))
@click.option("--rounds", type=click.IntRange(1), default=9, show_default=True,
              help="Timed rounds (after one warm-up); each round runs every graph once, medians kept.")
@click.option("--threads", type=click.IntRange(1), default=None, help="onnxruntime intra-op threads.")
@click.option("--backend", type=click.Choice(list(BACKENDS)), default=None,
              help=f"Engines to time (default: {DEFAULT_BACKEND} when the directory has them).")
@click.option("--json", "as_json", is_flag=True, help="Print what was written as JSON.")
@click.option("--accept-noise", is_flag=True,
              help="Write the costs even where a graph's rounds spread more than the noise limit "
                   "(runtime/timing_noise.py); without it such a run writes nothing and exits 3.")
def tune(engine_dir: Path, rounds: int, threads: int | None, backend: str | None, as_json: bool,
         accept_noise: bool) -> None:
    """Measure every graph's cost on this machine; the runtime then prefers them (costs.json)."""
    from specexport.cli.output import render_costs
    from specexport.runtime import load
    from specexport.runtime.costs import costs_in_use
    from specexport.runtime.costs import tune as run_tune

    pipe = load(engine_dir, threads=threads, backend=backend, tuned_costs=False)
    with noise_reported():
        data = run_tune(pipe, rounds, accept_noise)
    if as_json:
        print_json(data)
        return
    render_costs(costs_in_use(engine_dir))
    click.echo(f"wrote {data['written_to']}", err=True)


@click.command()
@click.argument("engine_dir", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print each file's check as JSON.")
def verify(engine_dir: Path, as_json: bool) -> None:
    """Hash every file of ENGINE_DIR against its manifest (loads re-hash only changed files)."""
    from rich.console import Console
    from rich.table import Table

    from specexport.contract import Manifest
    from specexport.errors import BadInput
    from specexport.runtime.integrity import verify_all

    manifest = Manifest.load(engine_dir)
    checks = verify_all(manifest)
    bad = [c for c in checks if not c.ok]
    if as_json:
        print_json({"engine_dir": str(engine_dir), "ok": not bad,
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
