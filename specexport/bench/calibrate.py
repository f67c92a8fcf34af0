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
4. With batch sizes built (shapes.batch): measure the batched verify cost t(B, T) at every
   built B and T = 1..1+D (ort-gqa: sizes of the one shared graph; static graphs, standard
   attention or a hybrid's unrolled recurrence: the built graph the loop runs T in, so a
   hybrid's K(B) reads its own state-writing graphs), and each draft model's batched step, and choose the depth by batch size K(B) = argmax_k B·E(k) / t(B, 1+k) (below).
   It goes into the same file as ``schedule``; the plan uses it unless the recipe gives its own
   draft.schedule (or disable_by_batch_size).
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import socket
from pathlib import Path

import numpy as np

from specexport import atomic
from specexport.backends import ONNXRUNTIME


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


def predict(curve: dict[int, float], profiles: dict, draft_ms: dict[str, list[float]], depth: int) -> list[dict]:
    """One row per D: predicted speedup per drafter and category, and their geometric mean.
    ``draft_ms``: drafter -> its round's ms at k = 0..depth (Drafter.round_cost, measured parts)."""
    base = curve[1]
    rows = []
    for d in range(1, depth + 1):
        verify = _interpolate(curve, 1 + d)
        cells = {}
        for (drafter, category), cum in profiles.items():
            expected = 1.0 + float(np.sum(cum[:d]))
            draft = draft_ms[drafter][d] / 1e3 if drafter in draft_ms else 0.0
            cells[f"{drafter}/{category}"] = expected * base / (verify + draft)
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


def calibrate(recipe_path: Path, prompts_path: Path, max_new_tokens: int, threads: int, reporter,
              cost_rounds: int = 9, accept_noise: bool = False) -> dict:
    """Steps 1-4 of the module docstring; writes <recipe>.calibration.json last. ``cost_rounds``: the
    timed rounds of every measurement; rounds spreading more than timing_noise.NOISE_LIMIT raise
    NoisyTimings (nothing written) unless ``accept_noise``."""
    from specexport.bench.harness import load_prompts, measure_costs
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
    with reporter.step("calibrate", "verify cost curve and the drafters' rounds") as step:
        costs = measure_costs(pipe, list(pipe.manifest.drafters), cost_rounds, False, depth, accept_noise)
        curve = {point["tokens"]: point["ms"] / 1e3 for point in costs["curve"]}
        step.detail = ", ".join(f"{k}: {v * 1e3:.1f} ms" for k, v in sorted(curve.items()))
    draft_ms = costs["draft_ms"]

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

    table = predict(curve, profiles, draft_ms, depth)
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
        "draft_round_ms": draft_ms,
        "table": table,
        "prompts": str(prompts_path),
        "max_new_tokens": max_new_tokens,
        "threads": threads,
        "device": pipe.manifest.device,
        "host": socket.gethostname(),
        "measured": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        # c_i per drafter/category (single sequence, full depth): E(k) = 1 + sum of the first k
        "acceptance": {f"{d}/{c}": [round(float(v), 4) for v in cum] for (d, c), cum in sorted(profiles.items())},
    }
    choice.update(calibrate_schedule(pipe, profiles, best["draft_len"], reporter, cost_rounds, accept_noise))
    choice["noisy"] = {**costs["noisy"], **choice.pop("schedule_noisy", {})}  # written anyway (--accept-noise)
    path = recipe_path.with_name(f"{recipe_path.stem}.calibration.json")
    atomic.write_text(path, json.dumps(choice, indent=1) + "\n")  # a build may read it any time
    choice["written_to"] = str(path)
    return choice


# -- depth by batch size (breadth against depth) ----------------------------------------------
#
# A batched round runs every row through one verify call of width T = 1 + k, whose cost t(B, T)
# is paid once for the B rows. At depth k the batch commits B·E(k) tokens per round (E from the
# single-sequence acceptance above), so the depth worth drafting at B is
#     K(B) = argmax_k B·E(k) / (t(B, 1+k) + k·t_draft(B)),
# k = 0 (the target alone) included; t_draft(B): one batched step of a draft model at B (0 for
# the n-gram drafter). Over drafters and categories: the depth with the best geometric mean of
# that rate against the target alone's B / t(B, 1).


