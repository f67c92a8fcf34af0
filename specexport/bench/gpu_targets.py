"""The GPU targets a `bench --device cuda` result is checked against (scripts/gpu_check.sh's
report): each one a value, its limit, and whether it holds (None: not measured, and why)."""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass

TARGET_OVER_TRANSFORMERS = 5.0  # our target alone over transformers' generate, same dtype, same GPU
TILE_PASS_OVER_ONE = 1.5  # the verify pass of 1+D (the tile rule's) over the one-token pass
BEST_DRAFTER_SPEEDUP = 2.0  # the best drafter over our target alone, in each category below
DRAFTER_CATEGORIES = ("grounded-code", "math")
PLAIN_PEER = "transformers-greedy"


@dataclass
class Target:
    name: str
    value: float | None
    limit: str  # ">= 5" or "<= 1.5"
    ok: bool | None  # None: not measured
    detail: str


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def target_over_transformers(result: dict) -> Target:
    """Our target alone's decode rate over transformers' plain generate, median over prompts."""
    name = f"target alone >= {TARGET_OVER_TRANSFORMERS:g}x transformers generate"
    rows = [p for p in result.get("peers", []) if p["peer"] == PLAIN_PEER and p.get("relative_to_baseline")]
    ratio = _median([1.0 / p["relative_to_baseline"] for p in rows])
    if ratio is None:
        why = next((s["skipped"] for s in result.get("peers_skipped", []) if s["peer"] == PLAIN_PEER),
                   f"{PLAIN_PEER} did not run")
        return Target(name, None, f">= {TARGET_OVER_TRANSFORMERS:g}", None, why)
    dtype = (rows[0].get("settings") or {}).get("dtype", "?")
    return Target(name, round(ratio, 2), f">= {TARGET_OVER_TRANSFORMERS:g}", ratio >= TARGET_OVER_TRANSFORMERS,
                  f"median over {len(rows)} prompts; transformers in {dtype}")


def tile_pass(result: dict) -> Target:
    """The verify pass of the tile rule's 1+D tokens over the one-token pass."""
    tokens = result["tile_point"]["tokens"]
    name = f"verify pass of {tokens} tokens <= {TILE_PASS_OVER_ONE:g}x one token"
    point = next((c for c in result["cost_curve"] if c["tokens"] == tokens), None)
    if point is None:
        return Target(name, None, f"<= {TILE_PASS_OVER_ONE:g}", None,
                      f"no engine of {tokens} tokens (draft.probe_tokens in the recipe adds one)")
    return Target(name, point["relative"], f"<= {TILE_PASS_OVER_ONE:g}", point["relative"] <= TILE_PASS_OVER_ONE,
                  f"{point['ms']:.3f} ms against {result['cost_curve'][0]['ms']:.3f} ms")


def best_drafter(result: dict, category: str) -> Target:
    """The best drafter's median speedup over the target alone in one category."""
    name = f"best drafter >= {BEST_DRAFTER_SPEEDUP:g}x on {category}"
    rows = [r for r in result["categories"] if r["category"] == category and r["drafter"] != "none"
            and r["speedup"] is not None]
    if not rows:
        return Target(name, None, f">= {BEST_DRAFTER_SPEEDUP:g}", None, f"no {category} prompt was benched")
    best = max(rows, key=lambda r: r["speedup"])
    return Target(name, best["speedup"], f">= {BEST_DRAFTER_SPEEDUP:g}", best["speedup"] >= BEST_DRAFTER_SPEEDUP,
                  f"{best['drafter']} ({best['prompts']} prompts)")


def outputs_equal(result: dict) -> Target:
    """Every drafter's greedy output equals the target alone's; every speculative peer's its own
    plain run's."""
    ours = [r for r in result["results"] if r["drafter"] != "none"]
    differ = [f"{r['drafter']}/{r['prompt_id']}" for r in ours if r["matches_baseline"] is not True]
    differ += [f"{p['peer']}/{p['prompt_id']}" for p in result.get("peers", []) if p.get("matches_own_plain") is False]
    return Target("every output equal to the target alone's", len(differ), "== 0", not differ and bool(ours),
                  "differ: " + ", ".join(differ) if differ else f"{len(ours)} drafter runs checked")


def check(result: dict) -> list[dict]:
    """Every target, in the issue's order, as dicts (for JSON)."""
    targets = [target_over_transformers(result), tile_pass(result),
               *(best_drafter(result, c) for c in DRAFTER_CATEGORIES), outputs_equal(result)]
    return [asdict(t) for t in targets]
