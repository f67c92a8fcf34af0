"""Turn the bench's raw runs into results: per prompt, per category, with predictions.

Per (drafter, prompt): tokens/s is the median over repeats of tokens / decode seconds (the
prefill is excluded, for every runner alike); E[L] is tokens per verify round over all repeats.
The predicted speedup is the equation E[L] · T_target / (T_draft + T_verify) with every time
measured apart from the runs (``harness.measure_costs``: the verify cost curve and each
drafter's step, timed round-robin, medians) and only the acceptance taken from the runs: for
the rounds that drafted k tokens (k = 0..D, from the run's draft sizes),

    predicted = tokens · T_verify(1) / Σ_k rounds_k · (T_verify(1+k) + T_draft(k))

where T_draft(k) is the drafter's engines for k drafts: k steps (a draft model), one catch-up
call and k − 1 steps (a chain head), one block call (a block head).

So it predicts from the engines alone: host time and the drafter's catch-up after rounds it
skipped are outside it, and the gap between predicted and measured is what they (and the
machine's drift) cost.
"""

from __future__ import annotations

import statistics
from collections import defaultdict


def rounds_by_draft_size(rounds: int, proposed_at: list[int]) -> list[int]:
    """[D+1] rounds that drafted k = 0..D tokens, from rounds that offered each position."""
    at_least = [rounds, *proposed_at, 0]  # at_least[k]: rounds that drafted k or more
    return [at_least[k] - at_least[k + 1] for k in range(len(proposed_at) + 1)]


def predict_speedup(tokens: int, rounds: int, proposed_at: list[int], verify_ms: list[float],
                    draft_ms: list[float] | None) -> float | None:
    """The equation's speedup for the run's acceptance (tokens, rounds and draft sizes) at the
    costs measured apart: verify_ms[k], the pass that verifies k drafts; draft_ms[k], drafting
    k tokens in one round (None: a drafter without engines)."""
    per_size = rounds_by_draft_size(rounds, proposed_at)
    if len(per_size) > len(verify_ms):  # a long drafter's rounds past D: no cost measured apart for them
        return None
    seconds = sum(n * (verify_ms[k] + (draft_ms[k] if draft_ms else 0.0)) for k, n in enumerate(per_size))
    return tokens * verify_ms[0] / seconds if seconds and tokens else None


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _fraction(runs: list[dict], key: str, minus: str | None = None) -> float | None:
    """Share of the runs' decode time spent in ``key`` (less ``minus``)."""
    seconds = sum(r["total_s"] for r in runs)
    part = sum(r[key] - (r[minus] if minus else 0.0) for r in runs)
    return round(part / seconds, 3) if seconds else None


def _per_prompt(records: list[dict], baseline: dict[str, dict], costs: dict,
                fixed: dict[tuple[str, str], float]) -> list[dict]:
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for record in records:
        groups[(record["drafter"], record["prompt_id"])].append(record)
    results = []
    for (drafter, prompt_id), runs in groups.items():
        tokens = sum(r["tokens"] for r in runs)
        rounds = sum(r["rounds"] for r in runs)
        tps = _median([r["tokens"] / r["total_s"] for r in runs if r["total_s"]])
        base = baseline[prompt_id]
        el = tokens / rounds if rounds else 0.0
        depth = max(len(r["accepted_at"]) for r in runs)  # D, or more where a long drafter drafted past it
        accepted = [sum(r["accepted_at"][i] for r in runs if i < len(r["accepted_at"])) for i in range(depth)]
        proposed = [sum(r["proposed_at"][i] for r in runs if i < len(r["proposed_at"])) for i in range(depth)]
        trees = sum(r.get("tree_nodes", 0) for r in runs)
        # the equation's costs are a chain's: a run with tree rounds is not predicted
        predicted = None if trees else predict_speedup(tokens, rounds, proposed, costs["verify_ms"],
                                                       costs["draft_ms"].get(drafter))
        results.append({
            "drafter": drafter,
            "tree_nodes": runs[0].get("tree_setting", 0),  # the setting: draft nodes per round at most
            "tree_nodes_per_round": round(trees / rounds, 2) if rounds else 0.0,
            "verify_tokens_per_round": round(sum(r.get("verified_tokens", 0) for r in runs) / rounds, 3) if rounds else None,
            "prompt_id": prompt_id,
            "category": runs[0]["category"],
            "tokens": tokens // len(runs),
            "tokens_per_s": round(tps, 2) if tps else None,
            "speedup": round(tps / base["tokens_per_s"], 3) if tps and base["tokens_per_s"] else None,
            **_paired(runs, base.get("by_repeat", {})),
            "acceptance_length": round(el, 3),
            # greedy E[L] at the fixed full depth (None: not measured, or the run was not adaptive)
            "acceptance_length_fixed": fixed.get((drafter, prompt_id), 1.0 if drafter == "none" else None),
            "predicted_speedup": round(predicted, 3) if predicted else None,
            # the policy's price of the rounds that ran against what they took (runtime/round_prices.py)
            **_round_prices(runs),
            "acceptance_by_position": [round(a / p, 3) if p else None for a, p in zip(accepted, proposed)],
            # of decode time: the drafter's engines, the target's, and everything outside them
            # (of which the drafter's own host work is draft_host_fraction)
            "draft_fraction": _fraction(runs, "draft_engine_s"),
            "verify_fraction": _fraction(runs, "verify_s"),
            "host_fraction": _fraction(runs, "host_s"),
            "draft_host_fraction": _fraction(runs, "draft_s", minus="draft_engine_s"),
            "matches_baseline": all(r["token_ids"] == base["token_ids"] for r in runs) if base.get("greedy") else None,
            **(_constrained(runs) if runs[0].get("constrained") else {}),
        })
    return results


