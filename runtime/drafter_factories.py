"""The drafter of each family (contract.DRAFTER_KINDS: each kind's family), made over a loop's
slots from its manifest entry and the pipeline that opens its models."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING

from specexport.contract import DRAFTER_KINDS, DrafterEntry, DrafterFamily
from specexport.runtime.drafters import Drafter, ModelDrafter, NgramDrafter

if TYPE_CHECKING:
    from specexport.runtime.api import Pipeline

Factory = Callable[["Pipeline", DrafterEntry, int], Drafter]


def _ngram(pipe: Pipeline, entry: DrafterEntry, slots: int) -> Drafter:
    return NgramDrafter(entry.name, entry.settings.max_ngram, entry.settings.min_ngram)


def _model(pipe: Pipeline, entry: DrafterEntry, slots: int) -> Drafter:
    model = entry.model or entry.name
    costs = {t: ms for by_tokens in pipe.costs.by_role(model).values() for t, ms in by_tokens.items()}
    return ModelDrafter(entry.name, pipe.model(model, slots=slots), costs)


def _from_module(module: str) -> Factory:
    """A factory in a runtime module (``make(pipe, entry, slots)``), imported on first use."""

    def factory(pipe: Pipeline, entry: DrafterEntry, slots: int) -> Drafter:
        return importlib.import_module(module).make(pipe, entry, slots)

    return factory


# EAGLE-3 and MTP draft a chain from the target's hidden states, DFlash and DSpark a block per call
DRAFTERS: dict[DrafterFamily, Factory] = {
    DrafterFamily.LOOKUP: _ngram,
    DrafterFamily.MODEL: _model,
    DrafterFamily.CHAIN: _from_module("specexport.runtime.chain_drafter"),
    DrafterFamily.BLOCK: _from_module("specexport.runtime.block_drafter"),
}


def make_drafter(pipe: Pipeline, entry: DrafterEntry, slots: int) -> Drafter:
    """The drafter of ``entry``'s family over ``slots`` rows."""
    return DRAFTERS[DRAFTER_KINDS[entry.kind].family](pipe, entry, slots)
