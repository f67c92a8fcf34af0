"""Replay adaptive depth over recorded acceptance: a model drafter's predicted speedup, untimed.

A timed bench of a drafter near break-even moves by several percent between runs on a shared
machine, more than a change to adaptive depth does. This replays the policy instead:

- ``collect``: for every prompt, the target's greedy output, then for every output position t
  how many drafts of a full-depth greedy chain drafted there (after the prompt and the first t+1
  output tokens) the target keeps, a(t): each a request of that context whose first round drafts
  D. Then the true price of a round at each depth k, the median of rounds at a forced depth
  (three passes, the depths interleaved, the target alone for depth 0) on three of the prompts.
- ``replay``: each prompt as a request decoding alone, its rounds chosen by the loop's own
  adaptive depth (``DepthPolicy``, the round prices kept across the prompts as a pipeline keeps
  them, measured at the true prices); a round at depth k keeps min(a(t), k) drafts and costs the
  true price, plus the catch-up and the drafter's start where the policy prices them. The
  predicted speedup of a prompt is its tokens at depth 0's price over what its rounds cost
  (decode only, the prefill left out). ``--set field=value`` sets a DepthPolicy or
  AcceptanceEstimate field for a variant; every variant runs the prompts in six orders (file
  order, reversed, four shuffles) and reports the mean by prompt.

    python scripts/depth_replay.py collect /tmp/m/int4-v7 eagle3 --prompts P.jsonl --out rec.json
    python scripts/depth_replay.py replay /tmp/m/int4-v7 eagle3 rec.json --set probe_share=0.02

Greedy chains only; a(t) is drafted from a fresh request of that context, which matches the
loop's draft there up to floating point. What it leaves out: the loop's host time, the machine's
drift, and a drafter start priced below what it costs (the head's first catch-up runs on cold
caches).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from specexport.bench.harness import load_prompts
from specexport.runtime import load
from specexport.runtime.adaptive import DepthPolicy


def first_round_kept(pipe, drafter: str, ids: list[int], new_tokens: int) -> int:
    """Drafts the target keeps of the first round of a request of ``ids`` at full depth."""
    reports = []
    loop = pipe.batch_loop(drafter=drafter, max_batch=1, schedule=False, adaptive=False, on_round=reports.append)
    request, _ = pipe.batch_request(ids, max_new_tokens=new_tokens)
    loop.submit(0, request)
    while loop.busy and not reports:
        loop.step()
    return int(reports[0].accepted[0]) if reports[0].proposed[0] else 0


def forced_round_seconds(pipe, drafter: str, prompts: list[list[int]], depth_max: int) -> dict[int, float]:
    """depth -> median seconds of a round at that forced depth (0: the target alone)."""
    times: dict[int, list[float]] = {k: [] for k in range(depth_max + 1)}
    for _ in range(3):
        for ids in prompts:
            for k in range(depth_max + 1):
                reports, seconds = [], []
                loop = pipe.batch_loop(drafter=drafter if k else "none", max_batch=1, schedule=False,
                                       adaptive=False, draft_len=k or None, on_round=reports.append)
                request, _ = pipe.batch_request(ids, max_new_tokens=48)
                loop.submit(0, request)
                while loop.busy:
                    start = time.perf_counter()
                    loop.step()
                    seconds.append(time.perf_counter() - start)
                times[k] += [s for r, s in list(zip(reports, seconds))[1:] if (r.proposed[0] if r.proposed else 0) == k]
    return {k: statistics.median(v) for k, v in times.items() if v}


def collect(args) -> None:
    pipe = load(args.engine, threads=args.threads)
    depth = pipe.manifest.draft_len
    prompts = load_prompts(args.prompts)
    data = {}
    for prompt in prompts:
        ids = list(pipe.prompt_ids(messages=prompt["messages"]))
        out = list(pipe.generate(prompt_ids=ids, drafter="none", max_new_tokens=args.max_new_tokens).token_ids)
        kept = [first_round_kept(pipe, args.drafter, ids + out[:t], min(depth + 1, len(out) - t))
                for t in range(len(out) - 1)]
        data[prompt["id"]] = {"prompt_len": len(ids), "out": out, "kept": kept}
        print(f"{prompt['id']}: {len(out)} tokens, a(t) mean {np.mean(kept):.2f}", flush=True)
    priced_on = [list(pipe.prompt_ids(messages=p["messages"])) for p in prompts[:3]]
    costs = forced_round_seconds(pipe, args.drafter, priced_on, depth)
    print("round ms by depth:", {k: round(1e3 * s, 2) for k, s in costs.items()})
    Path(args.out).write_text(json.dumps({"draft_len": depth, "costs": costs, "prompts": data}))


def replay_once(factory: Callable[[], DepthPolicy], start_cost: Callable[[int], float], drafter_name: str,
                record: dict, order: list[str], settings: dict) -> dict[str, float]:
    """prompt -> predicted speedup over the target alone, the prompts decoded in ``order``:
    ``factory`` makes a request's adaptive depth (the loop's), ``start_cost`` prices the
    drafter's start on a prompt of that many tokens (``Drafter.catchup_cost``)."""
    costs = {int(k): s for k, s in record["costs"].items()}
    depth_max, shared, speedups = record["draft_len"], None, {}
    for pid in order:
        prompt = record["prompts"][pid]
        kept, total = prompt["kept"], len(prompt["out"])
        policy = factory()
        for name, value in settings.items():
            setattr(policy.estimate if hasattr(policy.estimate, name) else policy, name, value)
        policy.start_cost = start_cost(prompt["prompt_len"] - 1)
        if shared is None:
            shared = policy.prices
        else:  # kept across requests, as a pipeline's loops keep them
            shared.forget_stale()
            policy.prices = shared
        made, seconds, started = 1, 0.0, False  # the prefill made the first token
        while made < total:
            since = policy._since_draft
            k = policy.best_depth(drafter_name, min(depth_max, total - made - 1), 1, remaining=total - made)
            cost = costs[k] + (policy.catchup_cost(since) if k and since else 0.0)
            if k and not started:
                cost, started = cost + policy.start_cost, True
            accepted = min(kept[made - 1], k)
            if k:
                policy.estimate.observe_chain(drafter_name, k, accepted)
            shared.observe(1, k, costs[k])
            seconds += cost
            made += 1 + accepted
        speedups[pid] = (total - 1) * costs[0] / seconds
    return speedups


