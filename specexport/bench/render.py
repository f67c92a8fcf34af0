"""Terminal tables for `specexport bench` (rich)."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table


def _x(value) -> str:
    return "–" if value is None else f"{value:.2f}×"


def print_summary(result: dict) -> None:
    console = Console()
    table = Table(title=f"{result['name']}: medians by category ({result['settings']['threads']} threads)")
    for column in ("drafter", "category", "tok/s", "speedup", "predicted", "E[L]", "host", "lossless"):
        table.add_column(column)
    for row in result["categories"]:
        host = row.get("host_fraction")
        table.add_row(row["drafter"], row["category"], "–" if row["tokens_per_s"] is None else f"{row['tokens_per_s']:.1f}",
                      _x(row["speedup"]), _x(row["predicted_speedup"]), f"{row['acceptance_length']:.2f}",
                      "–" if host is None else f"{host:.1%}",
                      {True: "yes", False: "[red]NO[/]", None: "n/a"}[row["matches_baseline"]])
    console.print(table)
    curve = ", ".join(f"{c['tokens']}: {c['ms']:.1f} ms" for c in result["cost_curve"])
    console.print(f"verify cost: {curve} (tile rule 1+D = {result['tile_point']['tokens']})", soft_wrap=True)
    console.print("predicted: the speedup equation at the run's acceptance, with costs timed apart from the runs; "
                  "host: decode time outside the engines", soft_wrap=True)
    for peer in sorted({p["peer"] for p in result["peers"]}):
        rows = [p for p in result["peers"] if p["peer"] == peer and p["tokens_per_s"]]
        if rows:
            tps = sorted(p["tokens_per_s"] for p in rows)[len(rows) // 2]
            own = [p["matches_own_plain"] for p in rows if p.get("matches_own_plain") is not None]
            exact = f"; same tokens as its plain run on {sum(own)}/{len(own)} prompts" if own else ""
            console.print(f"peer {peer} ({rows[0]['threads']} threads): median {tps:.1f} tok/s{exact}", soft_wrap=True)
    for skipped in result["peers_skipped"]:
        console.print(f"peer {skipped['peer']}: skipped ({skipped['skipped']})", soft_wrap=True)


def print_checks(checks, machine: str) -> None:
    console = Console()
    table = Table(title=f"regression gate (ratios against the baseline of this CPU class, {machine})")
    for column in ("drafter", "category", "metric", "baseline", "measured", ""):
        table.add_column(column)
    for c in checks:
        measured = "missing" if c.measured is None else f"{c.measured:.3f}"
        table.add_row(c.drafter, c.category, c.metric, f"{c.baseline:.3f}", measured,
                      "[green]ok[/]" if c.ok else "[red]REGRESSION[/]")
    console.print(table)


def print_calibration(choice: dict) -> None:
    console = Console()
    rows = choice["table"]
    drafters = sorted({k.split("/")[0] for k in rows[0] if "/" in k})
    table = Table(title=f"predicted speedup by draft length (tile rule: D = {choice['tile_draft_len']})")
    for column in ("D", "verify ms", "fixed depth", "adaptive ≤ D", *(f"{d} (median)" for d in drafters)):
        table.add_column(column)
    for row in rows:
        per_drafter = []
        for drafter in drafters:
            values = sorted(v for k, v in row.items() if k.startswith(f"{drafter}/"))
            per_drafter.append(_x(values[len(values) // 2]))
        style = "bold green" if row["draft_len"] == choice["draft_len"] else None
        table.add_row(str(row["draft_len"]), f"{row['verify_ms']:.1f}", _x(row["geomean_speedup"]),
                      _x(row["geomean_adaptive"]), *per_drafter, style=style)
    console.print(table)
    console.print(choice["why"], soft_wrap=True)
    console.print(f"written to {choice['written_to']}; a recipe uses it with draft: {{calibration: "
                  f"{Path(choice['written_to']).name}}}", soft_wrap=True)
