"""`specexport bench --batch 1,2,4,8`: the batched loop's throughput by batch size.

First the single-sequence loop (``Pipeline.generate``, prompt after prompt) per mode, the
batch-1 reference. Then, for each batch size B, the whole prompt set (a mixed workload: every category in the same
batches) runs through ``Pipeline.generate_batch(max_batch=B)``, for the target alone and for
each drafter at a fixed depth (D, and 1), with per-sequence depth (runtime/goodput.py), and
with the manifest's depth-by-batch-size schedule when it has one (each sequence's adaptive depth
under it, as the server runs it). Reported per (B, mode): aggregate tokens/s (all tokens over the wall time),
the median sequence's own tokens/s, E[L], and the speedup against the target alone at the same
B, in the same run. Greedy outputs are compared with the batch-1 run of the same mode: batching
must not change a token. Speculation spends spare compute; as B grows that compute goes to
breadth, and the plot shows where drafting stops paying on this machine.

Peers (``--peers``, bench/peers.py's BATCHED_PEERS): at each B, the target alone in another
stack, the same prompts in static batches of B (left-padded, greedy, the same
max_new_tokens), run right after our rows at that B: aggregate tokens/s (all new tokens over
the wall time of all batches), whether each prompt's tokens equal our greedy ones
(``matches_baseline``: the batch-1 single-sequence target alone), and ``speedup``: its
tokens/s over our batched target alone at the same B.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from specexport.atomic import atomic_path, write_text
from specexport.bench.harness import load_prompts
from specexport.errors import BadInput
from specexport.runtime.input_checks import check_drafter


def parse_batches(text: str) -> list[int]:
    try:
        sizes = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise BadInput(f"--batch: give batch sizes like 1,2,4,8 (got {text!r})") from None
    if not sizes or sizes[0] < 1:
        raise BadInput(f"--batch: batch sizes must be >= 1 (got {text!r})")
    return sizes


def run_batched(pipe, prompts_path: Path, batches: list[int], drafters: list[str], max_new_tokens: int,
                reporter, peers=(), peers_skipped=(), repeats: int = 1) -> dict:
    """``peers``: made by bench/peers.make_peers (those without ``run_batch`` are reported in
    ``peers_skipped``, as are the ones that could not be made); they run once, after our rows
    at each B in the first repeat. ``repeats``: runs of every mode, interleaved (the median)."""
    built = _check_batches(pipe.manifest, batches)
    for name in drafters:  # before any run
        check_drafter(pipe.manifest, name, max(batches), "--drafters")
    records = load_prompts(prompts_path)
    tree_drafters = frozenset(name for name in drafters if pipe.built_tree_nodes and
                              pipe.drafter(name).builds_trees)
    modes = _modes(pipe.manifest, drafters, tree_drafters)
    batch_peers, peers_skipped = _split_peers(peers, peers_skipped)
    prompt_ids = [pipe.prompt_ids(r.get("prompt"), messages=r.get("messages")) for r in records]
    # Every mode runs once per repeat, the modes of a loop and batch size in turn, so a drift of
    # the machine hits them alike; a row reports its median run (runs of the same computation on
    # this VM differ by up to ~10%). Repeats stay within a batch size: switching B rebuilds the
    # batched target (its [B] cache), which the first run after a switch would pay for.
    # (loop, batch, drafter, depth, rule) -> [(wall seconds, results)], one per repeat
    runs = _run_single_loop(pipe, records, modes, max_new_tokens, reporter, repeats)
    alone = [g.token_ids for g in runs[("single", 1, "none", 0, "fixed")][0][1]]
    peer_rows: dict[int, list[dict]] = {}
    for batch in batches:
        _warm_up(pipe, records, modes, batch, reporter)
        runs.update(_run_batched_loop(pipe, records, modes, batch, max_new_tokens, reporter, repeats))
        peer_rows[batch] = _run_peers(batch_peers, batch, prompt_ids, max_new_tokens, alone, reporter)
    rows = _rows(runs, modes[-1], peer_rows)
    _add_speedups(rows)
    return {"engines": str(pipe.manifest.root), "prompts": str(prompts_path), "prompt_count": len(records),
            "max_new_tokens": max_new_tokens, "repeats": repeats, "batches": batches, "built_batches": built,
            "schedule": pipe.manifest.plan.get("schedule"), "rows": rows,
            "peers": [{"peer": p.name, "threads": p.threads, "settings": p.settings} for p in batch_peers],
            "peers_skipped": peers_skipped,
            "measured_schedule": {name: measured_schedule(rows, name) for name in drafters}}


def _check_batches(manifest, batches: list[int]) -> list[int]:
    """The batch sizes the target's engines are built for; refuses a size above them all."""
    built = manifest.batch_sizes("target")
    missing = [b for b in batches if b > max(built)]
    if missing:
        raise BadInput(f"--batch {missing[0]}: the engines are built for batch sizes {built}; "
                       "rebuild with shapes.batch listing it")
    return built