def _paired(runs: list[dict], base_by_repeat: dict[int, float]) -> dict:
    """Each repeat's tokens/s over the target alone's in the same repeat (run seconds before it,
    so a machine that changes speed between repeats moves both): their median, and their lowest
    and highest, the spread a single run's ratio can land in."""
    ratios = sorted(r["tokens"] / r["total_s"] / base_by_repeat[r.get("repeat", 0)] for r in runs
                    if r["total_s"] and base_by_repeat.get(r.get("repeat", 0)))
    if not ratios:
        return {"speedup_paired": None, "speedup_range": None}
    return {"speedup_paired": round(statistics.median(ratios), 3), "speedup_range": [round(ratios[0], 3),
                                                                                      round(ratios[-1], 3)]}


def _round_prices(runs: list[dict]) -> dict:
    """ms per round: the adaptive policy's price of the rounds that ran (after its checks
    against the clock) and what they took (None: no priced rounds)."""
    rounds = sum(r.get("priced_rounds", 0) for r in runs)
    if not rounds:
        return {"priced_ms_per_round": None, "measured_ms_per_round": None}
    return {"priced_ms_per_round": round(1e3 * sum(r["priced_s"] for r in runs) / rounds, 3),
            "measured_ms_per_round": round(1e3 * sum(r["priced_measured_s"] for r in runs) / rounds, 3)}


def _constrained(runs: list[dict]) -> dict:
    """Structured output: the share of runs whose output parsed and met its schema, and the
    grammar's cost per ruled row (its mask, the rules around it) in ms."""
    verdicts = [r["schema_valid"] for r in runs if r.get("schema_valid") is not None]
    rows = sum(r.get("ruled_rows", 0) for r in runs)
    return {"constrained": True,
            "schema_valid": round(sum(verdicts) / len(verdicts), 3) if verdicts else None,
            "mask_ms_per_row": round(sum(r["rules_s"] for r in runs) / rows * 1e3, 4) if rows else None,
            "mask_fraction": _fraction(runs, "rules_s")}


def _baseline(records: list[dict], greedy: bool) -> dict[str, dict]:
    by_prompt: dict[str, list[dict]] = defaultdict(list)
    for record in records:
        if record["drafter"] == "none":
            by_prompt[record["prompt_id"]].append(record)
    return {
        prompt_id: {
            "tokens_per_s": _median([r["tokens"] / r["total_s"] for r in runs if r["total_s"]]),
            # repeat -> tokens/s: each repeat's runs of a prompt are seconds apart (speedup_paired)
            "by_repeat": {r.get("repeat", 0): r["tokens"] / r["total_s"] for r in runs if r["total_s"]},
            "token_ids": runs[0]["token_ids"],
            "greedy": greedy,
        }
        for prompt_id, runs in by_prompt.items()
    }


def _by_category(results: list[dict]) -> list[dict]:
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in results:
        groups[(r["drafter"], r["category"])].append(r)
    rows = []
    for (drafter, category), items in sorted(groups.items()):
        rows.append({
            "drafter": drafter,
            "category": category,
            "prompts": len(items),
            "tokens_per_s": _median([r["tokens_per_s"] for r in items]),
            "speedup": _median([r["speedup"] for r in items]),
            "acceptance_length": _median([r["acceptance_length"] for r in items]),
            "acceptance_length_fixed": _median([r.get("acceptance_length_fixed") for r in items]),
            "predicted_speedup": _median([r["predicted_speedup"] for r in items]),
            "host_fraction": _median([r["host_fraction"] for r in items]),
            "matches_baseline": None if items[0]["matches_baseline"] is None
            else all(r["matches_baseline"] for r in items),
            **({"schema_valid": _median([r["schema_valid"] for r in items]),
                "schema_valid_all": all(r["schema_valid"] == 1.0 for r in items),
                "mask_ms_per_row": _median([r["mask_ms_per_row"] for r in items]),
                "mask_fraction": _median([r["mask_fraction"] for r in items])} if items[0].get("constrained") else {}),
        })
    return rows


