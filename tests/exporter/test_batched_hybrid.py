"""Batched graphs of hybrid targets (linear-attention layers beside attention ones): each row
reads its own recurrent state and K/V, and the build checks every row against the batch-1
graph fed that row alone with its own state (exporter/validate_state.py), appended (standard
attention) and in place (ort-gqa). The control feeds one row's state to another and must fail."""

from __future__ import annotations

import numpy as np
import pytest

from specexport.contract import state_past_names, state_present_names
from specexport.errors import SpecexportError
from specexport.exporter.validate import BatchedGraph, GraphUnderTest
from specexport.exporter.validate_state import validate_batched_state
from specexport.runtime import load

BUILDS = ["batched_hybrid", "batched_hybrid_in_place"]


def _graphs(engines, model: str = "target"):
    """(batch-1 graphs by tokens, batched graphs, specs, the model's batch-1 runner, its
    cache filled with reference ids, those ids) of a built directory."""
    pipe = load(engines)
    entries = [e for e in pipe.manifest.engines if e.model == model and e.backend == "onnxruntime"]
    specs = {e.name: (e.inputs, e.outputs) for e in entries}
    single = {e.tokens: GraphUnderTest(e.name, engines / e.path, e.tokens) for e in entries if e.batch == 1}
    batched = [BatchedGraph(e.name, engines / e.path, e.tokens, e.batch) for e in entries if e.batch > 1]
    runner = pipe.runner(model)
    ids = np.random.default_rng(0).integers(3, 250, size=pipe.max_seq_len).astype(np.int64)  # [S_max]
    runner.forward(ids[: pipe.max_seq_len - 1].tolist())
    return single, batched, specs, runner, ids, pipe.manifest.models[model].attention == "ort-gqa"


@pytest.mark.parametrize("build", BUILDS)
def test_the_build_checked_each_row_of_a_batched_hybrid_graph_with_its_own_state(build, request):
    engines = request.getfixturevalue(build)
    pipe = load(engines)
    batched = [e for e in pipe.manifest.engines if e.model == "target" and e.batch == 4]
    assert {e.role.value for e in batched} >= {"decode", "verify"}
    for entry in batched:
        assert entry.inputs[state_past_names(1)[1]].shape[0] == 4  # past_state.0.recurrent [B, ...]
        assert entry.outputs[state_present_names(1)[1]].shape[:2] == (4, entry.tokens)  # [B, T, ...]
        assert entry.parity["reference"] == "the batch-1 graph, row by row"
        assert set(state_present_names(1)) <= set(entry.parity["outputs_compared"])
        assert entry.parity["own_state_per_row"] and entry.parity["rows"][-1] == [0, 0]  # the idle row
    assert pipe.manifest.batch_sizes("target") == [1, 4]


@pytest.mark.parametrize("build", BUILDS)
def test_a_row_fed_another_rows_state_fails_the_check(build, request):
    single, batched, specs, runner, ids, in_place = _graphs(request.getfixturevalue(build))
    verify = [g for g in batched if g.tokens > 1][:1]
    figures = validate_batched_state(verify, single, specs, runner, ids, None, in_place)
    assert figures[verify[0].name]["max_rel_output_diff"] <= 1e-4
    # the control: the rows' own tokens, K/V and cache lengths, but rows 0 and 1 swap states
    with pytest.raises(SpecexportError, match=r"row 0 \(.*\) differs in .* with its own state"):
        validate_batched_state(verify, single, specs, runner, ids, None, in_place, fed=[1, 0, 2, 3])
