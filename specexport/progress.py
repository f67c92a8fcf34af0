"""Progress display for long commands: one line per step with its time, on stderr.

``Reporter.step(kind, what)`` is a context manager: a spinner while the step runs, then a
line "✓ kind  what  12.3 s". Every step's time is kept for the JSON result and the notes.
``quiet`` shows nothing but still records the timings. Here, not in the exporter, because
the runtime-side commands (bench, tune) report progress too on an install without the exporter.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field

from rich.console import Console


@dataclass
class StepTiming:
    kind: str  # load | plan | export | quantize | validate | write | ...
    what: str
    seconds: float
    detail: str = ""


@dataclass
class Reporter:
    quiet: bool = False
    console: Console = field(default_factory=lambda: Console(stderr=True, highlight=False))
    timings: list[StepTiming] = field(default_factory=list)

    @contextmanager
    def step(self, kind: str, what: str):
        record = StepTiming(kind, what, 0.0)
        start = time.perf_counter()
        if self.quiet:
            yield record
        else:
            with self.console.status(f"[bold]{kind}[/] {what}", spinner="dots"):
                yield record
        record.seconds = time.perf_counter() - start
        self.timings.append(record)
        if not self.quiet:
            detail = f"  [dim]{record.detail}[/]" if record.detail else ""
            self.console.print(f"[green]✓[/] {kind:<9} {what:<34} {record.seconds:6.1f} s{detail}", soft_wrap=True)

    def note(self, message: str) -> None:
        if not self.quiet:
            self.console.print(f"  {message}", soft_wrap=True)

    def warn(self, message: str) -> None:
        if not self.quiet:
            self.console.print(f"[yellow]![/] {message}", soft_wrap=True)
