"""What a chain head (EAGLE-3, MTP) must draft: the greedy chain of the exporter's plain-torch
reference forward after a committed context, compared position by position with the runtime's
proposals through the decode loop; and the acceptance length (E[L]) a head reaches there.

A chain, as the runtime drafts it (runtime/chain_drafter.py): the catch-up rows of the committed
context (row p: token x_{p+1}, the target's features of position p) give the first draft; each
further draft is one more row, its token the draft before, fed the head's own hidden of the row
before. The reference runs every row in one causal pass (``Reference.run``, own rows last)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from tests.heads.block_checkpoints import drafts_by_reference
from tests.heads.common import with_shapes

CHAIN_KINDS = ("eagle3", "mtp")


def load_chain_heads(raw: dict, base: Path):
    """(the recipe's target as the exporter loads it, {drafter name: its loaded chain head})."""
    from specexport.exporter.heads import load_head
    from specexport.exporter.recipe import parse_recipe
    from specexport.exporter.sources import load_source

    parsed = parse_recipe(with_shapes(raw), "recipe")
    target = load_source(parsed.target, base, "target")
    heads = {spec.name: load_head(spec, target, base, f"drafters.{i}")
             for i, spec in enumerate(parsed.drafters) if spec.kind in CHAIN_KINDS}
    return target, heads


def context_states(target, context: np.ndarray, extra: int):
    """The target's states over ``context`` and ``extra`` placeholder positions after it (the
    reference slices its features by row count; the chain's rows there read the head's own
    hidden instead)."""
    from specexport.exporter.heads.chain import target_states

    ids = np.concatenate((context, np.full(extra, context[-1]))).astype(np.int64)  # [m + extra]
    return target_states(SimpleNamespace(target=target), ids)  # it reads ctx.target only


def reference_levels(head, target, context: np.ndarray, k: int) -> list[torch.Tensor]:
    """The head's logits [V_target] at each of the ``k`` levels of its greedy chain after
    ``context``, by its reference forward (over target ids: -inf off a reduced draft
    vocabulary, d2t applied)."""
    states = context_states(target, context, k)
    tokens = [int(t) for t in context[1:]]  # rows 0..m-2: token x_{p+1}
    own: list[torch.Tensor] = []  # [H] each: the features of the step rows
    levels: list[torch.Tensor] = []
    with torch.no_grad():
        for _ in range(k):
            logits, hidden = head.reference.run(torch.tensor(tokens), states, torch.stack(own) if own else None)
            levels.append(logits[-1])  # logits [rows, V_target], hidden [rows, H]
            own.append(hidden[-1])
            tokens.append(int(levels[-1].argmax()))
    return levels


def reference_chain(head, target, context: np.ndarray, k: int) -> list[int]:
    """The head's greedy chain of ``k`` drafts after ``context`` by its reference forward."""
    return [int(logits.argmax()) for logits in reference_levels(head, target, context, k)]


@contextmanager
def one_torch_thread() -> Iterator[None]:
    """Torch on one thread: the reference's many tiny forwards spin-wait in a pool of two on
    the two shared cores of CI (a hundred times slower)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def check_drafts_are_the_reference_chain(pipe, drafter: str, head, target,
                                         prompt: str = "The lighthouse keeper climbed", new_tokens: int = 12) -> None:
    """Greedy decode with ``drafter`` (fixed depth): every round's proposals equal the
    reference's chain after the same committed tokens, and the step graph drafted too."""
    seen = drafts_by_reference(pipe, drafter, prompt, new_tokens)
    assert len(seen) >= 3, f"{drafter}: only {len(seen)} rounds drafted"
    assert max(len(drafts) for _, drafts, _, _ in seen) == pipe.manifest.draft_len >= 2, "no step graph ran"
    with one_torch_thread():
        for context, drafts, _, _ in seen:
            want = reference_chain(head, target, context, len(drafts))
            assert drafts.tolist() == want, (drafter, len(context), drafts.tolist(), want)
