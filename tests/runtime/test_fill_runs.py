"""A drafter feeds the rows it never reads (its prompt, rows fed ahead of a catch-up) through its
fill entries (Role.FILL: no logits computed), with the same drafts; a directory built before
them decodes as it did."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from specexport.contract import Manifest, Role, write_manifest
from specexport.runtime import load
from tests.conftest import copy_engines, tuned_copy
from tests.runtime.own_cache import int4_copy, use_own_cache

DRAFTERS = ("quantized-self", "draft-model")
PROMPT = [int(t) for t in (np.arange(40) * 7 + 3) % 97]  # 40 tokens: two prefill chunks of 16 and a part


@pytest.fixture(scope="module")
def gqa(tiny_engines):
    return tiny_engines.for_arch("llama", "ort-gqa")


@pytest.fixture(scope="module")
def without_fill(gqa, tmp_path_factory):
    """The same directory as built before fill graphs: no fill entries (the files stay)."""
    dst = copy_engines(gqa, tmp_path_factory.mktemp("no-fill") / "engines")
    manifest = Manifest.load(dst)
    write_manifest(dst, replace(manifest, engines=[e for e in manifest.engines if e.role is not Role.FILL]))
    return dst


def _decode(root, drafter: str):
    """A fixed-depth decode and the drafter's runner: (generation, runner). The int4 copy
    computes its own K/V (sharing the target's, it never feeds a row: tests/runtime/test_shared_cache.py)."""
    pipe = load(root, threads=1)
    use_own_cache(pipe)
    out = pipe.generate(prompt_ids=PROMPT, max_new_tokens=24, drafter=drafter, draft_len=3, adaptive=False)
    return pipe, out, pipe.drafter(drafter).model.runners[0]


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_a_drafter_prefills_through_its_fill_entries_with_the_same_drafts(gqa, without_fill, drafter):
    pipe, out, runner = _decode(gqa, drafter)
    calls = runner.calls_by_engine
    fills = {name: n for name, n in calls.items() if ".fill." in name}
    assert runner.fill_sizes and sum(fills.values()) >= 3  # 39 prompt rows: pieces of at most 16
    assert calls[f"{drafter}.prefill.b1.t16"] == 0  # no prompt row computed logits
    _, old, old_runner = _decode(without_fill, drafter)
    assert not old_runner.fill_sizes and old_runner.calls_by_engine[f"{drafter}.prefill.b1.t16"] >= 2
    # the same drafts round by round, and the target's own output
    assert (out.stats.round_drafts, out.stats.round_accepted) == (old.stats.round_drafts, old.stats.round_accepted)
    assert out.token_ids == old.token_ids == pipe.generate(prompt_ids=PROMPT, max_new_tokens=24).token_ids


def test_a_catch_up_is_priced_at_the_fill_entries_it_runs(gqa, tmp_path):
    """Rows past a drafter's widest entry are filled first: its catch-up price is the read call's
    plan plus the fill entries' (costs chosen: every fill call 1 ms, every other call 10 ms)."""
    root = tuned_copy(gqa, tmp_path / "tuned", lambda e: 1.0 if e.role is Role.FILL else 10.0)
    drafter = int4_copy(load(root, threads=1), share=False)
    runner = drafter.model.runners[0]
    widest = runner.decoding_sizes[-1]
    assert (runner.fill_ms(5), runner.fill_ms(widest + 5), runner.planned_ms(widest)) == (1.0, 2.0, 10.0)
    assert runner.catchup_ms(widest + 5) == 11.0 and runner.catchup_ms(3) == runner.planned_ms(3)
    assert drafter.catchup_cost(widest + 4) == pytest.approx((11.0 - 10.0) / 1e3)
