"""The int4 copy of the target drafting over the target's own K/V (``share_target_cache``, on by
default): a row takes the positions it lacks from the target's cache row instead of computing
them, so it never prefills the prompt or catches up after rounds at depth 0, and each round
feeds it only the last committed token."""

from __future__ import annotations

import numpy as np
import pytest

from specexport.runtime import load
from specexport.runtime.acceptance import Sampling
from specexport.runtime.cache_store import HostStore
from specexport.runtime.drafters import DraftBudget, DraftRow, ModelDrafter
from tests.runtime.own_cache import int4_copy
from tests.runtime.test_batch_decode import _prompts


def _drafter(pipe, share: bool, slots: int = 1) -> ModelDrafter:
    return int4_copy(pipe, share, slots)


def _row_kv(store, length: int) -> dict[str, np.ndarray]:
    """A copy of positions [0, length) of a one-row store, host or device: name -> [1, n_kv, length, hd]."""
    arrays = store.host_copy() if hasattr(store, "host_copy") else store.rows()
    return {name: np.array(array[:, :, :length]) for name, array in arrays.items()}


def _draft(drafter: ModelDrafter, prompt: np.ndarray, k: int) -> np.ndarray:
    drafter.join(0, prompt, None)
    return drafter.propose([DraftRow(prompt, Sampling(), np.random.default_rng(0))], DraftBudget([k]))[0].tokens


def test_a_row_given_its_own_kv_drafts_what_it_computes_itself(batched_engines, monkeypatch):
    """The mechanics: the copy's row, handed the very K/V it would compute for the prompt (as the
    target's rows), drafts exactly what it drafts computing them, and runs one token where the
    other runs the whole prompt first."""
    pipe = load(batched_engines)
    prompt = np.asarray(_prompts(3, seed=5)[2], dtype=np.int64)
    own = _drafter(pipe, share=False)
    want = _draft(own, prompt, 4)
    row = own.model.runners[0].cache.rows_store
    computed = _row_kv(row, len(prompt) - 1)  # [1, n_kv, P-1, hd] each
    for array in row.rows().values():
        array[:] = 0  # what the shared row reads, it must have taken

    store = HostStore.allocate(pipe.manifest.models["target"].num_layers,
                               pipe.manifest.models["target"].kv.shape(1), "float32")
    for name, array in computed.items():
        store.rows()[name][:, :, : len(prompt) - 1] = array
    fed: list[int] = []
    run = ModelDrafter._run

    def spy(self, n, feed, want_logits):
        fed.extend(len(tokens) for tokens in feed.values())
        return run(self, n, feed, want_logits)

    monkeypatch.setattr(ModelDrafter, "_run", spy)
    shared = ModelDrafter("quantized-self", own.model, own.cost_ms, target_rows=[store])
    got = _draft(shared, prompt, 4)
    assert got.tolist() == want.tolist()
    assert fed == [1, 1, 1, 1]  # the last prompt token, then one step per draft
    assert shared.catchup_cost(len(prompt) - 1) == 0.0 and own.catchup_cost(len(prompt) - 1) > 0.0


@pytest.mark.parametrize("store", ["host", "device"])
def test_the_int4_copy_drafts_over_the_targets_kv_and_never_prefills(batched_engines, monkeypatch, store):
    """Through the loop: the draft row holds the target's K/V of the committed context, bit for
    bit, and no prompt or catch-up call ever runs; the control (sharing off) feeds its prompt and
    holds K/V of its own, which differ from the target's (int4 weights). "device": both caches
    in the device store on the CPU (runtime/device_store.py), taken by its copy graph."""
    pipe = load(batched_engines, device_store=store == "device")
    prompt = _prompts(3, seed=6)[2]
    alone = pipe.generate(prompt_ids=prompt, drafter="none", max_new_tokens=10)
    prefills: list[int] = []
    forward_alone = ModelDrafter._forward_alone

    def spy(self, slot, tokens):
        prefills.append(len(tokens))
        return forward_alone(self, slot, tokens)

    monkeypatch.setattr(ModelDrafter, "_forward_alone", spy)
    target_row = pipe.caches("target", 1).slots[0].rows_store
    held = {}
    for share in (True, False):
        drafter = _drafter(pipe, share)
        monkeypatch.setitem(pipe._drafters, ("quantized-self", 1), drafter)
        prefills.clear()
        result = pipe.generate(prompt_ids=prompt, drafter="quantized-self", max_new_tokens=10, adaptive=False)
        assert result.token_ids == alone.token_ids and result.stats.proposed > 0
        assert (prefills == []) is share, prefills
        mine = _row_kv(drafter.model.runners[0].cache.rows_store, len(prompt) - 1)
        theirs = _row_kv(target_row, len(prompt) - 1)
        held[share] = all(np.array_equal(mine[name], theirs[name]) for name in theirs)
    assert held == {True: True, False: False}


def test_a_hybrid_copy_computes_its_own(batched_hybrid):
    """A recurrent state is no per-position K/V: the int4 copy of a hybrid target keeps its own."""
    assert load(batched_hybrid).drafter("quantized-self").target_rows is None
