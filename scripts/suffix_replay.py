"""Replay chain drafters over the target's greedy outputs: E[L] and the predicted speedup over the
target alone, untimed and deterministic (a shared, noisy machine does not move them).

The target's greedy output of every prompt is decoded once (drafter none) and cached; each
drafter then drafts against it round by round as the loop does for a request decoding alone:
adaptive depth (fixed prices: the engine's costs.json, a verify of t tokens priced at the
smallest verify or probe entry holding it), a drafter that ``drafts_free`` drafting all the
round allows (past D up to the widest probe entry where it ``drafts_long``), each chain cut by
its own tag (``trim_chain``), the round's acceptance
observed, and the request's output joining the drafter's store when it ends. Prompts run in
file order through one drafter per variant, so a store spans them as in ``bench --repeats 1``.
``--oracle``: each suffix chain drafted as deep as a long draft goes and verified exactly as far
as it is kept (no policy has that): the bound on what a better cut could give, against n-gram
as it runs. ``--trace FILE``: one JSON line a round (the drafter, the prompt, the output position,
the chain's tag, its drafts before and after the cut, what the target would have kept of the
uncut chain, what it kept, the round's price): where a variant gains or loses, round by round.

    python scripts/suffix_replay.py engines/smollm2-135m --prompts bench/prompts/repeated.jsonl \\
        --variant default --variant spec_factor=2,chain_min_prob=0.1

A variant sets SuffixSettings fields (``default``: the settings as they are); n-gram's
prompt lookup, as the recipes ship it (``max_ngram`` 16 since 2026-12-07; 3 before), is the
baseline every line is compared with.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections import defaultdict
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np

from specexport.bench.harness import load_prompts
from specexport.runtime.acceptance import EMPTY_DRAFT, Sampling
from specexport.runtime.adaptive import DepthPolicy
from specexport.runtime.drafters import DraftBudget, Drafter, DraftRow, NgramDrafter
from specexport.runtime.policy import trim_chain
from specexport.runtime.suffix_drafter import SuffixDrafter, SuffixSettings
from specexport.runtime.suffix_store import ResponseStore
from specexport.runtime.tree import DraftTree

ENTRY_PREFIXES = ("target.decode.b1.t", "target.verify.b1.t", "target.probe.b1.t")


def verify_costs(engine: Path) -> dict[int, float]:
    """tokens -> seconds of the target's batch-1 decode, verify and probe entries (costs.json)."""
    path = engine / "costs.json"
    if not path.exists():
        sys.exit(f"{path}: no costs (run `specexport bench {engine}` once, or `specexport calibrate`)")
    entries = json.loads(path.read_text())["engines"]["onnxruntime"]
    return {int(name.rsplit(".t", 1)[1]): ms / 1e3 for name, ms in entries.items() if name.startswith(ENTRY_PREFIXES)}


def padded(costs: dict[int, float]) -> Callable[[int], float | None]:
    """A verify of t tokens at the smallest entry holding it (None past the widest)."""
    sizes = sorted(costs)
    return lambda t: next((costs[s] for s in sizes if s >= t), None)


def greedy_outputs(engine: Path, prompt_files: list[Path], max_new_tokens: int, cache: Path) -> list[dict]:
    """Per prompt, in file order: its id, category, prompt ids and the target's greedy output
    (decoded once, then read from ``cache``)."""
    key = {"engine": str(engine), "prompts": [str(p) for p in prompt_files], "max_new_tokens": max_new_tokens}
    if cache.exists():
        stored = json.loads(cache.read_text())
        if stored["key"] == key:
            return stored["rows"]
    from specexport.runtime import load

    pipe = load(str(engine), threads=2)
    rows = []
    for path in prompt_files:
        for record in load_prompts(path):
            ids = pipe.prompt_ids(record.get("prompt"), messages=record.get("messages"))
            output = pipe.generate(prompt_ids=ids, drafter="none", max_new_tokens=max_new_tokens).token_ids
            rows.append({"id": record["id"], "category": record.get("category", "-"), "prompt": list(ids),
                         "output": list(output)})
    cache.write_text(json.dumps({"key": key, "rows": rows}))
    return rows


@dataclasses.dataclass
class Totals:
    """One category's replay: tokens committed, rounds, seconds predicted, the target alone's."""

    tokens: int = 0
    rounds: int = 0
    seconds: float = 0.0
    alone: float = 0.0

    @property
    def acceptance_length(self) -> float:
        return self.tokens / max(self.rounds, 1)

    @property
    def speedup(self) -> float:
        return self.alone / self.seconds if self.seconds else 0.0

    def add(self, other: Totals) -> None:
        self.tokens, self.rounds = self.tokens + other.tokens, self.rounds + other.rounds
        self.seconds, self.alone = self.seconds + other.seconds, self.alone + other.alone


def kept(tokens: list[int], output: list[int], at: int) -> int:
    """Drafts the greedy target keeps: the prefix equal to its output from ``at``."""
    n = 0
    while n < len(tokens) and at + n < len(output) and tokens[n] == output[at + n]:
        n += 1
    return n


