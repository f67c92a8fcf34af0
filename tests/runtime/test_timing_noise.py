"""`tune` (and calibration's measurements) refuse timings whose rounds scatter: the noisy
entries are named with their spread, nothing is written, the exit is non-zero with one error
line; --accept-noise writes them anyway. The timer is faked: what is checked is the decision,
not this machine's noise."""

import itertools
import json

import numpy as np
import pytest

from specexport.runtime.costs import COSTS
from specexport.runtime.integrity import RECORD
from specexport.runtime.runner import ModelRunner
from specexport.runtime.timing_noise import NOISE_LIMIT, NoisyTimings, spread
from tests.conftest import TINY_SHAPE, copy_engines, run_cli

NOISY = "target.decode.b1.t1"


@pytest.fixture
def engines(tiny_engines, tmp_path):
    return copy_engines(tiny_engines.get("llama", **TINY_SHAPE), tmp_path / "engines")


def fake_timer(monkeypatch, noisy: bool) -> None:
    """Every graph's run takes 1 ms a token (a quiet machine: 1% jitter); with ``noisy`` the
    target's one-token graph alternates 1 and 3 ms."""
    ticks = itertools.count()

    def time_run(self, size, want_logits=False):
        tick = next(ticks)
        if noisy and self.name == "target" and size == 1:
            return 1e-3 if tick % 2 else 3e-3
        return size * 1e-3 * (1.0 + 0.01 * (tick % 2))

    monkeypatch.setattr(ModelRunner, "time_run", time_run)


def test_the_spread_is_the_middle_half_over_the_median():
    assert spread([1.0, 1.0, 1.0]) == 0.0
    assert spread([1.0]) == 0.0
    rounds = [1.0, 2.0, 3.0, 4.0, 5.0]
    q25, median, q75 = np.percentile(rounds, [25, 50, 75])
    assert spread(rounds) == pytest.approx((q75 - q25) / median)
    # one preempted round among many leaves the middle half alone
    assert spread([1.0] * 8 + [50.0]) == 0.0


def test_tune_refuses_noisy_rounds_and_writes_nothing(engines, monkeypatch):
    fake_timer(monkeypatch, noisy=True)
    before = sorted(p.name for p in engines.iterdir())
    code, out, err = run_cli("tune", engines, "--rounds", "4")
    assert code == 3 and "Traceback" not in err
    lines = err.strip().splitlines()
    assert lines[-1].startswith("specexport: error:") and sum(line.startswith("specexport: error:") for line in lines) == 1
    assert "--rounds" in lines[-1] and "--accept-noise" in lines[-1] and "quieter machine" in lines[-1]
    named = [line for line in lines if NOISY in line]
    assert named and "spread" in named[0] and "%" in named[0]
    assert all(NOISY in line for line in lines[1:-1])  # only the noisy entry is named
    written = {p.name for p in engines.iterdir()} - set(before) - {RECORD}  # a load's integrity record aside
    assert not written  # no costs.json, no partial file


def test_accept_noise_writes_them_and_says_which_were_noisy(engines, monkeypatch):
    fake_timer(monkeypatch, noisy=True)
    code, _, err = run_cli("tune", engines, "--rounds", "4", "--accept-noise")
    assert code == 0, err
    costs = json.loads((engines / COSTS).read_text())
    assert list(costs["noisy"]) == [NOISY] and costs["noisy"][NOISY] > NOISE_LIMIT


def test_a_quiet_machine_writes(engines, monkeypatch):
    fake_timer(monkeypatch, noisy=False)
    code, _, err = run_cli("tune", engines, "--rounds", "4")
    assert code == 0, err
    costs = json.loads((engines / COSTS).read_text())
    assert costs["noisy"] == {} and costs["engines"]["onnxruntime"][NOISY] == pytest.approx(1.0, rel=0.02)


def test_calibrations_cost_measurements_refuse_noise_too(engines, monkeypatch):
    """plan --calibrate's measurements (bench.harness.measure_costs, the batched surface) go
    through the same check: they raise before the calibration file is written."""
    from specexport.bench.harness import measure_costs
    from specexport.runtime import load

    pipe = load(engines)
    fake_timer(monkeypatch, noisy=True)
    with pytest.raises(NoisyTimings, match="target t1"):
        measure_costs(pipe, [], 4, False, pipe.manifest.draft_len, accept_noise=False)
    assert measure_costs(pipe, [], 4, False, pipe.manifest.draft_len)["noisy"]  # the bench: reported
    fake_timer(monkeypatch, noisy=False)
    assert measure_costs(pipe, [], 4, False, pipe.manifest.draft_len, accept_noise=False)["noisy"] == {}
