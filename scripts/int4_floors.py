"""How fast could our int4 step be? Upper bounds from graphs with a kept cost taken out.

Our int4 target keeps two costs that onnxruntime-genai's export does not pay: the Q4_1 offsets
(exporter/nbits_graph.py: per weight an AveragePool, a small MatMul and an Add beside the
MatMulNBits) and the attention pad (exporter/attention_pad.py: a Pad before and a Slice after
each GroupQueryAttention of a one-token call). This script writes copies of OUR graph without
them, **wrong models** made only to be timed (without the offsets the weights are not the GGUF's;
without the pad a one-token row is not the verify row), and times one-token calls of all of
them and genai's, interleaved in one process:

    ours, offsets dropped, pad dropped, both dropped, genai

The gap between "both dropped" and genai is what no rewrite of the offsets or the pad can win.

    .venv/bin/python scripts/int4_floors.py engines/smollm2-135m-int4/target.onnx \\
        engines/.smollm2-135m-int4.peers/ort-genai-int4/model.onnx --rounds 6
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import onnx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from int4_kernels import _bound, _session  # noqa: E402  (one binding for every graph)

CODES, OFFSETS = "__codes", "__offsets"  # nbits_graph.add_offset_terms' tensor suffixes
ATTNPAD = "attnpad"  # attention_pad's tensor names carry this


def _bypass(graph: onnx.GraphProto, node: onnx.NodeProto) -> None:
    """Remove ``node`` (one output, its first input passed on): its readers read that input; a
    graph output it made is made by that input's producer instead."""
    graph.node.remove(node)
    old, new = node.output[0], node.input[0]
    if any(o.name == old for o in graph.output):
        old, new = new, old  # keep the output's name: the input takes it
        for other in graph.node:
            for i, name in enumerate(other.output):
                if name == old:
                    other.output[i] = new
    for other in graph.node:
        for i, name in enumerate(other.input):
            if name == old:
                other.input[i] = new


def drop_offsets(model: onnx.ModelProto) -> int:
    """The MatMulNBits codes go on without their Q4_1 offset terms. Returns nodes removed."""
    graph, gone = model.graph, 0
    for node in [n for n in graph.node if n.op_type == "Add" and n.input[0].endswith(CODES)
                 and n.input[1].endswith(OFFSETS)]:
        _bypass(graph, node)
        gone += 1
    read = {name for n in graph.node for name in n.input}
    while True:  # the block sums and offset MatMuls nobody reads now
        dead = [n for n in graph.node if n.op_type in ("AveragePool", "MatMul", "Reshape", "ReduceSum")
                and not any(o in read for o in n.output) and not any(o.name in n.output for o in graph.output)]
        if not dead:
            return gone
        for node in dead:
            graph.node.remove(node)
            gone += 1
        read = {name for n in graph.node for name in n.input}


def drop_attention_pad(model: onnx.ModelProto) -> int:
    """Each GroupQueryAttention reads its unpadded inputs again. Returns nodes removed."""
    graph, gone = model.graph, 0
    for node in list(graph.node):
        padded_input = node.op_type in ("Pad", "Add") and len(node.input) > 1 and ATTNPAD in node.input[1]
        sliced_output = node.op_type == "Slice" and node.input[0].endswith(f"__{ATTNPAD}")
        if padded_input or sliced_output:
            _bypass(graph, node)
            gone += 1
    return gone


def variants(ours: Path, out: Path) -> list[tuple[str, Path, int]]:
    """(label, graph, nodes as saved) for ours and the three copies, written under ``out``."""
    rows = [("ours", ours, len(onnx.load(ours, load_external_data=False).graph.node))]
    for label, drops in (("offsets dropped", (drop_offsets,)), ("pad dropped", (drop_attention_pad,)),
                         ("both dropped", (drop_offsets, drop_attention_pad))):
        model = onnx.load(ours)
        for drop in drops:
            if not drop(model):
                raise SystemExit(f"{ours}: nothing to drop for '{label}' (not an int4 graph of ours?)")
        path = out / label.replace(" ", "_") / "target.onnx"
        path.parent.mkdir(parents=True)
        onnx.save(model, path, save_as_external_data=True, location="target.weights")
        rows.append((label, path, len(model.graph.node)))
    return rows


def interleaved(paths: list[Path], threads: int, rounds: int, calls: int, past: int) -> list[float]:
    """Median ms of a one-token call per graph: blocks of ``calls`` rotating over the graphs, the
    order reversed every round; each figure the median of its blocks' medians."""
    runs = []
    for path in paths:
        session = _session(str(path), threads)
        binding, keep = _bound(session, str(path), 1, past)
        for _ in range(10):
            session.run_with_iobinding(binding)
        runs.append((session, binding, keep))
    blocks: list[list[float]] = [[] for _ in paths]
    for r in range(rounds):
        order = list(range(len(paths)))[:: 1 if r % 2 == 0 else -1]
        for i in order:
            session, binding, _ = runs[i]
            times = []
            for _ in range(calls):
                start = time.perf_counter()
                session.run_with_iobinding(binding)
                times.append(time.perf_counter() - start)
            blocks[i].append(statistics.median(times) * 1e3)
    return [statistics.median(b) for b in blocks]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("ours", type=Path, help="our int4 target.onnx")
    parser.add_argument("genai", type=Path, help="onnxruntime-genai's int4 model.onnx")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--past", type=int, default=200)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="int4-floors.") as tmp:
        rows = variants(args.ours, Path(tmp)) + [("genai", args.genai, None)]
        ms = interleaved([path for _, path, _ in rows], args.threads, args.rounds, args.calls, args.past)
    genai = ms[-1]
    for (label, _, nodes), step in zip(rows, ms):
        print(json.dumps({"graph": label, "nodes_saved": nodes, "step_ms": round(step, 3),
                          "genai_over_this": round(genai / step, 3)}), flush=True)


if __name__ == "__main__":
    main()
