"""Prompt lookup replayed over the target's greedy outputs: what ``max_ngram`` buys, untimed.

For each depth and ``max_ngram`` asked, n-gram chains are replayed at a fixed depth along the
target's greedy outputs (decoded once and cached by scripts/suffix_replay.py's
``greedy_outputs``): a round drafts ``depth`` tokens from the context so far, keeps the prefix
the target's output agrees with (what the loop keeps: greedy is lossless), commits one more,
and costs the engine's tuned price of its verify width (``verify_costs``). The predicted speedup
of a prompt is its tokens at one token's price over what its rounds cost (decode only, no host
time):

    python scripts/ngram_replay.py ENGINE_DIR --prompts bench/prompts/heldout8.jsonl \
        --depths 3,7 --max-ngram 3,16

Fixed depths only: adaptive depth is left out, so this says how good the drafts are, not what
a run will time (scripts/suffix_replay.py replays adaptive depth).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
from suffix_replay import greedy_outputs, kept, padded, verify_costs  # scripts/suffix_replay.py

from specexport.runtime.drafters import NgramDrafter


def replay(drafter: NgramDrafter, prompt: list[int], output: list[int], depth: int,
           cost: Callable[[int], float | None]) -> float:
    """Predicted speedup of fixed-depth chains along ``output``."""
    at, seconds = 0, 0.0
    while at < len(output):
        k = min(depth, len(output) - at - 1)
        context = np.array(prompt + output[:at], dtype=np.int64)  # [prompt + at]
        drafts = drafter.chain(context, k).tokens.tolist() if k > 0 else []
        seconds += cost(1 + len(drafts)) or 0.0
        at += kept(drafts, output, at) + 1
    return len(output) * (cost(1) or 0.0) / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("engine_dir", type=Path)
    parser.add_argument("--prompts", type=Path, action="append", help="JSONL prompts (repeatable; default heldout8)")
    parser.add_argument("--depths", default="3,7")
    parser.add_argument("--max-ngram", default="3,16")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--cache", type=Path, default=Path("/tmp/ngram_replay_outputs.json"),
                        help="the greedy outputs, kept between runs (keyed by engine, prompts and length)")
    args = parser.parse_args()
    rows = greedy_outputs(args.engine_dir, args.prompts or [Path("bench/prompts/heldout8.jsonl")],
                          args.max_new_tokens, args.cache)
    cost = padded(verify_costs(args.engine_dir))
    for depth in (int(d) for d in args.depths.split(",")):
        for longest in (int(n) for n in args.max_ngram.split(",")):
            drafter = NgramDrafter(max_ngram=longest)
            speedups = {row["id"]: replay(drafter, row["prompt"], row["output"], depth, cost) for row in rows}
            mean = math.exp(sum(math.log(s) for s in speedups.values()) / len(speedups))
            print(f"depth {depth} max_ngram {longest:2d}: geometric mean {mean:.3f} | "
                  + ", ".join(f"{pid} {s:.2f}" for pid, s in speedups.items()))


if __name__ == "__main__":
    main()
