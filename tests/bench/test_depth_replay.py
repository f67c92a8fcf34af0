"""scripts/depth_replay.py: adaptive depth replayed over recorded acceptance drafts deep where
every draft is kept, stops where none is, and a variant's setting reaches the policy."""

from __future__ import annotations

import pytest

from specexport.runtime.adaptive import DepthPolicy
from tests.scripts import load_script

COSTS = {str(k): 0.010 + 0.002 * k for k in range(8)}  # depth -> seconds of a round (JSON keys)


@pytest.fixture(scope="module")
def replay():
    return load_script("depth_replay")


def record(kept: dict[str, int]) -> dict:
    """Prompts of 96 output tokens whose drafts are kept ``kept[id]`` deep at every position."""
    return {"draft_len": 7, "costs": COSTS,
            "prompts": {pid: {"prompt_len": 20, "out": list(range(96)), "kept": [k] * 95} for pid, k in kept.items()}}


def factory() -> DepthPolicy:
    return DepthPolicy(lambda tokens: 0.010 + 0.002 * (tokens - 1), checked=True)


def test_kept_drafts_pay_and_missed_ones_stay_near_the_floor(replay):
    rec = record({"kept": 7, "missed": 0})
    speedups = replay.replay_once(factory, lambda n: 0.0, "head", rec, ["kept", "missed"], {})
    assert speedups["kept"] > 2.5  # 8 tokens for 0.024 s against 8 rounds of 0.010
    assert 0.95 <= speedups["missed"] < 1.0  # a few rounds on the prior, then probes


def test_a_setting_reaches_the_policy(replay):
    rec = record({"missed": 0})
    cheap = replay.replay_once(factory, lambda n: 0.0, "head", rec, ["missed"], {"probe_share": 0.0})["missed"]
    assert cheap > replay.replay_once(factory, lambda n: 0.0, "head", rec, ["missed"], {})["missed"]
    assert replay.parse_setting("prior=0.6") == ("prior", 0.6)
