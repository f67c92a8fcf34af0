"""Output shared by the commands."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager

import click


def print_json(data) -> None:
    """``data`` as indented JSON on stdout (paths and other objects as their str)."""
    click.echo(json.dumps(data, indent=2, default=str))


@contextmanager
def noise_reported() -> Iterator[None]:
    """Timings too noisy to write (runtime/timing_noise.NoisyTimings): which entries and by how
    much on stderr, then the error goes on to the CLI's one-line message."""
    from specexport.runtime.timing_noise import NoisyTimings

    try:
        yield
    except NoisyTimings as err:
        click.echo(err.report(), err=True)
        raise


def render_costs(result: dict) -> None:
    """The plan and each engine's build, tuned and used cost (runtime/costs.costs_in_use) as a table."""
    from rich.console import Console
    from rich.table import Table

    def ms(value: float | None) -> str:
        return "–" if value is None else f"{value:.2f}"

    table = Table(title=f"{result['engine_dir']}: D = {result['plan']['draft_len']}; costs: {result['costs']}")
    for column in ("engine", "backend", "role", "tokens", "build ms", "tuned ms"):
        table.add_column(column, justify="right" if column in ("tokens", "build ms", "tuned ms") else "left",
                         no_wrap=column == "engine")
    for row in result["engines"]:
        table.add_row(row["engine"], row["backend"], row["role"], str(row["tokens"]), ms(row["build_ms"]),
                      ms(row["tuned_ms"]))
    Console().print(table)
