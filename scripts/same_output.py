"""Record what the runtime decodes on engine directories, and compare two such records.

Checks that a change to the runtime keeps its output: for each directory and each drafter in
``load(dir).drafter_names`` (``none`` included), ``Pipeline.generate`` on three fixed token-id
prompts (repeated patterns, so the n-gram drafter finds matches; ids 3..258 fit the tiny
byte vocabulary) with max_new_tokens=40, in four modes: greedy (temperature 0) and sampled
(temperature 0.8, top_p 0.95, seed 7), each with the adaptive depth (the default) and with
adaptive=False. Directories built with a batch size above 1 also run
``Pipeline.generate_batch`` on the three prompts together, greedy and sampled (seed 7).
Each case records the token ids, the stop reason and the draft counts (rounds, proposed,
accepted); a case that raises records its error text instead. Only the public API is used,
so the same script runs on the code before and after a refactor:

    PYTHONPATH=/tmp/base-pkg python scripts/same_output.py ENGINE_DIR... --out old.json   # old code
    python scripts/same_output.py ENGINE_DIR... --out new.json                            # this tree
    python scripts/same_output.py --compare old.json new.json   # exit 1 on any difference
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

PROMPTS = [
    [10, 20, 30, 40] * 4 + [10, 20],  # one short motif, repeated
    [72, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100, 46, 32] * 2 + [72, 101],  # "Hello world. " twice
    [(17 * i * i + 5 * i) % 250 + 5 for i in range(12)] + [(17 * i * i + 5 * i) % 250 + 5 for i in range(6)],
]
NEW_TOKENS = 40
GREEDY = {"temperature": 0.0}
SAMPLED = {"temperature": 0.8, "top_p": 0.95, "seed": 7}
MODES = {"greedy": (GREEDY, True), "greedy-fixed": (GREEDY, False),
         "sampled": (SAMPLED, True), "sampled-fixed": (SAMPLED, False)}


def record(gen) -> dict:
    s = gen.stats
    return {"tokens": list(map(int, gen.token_ids)), "stop": gen.stop_reason,
            "stats": [s.rounds, s.proposed, s.accepted]}


def error(exc: BaseException) -> dict:
    return {"error": f"{type(exc).__name__}: {exc}".splitlines()[0][:300]}


def max_batch(engines: Path) -> int:
    manifest = json.loads((engines / "manifest.json").read_text())
    return max((int(e.get("batch") or 1) for e in manifest["engines"] if e["model"] == "target"), default=1)


def run_dir(engines: Path) -> dict:
    from specexport.runtime import load

    try:
        pipe = load(engines, threads=1)
    except Exception as exc:  # noqa: BLE001 - recorded
        return {"_load": {"-": {"-": error(exc)}}}
    batched = max_batch(engines) > 1
    found: dict = {}
    for drafter in pipe.drafter_names:
        cases = found[drafter] = {}
        for mode, (sampling, adaptive) in MODES.items():
            cases[mode] = {}
            for i, ids in enumerate(PROMPTS):
                try:
                    gen = pipe.generate(prompt_ids=ids, drafter=drafter, max_new_tokens=NEW_TOKENS,
                                        adaptive=adaptive, **sampling)
                    cases[mode][str(i)] = record(gen)
                except Exception as exc:  # noqa: BLE001 - recorded
                    cases[mode][str(i)] = error(exc)
        for mode, sampling in (("batch-greedy", GREEDY), ("batch-sampled", SAMPLED)) if batched else ():
            try:
                gens = pipe.generate_batch(PROMPTS, drafter=drafter, max_new_tokens=NEW_TOKENS, **sampling)
                cases[mode] = {str(i): record(g) for i, g in enumerate(gens)}
            except Exception as exc:  # noqa: BLE001 - recorded
                cases[mode] = {"*": error(exc)}
        errors = sum("error" in c for m in cases.values() for c in m.values())
        print(f"{engines.name}/{drafter}: {sum(len(m) for m in cases.values())} cases, {errors} errors",
              file=sys.stderr, flush=True)
    return found


def flatten(data: dict) -> dict[str, dict]:
    return {f"{d}/{dr}/{m}/{i}": case for d, drafters in data.items() if d != "_meta"
            for dr, modes in drafters.items() for m, cases in modes.items() for i, case in cases.items()}


def compare(old_path: str, new_path: str) -> int:
    old, new = (flatten(json.loads(Path(p).read_text())) for p in (old_path, new_path))
    rows, bad = [], 0
    for key in sorted(old.keys() | new.keys()):
        a, b = old.get(key), new.get(key)
        if a == b:
            verdict = "equal" + (" (both error)" if a and "error" in a else "")
        elif a is None or b is None:
            verdict = "only in " + ("new" if a is None else "old")
        elif "error" in a or "error" in b:
            verdict = f"error: {a.get('error', 'ok')} -> {b.get('error', 'ok')}"
        elif a["tokens"] != b["tokens"]:
            n = next((j for j, (x, y) in enumerate(zip(a["tokens"], b["tokens"])) if x != y),
                     min(len(a["tokens"]), len(b["tokens"])))
            verdict = f"DIFFERENT tokens from position {n}"
        else:
            verdict = f"different stop/stats: {a['stop']} {a['stats']} -> {b['stop']} {b['stats']}"
        bad += not verdict.startswith("equal")
        rows.append((key, verdict))
    width = max((len(k) for k, _ in rows), default=0)
    for key, verdict in rows:
        print(f"{key:<{width}}  {verdict}")
    print(f"{len(rows)} cases: {len(rows) - bad} equal, {bad} different")
    return 1 if bad else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("engines", nargs="*", type=Path, help="engine directories")
    parser.add_argument("--out", help="write the record (JSON) here (default: stdout)")
    parser.add_argument("--compare", nargs=2, metavar=("OLD", "NEW"), help="compare two records")
    args = parser.parse_args()
    if args.compare:
        return compare(*args.compare)
    if not args.engines:
        parser.error("give engine directories, or --compare OLD NEW")
    import specexport

    data: dict = {"_meta": {"specexport": str(Path(specexport.__file__).parent)}}
    print(f"specexport from {data['_meta']['specexport']}", file=sys.stderr)
    for engines in args.engines:
        data[engines.name] = run_dir(engines)
    text = json.dumps(data, indent=1, sort_keys=True)
    if args.out:
        Path(args.out).write_text(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
