"""Fill graphs (Role.FILL, exporter/fill.py): a drafter's graph with only its cache outputs, built
for ort-gqa recipes beside its full graph, over the same weights file, and checked at build to
leave the cache exactly as the full graph does."""

from __future__ import annotations

import onnx
import pytest

from specexport.contract import Manifest, Role, is_cache_output
from specexport.errors import SpecexportError
from specexport.exporter.fill import check_fill, fill_copy
from specexport.runtime.engine import EngineOptions, SharedGraphs
from specexport.runtime.kv_cache import open_host_cache
from specexport.runtime.ort_engine import OrtEngine
from specexport.runtime.runner import ModelRunner
from tests.conftest import TINY_SHAPE

DRAFTERS = ("quantized-self", "draft-model")


@pytest.fixture(scope="module")
def gqa(tiny_engines):
    return tiny_engines.for_arch("llama", "ort-gqa")


@pytest.fixture(scope="module", params=["chains", "trees"])
def gqa_any(request, tiny_engines):
    """An ort-gqa build whose drafters draft chains, and one whose drafters draft trees too (their
    graphs take tree inputs, which a chain entry leaves to the backend: a fill entry must too)."""
    if request.param == "chains":
        return tiny_engines.for_arch("llama", "ort-gqa")
    return tiny_engines.get("llama", drafters=DRAFTERS, attention="ort-gqa", tree_nodes=6, **TINY_SHAPE)


def test_a_drafter_gets_fill_entries_at_its_decoding_sizes(gqa_any):
    manifest = Manifest.load(gqa_any)
    for model in DRAFTERS:
        engines = manifest.engines_of(model, "onnxruntime")
        fills = [e for e in engines if e.role is Role.FILL]
        decoding = sorted(e.tokens for e in engines if e.role.decoding)
        assert sorted(e.tokens for e in fills) == decoding, model
        full = next(e for e in engines if e.role is Role.PREFILL)
        for e in fills:
            assert e.path == f"{model}.fill.onnx" and e.weights == full.weights and e.batch == 1
            assert list(e.outputs) and all(is_cache_output(name) for name in e.outputs)
            assert list(e.inputs) == list(full.inputs)
            assert e.cost_ms and e.parity["cache_equal_to_full_graph"]
    # never the target's (it reads every call), nor a standard build's
    assert not [e for e in manifest.engines if e.role is Role.FILL and e.model == "target"]


def test_a_standard_build_has_no_fill_graphs(tiny_engines):
    manifest = Manifest.load(tiny_engines.get("llama", **TINY_SHAPE))
    assert manifest.drafters and not [e for e in manifest.engines if e.role is Role.FILL]


def test_the_fill_copy_computes_no_logits(gqa):
    full = onnx.load(str(gqa / "quantized-self.onnx"), load_external_data=False)
    fill = fill_copy(full)
    assert {v.name for v in fill.graph.output} == {v.name for v in full.graph.output if is_cache_output(v.name)}
    assert len(fill.graph.node) < len(full.graph.node)
    assert not {n.op_type for n in fill.graph.node} & {"ArgMax"}  # next_tokens' node is gone


def _runner(root, manifest, full_model: str, fill_model: str) -> ModelRunner:
    """One runner over ``full_model``'s batch-1 graphs and ``fill_model``'s fill entries."""
    entries = [e for e in manifest.engines_of(full_model, "onnxruntime") if e.role.decoding] + \
              [e for e in manifest.engines_of(fill_model, "onnxruntime") if e.role is Role.FILL]
    options, shared = EngineOptions(threads=1), SharedGraphs()
    engines = [OrtEngine(e.name, root / e.path, e.inputs, e.outputs, options, shared) for e in entries]
    info = manifest.models[full_model]
    cache = open_host_cache(info.num_layers, 1, info.num_kv_heads, info.max_seq_len, info.head_dim)
    return ModelRunner("t", engines, cache, {e.name: e.tokens for e in entries},
                       in_place=frozenset(e.name for e in entries), roles={e.name: e.role for e in entries},
                       full_rows=info.full_rows)


def test_the_check_holds_a_fill_graph_to_its_own_full_graph(gqa):
    """The build's check passes the model's own fill graph, and fails one of other weights (the
    int4 copy's fill graph against the fp32 target's full graph: the same shapes)."""
    import numpy as np

    manifest = Manifest.load(gqa)
    ids = np.arange(3, 3 + 120) % manifest.models["target"].vocab_size
    runner = _runner(gqa, manifest, "quantized-self", "quantized-self")
    runner.forward(ids[:80].tolist())
    assert check_fill(runner, ids, lengths=(0, 40, 80))["tested"]
    control = _runner(gqa, manifest, "target", "quantized-self")
    control.forward(ids[:80].tolist())
    with pytest.raises(SpecexportError, match="cache differs from the full graph"):
        check_fill(control, ids, lengths=(0, 40))
