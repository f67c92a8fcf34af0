"""`specexport distill`: train a drafter head for a recipe's target (exporter/distill/).

torch and the exporter load only when it runs, so a runtime-only install still imports the CLI.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import click

from specexport.errors import BadInput, missing_extra


def _layers(value: str | None) -> list[int] | None:
    if value is None:
        return None
    try:
        return [int(x) for x in value.split(",")]
    except ValueError:
        raise BadInput(f"--layers: '{value}' is not a comma-separated list of layer indices (2,15,27)") from None


@click.command()
@click.argument("recipe", type=click.Path(path_type=Path))
@click.option("--drafter", "drafter", default="eagle3", show_default=True,
              help="The head to train: eagle3 (SafeAILab layout), dflash or dspark (speculators layout).")
@click.option("-o", "--out", type=click.Path(path_type=Path), required=True,
              help="Output folder: the checkpoint (config.json, model.safetensors), distill.json, state/.")
@click.option("--minutes", type=click.FloatRange(min=0.0, min_open=True), default=10.0, show_default=True,
              help="Training time of this run (data preparation not counted).")
@click.option("--device", default="cpu", show_default=True, help="cpu or cuda.")
@click.option("--prompts", "prompts", type=click.Path(path_type=Path), multiple=True,
              help="JSONL prompts ({messages} or {prompt}, the bench's format) the target answers itself; "
                   "repeatable. Not the bench's own set (bench/prompts/dev.jsonl): that would inflate its E[L].")
@click.option("--data", "data", type=click.Path(path_type=Path), multiple=True,
              help="JSONL text to train on as is: {text} or {messages} ending with an assistant turn; repeatable.")
@click.option("--resume", is_flag=True, help="Continue the run whose checkpoint is in --out (its data and settings).")
@click.option("--init", "init", type=click.Path(path_type=Path), default=None,
              help="eagle3: fine-tune this trained head (SafeAILab layout; its draft vocabulary and taps) "
                   "instead of starting from scratch.")
@click.option("--force", is_flag=True, help="Start over, replacing an earlier run's --out.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seeds the data split, sampling and initialisation.")
@click.option("--max-steps", type=click.IntRange(1), default=None, help="Stop after this many optimizer steps in all.")
@click.option("--eval-minutes", type=click.FloatRange(min=0.0, min_open=True), default=2.0, show_default=True,
              help="Score the held-out split (and write a checkpoint) this often.")
@click.option("--samples", type=click.IntRange(0), default=1, show_default=True,
              help="Sampled responses per training prompt, besides the greedy one.")
@click.option("--temperature", type=click.FloatRange(min=0.0, min_open=True), default=0.7, show_default=True,
              help="Temperature of the sampled responses (--samples).")
@click.option("--max-new", type=click.IntRange(1), default=256, show_default=True, help="Tokens per response.")
@click.option("--gen-batch", type=click.IntRange(1), default=64, show_default=True, help="Prompts per generate call.")
@click.option("--holdout", type=click.FloatRange(0.0, 0.5), default=0.05, show_default=True,
              help="Share of prompts (and data lines) held out for scoring.")
@click.option("--draft-vocab", type=click.IntRange(2), default=8192, show_default=True,
              help="Draft vocabulary: the most frequent response tokens (d2t/t2d).")
@click.option("--topk", type=click.IntRange(1), default=64, show_default=True,
              help="The target's distribution is kept as its top K draft tokens.")
@click.option("--ttt-steps", type=click.IntRange(1), default=5, show_default=True,
              help="Unrolled training-time-test steps.")
@click.option("--batch-tokens", type=click.IntRange(16), default=8192, show_default=True,
              help="Padded tokens per training batch.")
@click.option("--lr", type=click.FloatRange(min=0.0, min_open=True), default=1e-3, show_default=True,
              help="Peak learning rate (AdamW, warm-up then cosine).")
@click.option("--warmup", type=click.IntRange(0), default=100, show_default=True, help="Warm-up steps.")
@click.option("--layers", default=None, help="Target layers tapped, the stream entering each (default eagle3: "
              "2,L//2,L-3; dflash: up to 5 spread over 1..L-1).")
@click.option("--block-size", type=click.IntRange(2), default=None,
              help="dflash/dspark: block size, the anchor + its drafts (default: the plan's D + 1; dspark, "
                   "whose anchor slot drafts too: D).")
@click.option("--draft-layers", type=click.IntRange(1), default=1, show_default=True,
              help="dflash/dspark: decoder layers of the head.")
@click.option("--anchors", type=click.IntRange(1), default=64, show_default=True,
              help="dflash/dspark: random blocks per sequence per step (and blocks per scoring pass).")
@click.option("--gamma", type=click.FloatRange(min=0.0, min_open=True), default=None,
              help="dflash/dspark: loss weight exp(-i/gamma) of drafting slot i (default: 7 at 15 drafts, "
                   "5 at 9, 4 at 7).")
@click.option("--markov-rank", type=click.IntRange(1), default=None,
              help="dspark: rank of the vanilla Markov head (default: 32).")
@click.option("--cache-dir", type=click.Path(path_type=Path, file_okay=False), default=None,
              help="Where the teacher's rows are cached (default: the system's temporary folder).")
@click.option("--cache-gb", type=click.FloatRange(0.0), default=4.0, show_default=True,
              help="Size cap of that cache; past it rows are recomputed.")
@click.option("--quiet", "-q", is_flag=True, help="No progress display.")
def distill(recipe: Path, drafter: str, out: Path, minutes: float, device: str, prompts: tuple[Path, ...],
            data: tuple[Path, ...], resume: bool, init: Path | None, force: bool, seed: int, max_steps: int | None,
            eval_minutes: float, samples: int, temperature: float, max_new: int, gen_batch: int, holdout: float,
            draft_vocab: int, topk: int, ttt_steps: int, batch_tokens: int, lr: float, warmup: int,
            layers: str | None, block_size: int | None, draft_layers: int, anchors: int, gamma: float | None,
            markov_rank: int | None, cache_dir: Path | None, cache_gb: float, quiet: bool) -> None:
    """Train a drafter head (--drafter eagle3, dflash or dspark) for RECIPE's target from the target's
    own responses; write a checkpoint a recipe's drafters can name (kind: eagle3, dflash or dspark, path: OUT)."""
    if importlib.util.find_spec("torch") is None or importlib.util.find_spec("transformers") is None:
        raise missing_extra("torch", "export")
    from specexport.exporter.distill.command import DistillOptions, summary
    from specexport.exporter.distill.command import distill as run

    opts = DistillOptions(
        recipe=recipe, drafter=drafter, out=out, minutes=minutes, device=device, prompts=list(prompts),
        data=list(data), resume=resume, init=init, force=force, seed=seed, max_steps=max_steps, eval_minutes=eval_minutes,
        samples=samples, temperature=temperature, max_new=max_new, gen_batch=gen_batch, holdout=holdout,
        draft_vocab=draft_vocab, topk=topk, ttt_steps=ttt_steps, batch_tokens=batch_tokens, lr=lr, warmup=warmup,
        layers=_layers(layers), block_size=block_size, draft_layers=draft_layers, anchors=anchors, gamma=gamma,
        markov_rank=markov_rank, cache_dir=cache_dir, cache_gb=cache_gb, quiet=quiet,
    )
    provenance = run(opts)
    if not quiet:
        click.echo(f"wrote {out}: {summary(provenance)}")
