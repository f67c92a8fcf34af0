"""Draw docs/results.png, the README's chart, from a kept bench report.

    .venv/bin/python docs/results_chart.py [REPORT_DIR] [OUT_PNG]

The chart shows each drafter's decode speedup over the target alone, per prompt category
(medians over the category's prompts, as `bench.json` records them), and onnxruntime-genai's own
n-gram decoding beside them (its median tokens/s over our target alone's, as docs/results.md). Its title carries the run's date and machine, read from the report.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
REPORT = REPO / "bench" / "reports" / "2026-12-02-peers-eagle3"
OUT = REPO / "docs" / "results.png"
DATE = "2026-12-02"  # the report's folder name starts with it
MACHINE = "2-core x86_64 VM, 2 threads"
COMMAND = ("specexport bench engines/smollm2-135m --prompts bench/prompts/dev.jsonl --max-new-tokens 96 "
           "--repeats 3 --threads 2 --peers ort-genai,ort-genai-ngram")
LABELS = {"ngram": "n-gram (prompt lookup)", "quantized-self": "int4 self-draft", "eagle3": "EAGLE-3 (shipped head)",
          "ort-genai-ngram": "onnxruntime-genai n-gram"}


def speedups(result: dict) -> dict[str, dict[str, float]]:
    """{runner: {category: speedup over our target alone}}: each drafter's median speedup (the
    report's categories), and for the n-gram peer its median tokens/s over our target alone's."""
    table: dict[str, dict[str, float]] = {}
    ours: dict[str, float] = {}
    for row in result["categories"]:
        if row["drafter"] == "none":
            ours[row["category"]] = row["tokens_per_s"]
        elif row["speedup"] is not None:
            table.setdefault(row["drafter"], {})[row["category"]] = row["speedup"]
    rates: dict[str, list[float]] = {}
    for peer in result["peers"]:
        if peer["peer"] == "ort-genai-ngram" and peer["tokens_per_s"] is not None:
            rates.setdefault(peer["category"], []).append(peer["tokens_per_s"])
    if rates:
        table["ort-genai-ngram"] = {c: statistics.median(v) / ours[c] for c, v in rates.items()}
    return table


def draw(result: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # a file, no display
    import matplotlib.pyplot as plt

    table = speedups(result)
    runners = [r for r in LABELS if r in table]
    categories = sorted({c for values in table.values() for c in values})
    settings = result["settings"]
    width = 0.8 / len(runners)
    fig, ax = plt.subplots(figsize=(9, 4.6))
    for j, runner in enumerate(runners):
        xs = [i + (j - (len(runners) - 1) / 2) * width for i in range(len(categories))]
        hatch = "//" if runner.startswith("ort-genai") else None
        ax.bar(xs, [table[runner].get(c, 0.0) for c in categories], width, label=LABELS[runner], hatch=hatch)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(categories)), categories)
    ax.set_ylabel("decode speedup over the target alone")
    lossless = all(r["matches_baseline"] for r in result["results"])
    ax.set_title(f"{result['name']} (fp32, onnxruntime), greedy, {settings['max_new_tokens']} new tokens, "
                 f"D ≤ {settings['draft_len']}, adaptive depth"
                 + (": every output equals the target's" if lossless else ""), fontsize=9)
    fig.suptitle(f"Lossless speculative decoding on a CPU: {DATE}, {MACHINE}", fontsize=11)
    ax.legend(fontsize=8, ncol=2)
    fig.text(0.01, 0.01, COMMAND, fontsize=6.5, family="monospace")
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: list[str]) -> None:
    report = Path(argv[0]) if argv else REPORT
    out = Path(argv[1]) if len(argv) > 1 else OUT
    draw(json.loads((report / "bench.json").read_text()), out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main(sys.argv[1:])