def parse_setting(text: str) -> tuple[str, float | bool]:
    name, _, value = text.partition("=")
    return name, (value == "true") if value in ("true", "false") else float(value)


def replay(args) -> None:
    pipe = load(args.engine, threads=args.threads)
    record = json.loads(Path(args.record).read_text())
    settings = dict(parse_setting(s) for s in args.set)
    pids = list(record["prompts"])
    orders = [pids, pids[::-1]] + [random.Random(seed).sample(pids, len(pids)) for seed in range(4)]
    factory = pipe.batch_loop(drafter=args.drafter, max_batch=1, schedule=False).policy.adaptive
    start_cost = pipe.drafter(args.drafter).catchup_cost
    runs = [replay_once(factory, start_cost, args.drafter, record, order, settings) for order in orders]
    means = {pid: float(np.mean([run[pid] for run in runs])) for pid in pids}
    for pid, mean in means.items():
        print(f"{pid:24} {mean:.3f}")
    print(f"{'lowest':24} {min(means.values()):.3f}")
    print(f"{'geometric mean':24} {float(np.exp(np.mean(np.log(list(means.values()))))):.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    one = sub.add_parser("collect")
    one.add_argument("engine", type=Path)
    one.add_argument("drafter")
    one.add_argument("--prompts", type=Path, required=True)
    one.add_argument("--out", type=Path, required=True)
    one.add_argument("-n", "--max-new-tokens", type=int, default=96)
    one.add_argument("--threads", type=int, default=2)
    two = sub.add_parser("replay")
    two.add_argument("engine", type=Path)
    two.add_argument("drafter")
    two.add_argument("record", type=Path)
    two.add_argument("--set", action="append", default=[], help="field=value of DepthPolicy or AcceptanceEstimate")
    two.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    (collect if args.command == "collect" else replay)(args)


if __name__ == "__main__":
    main()
