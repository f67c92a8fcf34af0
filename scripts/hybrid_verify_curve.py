"""The verify cost curve of a hybrid (linear-attention) target against a dense one of its size.

A hybrid graph outputs its recurrent state after every position (present_state.* [B, T, ...]),
so the runtime can roll back to any accepted token by choosing a position; the price is that a
pass's outputs grow with its width T = 1 + D. This script builds two tiny random-weight targets
of about the same parameter count with the exporter (a Qwen3.5 hybrid, qwen3_5: Gated DeltaNet
layers beside full-attention ones, and the dense Qwen3 of the same widths), with a graph at
every width 1..T, times them in one interleaved schedule (runner.time_rounds: round after
round, every (model, width) in turn, over a half-full cache), and prints each model's pass
against one token. Then it hands each curve to the calibration's own arithmetic
(bench/calibrate.py predict + choose) with one shared acceptance profile (c_i = a^i), so the
depth D each model gets differs by its curve alone.

Usage: .venv/bin/python scripts/hybrid_verify_curve.py [--out /tmp/hybrid-curve] [--hidden 64]
       [--layers 2] [--intermediate 128] [--tokens 8] [--rounds 41] [--threads 2] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import numpy as np
import yaml

from specexport.bench.calibrate import choose, predict
from specexport.exporter.recipe import TinySource
from specexport.runtime.runner import time_rounds
from specexport.runtime.timing_noise import medians

PAIR = {"hybrid": "qwen3_5", "dense": "qwen3"}  # same family, the hybrid's linear layers the difference
ACCEPTANCE = (0.6, 0.8, 0.9)  # a: the share of rounds keeping draft i is a^i


def tiny_target(args, arch: str) -> dict:
    return {"source": "tiny", "arch": arch, "seed": 0, "hidden_size": args.hidden, "num_layers": args.layers,
            "intermediate_size": args.intermediate}


def build_target(args, label: str, arch: str) -> Path:
    """The target alone, with a graph at every width 1..tokens (verify at the widest, probes
    between); reused when already built."""
    from specexport.exporter.builder import build
    from specexport.progress import Reporter

    out = args.out / f"{label}-{arch}-h{args.hidden}-l{args.layers}"
    if (out / "manifest.json").is_file():
        return out
    recipe = {"name": out.name, "target": tiny_target(args, arch), "drafters": [],
              "shapes": {"batch": 1, "max_seq_len": 128, "prefill_chunk": 16},
              "draft": {"tile": 128, "max_draft": args.tokens - 1, "probe_tokens": list(range(2, args.tokens))},
              "attention": "standard"}
    path = args.out / f"{out.name}.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    build(path, out, False, Reporter(quiet=True), args.threads)
    return out


def parameters(args, arch: str) -> int:
    from specexport.exporter.tiny import tiny_model

    model, _ = tiny_model(TinySource(**tiny_target(args, arch)))
    return sum(p.numel() for p in model.parameters())


def curves(args, dirs: dict[str, Path]) -> tuple[dict[str, dict[int, float]], dict[str, dict[int, float]]]:
    """Median seconds per (model, width), and the median over rounds of each round's pass
    against that round's one-token pass (a drift of the machine moves it least)."""
    from specexport.runtime import load

    pipes = {label: load(path, threads=args.threads, tuned_costs=False) for label, path in dirs.items()}
    samples = time_rounds({label: (pipe.target, list(range(1, args.tokens + 1))) for label, pipe in pipes.items()},
                          args.rounds)
    ratios = {label: {t: statistics.median(s / one for s, one in zip(by_t[t], by_t[1], strict=True))
                      for t in by_t} for label, by_t in samples.items()}
    return medians(samples), ratios


def chosen_depths(curve: dict[int, float], depth: int) -> dict[float, int]:
    """a -> the D the calibration picks from this curve when draft i is kept in a^i of rounds
    (a drafter with no cost of its own, as the n-gram drafter)."""
    out = {}
    for a in ACCEPTANCE:
        profile = {("ngram", "all"): np.array([a ** i for i in range(1, depth + 1)])}
        out[a] = choose(predict(curve, profile, {}, depth))["draft_len"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/hybrid-curve"))
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--intermediate", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=8, help="the widest pass timed (1 + D)")
    parser.add_argument("--rounds", type=int, default=41)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    dirs = {label: build_target(args, label, arch) for label, arch in PAIR.items()}
    params = {label: parameters(args, arch) for label, arch in PAIR.items()}
    ms, ratios = curves(args, dirs)
    depths = {label: chosen_depths(ms[label], args.tokens - 1) for label in PAIR}
    result = {"models": {label: {"arch": PAIR[label], "parameters": params[label], "engines": str(dirs[label]),
                                 "ms": {t: round(s * 1e3, 4) for t, s in ms[label].items()},
                                 "relative": {t: round(r, 3) for t, r in ratios[label].items()},
                                 "calibrated_draft_len": {str(a): d for a, d in depths[label].items()}}
                         for label in PAIR},
              "hidden": args.hidden, "layers": args.layers, "intermediate": args.intermediate,
              "rounds": args.rounds, "threads": args.threads}
    if args.json:
        print(json.dumps(result, indent=1))
        return
    for label, info in result["models"].items():
        print(f"{label}: {info['arch']}, {info['parameters']:,} parameters, {info['engines']}")
    widths = range(1, args.tokens + 1)
    print("| T = 1 + D | " + " | ".join(str(t) for t in widths) + " |")
    print("|---" * (args.tokens + 1) + "|")
    for label, info in result["models"].items():
        print(f"| {label} ({info['ms'][1]:.3f} ms at T=1) | "
              + " | ".join(f"{info['relative'][t]:.2f}" for t in widths) + " |")
    for label, info in result["models"].items():
        picks = ", ".join(f"a={a}: D={d}" for a, d in info["calibrated_draft_len"].items())
        print(f"calibrated D from the {label} curve: {picks}")


if __name__ == "__main__":
    main()
