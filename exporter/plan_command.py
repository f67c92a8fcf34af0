"""`specexport plan`: the draft-length plan of a recipe, without loading any weights."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table

from specexport.exporter.plan import plan_recipe_draft
from specexport.exporter.recipe import load_recipe
from specexport.exporter.sources import load_config


def plan_recipe(path: Path) -> dict:
    recipe, base = load_recipe(path)
    config = load_config(recipe.target, base, "target")
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    plan = plan_recipe_draft(recipe, base, heads, kv_heads)
    return {
        "recipe": recipe.name,
        "model_type": config.model_type,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        **plan.to_dict(),
        "max_draft": recipe.draft.max_draft,
        "draft_len_override": recipe.draft.draft_len,
        "graphs": {
            "decode": 1,
            "verify": plan.tokens_per_verify,
            "prefill": recipe.shapes.prefill_chunk,
        },
        # ort-gqa: an entry of the one graph at every verify size (a round verifies what it drafted)
        "verify_sizes": (list(range(2, plan.tokens_per_verify + 1)) if recipe.attention == "ort-gqa"
                         else [plan.tokens_per_verify]),
        "shapes": recipe.shapes.model_dump(),
    }


def render_plan(result: dict) -> None:
    console = Console()
    table = Table(title=f"draft plan: {result['recipe']} ({result['model_type']})", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    g, tile = result["group_size"], result["tile"]
    table.add_row("G (query heads per KV head)", f"{result['num_attention_heads']} / {result['num_key_value_heads']} = {g}")
    table.add_row("tile rule", f"D = floor({tile}/{g}) - 1 = {result['tile_draft_len']}")
    table.add_row("draft length D", str(result["draft_len"]))
    table.add_row("tokens per verify (1+D)", str(result["tokens_per_verify"]))
    table.add_row("tile rows used G·(1+D)", f"{result['tile_rows_used']} of {tile} × {result['tiles']}")
    sizes = result.get("verify_sizes", [])
    verify = f"{sizes[0]}..{sizes[-1]}" if len(sizes) > 1 else None
    table.add_row("graphs (tokens)", ", ".join(f"{k} {verify if k == 'verify' and verify else v}"
                                               for k, v in result["graphs"].items()))
    table.add_row("reason", result["reason"])
    table.add_row("depth by batch size", depth_by_batch_text(result))
    table.add_row("token tree", tree_text(result))
    console.print(table)
    for warning in result["warnings"]:
        console.print(f"[yellow]warning:[/] {warning}")


def tree_text(result: dict) -> str:
    """The tree budget: the tile's (a GPU's 1 + N rows fill one tile) and the recipe's."""
    tile_n = result.get("tile_tree_nodes", result["tile_draft_len"])
    built = result.get("tree_nodes", 0)
    chosen = result.get("tree_drafters")
    users = "every drafter that builds trees" if chosen is None else ", ".join(chosen) or "none (asked per call)"
    recipe = (f"{built} nodes built (draft.tree.max_nodes), up to {result.get('tree_top_k', 4)} children each; "
              f"trees by default for {users}" if built else "none built (draft.tree.max_nodes: 0, chains only)")
    return f"tile budget N = {tile_n} (G·(1+N) = {result['group_size'] * (tile_n + 1)} rows); {recipe}"


def depth_by_batch_text(result: dict) -> str:
    """The schedule and where it came from: '(recipe)' or '(calibrated on HOST, DATE)'."""
    if not result.get("schedule"):
        return f"D = {result['draft_len']} at every batch size (no draft.schedule, no calibrated schedule)"
    return f"{schedule_text(result['schedule'])} ({result.get('schedule_source') or 'recipe'})"


def schedule_text(steps: list[list[int]]) -> str:
    """[[4, 4], [8, 2]] -> 'batch 1-4: 4, 5-8: 2, above 8: 0'"""
    parts, low = [], 1
    for bound, depth in steps:
        parts.append(f"{low}-{bound}: {depth}" if bound > low else f"{low}: {depth}")
        low = bound + 1
    return "batch " + ", ".join(parts) + f", above {steps[-1][0]}: 0"
