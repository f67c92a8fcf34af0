"""The int4 copy computing its own K/V of the context (``share_target_cache: false``): what a
draft model does, and what tests of a draft model's own prefill, catch-up and trees check it
with (its drafts over the target's K/V are tests/runtime/test_shared_cache.py's)."""

from __future__ import annotations

import dataclasses

from specexport.runtime.drafter_factories import make_drafter
from specexport.runtime.drafters import ModelDrafter


def int4_copy(pipe, share: bool, slots: int = 1, name: str = "quantized-self") -> ModelDrafter:
    """The pipeline's int4 copy over ``slots`` rows, sharing the target's cache or not."""
    entry = pipe.manifest.drafter_entry(name)
    drafter = make_drafter(pipe, dataclasses.replace(entry, params={**entry.params, "share_target_cache": share}),
                           slots)
    assert isinstance(drafter, ModelDrafter) and (drafter.target_rows is not None) is share
    return drafter


def use_own_cache(pipe, slots: tuple[int, ...] = (1,), name: str = "quantized-self") -> None:
    """The pipeline's ``name`` drafter over each of ``slots`` computes its own K/V from now on
    (pipe.drafter and pipe.generate use it)."""
    for count in slots:
        pipe._drafters[(name, count)] = int4_copy(pipe, share=False, slots=count, name=name)
