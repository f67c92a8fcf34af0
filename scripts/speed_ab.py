"""Compare the decode speed of two versions of the runtime in one process, calls interleaved.

Across processes the VM's memory placement alone moves tokens/s by about 5%, so the old
runtime is loaded into this process beside the new one: a commit's package is copied under
the name ``specexport_old`` (its imports rewritten) and both open the same engine directory on
onnxruntime's one thread pool. For each drafter, each prompt is decoded by both runtimes in
turn (the order alternating), and each runtime's host time (wall time minus the time inside
onnxruntime's run calls) is measured apart from the engines'. The runtime loaded second runs
faster by a few percent whichever it is, so run both orders (``--new-first``) and take the
geometric mean of the two ratios.

    git archive cc3e796 | tar -x -C /tmp/old
    .venv/bin/python scripts/speed_ab.py /tmp/old engines/smollm2-135m --drafters none,eagle3
    .venv/bin/python scripts/speed_ab.py /tmp/old engines/smollm2-135m --drafters none,eagle3 --new-first

Prints one JSON line per drafter: tokens/s of each, their ratio (new / old, all calls pooled,
and the median of per-prompt pairs), host milliseconds per token of each, and whether both
produced the same tokens and rounds.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def old_package(tree: Path, into: Path) -> Path:
    """``tree``'s specexport, runtime/ and exporter/ as one package ``specexport_old`` under ``into``."""
    package = into / "specexport_old"
    shutil.copytree(tree / "specexport", package)
    for sub in ("runtime", "exporter"):
        shutil.copytree(tree / sub, package / sub, dirs_exist_ok=True)
    for path in package.rglob("*.py"):
        text = path.read_text()
        text = re.sub(r"\bspecexport\.", "specexport_old.", text)
        text = re.sub(r"^from specexport import", "from specexport_old import", text, flags=re.M)
        path.write_text(text)
    return into


class EngineClock:
    """Seconds spent inside onnxruntime's run calls (wrapped here, in this script's process only)."""

    def __init__(self, ort) -> None:
        self.seconds = 0.0
        for name in ("run", "run_with_iobinding"):
            setattr(ort.InferenceSession, name, self._timed(getattr(ort.InferenceSession, name)))

    def _timed(self, fn):
        def wrapper(session, *args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(session, *args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
        return wrapper


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old_tree", type=Path, help="a checkout or `git archive` of the old commit")
    parser.add_argument("engines", type=Path)
    parser.add_argument("--drafters", default="none,ngram,quantized-self,eagle3")
    parser.add_argument("--prompts", type=Path, default=ROOT / "bench" / "prompts" / "dev.jsonl")
    parser.add_argument("--count", type=int, default=6, help="prompts used (the first ones)")
    parser.add_argument("--rounds", type=int, default=2, help="passes over the prompts")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--new-first", action="store_true", help="load the new runtime first")
    parser.add_argument("--tree-nodes", type=int, default=None,
                        help="draft nodes per tree round (0: chains; default: the recipe's draft.tree)")
    args = parser.parse_args()

    import onnxruntime as ort

    clock = EngineClock(ort)
    sys.path.insert(0, str(old_package(args.old_tree, Path(tempfile.mkdtemp(prefix="speed-ab-")))))
    import specexport_old.runtime.ort_engine as old_ort
    from specexport_old.runtime.api import load as load_old

    import specexport.runtime.ort_engine as new_ort
    from specexport.runtime.api import load as load_new

    # one process, one onnxruntime pool: the second runtime must not try to make its own
    if args.new_first:
        new = load_new(args.engines)
        old_ort.SHARED_POOL.size = new_ort.SHARED_POOL.size
        old = load_old(args.engines)
    else:
        old = load_old(args.engines)
        new_ort.SHARED_POOL.size = old_ort.SHARED_POOL.size
        new = load_new(args.engines)
    pipes = {"old": old, "new": new}
    records = [json.loads(line) for line in args.prompts.read_text().splitlines() if line.strip()][: args.count]
    for drafter in args.drafters.split(","):
        for pipe in pipes.values():  # warm: first calls open lazily made sessions
            pipe.generate(messages=records[0].get("messages"), prompt=records[0].get("prompt"), max_new_tokens=8,
                          drafter=drafter, tree_nodes=args.tree_nodes)
        runs: dict[str, list[tuple[int, float, float, list[int], int]]] = {"old": [], "new": []}
        for r in range(args.rounds):
            for record in records:
                for name in (("old", "new") if r % 2 == 0 else ("new", "old")):
                    clock.seconds = 0.0
                    start = time.perf_counter()
                    result = pipes[name].generate(prompt=record.get("prompt"), messages=record.get("messages"),
                                                  max_new_tokens=args.max_new_tokens, drafter=drafter,
                                                  tree_nodes=args.tree_nodes)
                    wall = time.perf_counter() - start
                    runs[name].append((len(result.token_ids), wall, wall - clock.seconds,
                                       list(result.token_ids), result.stats.rounds))
        print(json.dumps(summary(drafter, runs["old"], runs["new"])), flush=True)
    return 0


def summary(drafter: str, old: list, new: list) -> dict:
    def rate(runs):
        return sum(r[0] for r in runs) / sum(r[1] for r in runs)

    def host_ms(runs):
        return 1e3 * sum(r[2] for r in runs) / sum(r[0] for r in runs)

    pairs = [(n[0] / n[1]) / (o[0] / o[1]) for o, n in zip(old, new)]
    return {"drafter": drafter, "old_tok_s": round(rate(old), 2), "new_tok_s": round(rate(new), 2),
            "ratio": round(rate(new) / rate(old), 4), "ratio_median_pair": round(statistics.median(pairs), 4),
            "host_ms_per_token_old": round(host_ms(old), 3), "host_ms_per_token_new": round(host_ms(new), 3),
            "same_tokens": [o[3] for o in old] == [n[3] for n in new],
            "rounds_old": sum(o[4] for o in old), "rounds_new": sum(n[4] for n in new)}


if __name__ == "__main__":
    raise SystemExit(main())