def _widened(entry, tokens: int):
    """``entry`` (one size of an ort-gqa model's shared graph, batch and token count symbolic)
    at ``tokens`` tokens: the same graph file and session, the token axis of its token-wise
    inputs and outputs changed. The cache tensors keep their shapes."""
    from dataclasses import replace

    from specexport.contract import Role, TensorSpec, engine_name, is_kv, is_state

    def specs(tensors: dict) -> dict:
        out = {}
        for name, spec in tensors.items():
            shape = list(spec.shape)
            if not (is_kv(name) or is_state(name)) and len(shape) >= 2 and shape[1] == entry.tokens:
                shape[1] = tokens
            out[name] = TensorSpec(spec.dtype, tuple(shape))
        return out

    return replace(entry, name=f"{engine_name(entry.model, Role.VERIFY, entry.batch, tokens)}.calibration",
                   role=Role.VERIFY, tokens=tokens, inputs=specs(entry.inputs), outputs=specs(entry.outputs),
                   cost_ms=None, sha256=None)


def _shared_graph(manifest, model: str) -> bool:
    """Are ``model``'s sizes entries of one graph with a symbolic token count (ort-gqa without a
    recurrent state), so that any width can be timed? Else each (B, T) is a static graph of its
    own (standard attention; a hybrid's recurrence unrolled over T) and a width between two
    built ones runs in the larger, as the batched loop runs it (Model.graph)."""
    info = manifest.models[model]
    return info.attention == "ort-gqa" and info.state is None


def _batched_model(pipe, model: str, batches: list[int], widths: list[int]):
    """A Model of ``model`` over a cache of its own, with a call at every (B, T) of ``batches``
    and ``widths``: the built ones, the others as sizes of the same shared graph (_widened);
    a model of static graphs (not _shared_graph) keeps its built calls only."""
    from specexport.contract import BATCHED_ROLES, KVUpdate
    from specexport.runtime.engine import LazyEngine
    from specexport.runtime.model import BatchedCall, open_caches, open_model

    info = pipe.manifest.models[model]
    caches = open_caches(info, ONNXRUNTIME, pipe.options, max(2, *batches), 1)
    batched = open_model(pipe.manifest, model, ONNXRUNTIME, pipe.options, pipe.sessions, caches)
    if not _shared_graph(pipe.manifest, model):
        return batched
    for batch in batches:
        built = [e for e in pipe.manifest.engines_of(model, ONNXRUNTIME, batch=batch)
                 if e.role in BATCHED_ROLES and e.kv_update == KVUpdate.IN_PLACE]
        for tokens in widths:
            if (batch, tokens) not in batched.calls:
                entry = _widened(built[-1], tokens)
                engine = LazyEngine(entry, pipe.manifest.root, pipe.options, None, pipe.sessions)
                batched.calls[(batch, tokens)] = BatchedCall(engine, batch, tokens, caches.store, in_place=True)
    return batched


def _time_calls(batched, keys: list[tuple[int, int]], rounds: int, accept_noise: bool = False,
                noisy: dict[str, float] | None = None) -> dict[tuple[int, int], float]:
    """Median seconds of each (B, T) call, all rows full, interleaved (runner.time_rounds), after
    the noise check (timing_noise.check_noise: raises NoisyTimings unless ``accept_noise``; the
    noisy ones accepted go into ``noisy``, label -> spread). A (B, T) without a graph of its own
    (static graphs) costs the graph the loop runs it in (Model.graph), timed once."""
    from specexport.runtime.runner import time_rounds
    from specexport.runtime.timing_noise import check_noise, labelled, medians

    runs = {key: key if key in batched.calls else batched.graph(*key, verify=True) for key in keys}
    samples = time_rounds({batched.name: (batched, sorted(set(runs.values())))}, rounds)
    label = labelled(samples, lambda name, key: f"{name} B={key[0]} T={key[1]}")
    found = check_noise(label, rounds, accept_noise)
    if noisy is not None:
        noisy.update({e.what: round(e.spread, 3) for e in found})
    timed = medians(samples)[batched.name]
    return {key: timed[run] for key, run in runs.items()}


def measure_surface(pipe, batches: list[int], depth: int, rounds: int = 5, accept_noise: bool = False,
                    noisy: dict[str, float] | None = None) -> dict[tuple[int, int], float]:
    """t(B, T) in seconds: the target's batched verify call at each of ``batches`` and every
    width T = 1 .. 1 + ``depth``, interleaved (``_time_calls``' noise check)."""
    widths = list(range(1, depth + 2))
    return _time_calls(_batched_model(pipe, "target", batches, widths), [(b, t) for b in batches for t in widths],
                       rounds, accept_noise, noisy)


