"""Weights held once per model (issue 9): an ort-gqa model is one graph with a symbolic token
count, every manifest entry one static size of it, and a load opens one session per graph file
however many sizes (decode, catch-up, verify, prefill, probes) it runs. The standard graph stays
one static graph per size (TensorRT builds from those)."""

from __future__ import annotations

import onnx

from specexport.contract import INPUT_IDS, Role, read_manifest
from specexport.runtime import load
from tests.conftest import TINY_SHAPE

DRAFTERS = ("ngram", "quantized-self", "draft-model")


def _files_by_model(directory) -> dict[str, set[str]]:
    files: dict[str, set[str]] = {}
    for entry in read_manifest(directory).engines:
        files.setdefault(entry.model, set()).add(entry.path)
    return files


def test_an_ort_gqa_model_is_one_graph_with_a_symbolic_token_count(tiny_engines):
    directory = tiny_engines.get("llama", attention="ort-gqa", **TINY_SHAPE)
    manifest = read_manifest(directory)
    for model, files in _files_by_model(directory).items():
        # a drafter's fill graph (its cache outputs alone, exporter/fill.py) is one more such graph
        assert files == {f"{model}.onnx", *([f"{model}.fill.onnx"] if model != "target" else [])}, (model, files)
        sizes = [e.tokens for e in manifest.engines if e.model == model and e.role is not Role.FILL]
        assert len(sizes) >= 3, sizes  # decode, catch-up or verify, prefill at least
        for file in files:
            graph = onnx.load(str(directory / file), load_external_data=False)
            ids = next(v for v in graph.graph.input if v.name == INPUT_IDS)
            assert [d.dim_param or d.dim_value for d in ids.type.tensor_type.shape.dim] == [1, "tokens"], file
        for entry in (e for e in manifest.engines if e.model == model):
            assert entry.inputs[INPUT_IDS].shape == (1, entry.tokens)  # each entry: one static size


def test_a_standard_model_keeps_one_static_graph_per_size(tiny_engines):
    directory = tiny_engines.get("llama", attention="standard", **TINY_SHAPE)
    manifest = read_manifest(directory)
    for model, files in _files_by_model(directory).items():
        entries = [e for e in manifest.engines if e.model == model]
        assert len(files) == len(entries), (model, files)


def test_a_load_opens_one_session_per_graph_file_whatever_sizes_it_runs(tiny_engines):
    pipe = load(tiny_engines.get("llama", attention="ort-gqa", **TINY_SHAPE))
    baseline = pipe.generate(prompt_ids=list(range(3, 40)), drafter="none", max_new_tokens=16)
    for drafter in DRAFTERS:
        result = pipe.generate(prompt_ids=list(range(3, 40)), drafter=drafter, max_new_tokens=16)
        assert result.token_ids == baseline.token_ids, drafter
    pipe.target.time_engines(pipe.target.sizes, rounds=1)  # the probes too
    models = ("target", "quantized-self", "draft-model")
    opened = {e.path for e in pipe.manifest.engines
              if e.model in models and e.role is not Role.FILL and pipe.runner(e.model).is_open(e.tokens)}
    assert len(pipe.target.sizes) >= 4
    assert opened == {"target.onnx", "quantized-self.onnx", "draft-model.onnx"}
    files = {e.path for e in pipe.manifest.engines if e.model in models}  # the drafters' fill graphs too
    assert files - opened == {"quantized-self.fill.onnx", "draft-model.fill.onnx"}
    assert len(pipe.sessions) == len(files)  # one per file: with a session per size it would be one per entry


def test_a_standard_load_opens_a_session_per_size(tiny_engines):
    """The counter above can fail: static graphs each take their own session."""
    pipe = load(tiny_engines.get("llama", attention="standard", **TINY_SHAPE))
    pipe.generate(prompt_ids=list(range(3, 40)), drafter="none", max_new_tokens=4)
    opened = [size for size in pipe.target.sizes if pipe.target.is_open(size)]
    assert len(pipe.sessions) == len(opened) >= 3


def test_outputs_handed_out_survive_the_next_run_of_the_same_engine(tiny_engines):
    """In-place engines reuse their binding and its output buffers: what a run returned must be
    the caller's own, not a view the next run of that engine overwrites."""
    import numpy as np

    pipe = load(tiny_engines.get("llama", attention="ort-gqa", **TINY_SHAPE))
    runner = pipe.runner("target")
    runner.cache.set_length(0)
    first = runner.forward(list(range(3, 10)), want_logits=True)  # [7], [7, V]
    kept_tokens, kept_logits = first.next_tokens.copy(), first.logits.copy()
    runner.cache.set_length(0)
    second = runner.forward(list(range(20, 27)), want_logits=True)  # the same engine (same size)
    assert not np.array_equal(second.logits, kept_logits)
    assert np.array_equal(first.next_tokens, kept_tokens) and np.array_equal(first.logits, kept_logits)
