"""Commands from a recipe to an engine directory: `plan` (the draft length and tile arithmetic
a recipe builds for, or an engine directory's costs) and `build` (or `build --from-onnx`).

The exporter loads when a command runs, so a runtime-only install still imports the CLI.
"""

from __future__ import annotations

from pathlib import Path

import click

from specexport.cli.output import noise_reported, print_json


@click.command()
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
@click.option("--rounds", type=click.IntRange(1), default=9, show_default=True,
              help="With --calibrate: timed rounds of every cost measurement (medians kept).")
@click.option("--accept-noise", is_flag=True,
              help="With --calibrate: write the calibration even where a graph's rounds spread more than the "
                   "noise limit (runtime/timing_noise.py); without it such a run writes nothing and exits 3.")
def plan(recipe: Path, as_json: bool, calibrate: bool, prompts: Path, max_new_tokens: int, threads: int,
         rounds: int, accept_noise: bool) -> None:
    """Show G, the tile arithmetic and the draft length a RECIPE builds for (or, given an
    engine directory, its plan and the engine costs the runtime uses: tuned or the build's)."""
    if (recipe / "manifest.json").is_file():  # an engine directory: the runtime's view, no exporter
        from specexport.cli.output import render_costs
        from specexport.errors import BadInput
        from specexport.runtime.costs import costs_in_use

        if calibrate:
            raise BadInput(f"{recipe}: --calibrate takes a RECIPE, not an engine directory")
        result = costs_in_use(recipe)
        if as_json:
            print_json(result)
        else:
            render_costs(result)
        return
    from specexport.exporter.plan_command import plan_recipe, render_plan

    if calibrate:
        from specexport.bench.calibrate import calibrate as run_calibration
        from specexport.bench.render import print_calibration
        from specexport.progress import Reporter

        with noise_reported():
            choice = run_calibration(recipe, prompts, max_new_tokens, threads, Reporter(quiet=as_json), rounds,
                                     accept_noise)
        if as_json:
            print_json(choice)
        else:
            from specexport.bench.calibrate import print_schedule

            print_calibration(choice)
            print_schedule(choice)
        return
    result = plan_recipe(recipe)
    if as_json:
        print_json(result)
    else:
        render_plan(result)


@click.command()
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
    from specexport.progress import Reporter

    if from_onnx is not None:
        if recipe is not None or out is not None:
            raise BadInput("give a RECIPE or --from-onnx DIR, not both (--from-onnx rebuilds DIR in place)")
        from specexport.backends import TENSORRT
        from specexport.cli.trt import build_from_onnx

        manifest = build_from_onnx(from_onnx, Reporter(quiet=quiet or as_json), precision=precision)
        built = [e["name"] for e in manifest["engines"] if e["backend"] == TENSORRT]
        if as_json:
            print_json({"out": str(from_onnx), "tensorrt_engines": built})
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
        print_json(summary)
    elif not quiet:
        state = "reused" if result.reused else "built"
        click.echo(f"{state} {result.out} in {result.seconds:.1f} s ({summary['disk_bytes'] / 1e6:.1f} MB)")
