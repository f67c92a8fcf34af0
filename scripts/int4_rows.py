"""Decode against verify on a quantized target: how often the one-token logits and the logits of
the same position inside a multi-token verify call disagree (llama.cpp issue #25618's failure),
for the graph as built (one-token calls padded to two rows) and for the same graph unpadded.

    python scripts/int4_rows.py engines/smollm2-135m-int4 [--tokens 64] [--width 5]

Teacher-forced along the padded target's greedy continuation of each dev prompt (chat template):
every position runs once as a one-token call and once inside a ``width``-token call that starts
at a round boundary, as the decode loop's verify does. Prints, per graph, the positions compared,
the argmax flips, the largest |Δlogit| and the largest top-2 margin at a flip.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from specexport.contract import CACHE_LENGTH, INPUT_IDS, LOGITS, VALID_TOKENS, is_past, present_of  # noqa: E402


def session(path: Path, threads: int):
    import onnxruntime as ort

    from specexport.runtime.ort_engine import session_options

    return ort.InferenceSession(str(path), session_options(ort, threads), providers=["CPUExecutionProvider"])


class Graph:
    """The target graph with its cache as numpy arrays (presents carried into the next past)."""

    def __init__(self, path: Path, threads: int):
        self.session = session(path, threads)
        self.outputs = [o.name for o in self.session.get_outputs()]
        shapes = {i.name: i.shape for i in self.session.get_inputs()}
        self.empty = {n: np.zeros([1, *shapes[n][1:]], dtype=np.float32) for n in shapes if is_past(n)}

    def run(self, past: dict, ids: list[int], start: int) -> tuple[np.ndarray, dict]:
        feeds = {**past, INPUT_IDS: np.array([ids], dtype=np.int64), CACHE_LENGTH: np.array([start]),
                 VALID_TOKENS: np.array([len(ids)])}
        out = dict(zip(self.outputs, self.session.run(None, feeds)))
        nxt = {name: out[present_of(name)] for name in past}  # the presents are the next call's past
        return out[LOGITS][0], nxt  # [T, V]


def compare(graph: Graph, prompt: list[int], continuation: list[int], width: int) -> dict:
    tokens = prompt + continuation
    _, past = graph.run(graph.empty, prompt[:-1], 0)
    start = len(prompt) - 1
    ones, _ = [], past
    running = past
    for i in range(start, len(tokens) - 1):  # one token at a time
        logits, running = graph.run(running, [tokens[i]], i)
        ones.append(logits[0])
    many = []
    for i in range(start, len(tokens) - 1, width):  # rounds of `width` tokens from the same cache
        chunk = tokens[i : min(i + width, len(tokens) - 1)]
        logits, past = graph.run(past, chunk, i)
        many.extend(logits)
    ones_a, many_a = np.stack(ones), np.stack(many)  # [n, V]
    flips = ones_a.argmax(-1) != many_a.argmax(-1)
    top2 = np.sort(many_a[flips], axis=-1)[:, -2:]
    return {"positions": len(ones), "flips": int(flips.sum()), "max_abs_diff": float(np.abs(ones_a - many_a).max()),
            "max_margin_at_flip": float((top2[:, 1] - top2[:, 0]).max()) if flips.any() else 0.0}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("engines", type=Path)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--width", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    from specexport.runtime import load

    pipe = load(args.engines, threads=args.threads)
    prompts = [json.loads(line) for line in (REPO / "bench/prompts/dev.jsonl").read_text().splitlines() if line]
    with tempfile.TemporaryDirectory() as tmp:
        model = onnx.load(str(args.engines / "target.onnx"), load_external_data=False)
        pad = next((t for t in model.graph.initializer if t.name == "rowpad_two"), None)
        if pad is None:
            raise SystemExit(f"{args.engines}: target.onnx pads nothing (its probe found every kernel agrees alone)")
        pad.CopyFrom(numpy_helper.from_array(np.array([1], dtype=np.int64), "rowpad_two"))  # never pads
        onnx.save(model, str(Path(tmp) / "target.onnx"))
        shutil.copy(args.engines / "target.weights", Path(tmp) / "target.weights")
        graphs = {"as built (padded)": Graph(args.engines / "target.onnx", args.threads),
                  "unpadded": Graph(Path(tmp) / "target.onnx", args.threads)}
        totals = {name: {"positions": 0, "flips": 0, "max_abs_diff": 0.0, "max_margin_at_flip": 0.0} for name in graphs}
        for prompt in prompts:
            ids = pipe.prompt_ids(chat=True, messages=prompt["messages"])
            continuation = pipe.generate(prompt_ids=ids, max_new_tokens=args.tokens, drafter="none").token_ids
            for name, graph in graphs.items():
                figures = compare(graph, list(ids), list(continuation), args.width)
                total = totals[name]
                total["positions"] += figures["positions"]
                total["flips"] += figures["flips"]
                total["max_abs_diff"] = max(total["max_abs_diff"], figures["max_abs_diff"])
                total["max_margin_at_flip"] = max(total["max_margin_at_flip"], figures["max_margin_at_flip"])
    print(json.dumps(totals, indent=1))


if __name__ == "__main__":
    main()
