"""What an engine directory can run, checked before anything opens: the batch sizes, a drafter
batched, a tree size, a draft length. Each refusal is one line naming what to change."""

from __future__ import annotations

from specexport.backends import BACKENDS, DEFAULT_BACKEND
from specexport.contract import Manifest, drafter_kinds
from specexport.errors import BadInput
from specexport.runtime.model import slots_refusal

HEAD_KINDS = drafter_kinds(reads_taps=True)  # read the target's hidden states


def target_batches(manifest: Manifest, max_batch: int | None = None) -> list[int]:
    """The batch sizes the loop runs: those built for the target, up to ``max_batch``."""
    built = manifest.batch_sizes("target")
    return [b for b in built if max_batch is None or b <= max_batch] or [1]


def batched_refusal(manifest: Manifest, drafter: str, max_batch: int | None = None,
                    backend: str | None = None) -> str | None:
    """Why ``drafter`` cannot run with up to ``max_batch`` sequences at once on ``backend``
    (None: the default backend) in this directory (None when it can; "none" and an unknown name
    are the caller's to report)."""
    backend = backend or DEFAULT_BACKEND
    batches = target_batches(manifest, max_batch)
    refusal = slots_refusal(manifest, "target", backend, batches, need_graphs=True)
    entry = manifest.drafter_entry(drafter)
    if refusal is not None or entry is None or not entry.signature.runs_model:
        return refusal
    model, fallback = entry.model or entry.name, BACKENDS[backend].fallback
    if model not in manifest.models or not manifest.engines_of(model, fallback):
        return f"its model '{model}' has no {fallback} graphs in this directory; rebuild it"
    if entry.kind in HEAD_KINDS and not manifest.models["target"].taps:
        return "the target's graphs output no aux_hidden_states for it; rebuild with the head in the recipe"
    backend = backend if manifest.engines_of(model, backend) else fallback
    # a head without batched graphs runs its rows one after another; a draft model needs them
    return slots_refusal(manifest, model, backend, batches, need_graphs=entry.kind not in HEAD_KINDS)


def built_tree_nodes(manifest: Manifest) -> int:
    """The tree graph's draft nodes (recipe draft.tree.max_nodes; 0: no tree graph built)."""
    return int(manifest.plan.get("tree_nodes", 0))


def check_tree_nodes(manifest: Manifest, asked: int | None, drafter: str | None = None) -> int:
    """Draft nodes per tree round: ``asked`` (0: chains), default the recipe's (draft.tree) for a
    drafter among draft.tree.drafters (all of them where the recipe names none), else 0; a size
    the directory has no tree graph for is a one-line error naming --tree-nodes."""
    built = built_tree_nodes(manifest)
    if asked is None:
        chosen = manifest.plan.get("tree_drafters")
        return built if chosen is None or drafter is None or drafter in chosen else 0
    if asked and not built:
        raise BadInput("--tree-nodes: this engine directory has no tree graph; rebuild with draft.tree.max_nodes "
                       "in the recipe")
    if not 0 <= asked <= built:
        raise BadInput(f"--tree-nodes must be between 0 and {built}, the tree graph's nodes (got {asked})")
    return asked


def check_draft_len(manifest: Manifest, asked: int | None) -> int:
    """The draft length asked for (default: the plan's D), checked against the engines'."""
    depth = manifest.draft_len if asked is None else asked
    if not 0 <= depth <= manifest.draft_len:
        raise BadInput(f"draft length must be between 0 and {manifest.draft_len} (got {depth})")
    return depth


def check_drafter(manifest: Manifest, drafter: str, max_batch: int | None, option: str = "",
                  backend: str | None = None) -> None:
    """Raise BadInput (led by ``option``, the CLI flag that chose it) when ``drafter`` is unknown
    to this directory or, for ``max_batch`` above 1 (None: the largest built), cannot run batched."""
    entry, lead = manifest.drafter_entry(drafter), f"{option}: " if option else ""
    if entry is None and drafter != "none":
        raise BadInput(f"{lead}unknown drafter '{drafter}'; this engine directory has: "
                       f"{', '.join(['none', *manifest.runnable_drafters])}")
    if entry is None or max_batch == 1:
        return
    reason = batched_refusal(manifest, drafter, max_batch, backend)
    if reason is not None:
        raise BadInput(f"{lead}'{drafter}' ({entry.kind}) cannot run batched: {reason}")