# depth rule -> the batched loop's settings; the tree rules verify token trees of the recipe's
# draft.tree size (at B > 1 at most the depth per row), the others chains
_RULES = {
    "fixed": dict(schedule=False, per_sequence=False, adaptive=False, trees=False),
    "per-sequence": dict(schedule=False, per_sequence=True, adaptive=False, trees=False),
    "schedule": dict(schedule=True, per_sequence=False, adaptive=True, trees=False),
    "tree": dict(schedule=False, per_sequence=False, adaptive=False, trees=True),
    "schedule+tree": dict(schedule=True, per_sequence=False, adaptive=True, trees=True),
}


def _modes(manifest, drafters: list[str], tree_drafters: frozenset[str] = frozenset()) -> list[tuple[str, int, str]]:
    """(drafter, depth, depth rule) of every mode: the target alone first, then per drafter the
    manifest's depth, depth 1, per-sequence depth and (with a manifest schedule) the schedule;
    a drafter in ``tree_drafters`` (it builds trees, the directory has tree graphs) also with
    trees at the manifest's depth (and under the schedule)."""
    depth = manifest.draft_len
    modes = [("none", 0, "fixed")]
    for name in drafters:
        modes += [(name, depth, "fixed"), (name, 1, "fixed"), (name, depth, "per-sequence")]
        if manifest.draft_schedule is not None:
            modes.append((name, depth, "schedule"))
        if name in tree_drafters:
            modes.append((name, depth, "tree"))
            if manifest.draft_schedule is not None:
                modes.append((name, depth, "schedule+tree"))
    return modes


def _settings(pipe, rule: str) -> dict:
    """generate_batch's keyword arguments for a depth rule."""
    settings = dict(_RULES[rule])
    trees = settings.pop("trees")
    return {**settings, "tree_nodes": pipe.built_tree_nodes if trees else 0}


def _split_peers(peers, peers_skipped) -> tuple[list, list[dict]]:
    """(the batched peers to run, every skipped peer: ``peers_skipped`` and those that run one
    sequence at a time)."""
    peers_skipped = list(peers_skipped)
    batch_peers = []
    for peer in peers:
        if hasattr(peer, "run_batch") and not getattr(peer, "speculative", None) and peer.name in _batched_peer_names():
            batch_peers.append(peer)
        else:
            peers_skipped.append({"peer": peer.name, "skipped": "runs one sequence at a time (not a batched peer)"})
    return batch_peers, peers_skipped


def _run_single_loop(pipe, records: list[dict], modes, max_new_tokens: int, reporter,
                     repeats: int) -> dict[tuple, list[tuple[float, list]]]:
    """Today's single-sequence loop (``Pipeline.generate``, prompt after prompt), the batch-1
    comparison, for the fixed-depth modes: ("single", 1, drafter, depth, rule) -> [(wall
    seconds, results)] per repeat."""
    runs: dict[tuple, list[tuple[float, list]]] = {}
    for repeat in range(repeats):
        for drafter, k, rule in modes:
            if rule != "fixed":  # the schedule and per-sequence depth exist in the batched loop only
                continue
            with reporter.step("bench", f"repeat {repeat + 1}: single-sequence loop, {drafter} d={k}") as step:
                start = time.perf_counter()
                single = [pipe.generate(r.get("prompt"), messages=r.get("messages"), drafter=drafter, draft_len=k,
                                        adaptive=False, max_new_tokens=max_new_tokens, tree_nodes=0) for r in records]
                wall = time.perf_counter() - start
                step.detail = f"{sum(g.stats.tokens for g in single) / wall:.1f} tok/s"
            runs.setdefault(("single", 1, drafter, k, rule), []).append((wall, single))
    return runs


def _warm_up(pipe, records: list[dict], modes, batch: int, reporter) -> None:
    """Untimed: the first mode at a batch size must not pay for the sessions' first runs at its
    shapes (every width T the modes use), which the later modes would not; nor an adaptive tree
    mode for timing its tree graph's sizes at each batch size (once per batch loop's target)."""
    with reporter.step("bench", f"batch {batch}, warm-up"):
        for drafter, k, rule in modes:
            settings = _settings(pipe, rule)
            pipe.generate_batch(records[:batch], drafter=drafter, max_new_tokens=4, draft_len=k,
                                max_batch=batch, **{**settings, "schedule": False, "adaptive": False})
            if settings["tree_nodes"] and settings["adaptive"]:
                verifier = pipe.tree_verifier(pipe.batched_target(batch))
                for size in verifier.batches:  # as rows finish, the smaller batch sizes' too
                    verifier.cost(2, size)


