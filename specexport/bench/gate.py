"""The `make bench` regression gate: compare ratios (never absolute times) with a baseline.

A regression is a category whose median speedup fell more than ``speedup_tolerance`` below
the baseline's, whose E[L] fell more than ``acceptance_tolerance``, or a greedy run whose
output differs from the target alone.

E[L] under adaptive depth follows the depth the machine's measured costs choose (``tune``), so
it differs between machines and between tunings with nothing wrong; where both the baseline and
the run have it, the gate compares the greedy E[L] at the fixed full depth instead, which only a
change in the drafter or the target moves.

Speedups are ratios on one machine, but which ratios a machine gives follows its kernels: on an
AVX2 CPU without VNNI an int4 graph's rows cost about linearly, so a verify pass and an int4 draft
cost more against a step than on an AVX-512 VNNI one (docs/results.md, tenth pass). So a baseline
file keeps one baseline per CPU class (``machine_class``: the widest of the flags that pick MLAS's
kernels), ``--update-baseline`` replaces only this machine's, and a machine whose class has none
is gated on its E[L] and exactness only, saying so, until one is recorded.
"""

from __future__ import annotations

import json
import platform
from dataclasses import dataclass
from pathlib import Path

from specexport import atomic
from specexport.errors import BadInput
from specexport.runtime.kernel_probe import cpu_flags

SPEEDUP_TOLERANCE = 0.25  # relative: on a shared 2-core VM the ratios of one run move by ~15%
ACCEPTANCE_TOLERANCE = 0.15  # relative: greedy E[L] at a fixed depth moves only at near-ties
UNKNOWN_CLASS = "unrecorded"  # the class of a baseline file written before the classes


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


def compare(result: dict, baseline: dict, speedups: bool = True) -> list[Check]:
    """The gate's checks of ``result`` against one class's ``baseline``; ``speedups``: False where
    that baseline was recorded on another class of CPU (baseline_for)."""
    tolerances = baseline.get("tolerances", {})
    speed_tol = tolerances.get("speedup", SPEEDUP_TOLERANCE)
    accept_tol = tolerances.get("acceptance_length", ACCEPTANCE_TOLERANCE)
    measured = {(r["drafter"], r["category"]): r for r in result["categories"]}
    checks = []
    for row in baseline["categories"]:
        got = measured.get((row["drafter"], row["category"]))
        fixed = got is not None and None not in (row.get("acceptance_length_fixed"), got.get("acceptance_length_fixed"))
        acceptance = "acceptance_length_fixed" if fixed else "acceptance_length"
        metrics = [("speedup", speed_tol), (acceptance, accept_tol)] if speedups else [(acceptance, accept_tol)]
        for metric, tol in metrics:
            value = None if got is None else got[metric]
            ok = value is not None and value >= row[metric] * (1 - tol)
            checks.append(Check(row["drafter"], row["category"], metric, row[metric], value, ok))
        if got is not None and got["matches_baseline"] is False:
            checks.append(Check(row["drafter"], row["category"], "lossless", 1.0, 0.0, False))
    return checks


def machine_class(flags: list[str] | None = None) -> str:
    """The CPU class a baseline's speedups hold on: the widest of kernel_probe.CPU_FLAGS this
    machine has (``avx512_vnni``, ``avx2``, ...), else its architecture (``aarch64``)."""
    found = cpu_flags() if flags is None else flags
    return found[0] if found else platform.machine()


def write_baseline(path: Path, result: dict, machine: str) -> None:
    """Record ``result`` as ``machine``'s baseline, keeping the other classes'; in one rename, so a
    killed update leaves the old file whole."""
    machines = load_baseline(path)["machines"] if path.is_file() else {}
    machines = {**machines, machine: baseline_of(result)}
    atomic.write_text(path, json.dumps({"machines": dict(sorted(machines.items()))}, indent=1) + "\n")


def load_baseline(path: Path) -> dict:
    """``{"machines": {class: baseline}}``; a file from before the classes (one baseline at the
    top) is read as the baseline of a class no machine has."""
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadInput(f"{path}: not a JSON baseline ({e}); write a new one with --update-baseline") from None
    machines = data.get("machines") if isinstance(data, dict) and "machines" in data else {UNKNOWN_CLASS: data}
    if not isinstance(machines, dict) or not machines or not all(
            isinstance(b, dict) and isinstance(b.get("categories"), list) for b in machines.values()):
        raise BadInput(f"{path}: not a bench baseline (a 'categories' list per CPU class under 'machines'); "
                       "write a new one with --update-baseline")
    return {"machines": machines}


def baseline_for(baseline: dict, machine: str) -> tuple[dict, bool]:
    """``machine``'s baseline and True; where its class has none, another class's and False:
    then only its fixed-depth E[L] (a lower bound: an int4 draft's may differ by class) and
    exactness are compared, not its speedups."""
    machines = baseline["machines"]
    if machine in machines:
        return machines[machine], True
    return next(iter(machines.values())), False