def replay(drafter: Drafter, rows: list[dict], cost: Callable[[int], float | None], draft_len: int,
           long_depth: int, oracle: bool, trace: list[dict] | None = None) -> dict[str, Totals]:
    """Every row's output decoded in rounds of ``drafter``'s chains (the module docstring);
    ``trace``: a record of every round appended to it."""
    totals: dict[str, Totals] = defaultdict(Totals)
    for row in rows:
        depth = DepthPolicy(cost, checked=False)
        prompt, output = np.array(row["prompt"], dtype=np.int64), row["output"]
        context = list(row["prompt"])
        drafter.join(0, prompt, {})
        at, total = 0, totals[row["category"]]
        while at < len(output):
            left = len(output) - at
            k = depth.best_depth(drafter.name, min(draft_len, left - 1))
            if k > 0 and drafter.drafts_free:  # all the round allows, cut by its tag (runtime/policy.py)
                k = min(draft_len, left - 1)
            if oracle or (k > 0 and drafter.drafts_long):  # past D as a request alone drafts (runtime/policy.py)
                k = min(long_depth, left - 1)
            draft_row = DraftRow(np.array(context, dtype=np.int64), Sampling(), np.random.default_rng(0), None, len(prompt))
            proposal = drafter.propose([draft_row], DraftBudget([k]))[0] if k > 0 else DraftTree.of_draft(EMPTY_DRAFT)
            drafted = proposal.size
            uncut = n = kept(proposal.tokens.tolist(), output, at)
            proposal = proposal.prefix(n) if oracle else trim_chain(depth, proposal, drafter.name)
            n = min(n, proposal.size)
            depth.estimate.observe(proposal.tag or drafter.name, proposal, n)
            if at + n < len(output):
                drafter.accept(0, n, output[at + n], {})
            committed = min(n + 1, left)
            seconds = cost(1 + proposal.size)
            assert seconds is not None, "a proposal past the widest entry"
            if trace is not None:
                trace.append({"drafter": drafter.name, "id": row["id"], "category": row["category"], "at": at,
                              "tag": proposal.tag, "drafted": drafted, "verified": proposal.size,
                              "kept_uncut": uncut, "kept": n, "committed": committed, "seconds": seconds})
            context += output[at : at + committed]
            at += committed
            total.tokens, total.rounds, total.seconds = total.tokens + committed, total.rounds + 1, total.seconds + seconds
        one = cost(1)
        assert one is not None
        total.alone += len(output) * one
        drafter.leave(0, np.array(context, dtype=np.int64), len(prompt))
    return totals


def suffix_variant(spec: str, store_tokens: int) -> SuffixSettings:
    """``default`` or ``field=value,...`` over SuffixSettings' defaults (bad fields: exit naming them)."""
    settings = SuffixSettings(store_tokens=store_tokens)
    if spec == "default":
        return settings
    types = {f.name: type(getattr(settings, f.name)) for f in dataclasses.fields(settings)}
    changes = {}
    for item in spec.split(","):
        name, _, value = item.partition("=")
        if name not in types:
            sys.exit(f"--variant {spec!r}: {name!r} is not a suffix setting (one of {', '.join(types)})")
        changes[name] = value.lower() == "true" if types[name] is bool else types[name](value)
    return dataclasses.replace(settings, **changes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("engine", type=Path)
    parser.add_argument("--prompts", type=Path, action="append", required=True, help="prompt files, in order")
    parser.add_argument("--variant", action="append", default=[], help="suffix settings: default or field=value,...")
    parser.add_argument("-n", "--max-new-tokens", type=int, default=96)
    parser.add_argument("--store-tokens", type=int, default=16384, help="the store's budget (0: no store)")
    parser.add_argument("--cache", type=Path, default=Path("/tmp/suffix_replay_outputs.json"))
    parser.add_argument("--oracle", action="store_true", help="verify each chain exactly as far as it is kept")
    parser.add_argument("--by-category", action="store_true")
    parser.add_argument("--trace", type=Path, help="write one JSON line a round of every drafter here")
    args = parser.parse_args()

    costs = verify_costs(args.engine)
    cost = padded(costs)
    manifest = json.loads((args.engine / "manifest.json").read_text())
    draft_len, long_depth = int(manifest["plan"]["draft_len"]), max(costs) - 1
    rows = greedy_outputs(args.engine, args.prompts, args.max_new_tokens, args.cache)
    drafters: dict[str, Callable[[], Drafter]] = {"ngram": lambda: NgramDrafter("ngram")}
    for spec in args.variant or ["default"]:
        settings = suffix_variant(spec, args.store_tokens)
        store = ResponseStore(settings.store_tokens, settings.index_depth) if settings.store_tokens else None
        drafters[f"suffix {spec}"] = partial(SuffixDrafter, "suffix", settings, store, 1)
    baseline: dict[str, Totals] = {}
    trace: list[dict] | None = [] if args.trace else None
    for name, make in drafters.items():
        # the oracle bounds a better cut of the suffix chains, against n-gram as it runs
        rounds: list[dict] = []
        by_category = replay(make(), rows, cost, draft_len, long_depth, args.oracle and name != "ngram",
                             None if trace is None else rounds)
        if trace is not None:
            trace += [{"variant": name, **r} for r in rounds]
        overall = Totals()
        for totals in by_category.values():
            overall.add(totals)
        baseline = baseline or {**by_category, "all": overall}
        lines = [("all", overall)] + (sorted(by_category.items()) if args.by_category else [])
        for category, totals in lines:
            print(f"{name:44s} {category:16s} E[L] {totals.acceptance_length:.3f}  predicted speedup "
                  f"{totals.speedup:.3f}  vs ngram {totals.speedup / baseline[category].speedup:.3f}")
    if args.trace and trace is not None:
        args.trace.write_text("".join(json.dumps(r) + "\n" for r in trace))


if __name__ == "__main__":
    main()