def _run_batched_loop(pipe, records: list[dict], modes, batch: int, max_new_tokens: int, reporter,
                      repeats: int) -> dict[tuple, list[tuple[float, list]]]:
    """Every mode through ``Pipeline.generate_batch(max_batch=batch)``, the modes in turn per
    repeat: ("batched", batch, drafter, depth, rule) -> [(wall seconds, results)] per repeat."""
    runs: dict[tuple, list[tuple[float, list]]] = {}
    for repeat in range(repeats):
        for drafter, k, rule in modes:
            with reporter.step("bench", f"repeat {repeat + 1}: batch {batch}, {drafter} d={k} {rule}") as step:
                start = time.perf_counter()
                results = pipe.generate_batch(records, drafter=drafter, max_new_tokens=max_new_tokens,
                                              draft_len=k, max_batch=batch, **_settings(pipe, rule))
                wall = time.perf_counter() - start
                step.detail = f"{sum(r.stats.tokens for r in results) / wall:.1f} tok/s"
            runs.setdefault(("batched", batch, drafter, k, rule), []).append((wall, results))
    return runs


def _run_peers(batch_peers, batch: int, prompt_ids: list[list[int]], max_new_tokens: int, alone: list[list[int]],
               reporter) -> list[dict]:
    """The peers' rows at ``batch``, run right after ours (once: peers are slow); ``alone``: our
    single-sequence target alone's tokens per prompt."""
    rows = []
    for peer in batch_peers:
        with reporter.step("bench", f"batch {batch}, peer {peer.name}") as step:
            row = _peer_row(peer, batch, prompt_ids, max_new_tokens, alone)
            step.detail = f"{row['aggregate_tokens_per_s']:.1f} tok/s"
        rows.append(row)
    return rows


