"""The drafter of each kind, made over a loop's slots from its manifest entry and the pipeline
that opens its models: the factory its kind names (contract.DRAFTER_KINDS: KindSignature.drafter,
imported on first use), so that a new kind's runtime module needs no entry here. The factories
of the two families that need no module of their own (prompt lookup, a draft model) are here."""

from __future__ import annotations

from typing import TYPE_CHECKING

from specexport.contract import DrafterEntry
from specexport.runtime.drafters import Drafter, ModelDrafter, NgramDrafter
from specexport.runtime.engine import import_factory

if TYPE_CHECKING:
    from specexport.runtime.api import Pipeline


def ngram(pipe: Pipeline, entry: DrafterEntry, slots: int) -> Drafter:
    return NgramDrafter(entry.name, entry.settings.max_ngram, entry.settings.min_ngram)


def model(pipe: Pipeline, entry: DrafterEntry, slots: int) -> Drafter:
    name = entry.model or entry.name
    costs = {t: ms for by_tokens in pipe.costs.by_role(name).values() for t, ms in by_tokens.items()}
    return ModelDrafter(entry.name, pipe.model(name, slots=slots), costs)


def make_drafter(pipe: Pipeline, entry: DrafterEntry, slots: int) -> Drafter:
    """The drafter of ``entry``'s kind over ``slots`` rows."""
    return import_factory(entry.signature.drafter)(pipe, entry, slots)
