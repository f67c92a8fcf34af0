"""Resident memory of this process, for generate --json and bench (what an edge device needs).

Peak RSS from getrusage (Linux and macOS; ru_maxrss is KiB on Linux, bytes on macOS); current
RSS from /proc/self/status where it exists. Unavailable figures are None.
"""

from __future__ import annotations

import sys
from pathlib import Path

_MB = 1 << 20


def peak_rss_bytes() -> int | None:
    try:
        import resource  # Unix only
    except ImportError:
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024


def current_rss_bytes() -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024  # "VmRSS:  123456 kB"
    except (OSError, ValueError, IndexError):
        pass
    return None


def memory() -> dict:
    """{"peak_rss_mb": ..., "rss_mb": ...} (MiB, one decimal; None where unknown)."""
    now, peak = current_rss_bytes(), peak_rss_bytes()  # current first: the peak read after it holds it
    if peak is not None and now is not None:
        peak = max(peak, now)  # getrusage's high-water mark lags /proc's count by a page or so
    return {"peak_rss_mb": round(peak / _MB, 1) if peak is not None else None,
            "rss_mb": round(now / _MB, 1) if now is not None else None}