def _rows(runs: dict[tuple, list[tuple[float, list]]], last_mode: tuple[str, int, str],
          peer_rows: dict[int, list[dict]]) -> list[dict]:
    """A row per run key from its median run, lossless when every repeat's greedy tokens equal
    the mode's first run (the single-sequence loop's or, scheduled, the smallest batch's); a
    batch size's peer rows after its ``last_mode`` row."""
    rows, outputs = [], {}
    for (loop, batch, drafter, k, rule), done in runs.items():
        wall, results = sorted(done, key=lambda run: run[0])[len(done) // 2]
        key = (drafter, k, rule)
        outputs.setdefault(key, [r.token_ids for r in done[0][1]])
        lossless = all([r.token_ids for r in results_] == outputs[key] for _, results_ in done)
        rows.append(_row(batch, drafter, k, rule, results, wall, loop, lossless))
        if loop == "batched" and (drafter, k, rule) == last_mode:
            rows += peer_rows.get(batch, [])
    return rows


def _add_speedups(rows: list[dict]) -> None:
    """Each row's ``speedup``: its aggregate tokens/s over the target alone's at the same batch
    size and loop (peers: batched), in the same run."""
    for row in rows:
        loop = "batched" if row["loop"] == "peer" else row["loop"]
        alone = next(r for r in rows if r["batch"] == row["batch"] and r["drafter"] == "none" and r["loop"] == loop)
        row["speedup"] = round(row["aggregate_tokens_per_s"] / alone["aggregate_tokens_per_s"], 3)


def measured_schedule(rows: list[dict], drafter: str) -> list[list[int]]:
    """The depth with the most aggregate tokens/s at each measured batch size (0: the target
    alone won), as a draft.schedule (TensorRT-LLM's upper bounds: [[2, 5], [8, 1]] means batch
    1-2 drafts 5, 3-8 drafts 1), from this run's batched rows of ``drafter`` at fixed depths.
    Batch sizes between two measured ones take the larger one's depth."""
    best: dict[int, int] = {}
    for batch in sorted({r["batch"] for r in rows if r["loop"] == "batched"}):
        candidates = [r for r in rows if r["loop"] == "batched" and r["batch"] == batch
                      and r["depth_rule"] == "fixed" and r["drafter"] in ("none", drafter)]
        best[batch] = max(candidates, key=lambda r: r["aggregate_tokens_per_s"])["depth"]
    steps: list[list[int]] = []
    for batch, depth in sorted(best.items()):
        if steps and steps[-1][1] == depth:
            steps[-1][0] = batch
        else:
            steps.append([batch, depth])
    while steps and steps[-1][1] == 0:  # past the last bound no drafting anyway
        steps.pop()
    return steps


def _batched_peer_names() -> tuple[str, ...]:
    from specexport.bench.peers import BATCHED_PEERS

    return BATCHED_PEERS


def _peer_row(peer, batch: int, prompt_ids: list[list[int]], max_new_tokens: int, ours: list[list[int]]) -> dict:
    """A peer's target alone at ``batch``: the prompts in static batches of ``batch``, in order
    (one untimed warm-up batch of 2 tokens first)."""
    peer.run_batch(prompt_ids[:batch], 2)
    tokens, wall, per_sequence = [], 0.0, []
    for start in range(0, len(prompt_ids), batch):
        run = peer.run_batch(prompt_ids[start:start + batch], max_new_tokens)
        wall += run.total_s
        tokens += run.token_ids
        per_sequence += [len(t) / run.total_s for t in run.token_ids]
    matches = [a == b for a, b in zip(tokens, ours)]
    count = sum(len(t) for t in tokens)
    return {
        "batch": batch, "loop": "peer", "drafter": "none", "peer": peer.name, "depth": 0, "depth_rule": "fixed",
        "tokens": count, "seconds": round(wall, 3), "aggregate_tokens_per_s": round(count / wall, 2),
        "median_sequence_tokens_per_s": round(float(np.median(per_sequence)), 2),
        "acceptance_length": 1.0, "lossless": all(matches), "matches_baseline": all(matches),
        "prompts_matching": f"{sum(matches)}/{len(matches)}",
    }


def _row(batch: int, drafter: str, depth: int, rule: str, results, wall: float, loop: str,
         lossless: bool) -> dict:
    tokens = sum(r.stats.tokens for r in results)
    return {
        "batch": batch, "loop": loop, "drafter": drafter, "depth": depth, "depth_rule": rule, "tokens": tokens,
        "seconds": round(wall, 3), "aggregate_tokens_per_s": round(tokens / wall, 2),
        "median_sequence_tokens_per_s": round(float(np.median([r.stats.tokens_per_s for r in results])), 2),
        "acceptance_length": round(tokens / max(1, sum(r.stats.rounds for r in results)), 3),
        "lossless": lossless,
    }


def write_batched(result: dict, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    files = [out / "bench_batched.json", out / "bench_batched.md", out / "speedup_by_batch.png"]
    write_text(files[0], json.dumps(result, indent=1) + "\n")
    lines = ["| batch | mode | aggregate tok/s | median sequence tok/s | E[L] | speedup | lossless |",
             "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        mode = "target alone" if r["drafter"] == "none" else f"{r['drafter']} d={r['depth']}" + (
            f" ({r['depth_rule']})" if r["depth_rule"] != "fixed" else "")
        if r["loop"] == "single":
            mode += ", single-sequence loop"
        lossless = "yes" if r["lossless"] else "NO"
        if r["loop"] == "peer":
            mode = f"peer {r['peer']} (target alone, static batches)"
            lossless = f"{'yes' if r['matches_baseline'] else 'NO'} ({r['prompts_matching']} prompts equal ours)"
        lines.append(f"| {r['batch']} | {mode} | {r['aggregate_tokens_per_s']} | {r['median_sequence_tokens_per_s']} "
                     f"| {r['acceptance_length']} | {r['speedup']}× | {lossless} |")
    peer_rows = [r for r in result["rows"] if r["loop"] == "peer"]
    if peer_rows:
        lines.append("")
        lines.append("Peers: speedup is the peer's aggregate tok/s over our batched target alone at the same batch "
                     "size (below 1: ours is faster); lossless: each prompt's greedy tokens equal ours.")
    for skipped in result.get("peers_skipped", []):
        lines.append("")
        lines.append(f"Peer {skipped['peer']}: skipped ({skipped['skipped']})")
    for name, steps in result.get("measured_schedule", {}).items():
        lines.append("")
        lines.append(f"Measured schedule for {name} (draft.schedule, keys are upper bounds on the batch size): "
                     + (json.dumps({b: d for b, d in steps}) if steps else "no drafting at any measured batch size"))
    write_text(files[1], "\n".join(lines) + "\n")
    _plot(result, files[2])
    return files


def _plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    batched = [r for r in result["rows"] if r["loop"] == "batched"]
    modes = sorted({(r["drafter"], r["depth"], r["depth_rule"]) for r in batched if r["drafter"] != "none"})
    for drafter, depth, rule in modes:
        points = [(r["batch"], r["speedup"]) for r in batched
                  if (r["drafter"], r["depth"], r["depth_rule"]) == (drafter, depth, rule)]
        ax.plot(*zip(*points), marker="o", label=f"{drafter} d={depth}" + (f" {rule}" if rule != "fixed" else ""))
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequences decoded together (batch)")
    ax.set_ylabel("aggregate speedup over the target alone")
    ax.set_title("where speculation stops paying")
    ax.legend()
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)
