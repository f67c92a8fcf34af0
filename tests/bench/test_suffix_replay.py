"""scripts/suffix_replay.py: the replay's verify prices, its rounds over a greedy output that
repeats an earlier one (the store drafts it whole), the oracle cut as the bound on the policy's,
and a bad variant as one line naming the field."""

from __future__ import annotations

import numpy as np
import pytest

from specexport.runtime.drafters import NgramDrafter
from specexport.runtime.suffix_drafter import SuffixDrafter, SuffixSettings
from specexport.runtime.suffix_store import ResponseStore
from tests.scripts import load_script

COSTS = {1: 0.010, 2: 0.011, 3: 0.012, 6: 0.014, 8: 0.016, 16: 0.020}  # seconds by verify tokens


@pytest.fixture(scope="module")
def replay():
    return load_script("suffix_replay")


def rows() -> list[dict]:
    """Two requests of one task: the second's answer repeats the first's (a template)."""
    answer = [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51]
    return [{"id": f"t-{n}", "category": "task", "prompt": [1, 2, 3 + n], "output": answer} for n in range(2)]


def test_a_verify_is_priced_at_the_smallest_entry_holding_it(replay):
    cost = replay.padded(COSTS)
    assert [cost(t) for t in (1, 4, 6, 7, 16)] == [0.010, 0.014, 0.014, 0.016, 0.020]
    assert cost(17) is None


def test_the_store_drafts_a_repeated_answer_and_the_oracle_bounds_the_cut(replay):
    cost = replay.padded(COSTS)

    def suffix():
        settings = SuffixSettings(store_tokens=1000)
        return SuffixDrafter("suffix", settings, ResponseStore(1000, settings.index_depth), 1)

    alone = replay.replay(suffix(), rows()[:1], cost, 5, 15, False)["task"]
    both = replay.replay(suffix(), rows(), cost, 5, 15, False)["task"]
    # the second answer drafted from the first's in the store: 3 tokens a round at least
    second_rounds = both.rounds - alone.rounds
    assert (alone.tokens, both.tokens) == (12, 24) and (both.tokens - alone.tokens) / second_rounds >= 3
    assert second_rounds < alone.rounds
    oracle = replay.replay(suffix(), rows(), cost, 5, 15, True)["task"]
    assert oracle.speedup >= both.speedup > 1.0
    ngram = replay.replay(NgramDrafter("ngram", 3, 1), rows(), cost, 5, 15, False)["task"]
    assert ngram.rounds > both.rounds  # prompt lookup has no store: the repeat is new to it


def test_a_variant_sets_suffix_fields_and_a_bad_one_names_the_field(replay):
    settings = replay.suffix_variant("spec_factor=2,store_prompts=true,max_match=8", 0)
    assert (settings.spec_factor, settings.store_prompts, settings.max_match, settings.store_tokens) == (2.0, True, 8, 0)
    with pytest.raises(SystemExit, match="'spec_facter' is not a suffix setting"):
        replay.suffix_variant("spec_facter=2", 0)


def test_the_trace_has_a_record_a_round_that_adds_up_to_the_totals(replay):
    cost = replay.padded(COSTS)
    settings = SuffixSettings(store_tokens=1000)
    trace: list[dict] = []
    totals = replay.replay(SuffixDrafter("suffix", settings, ResponseStore(1000, settings.index_depth), 1), rows(),
                           cost, 5, 15, False, trace)["task"]
    assert len(trace) == totals.rounds
    assert sum(r["committed"] for r in trace) == totals.tokens
    assert sum(r["seconds"] for r in trace) == pytest.approx(totals.seconds)
    for row_id in ("t-0", "t-1"):  # each request's rounds in order, from its first position, without gaps
        rounds = [r for r in trace if r["id"] == row_id]
        assert [r["at"] for r in rounds] == [0] + list(np.cumsum([r["committed"] for r in rounds[:-1]]))
    # the cut keeps a prefix of the drafts, and what the target kept of it is what it would have of the uncut chain
    assert all(r["kept"] == min(r["kept_uncut"], r["verified"]) <= r["verified"] <= r["drafted"] for r in trace)
    assert any(r["kept"] >= 3 for r in trace if r["id"] == "t-1")  # the repeat drafted from the store