def measure_draft_rounds(pipe, drafters: list[str], batches: list[int], depth: int, rounds: int = 5,
                         accept_noise: bool = False, noisy: dict[str, float] | None = None
                         ) -> dict[str, dict[int, list[float]]]:
    """Seconds of each drafter's round of k = 0..``depth`` drafts at every batch size, from its
    own cost model (Drafter.round_cost) over its batched step measured at B, for the drafters
    with a model that run batched; drafters without engines cost nothing."""
    from specexport.runtime.input_checks import HEAD_KINDS, batched_refusal

    costs: dict[str, dict[int, list[float]]] = {}
    timed: dict[str, dict[tuple[int, int], float]] = {}
    for name in drafters:
        entry = pipe.manifest.drafters[name]
        if entry.model is None or entry.kind in HEAD_KINDS or batched_refusal(pipe.manifest, name, max(batches)) is not None:
            continue  # a head's batched graphs are not measured here yet
        if entry.model not in timed:
            timed[entry.model] = _time_calls(_batched_model(pipe, entry.model, batches, [1]),
                                             [(b, 1) for b in batches], rounds, accept_noise, noisy)
        drafter = pipe.drafter(name)
        costs[name] = {b: [drafter.round_cost(k, {"step": {1: timed[entry.model][(b, 1)] * 1e3}})
                           for k in range(depth + 1)] for b in batches}
    return costs


def schedule_table(surface: dict[tuple[int, int], float], profiles: dict, draft_rounds: dict[str, dict[int, list[float]]],
                   depth: int, batches: list[int], runnable: dict[int, set[str]] | None = None) -> list[dict]:
    """One row per batch size: K(B), the rate it predicts against the target alone, and the
    same for every depth 0..``depth``. ``profiles``: (drafter, category) -> c_i (rounds keeping
    the first i drafts); ``runnable``: the drafters the batched loop runs at each B (default all)."""
    rows = []
    for batch in batches:
        alone = batch / surface[(batch, 1)]  # tokens/s of the target alone at B
        cells = {key: cum for key, cum in profiles.items() if runnable is None or key[0] in runnable.get(batch, set())}
        by_depth: list[float] = []
        per_cell: dict[str, list[float]] = {f"{d}/{c}": [] for d, c in cells}
        for k in range(depth + 1):
            ratios = []
            for (drafter, category), cum in cells.items():
                expected = 1.0 + float(np.sum(cum[:k]))
                # k = 0 is the target alone: a drafter that does not draft at B pays nothing there
                # (round_cost(0), the catch-up a skipped round costs later, prices one skipped round
                # between drafting ones, not a batch size at which nobody drafts)
                drafting = draft_rounds[drafter][batch][k] if drafter in draft_rounds and k else 0.0
                seconds = surface[(batch, 1 + k)] + drafting
                ratio = batch * expected / seconds / alone
                per_cell[f"{drafter}/{category}"].append(ratio)
                ratios.append(ratio)
            by_depth.append(float(np.exp(np.mean(np.log(ratios)))) if ratios else 1.0)
        best = max(range(depth + 1), key=lambda k: (by_depth[k], -k))  # ties: the shallower
        per_drafter = {}
        for drafter in sorted({d for d, _ in cells}):
            mine = [v for key, v in per_cell.items() if key.split("/")[0] == drafter]
            geo = [float(np.exp(np.mean(np.log([v[k] for v in mine])))) for k in range(depth + 1)]
            per_drafter[drafter] = max(range(depth + 1), key=lambda k: (geo[k], -k))
        rows.append({"batch": batch, "depth": best, "speedup": round(by_depth[best], 3),
                     "target_ms": round(surface[(batch, 1)] * 1e3, 3),
                     "verify_ms": round(surface[(batch, 1 + best)] * 1e3, 3),
                     "alone_tokens_per_s": round(alone, 2),
                     "tokens_per_s": round(alone * by_depth[best], 2),
                     "speedup_by_depth": [round(v, 3) for v in by_depth],
                     "best_depth_by_drafter": per_drafter})
    return rows


def schedule_steps(table: list[dict]) -> list[list[int]]:
    """K(B) at the built batch sizes as a draft.schedule (TensorRT-LLM's upper bounds: rows
    between two built sizes run the larger one's graphs, so they take its depth). No drafting
    at any size: [[1, 0]]."""
    steps: list[list[int]] = []
    for row in sorted(table, key=lambda r: r["batch"]):
        if steps and steps[-1][1] == row["depth"]:
            steps[-1][0] = row["batch"]
        else:
            steps.append([row["batch"], row["depth"]])
    while steps and steps[-1][1] == 0:  # past the last bound no drafting anyway
        steps.pop()
    return steps or [[1, 0]]


