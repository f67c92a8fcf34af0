"""The `make bench` regression gate: compare ratios (never absolute times) with a baseline.

A regression is a category whose median speedup fell more than ``speedup_tolerance`` below
the baseline's, whose E[L] fell more than ``acceptance_tolerance``, or a greedy run whose
output differs from the target alone.

E[L] under adaptive depth follows the depth the machine's measured costs choose (``tune``), so
it differs between machines and between tunings with nothing wrong; where both the baseline and
the run have it, the gate compares the greedy E[L] at the fixed full depth instead, which only a
change in the drafter or the target moves.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from specexport import atomic

SPEEDUP_TOLERANCE = 0.25  # relative: on a shared 2-core VM the ratios of one run move by ~15%
ACCEPTANCE_TOLERANCE = 0.15  # relative: greedy E[L] at a fixed depth moves only at near-ties


@dataclass
class Check:
    drafter: str
    category: str
    metric: str
    baseline: float
    measured: float | None
    ok: bool


def baseline_of(result: dict) -> dict:
    """What a baseline file keeps: the ratios per drafter and category, and the settings."""
    return {
        "settings": {k: result["settings"][k] for k in ("max_new_tokens", "temperature", "adaptive", "draft_len")},
        "tolerances": {"speedup": SPEEDUP_TOLERANCE, "acceptance_length": ACCEPTANCE_TOLERANCE},
        "categories": [
            {k: row.get(k) for k in ("drafter", "category", "speedup", "acceptance_length", "acceptance_length_fixed")}
            for row in result["categories"]
            if row["drafter"] != "none"
        ],
    }


def compare(result: dict, baseline: dict) -> list[Check]:
    tolerances = baseline.get("tolerances", {})
    speed_tol = tolerances.get("speedup", SPEEDUP_TOLERANCE)
    accept_tol = tolerances.get("acceptance_length", ACCEPTANCE_TOLERANCE)
    measured = {(r["drafter"], r["category"]): r for r in result["categories"]}
    checks = []
    for row in baseline["categories"]:
        got = measured.get((row["drafter"], row["category"]))
        fixed = got is not None and None not in (row.get("acceptance_length_fixed"), got.get("acceptance_length_fixed"))
        acceptance = "acceptance_length_fixed" if fixed else "acceptance_length"
        for metric, tol in (("speedup", speed_tol), (acceptance, accept_tol)):
            value = None if got is None else got[metric]
            ok = value is not None and value >= row[metric] * (1 - tol)
            checks.append(Check(row["drafter"], row["category"], metric, row[metric], value, ok))
        if got is not None and got["matches_baseline"] is False:
            checks.append(Check(row["drafter"], row["category"], "lossless", 1.0, 0.0, False))
    return checks


def write_baseline(path: Path, result: dict) -> None:
    """Replace the baseline in one rename: a killed update leaves the old one whole."""
    atomic.write_text(path, json.dumps(baseline_of(result), indent=1) + "\n")


def load_baseline(path: Path) -> dict:
    return json.loads(path.read_text())
