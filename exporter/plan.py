"""The draft-length plan: the tile rule, then the recipe's cap or override.

Attention kernels stack the G query heads that share a KV head, times the 1+D verify tokens,
along the rows of a 128-row tile. D = floor(tile / G) - 1 fills one tile exactly; past that,
G·(1+D) should be a multiple of the tile, since a partly filled tile costs a full one.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from specexport.contract import DraftSchedule
from specexport.errors import BadInput


@dataclass(frozen=True)
class DraftPlanResult:
    group_size: int  # G: query heads per KV head
    tile: int
    tile_draft_len: int  # D from the tile rule, before any cap
    draft_len: int  # D the engines are built for
    tokens_per_verify: int  # 1 + D
    tile_rows_used: int  # G · (1 + D)
    tiles: int  # tiles a verify pass occupies per KV head
    reason: str
    warnings: list[str] = field(default_factory=list)
    schedule: list[list[int]] | None = None  # [[batch upper bound, depth], ...] (contract.DraftSchedule)
    # where the schedule came from: "recipe" (draft.schedule / disable_by_batch_size) or
    # "calibrated on HOST, DATE" (the calibration file's measured one); None without a schedule
    schedule_source: str | None = None
    # token trees (recipe draft.tree): the tree graph's draft nodes (0: none built) and children
    # per node; tile_tree_nodes is the tile rule's budget, the N with G · (1 + N) = one tile
    tree_nodes: int = 0
    tree_top_k: int = 4
    tree_drafters: list[str] | None = None  # the drafters that decode trees by default (None: all that can)
    tile_tree_nodes: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


def group_size(num_attention_heads: int, num_key_value_heads: int | None) -> int:
    kv = num_key_value_heads or num_attention_heads
    if num_attention_heads % kv:
        raise BadInput(
            f"num_attention_heads ({num_attention_heads}) is not a multiple of "
            f"num_key_value_heads ({kv})"
        )
    return num_attention_heads // kv


def plan_draft_len(
    num_attention_heads: int,
    num_key_value_heads: int | None,
    tile: int = 128,
    max_draft: int | None = None,
    draft_len: int | None = None,
    why: str | None = None,
    override_label: str = "draft.draft_len",
) -> DraftPlanResult:
    g = group_size(num_attention_heads, num_key_value_heads)
    tile_d = tile // g - 1
    warnings: list[str] = []
    rule = f"G = {num_attention_heads}/{num_key_value_heads or num_attention_heads} = {g}; tile rule D = floor({tile}/{g}) - 1 = {tile_d}"

    if draft_len is not None:
        d = draft_len
        reason = f"{rule}; overridden by {override_label} = {d}"
    elif tile_d < 1:
        d = 1
        reason = f"{rule}; G fills a whole tile with one token, so D = 1 (the smallest useful draft)"
        warnings.append(f"group size {g} fills a {tile}-row tile with one token; verify cost grows with every draft token")
    elif max_draft is not None and max_draft < tile_d:
        d = max_draft
        reason = f"{rule}; capped by draft.max_draft = {d}"
    else:
        d = tile_d
        reason = rule

    if why and (draft_len is not None or d == max_draft):
        reason = f"{reason} ({why})"
    rows = g * (1 + d)
    tiles = -(-rows // tile)
    if rows > tile and rows % tile:
        warnings.append(
            f"G·(1+D) = {g}·{1 + d} = {rows} rows is past one {tile}-row tile and not a multiple of it: "
            f"the last tile is {rows % tile}/{tile} full but costs a whole one"
        )
    return DraftPlanResult(
        group_size=g,
        tile=tile,
        tile_draft_len=tile_d,
        draft_len=d,
        tokens_per_verify=1 + d,
        tile_rows_used=rows,
        tiles=tiles,
        reason=reason,
        warnings=warnings,
    )


def calibration_file(recipe, base: Path) -> Path | None:
    if recipe.draft.calibration is None:
        return None
    path = recipe.draft.calibration
    return path if path.is_absolute() else base / path


def plan_recipe_draft(recipe, base: Path, heads: int, kv_heads: int | None) -> DraftPlanResult:
    """The recipe's plan, with a calibration file's measured D when the recipe names one, and
    its depth by batch size, depths capped at D: the recipe's own (draft.schedule or
    draft.disable_by_batch_size) when it gives one, else the calibration file's measured
    schedule when it has one, else none (D at every batch size)."""
    measured, path = _calibration(recipe, base)
    plan = _plan_depth(recipe, heads, kv_heads, measured, path)
    draft = recipe.draft
    steps, source = None, None
    if draft.schedule is not None:
        steps, source = [[bound, depth] for bound, depth in sorted(draft.schedule.items())], "recipe"
    elif draft.disable_by_batch_size is not None:
        steps = DraftSchedule.disable_by_batch_size(draft.disable_by_batch_size, plan.draft_len).to_json()
        source = "recipe"
    elif measured is not None and measured.get("schedule"):
        try:
            steps = DraftSchedule.parse(measured["schedule"]).to_json()
        except (BadInput, ValueError, TypeError) as err:
            raise BadInput(f"{path}: its schedule is not a depth by batch size ({err}); "
                           "rerun specexport plan --calibrate") from None
        when = str(measured.get("measured", ""))[:10] or "undated"
        source = f"calibrated on {measured.get('host') or 'an unnamed host'}, {when}"
    if steps is not None:
        steps = [[bound, min(depth, plan.draft_len)] for bound, depth in steps]
    return replace(plan, schedule=steps, schedule_source=source, tree_nodes=draft.tree.max_nodes,
                   tree_top_k=draft.tree.top_k, tree_drafters=draft.tree.drafters, tile_tree_nodes=plan.tile_draft_len)


def _calibration(recipe, base: Path) -> tuple[dict | None, Path | None]:
    """The recipe's calibration file, read (None when it names none or it is missing)."""
    path = calibration_file(recipe, base)
    if path is None or not path.is_file():
        return None, path
    try:
        measured = json.loads(path.read_text())
        if not isinstance(measured, dict):
            raise TypeError("not an object")
        return measured, path
    except (ValueError, TypeError) as err:
        raise BadInput(f"{path}: not a calibration file ({err}); rerun specexport plan --calibrate") from None


def _plan_depth(recipe, heads: int, kv_heads: int | None, measured: dict | None, path: Path | None) -> DraftPlanResult:
    draft = recipe.draft
    if measured is not None:
        try:
            return plan_draft_len(heads, kv_heads, draft.tile, draft_len=int(measured["draft_len"]),
                                  why=str(measured.get("why", "")) or None, override_label=path.name)
        except (ValueError, KeyError, TypeError) as err:
            raise BadInput(f"{path}: not a calibration file ({err}); rerun specexport plan --calibrate") from None
    plan = plan_draft_len(heads, kv_heads, draft.tile, draft.max_draft, draft.draft_len, draft.why)
    if path is not None:
        plan.warnings.append(f"{path.name} not found: using max_draft; run specexport plan --calibrate to measure D")
    return plan
