"""Progress display for long commands: one line per step with its time, on stderr.

``Reporter.step(kind, what)`` is a context manager: a spinner while the step runs, then a
line "✓ kind  what  12.3 s". Every step's time is kept for the JSON result and the notes.
``quiet`` shows nothing but still records the timings.
"""

from __future__ import annotations

# moved to specexport.progress (bench and tune use it on installs without the exporter);
# this import path stays for the exporter's modules
from specexport.progress import Reporter, StepTiming

__all__ = ["Reporter", "StepTiming"]
