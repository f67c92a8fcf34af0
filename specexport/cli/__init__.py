"""The `specexport` command: the root click group, the one list of its subcommands, and `main`.

Each module holds one group of commands and imports only click at the top; what a command
needs (the exporter, onnxruntime, torch, FastAPI, httpx) loads when it runs, so a runtime-only
install imports the CLI, and `generate` never imports torch.

Exit codes: 0 ok, 1 runtime failure, 2 bad input. Errors the user can fix are one line on
stderr, never a traceback.
"""

from __future__ import annotations

import os
import signal
import sys

import click

from specexport import __version__
from specexport.cli import bench, build, distill, run, serve, trt
from specexport.errors import SpecexportError, missing_module


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="specexport")
def cli() -> None:
    """Compile LLMs and their drafters into static-shape engines; run them as a lossless speculative decoder."""


# Every subcommand, registered here and nowhere else (a new command: add it to its module and here).
COMMANDS: tuple[click.Command, ...] = (
    build.plan, build.build,  # a recipe to an engine directory
    run.generate, run.tune, run.verify,  # an engine directory
    bench.bench,
    serve.serve, serve.bench_serve,  # the OpenAI-compatible server and its load bench
    distill.distill,
    trt.lint,
)
for _command in COMMANDS:
    cli.add_command(_command)


def _fail(message: str, code: int) -> None:
    click.echo(f"specexport: error: {message}", err=True)
    sys.exit(code)


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
