"""Node counts by op type of engine directories' graphs, side by side: as saved, and as onnxruntime
runs them on the CPU (after its graph optimizations).

    .venv/bin/python scripts/graph_ops.py engines/smollm2-135m-int4 /tmp/new/smollm2-135m-int4 [--graph target.onnx]

Prints a markdown table: one row per op type, a column pair (saved, optimized) per directory.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO.parent))  # the repository is the specexport package

from specexport.exporter.graph_ops import op_counts, optimized_op_counts  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dirs", nargs="+", type=Path)
    parser.add_argument("--graph", default="target.onnx")
    args = parser.parse_args()
    import onnx

    columns = []
    for directory in args.dirs:
        path = directory / args.graph
        if not path.is_file():
            sys.exit(f"{path}: no such graph; pass an engine directory (--graph names the file in it)")
        columns.append((op_counts(onnx.load(str(path), load_external_data=False)), optimized_op_counts(path)))
    ops = sorted({op for pair in columns for counts in pair for op in counts},
                 key=lambda op: -max(counts[op] for pair in columns for counts in pair))
    print("| op | " + " | ".join(f"{d.name} saved | {d.name} run" for d in args.dirs) + " |")
    print("|---|" + "---:|" * (2 * len(columns)))
    for op in ops:
        print(f"| {op} | " + " | ".join(f"{saved[op]} | {run[op]}" for saved, run in columns) + " |")
    print("| **total** | " + " | ".join(f"{sum(saved.values())} | {sum(run.values())}" for saved, run in columns) + " |")


if __name__ == "__main__":
    main()