def calibrate_schedule(pipe, profiles: dict, depth: int, reporter, rounds: int = 5, accept_noise: bool = False) -> dict:
    """Measure t(B, T) (and the draft models' batched steps) over the batch sizes built, and
    choose K(B) up to ``depth``; {} with a ``schedule_skipped`` reason when nothing is batched.
    Scattered rounds raise NoisyTimings unless ``accept_noise`` (then in ``schedule_noisy``)."""
    from specexport.runtime.input_checks import HEAD_KINDS, batched_refusal

    manifest = pipe.manifest
    batches = manifest.batch_sizes("target")
    if ONNXRUNTIME not in manifest.backends():
        return {"schedule_skipped": "the batched verify cost is measured on onnxruntime graphs; the directory has none"}
    if batches == [1]:
        return {"schedule_skipped": "built for batch 1 only (shapes.batch): no depth by batch size to choose"}
    drafters = sorted({d for d, _ in profiles})
    # heads run batched, but their batched draft costs are not measured here yet: left out of K(B)
    runnable = {b: {d for d in drafters if batched_refusal(manifest, d, b) is None
                    and getattr(manifest.drafters.get(d), "kind", None) not in HEAD_KINDS} for b in batches}
    with reporter.step("calibrate", f"batched verify cost t(B, T), B = {batches}, T = 1..{depth + 1}") as step:
        noisy: dict[str, float] = {}
        surface = measure_surface(pipe, batches, depth, rounds, accept_noise, noisy)
        step.detail = ", ".join(f"B={b}: {surface[(b, 1)] * 1e3:.1f}-{surface[(b, depth + 1)] * 1e3:.1f} ms"
                                for b in batches)
    draft_rounds = measure_draft_rounds(pipe, drafters, batches, depth, rounds, accept_noise, noisy)
    table = schedule_table(surface, profiles, draft_rounds, depth, batches, runnable)
    return {
        "schedule": schedule_steps(table),
        "schedule_table": table,
        "schedule_drafters": {str(b): sorted(runnable[b]) for b in batches},
        "cost_surface_ms": {str(b): {str(t): round(surface[(b, t)] * 1e3, 4) for t in range(1, depth + 2)}
                            for b in batches},
        "draft_round_ms_by_batch": {d: {str(b): [round(s * 1e3, 4) for s in by_k] for b, by_k in by_b.items()}
                                    for d, by_b in draft_rounds.items()},
        "schedule_noisy": noisy,
    }


def print_schedule(choice: dict) -> None:
    """The calibrated depth by batch size, as `plan --calibrate` prints it."""
    from rich.console import Console
    from rich.table import Table

    from specexport.exporter.plan_command import schedule_text

    console = Console()
    if "schedule_table" not in choice:
        console.print(f"depth by batch size: not calibrated ({choice.get('schedule_skipped', 'no batched graphs')})",
                      soft_wrap=True)
        return
    rows = choice["schedule_table"]
    depth = len(rows[0]["speedup_by_depth"]) - 1
    table = Table(title="depth by batch size: K(B) = argmax_k B·E(k) / (t(B, 1+k) + k·t_draft(B))")
    for column in ("B", "t(B,1) ms", "K(B)", "t(B,1+K) ms", "tok/s alone", "tok/s at K", "predicted",
                   *(f"k={k}" for k in range(1, depth + 1)), "by drafter"):
        table.add_column(column)
    for row in rows:
        table.add_row(str(row["batch"]), f"{row['target_ms']:.1f}", str(row["depth"]), f"{row['verify_ms']:.1f}",
                      f"{row['alone_tokens_per_s']:.0f}", f"{row['tokens_per_s']:.0f}", f"{row['speedup']:.2f}×",
                      *(f"{v:.2f}×" for v in row["speedup_by_depth"][1:]),
                      ", ".join(f"{d}: {k}" for d, k in row["best_depth_by_drafter"].items()) or "–")
    console.print(table)
    console.print(f"depth by batch size: {schedule_text(choice['schedule'])} (calibrated on {choice['host']}, "
                  f"{choice['measured'][:10]}); the plan uses it unless the recipe gives draft.schedule or "
                  "draft.disable_by_batch_size", soft_wrap=True)
