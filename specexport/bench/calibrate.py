"""`specexport plan RECIPE --calibrate`: pick D from this machine's costs and the drafters'
acceptance, instead of from the 128-row tile.

1. Build the recipe once at the tile rule's depth, with verify graphs at 1, 2, 4, 8, ... tokens
   (cached under the engine root, reused while the recipe is unchanged).
2. Measure the verify cost curve T(n), and run every drafter at full depth without adaptive
   trimming on the prompts: the fraction of rounds that kept the first i drafts, c_i, gives
   E(D) = 1 + sum_{i<=D} c_i for any shorter depth D.
3. Predict speedup(d) = E(d) · T(1) / (T(1+d) + d · t_draft) for each drafter and category.
   The runtime's adaptive depth drafts any d <= D per round, so D is worth the best d <= D in
   each cell: choose the smallest D whose geometric mean of those comes within 1% of the best
   (deeper graphs cost build time and memory for nothing more), print the table, and write
   <recipe>.calibration.json, which the recipe's `draft.calibration` points `build` at.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from specexport import atomic


def _interpolate(curve: dict[int, float], tokens: int) -> float:
    sizes = sorted(curve)
    if tokens in curve:
        return curve[tokens]
    below = max((s for s in sizes if s < tokens), default=sizes[0])
    above = min((s for s in sizes if s > tokens), default=sizes[-1])
    if above == below:
        return curve[below] * tokens / below
    share = (tokens - below) / (above - below)
    return curve[below] + share * (curve[above] - curve[below])


def calibration_recipe(recipe, depth: int):
    """The recipe at full depth, with the probe sizes of a cost curve."""
    probes = sorted({2 ** i for i in range(1, int(math.log2(depth + 1)) + 1)} | {depth + 1})
    draft = recipe.draft.model_copy(update={"draft_len": depth, "max_draft": None, "calibration": None,
                                            "probe_tokens": probes})
    return recipe.model_copy(update={"draft": draft, "name": f"{recipe.name}-calibration"})


def predict(curve: dict[int, float], profiles: dict, draft_costs: dict[str, float], depth: int) -> list[dict]:
    """One row per D: predicted speedup per drafter and category, and their geometric mean."""
    base = curve[1]
    rows = []
    for d in range(1, depth + 1):
        verify = _interpolate(curve, 1 + d)
        cells = {}
        for (drafter, category), cum in profiles.items():
            expected = 1.0 + float(np.sum(cum[:d]))
            cells[f"{drafter}/{category}"] = expected * base / (verify + d * draft_costs.get(drafter, 0.0))
        geo = float(np.exp(np.mean(np.log(list(cells.values()))))) if cells else 0.0
        rows.append({"draft_len": d, "verify_ms": round(verify * 1e3, 2), "geomean_speedup": round(geo, 3),
                     **{k: round(v, 3) for k, v in cells.items()}})
    # with adaptive depth, a ceiling D is worth the best depth up to it, cell by cell
    best_so_far: dict[str, float] = {}
    for row in rows:
        for key in (k for k in row if "/" in k):
            best_so_far[key] = max(best_so_far.get(key, 0.0), row[key])
        values = list(best_so_far.values())
        row["geomean_adaptive"] = round(float(np.exp(np.mean(np.log(values)))), 3) if values else 0.0
    return rows


def choose(rows: list[dict], tolerance: float = 0.01) -> dict:
    """The smallest D within ``tolerance`` of the best adaptive geometric mean."""
    best = max(row["geomean_adaptive"] for row in rows)
    return next(row for row in rows if row["geomean_adaptive"] >= best * (1 - tolerance))


def calibrate(recipe_path: Path, prompts_path: Path, max_new_tokens: int, threads: int, reporter) -> dict:
    from specexport.bench.harness import load_prompts
    from specexport.exporter.builder import build_recipe
    from specexport.exporter.plan import plan_draft_len
    from specexport.exporter.recipe import load_recipe
    from specexport.exporter.sources import load_config
    from specexport.runtime import load

    recipe, base = load_recipe(recipe_path)
    config = load_config(recipe.target, base, "target")
    tile = plan_draft_len(config.num_attention_heads, getattr(config, "num_key_value_heads", None),
                          recipe.draft.tile)
    depth = max(tile.tile_draft_len, 1)
    full = calibration_recipe(recipe, depth)
    out = Path("engines") / full.name
    build_recipe(full, base, out, False, reporter, threads)

    pipe = load(out, threads=threads)
    prompts = load_prompts(prompts_path)
    with reporter.step("calibrate", "verify cost curve") as step:
        curve = pipe.target.time_engines(pipe.target.sizes, 9)
        step.detail = ", ".join(f"{k}: {v * 1e3:.1f} ms" for k, v in sorted(curve.items()))
    draft_costs = {}
    for name, entry in pipe.manifest.drafters.items():
        if entry.model is not None:
            draft_costs[name] = pipe.runner(entry.model).time_engine(1, 7)

    profiles: dict[tuple[str, str], np.ndarray] = {}
    for name in pipe.manifest.drafters:
        with reporter.step("calibrate", f"acceptance of {name} at D={depth}"):
            kept: dict[str, np.ndarray] = {}
            rounds: dict[str, int] = {}
            for prompt in prompts:
                ids = pipe.prompt_ids(messages=prompt["messages"]) if "messages" in prompt else pipe.prompt_ids(
                    prompt["prompt"])
                result = pipe.generate(prompt_ids=ids, drafter=name, max_new_tokens=max_new_tokens, adaptive=False)
                cat = prompt["category"]
                kept[cat] = kept.get(cat, np.zeros(depth)) + np.array(result.stats.accepted_at, dtype=float)
                rounds[cat] = rounds.get(cat, 0) + result.stats.rounds
            for cat in kept:
                profiles[(name, cat)] = kept[cat] / max(rounds[cat], 1)  # c_i: rounds keeping the first i drafts

    table = predict(curve, profiles, draft_costs, depth)
    best = choose(table)
    fixed = max(table, key=lambda row: row["geomean_speedup"])
    choice = {
        "draft_len": best["draft_len"],
        "why": (f"calibrated on this machine: with adaptive depth, D={best['draft_len']} reaches the best predicted "
                f"speedup (geometric mean {best['geomean_adaptive']:.2f}x over drafters and categories); at a fixed "
                f"depth D={fixed['draft_len']} is best ({fixed['geomean_speedup']:.2f}x) and the tile rule's "
                f"D={depth} gives {table[-1]['geomean_speedup']:.2f}x"),
        "tile_draft_len": depth,
        "cost_curve_ms": {str(k): round(v * 1e3, 3) for k, v in sorted(curve.items())},
        "draft_cost_ms": {k: round(v * 1e3, 3) for k, v in draft_costs.items()},
        "table": table,
        "prompts": str(prompts_path),
        "max_new_tokens": max_new_tokens,
        "threads": threads,
        "device": pipe.manifest.raw.get("toolchain", {}).get("device"),
    }
    path = recipe_path.with_name(f"{recipe_path.stem}.calibration.json")
    atomic.write_text(path, json.dumps(choice, indent=1) + "\n")  # a build may read it any time
    choice["written_to"] = str(path)
    return choice
