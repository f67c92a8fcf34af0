"""The calibration's depth from a hybrid target's own verify curve (issue 54, item 4).

A hybrid (linear-attention) graph outputs its recurrent state after every position
(present_state.* [B, T, ...]), so its pass grows with the verify width faster than a dense
model's of the same size (docs/results.md, "Hybrid targets batched":
scripts/hybrid_verify_curve.py measured 1.77x at T = 8 against 1.43x). `plan --calibrate`
times the hybrid's own graphs, state outputs included, and chooses D from that curve."""

from __future__ import annotations

import numpy as np
import pytest

from specexport.bench.calibrate import choose, predict
from specexport.contract import STATE_PRESENT
from tests.conftest import TINY_SHAPE

DEPTH = 7
# two categories, draft i kept in 0.8^i and 0.6^i of the rounds: the same acceptance for every curve
PROFILES = {("ngram", "code"): 0.8 ** np.arange(1, DEPTH + 1), ("ngram", "chat"): 0.6 ** np.arange(1, DEPTH + 1)}
DENSE_SLOPE = 0.06  # a dense pass's growth per extra token, against one token (the measured 1.43x at T = 8)


def _curve(state_per_position: float) -> dict[int, float]:
    """Seconds of a pass of T tokens at the probe widths 1, 2, 4, 8: the dense model's growth
    and, for a hybrid, the state it writes out per position on top."""
    return {t: 1e-3 * (1 + (DENSE_SLOPE + state_per_position) * (t - 1)) for t in (1, 2, 4, 8)}


def _calibrated_depth(curve: dict[int, float]) -> int:
    return choose(predict(curve, PROFILES, {}, DEPTH))["draft_len"]


def test_a_steeper_verify_curve_gets_a_smaller_depth():
    dense = _calibrated_depth(_curve(0.0))
    hybrid = _calibrated_depth(_curve(0.05))  # about the measured hybrid: 1.77x at T = 8
    assert hybrid < dense
    # the more state a position writes out, the shallower: never deeper, and down to D = 1
    depths = [_calibrated_depth(_curve(s)) for s in (0.0, 0.02, 0.05, 0.1, 0.2, 0.5)]
    assert depths == sorted(depths, reverse=True) and depths[-1] == 1 < depths[0]


def test_the_hybrid_s_timed_pass_writes_out_its_state(tiny_engines):
    """The curve the calibration reads (runner.time_run, as bench and tune time it) is of the
    hybrid's pass with every present_state.* output fetched, as a verify round fetches it: a
    timing without them would price the hybrid as a dense model."""
    from specexport.runtime import load
    pipe = load(tiny_engines.for_arch("qwen3_5", "standard"))
    runner = pipe.target
    widest = max(runner.sizes)
    asked: list[str] = []
    call = runner._calls[widest]
    real_time = call.time
    call.time = lambda outputs: (asked.extend(outputs), real_time(outputs))[1]  # type: ignore[method-assign]
    assert runner.time_run(widest) > 0
    entry = next(e for e in pipe.manifest.engines_of("target", pipe.backend_of("target")) if e.tokens == widest)
    states = [name for name in entry.outputs if name.startswith(STATE_PRESENT + ".")]
    assert states and set(states) <= set(asked)


@pytest.fixture(scope="module")
def standard_batched_llama(tiny_engines):
    return tiny_engines.get("llama", drafters=("ngram",), attention="standard", batch=(1, 2), max_draft=3, **TINY_SHAPE)


@pytest.mark.parametrize("build", ["standard_batched_llama", "batched_hybrid", "batched_hybrid_in_place"])
def test_a_batched_surface_of_static_graphs_prices_each_width_at_the_graph_that_runs_it(build, request):
    """Static graphs (standard attention; a hybrid's recurrence unrolled over T, whatever its
    attention: the qwen3_next build is ort-gqa) have no size between the built ones: t(B, 1+k)
    is the built graph the batched loop runs 1+k tokens in (Model.graph), so K(B) reads the
    cost the loop pays, a hybrid's state outputs included."""
    from specexport.bench.calibrate import measure_surface
    from specexport.runtime import load

    pipe = load(request.getfixturevalue(build), threads=1)
    depth = pipe.manifest.plan["draft_len"]
    batches = pipe.manifest.batch_sizes("target")
    surface = measure_surface(pipe, batches, depth, rounds=2, accept_noise=True)
    assert set(surface) == {(b, t) for b in batches for t in range(1, depth + 2)}
    assert all(seconds > 0 for seconds in surface.values())
    for batch in batches[1:]:  # e.g. graphs of 1 and 1+D tokens (and a catch-up's 2): 3..1+D run the 1+D one
        built = sorted(e.tokens for e in pipe.manifest.engines_of("target", "onnxruntime", batch=batch)
                       if e.role.decoding)
        for tokens in range(1, depth + 2):
            runs_in = min(w for w in built if w >= tokens)
            assert surface[(batch, tokens)] == surface[(batch, runs_in)]
        assert len({surface[(batch, t)] for t in range(1, depth + 2)}) == len([w for w in built if w <= depth + 1])


def test_depth_zero_at_a_batch_size_is_the_target_alone_whatever_the_drafter_s_skip_costs():
    """A draft model's round at k = 0 (Drafter.round_cost(0): the catch-up a skipped round costs
    later) is not paid at a batch size that never drafts: there k = 0 is the target alone, 1.0x,
    and a drafter that loses at every depth gets K(B) = 0 (on the tiny hybrid bench the int4
    copy's skip cost made K(B) = 1 at 0.86x; docs/results.md, "Hybrid targets batched")."""
    from specexport.bench.calibrate import schedule_table

    surface = {(b, t): (10 + t) / 1e3 for b in (1, 4) for t in range(1, 4)}  # ms: 11, 12, 13
    steps = {"model": {b: [0.011, 0.011, 0.022] for b in (1, 4)}}  # a step as dear as the target's
    table = schedule_table(surface, {("model", "chat"): np.array([0.3, 0.1])}, steps, depth=2, batches=[1, 4])
    for row in table:
        assert row["speedup_by_depth"][0] == 1.0
        assert row["depth"] == 0 and max(row["speedup_by_depth"][1:]) < 1.0
