"""The drafter of each kind, made over a loop's slots from its manifest entry and the pipeline
that opens its models: the factory its kind names (contract.DRAFTER_KINDS: KindSignature.drafter,
imported on first use), so that a new kind's runtime module needs no entry here. The factories
of the two families that need no module of their own (prompt lookup, a draft model) are here."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from specexport.contract import DrafterEntry, Role
from specexport.runtime.drafters import Drafter, ModelDrafter, NgramDrafter
from specexport.runtime.engine import import_factory

if TYPE_CHECKING:
    from specexport.runtime.api import Pipeline

_log = logging.getLogger(__name__)


def ngram(pipe: Pipeline, entry: DrafterEntry, slots: int) -> Drafter:
    return NgramDrafter(entry.name, entry.settings.max_ngram, entry.settings.min_ngram)


def model(pipe: Pipeline, entry: DrafterEntry, slots: int) -> Drafter:
    name = entry.model or entry.name
    costs = {t: ms for role, by_tokens in pipe.costs.by_role(name).items() if role is not Role.FILL
             for t, ms in by_tokens.items()}  # a fill entry shares its size with a decoding one
    return ModelDrafter(entry.name, pipe.model(name, slots=slots), costs)


def quantized_self(pipe: Pipeline, entry: DrafterEntry, slots: int) -> Drafter:
    """The int4 copy of the target: a draft model whose rows take the target's K/V of the
    context (ModelDrafter.target_rows) where the two caches have one layout and the recipe
    leaves ``share_target_cache`` on; else a draft model computing its own."""
    drafter = model(pipe, entry, slots)
    assert isinstance(drafter, ModelDrafter)
    why = _why_not_shared(pipe, entry, slots)
    if why is None:
        drafter.target_rows = [cache.rows_store for cache in pipe.caches("target", slots).slots]
    elif entry.settings.share_target_cache is not False:
        _log.info("drafter '%s' computes its own K/V of the context: %s", entry.name, why)
    return drafter


def _why_not_shared(pipe: Pipeline, entry: DrafterEntry, slots: int) -> str | None:
    """None where the int4 copy's cache rows can take the target's; else why not, in words."""
    if entry.settings.share_target_cache is False:
        return "share_target_cache is off"
    mine, target = pipe.manifest.models[entry.model or entry.name], pipe.manifest.models["target"]
    if mine.state is not None:
        return "a recurrent state cannot be taken position by position"
    layout = (mine.num_layers, mine.kv.shape(1), mine.kv_dtype)
    if layout != (target.num_layers, target.kv.shape(1), target.kv_dtype):
        return f"its cache layout (layers, [1, n_kv, S_max, hd], dtype) {layout} is not the target's"
    ours, theirs = pipe.caches(mine.name, slots).slots[0], pipe.caches("target", slots).slots[0]
    mine_store, target_store = getattr(ours, "rows_store", None), getattr(theirs, "rows_store", None)
    if mine_store is None or type(mine_store) is not type(target_store) or pipe.backend_of(mine.name) != \
            pipe.backend_of("target"):
        return "its cache and the target's live on different devices or backends"
    return None


def make_drafter(pipe: Pipeline, entry: DrafterEntry, slots: int) -> Drafter:
    """The drafter of ``entry``'s kind over ``slots`` rows."""
    return import_factory(entry.signature.drafter)(pipe, entry, slots)
