"""Prompt lookup replayed over the target's greedy outputs: what ``max_ngram`` buys, untimed.

For each prompt the target alone decodes greedily once (kept in ``--cache``); then for each
depth and ``max_ngram`` asked, n-gram chains are replayed along that output at a fixed depth:
a round drafts ``depth`` tokens from the context so far, keeps the prefix the target's output
agrees with (exactly what the loop would keep: greedy is lossless), commits one more, and costs
the engine directory's tuned price of its verify width. The predicted speedup of a prompt is its
tokens at one token's price over what its rounds cost (decode only, no host time):

    python scripts/ngram_replay.py ENGINE_DIR --prompts bench/prompts/heldout8.jsonl \
        --depths 3,7 --max-ngram 3,16

Fixed depths only: adaptive depth is left out (so is a policy's learning), so this says how
good the drafts are, not what a run will time.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np

from specexport.bench.harness import load_prompts
from specexport.runtime import load
from specexport.runtime.drafters import NgramDrafter


def greedy_outputs(engine_dir: Path, prompts: Path, new_tokens: int, threads: int) -> dict[str, tuple[list[int], list[int]]]:
    """prompt id -> (prompt ids, the target alone's greedy output)."""
    pipe = load(engine_dir, threads=threads)
    outputs = {}
    for record in load_prompts(prompts):
        ids = [int(t) for t in pipe.prompt_ids(messages=record["messages"])]
        tokens: list[int] = []
        loop = pipe.batch_loop(drafter="none", max_batch=1, schedule=False,
                               on_token=lambda _key, t, into=tokens: into.append(t))
        request, _ = pipe.batch_request(ids, max_new_tokens=new_tokens)
        loop.submit(0, request)
        while loop.busy:
            loop.step()
        outputs[record["id"]] = (ids, tokens)
    return outputs


def verify_prices(engine_dir: Path) -> dict[int, float]:
    """verify width -> tuned ms at batch 1 (one token: the decode step)."""
    costs = json.loads((engine_dir / "costs.json").read_text())["engines"]["onnxruntime"]
    prices = {1: costs["target.decode.b1.t1"]}
    for name, ms in costs.items():
        if name.startswith(("target.verify.b1.t", "target.probe.b1.t")):
            prices[int(name.rsplit(".t", 1)[1])] = ms
    return prices


def replay(drafter: NgramDrafter, prompt: list[int], output: list[int], depth: int, prices: dict[int, float]) -> float:
    """Predicted speedup of fixed-depth chains along ``output``."""
    position, seconds = 0, 0.0
    while position < len(output):
        k = min(depth, len(output) - position - 1)
        context = np.array(prompt + output[:position], dtype=np.int64)  # [prompt + position]
        drafts = drafter.chain(context, k).tokens if k > 0 else np.empty(0, np.int64)  # [<= k]
        kept = 0
        for draft, truth in zip(drafts, output[position:]):
            if int(draft) != truth:
                break
            kept += 1
        seconds += prices[1 + len(drafts)]
        position += kept + 1
    return len(output) * prices[1] / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("engine_dir", type=Path)
    parser.add_argument("--prompts", type=Path, default=Path("bench/prompts/heldout8.jsonl"))
    parser.add_argument("--depths", default="3,7")
    parser.add_argument("--max-ngram", default="3,16")
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cache", type=Path, help="JSON file keeping the greedy outputs between runs")
    args = parser.parse_args()
    if args.cache is not None and args.cache.exists():
        outputs = {k: (v[0], v[1]) for k, v in json.loads(args.cache.read_text()).items()}
    else:
        outputs = greedy_outputs(args.engine_dir, args.prompts, args.new_tokens, args.threads)
        if args.cache is not None:
            args.cache.write_text(json.dumps(outputs))
    prices = verify_prices(args.engine_dir)
    for depth in (int(d) for d in args.depths.split(",")):
        for longest in (int(n) for n in args.max_ngram.split(",")):
            drafter = NgramDrafter(max_ngram=longest)
            speedups = {pid: replay(drafter, prompt, output, depth, prices) for pid, (prompt, output) in outputs.items()}
            mean = math.exp(sum(math.log(s) for s in speedups.values()) / len(speedups))
            print(f"depth {depth} max_ngram {longest:2d}: geometric mean {mean:.3f} | "
                  + ", ".join(f"{pid} {s:.2f}" for pid, s in speedups.items()))


if __name__ == "__main__":
    main()