def _peer_decode_rate(record: dict) -> float | None:
    """Tokens per second after the first token: timed in the run where the peer can
    (``decode_s``), else the run's time less a separate first-token run's."""
    steps = len(record["token_ids"]) - 1
    if steps < 1:
        return None
    if record.get("decode_s"):
        # the peer's own count where one step emits several tokens (prompt lookup)
        return (record.get("decode_tokens") or steps) / record["decode_s"]
    decode_s = record["total_s"] - record["first_token_s"]
    return steps / decode_s if decode_s > 0 else None


def _peers(peer_records: list[dict], baseline: dict[str, dict]) -> list[dict]:
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for record in peer_records:
        groups[(record["peer"], record["prompt_id"])].append(record)
    rows = []
    for (peer, prompt_id), runs in groups.items():
        decode = [_peer_decode_rate(r) for r in runs]
        decode = [rate for rate in decode if rate is not None]
        tps = _median(decode)
        base = baseline[prompt_id]
        rows.append({
            "peer": peer,
            "threads": runs[0]["threads"],
            "settings": runs[0].get("settings", {}),
            "acceptance_rate": _median([(r.get("stats") or {}).get("acceptance_rate") for r in runs]),
            "prompt_id": prompt_id,
            "category": runs[0]["category"],
            "tokens_per_s": round(tps, 2) if tps else None,
            "relative_to_baseline": round(tps / base["tokens_per_s"], 3) if tps and base["tokens_per_s"] else None,
            "matches_baseline": runs[0]["token_ids"] == base["token_ids"] if base.get("greedy") else None,
            "matches_own_plain": _matches_own_plain(peer, prompt_id, groups) if base.get("greedy") else None,
        })
    return rows


def _matches_own_plain(peer: str, prompt_id: str, groups: dict[tuple, list[dict]]) -> bool | None:
    """A speculative peer's greedy tokens against its own plain decoding of the same prompt in
    this run (peers.PLAIN_PEER: is the peer's speculation lossless?); None for a plain peer, or
    when its plain peer did not run."""
    from specexport.bench.peers import PLAIN_PEER

    plain = groups.get((PLAIN_PEER.get(peer, ""), prompt_id))
    if not plain:
        return None
    return all(run["token_ids"] == plain[0]["token_ids"] for run in groups[(peer, prompt_id)])


def summarize(pipe, options, prompts, drafters, records, peer_records, skipped, costs,
              fixed_records: list[dict] | None = None) -> dict:
    greedy = options.temperature == 0.0
    baseline = _baseline(records, greedy)
    fixed = {(r["drafter"], r["prompt_id"]): round(r["tokens"] / r["rounds"], 3)
             for r in fixed_records or [] if r["rounds"]}
    results = _per_prompt(records, baseline, costs, fixed)
    curve = costs["curve"]
    plan = pipe.manifest.plan
    tile_tokens = plan["tile_draft_len"] + 1
    return {
        "engine_dir": str(pipe.manifest.root),
        "name": pipe.manifest.name,
        "toolchain": dict(pipe.manifest.toolchain),
        "settings": {
            "threads": options.threads,
            "device": getattr(options, "device", "cpu"),
            "max_new_tokens": options.max_new_tokens,
            "repeats": options.repeats,
            "temperature": options.temperature,
            "adaptive": options.adaptive,
            "draft_len": options.draft_len or pipe.manifest.draft_len,
            "prompts": str(options.prompts),
            "drafters": drafters,
        },
        "plan": plan,
        "results": results,
        "categories": _by_category(results),
        "cost_curve": curve,
        # what predicted_speedup is made of, measured apart from the runs
        "costs": {k: costs[k] for k in ("verify_ms", "draft_ms", "draft_parts_ms", "repeats", "logits")},
        "tile_point": {"tokens": tile_tokens, "group_size": plan["group_size"],
                       "measured": any(c["tokens"] == tile_tokens for c in curve)},
        "peers": _peers(peer_records, baseline),
        "peers_skipped": skipped,
    }
