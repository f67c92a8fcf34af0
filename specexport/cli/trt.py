"""The TensorRT pieces of the CLI: `lint`, and the body of `build --from-onnx` (cli/build.py).

The exporter, onnx and TensorRT load only when they run.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from specexport.errors import missing_extra


@click.command()
@click.argument("engine_dir", type=click.Path(path_type=Path))
@click.option("--for", "backend", type=click.Choice(["tensorrt"]), default="tensorrt", show_default=True,
              help="The backend whose ONNX parser must accept the graphs.")
@click.option("--strict", is_flag=True,
              help="Also fail on graphs the TensorRT compile skips (onnxruntime contrib operators).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def lint(engine_dir: Path, backend: str, strict: bool, as_json: bool) -> None:
    """Check ENGINE_DIR's ONNX graphs (or .onnx files) for TensorRT: static shapes, supported
    operators and dtypes. Exit 1 when a graph would fail to compile."""
    try:
        from specexport.exporter.lint import lint_tensorrt
    except ImportError:
        raise missing_extra("onnx", "export") from None
    report = lint_tensorrt(engine_dir, strict=strict)
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=2))
    else:
        click.echo(report.render())
    if not report.ok:
        # SystemExit, not click's Exit: cli.main runs click with standalone_mode=False, where an
        # Exit's code would be returned and dropped
        sys.exit(1)


def build_from_onnx(directory: Path, reporter, precision: str | None = None, workspace_mb: int | None = None) -> dict:
    """Compile DIRECTORY's ONNX graphs into TensorRT engines on this machine (its manifest is
    returned). For `specexport build --from-onnx DIR`."""
    from specexport.exporter.trt_from_onnx import rebuild_from_onnx

    return rebuild_from_onnx(directory, reporter, precision=precision, workspace_mb=workspace_mb)
