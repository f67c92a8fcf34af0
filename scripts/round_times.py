"""Round times by kind: how long a drafter's rounds take at each depth, and after rounds at
depth 0 (a draft model then catches up on what it skipped), next to the target alone's.

The target alone and the drafter decode one prompt in turn, in one process (so a drift of the
machine hits both), each round timed around ``BatchLoop.step`` with adaptive depth as
``generate`` runs it:

    .venv/bin/python scripts/round_times.py ENGINE_DIR quantized-self open-garden \
        --prompts bench/prompts/heldout8.jsonl --runs 3

Prints each run's ms per token and, per kind of round (drafter, depth, after depth 0), the
count and the median and mean ms of the round and of its verify pass.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path

from specexport.runtime import load


def rounds_of(pipe, ids: list[int], drafter: str, max_new_tokens: int) -> list[tuple[int, float, float]]:
    """(drafts, seconds, verify seconds) of every round of one decode."""
    reports: list = []
    loop = pipe.batch_loop(drafter=drafter, max_batch=1, schedule=False, on_round=reports.append)
    request, _ = pipe.batch_request(ids, max_new_tokens=max_new_tokens)
    loop.submit(0, request)
    times = []
    while loop.busy:
        start = time.perf_counter()
        loop.step()
        times.append(time.perf_counter() - start)
    return [(r.proposed[0] if r.proposed else 0, t, r.verify_s) for r, t in zip(reports, times)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("engine_dir", type=Path)
    parser.add_argument("drafter")
    parser.add_argument("prompt_id")
    parser.add_argument("--prompts", type=Path, default=Path("bench/prompts/heldout8.jsonl"))
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    pipe = load(args.engine_dir, threads=args.threads)
    records = {json.loads(line)["id"]: json.loads(line) for line in args.prompts.read_text().splitlines() if line}
    ids = pipe.prompt_ids(messages=records[args.prompt_id]["messages"])
    by_kind: dict[tuple, list[float]] = defaultdict(list)
    for run in range(args.runs):
        for drafter in ("none", args.drafter):
            rounds = rounds_of(pipe, ids, drafter, args.max_new_tokens)
            previous = 0
            for drafts, seconds, verify in rounds[1:]:  # the first step also prefills
                kind = (drafter, drafts, "after depth 0" if drafts and previous == 0 else "")
                by_kind[kind].append(1e3 * seconds)
                by_kind[(*kind, "verify")].append(1e3 * verify)
                previous = drafts
            total = sum(seconds for _, seconds, _ in rounds[1:])
            print(f"run {run} {drafter}: {1e3 * total / max(1, args.max_new_tokens - 1):.2f} ms per token, "
                  f"{len(rounds)} rounds")
    for kind, ms in sorted(by_kind.items()):
        print(" ".join(str(k) for k in kind if k != ""), f"n={len(ms)} median {statistics.median(ms):.1f} "
              f"mean {statistics.mean(ms):.1f}")


if __name__ == "__main__":
    main()
