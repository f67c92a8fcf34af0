"""The TensorRT path of the hidden-state heads (EAGLE-3, MTP, DFlash, DSpark), on a machine
without TensorRT: one tiny build with a head of each kind.

- the lint of what TensorRT is given for every head engine (a chain head's shared catch-up
  graph fixed to each entry's shapes) passes; the shared graph as exported would not, and an
  unsupported operator in a head graph fails it;
- the graph TensorRT parses for each head engine (``trt_build.tensorrt_graph``: the static
  copy, and the fp16 cast) runs on onnxruntime and agrees with the exported graph under the
  build-time comparison (``trt_parity``), -inf columns of a reduced draft vocabulary and a
  block head's d2t-mapped argmax included;
- the manifest of a TensorRT build with head engines reads back through the contract;
- the runtime: asking for TensorRT without it is one line naming the extra; with the fake
  TensorRT and CUDA of tests/fake_gpu, every head runs on TensorRT engines over a device KV
  cache of its own and drafts what it drafts on onnxruntime (greedy), with the host cache and
  with CUDA graphs too.

Nothing here builds or runs a real TensorRT engine (docs/tensorrt.md, "What has never run").
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import numpy as np
import onnx
import pytest

from specexport.contract import LOGITS, MANIFEST, EngineEntry, Manifest, read_manifest
from specexport.errors import BadInput
from tests.conftest import copy_engines
from tests.gpu import needs_gpu
from tests.scaffold import as_tensorrt_build, json_from_fake_gpu

HEADS = {"eagle": "eagle3", "mtp": "mtp", "dflash": "dflash", "dspark": "dspark"}  # drafter name -> kind
PROMPT = "hello hello hello world, hello"


@pytest.fixture(scope="module")
def engines(tmp_path_factory) -> Path:
    """A tiny qwen3 target with one head of each kind (EAGLE-3 and DFlash with a reduced draft
    vocabulary, MTP and DSpark in the speculators layout)."""
    from tests.heads.block_checkpoints import (
        TARGET,
        build,
        tiny_target,
        write_speculators_dflash,
        write_speculators_dspark,
    )
    from tests.heads.chain_checkpoints import write_eagle3, write_mtp_speculators
    from tests.heads.common import SHAPES

    root = tmp_path_factory.mktemp("trt-heads")
    target = tiny_target()
    write_eagle3(root / "eagle", target.config, "speculators", seed=3, layer_ids=[0, 1, 3], with_embed=True)
    write_mtp_speculators(root / "mtp", target.config)
    write_speculators_dflash(root / "dflash", target, draft_vocab=100)
    write_speculators_dspark(root / "dspark", target)
    raw = {"name": "trt-heads", "target": TARGET, "shapes": SHAPES, "draft": {"max_draft": 3},
           "drafters": [{"kind": kind, "name": name, "path": name} for name, kind in HEADS.items()]}
    return build(raw, root, root / "engines")


def head_entries(manifest: Manifest) -> list[EngineEntry]:
    return [e for e in manifest.engines if e.model in HEADS and e.backend == "onnxruntime"]


# -- lint: what TensorRT is given for every head engine --------------------------------------


def test_every_head_engine_passes_the_tensorrt_lint(engines):
    from specexport.exporter.lint import lint_tensorrt

    report = lint_tensorrt(engines)
    status = {g.graph: (g.status, g.problems) for g in report.graphs}
    entries = head_entries(read_manifest(engines))
    assert {e.model for e in entries} == set(HEADS) and len(entries) == 10  # 3 per chain head, 2 per block head
    for e in entries:  # each engine on its own, the catch-up sizes of one shared graph included
        assert status[e.name] == ("ok", []), (e.name, status.get(e.name))
    assert report.ok, report.render()


def test_the_shared_catchup_graph_as_exported_is_not_static(engines):
    """The control: linted as a file, a chain head's catch-up graph (its token count symbolic)
    fails; TensorRT is given it once per size (lint.static_graph), which passes above."""
    from specexport.exporter.lint import lint_file, static_graph

    for head in ("eagle", "mtp"):
        report = lint_file(engines / f"{head}.catchup.onnx")
        assert report.status == "fail" and any("dynamic shape [1, tokens]" in p for p in report.problems)
    entry = next(e for e in head_entries(read_manifest(engines)) if e.role == "catchup" and e.model == "eagle")
    fixed = static_graph(onnx.load(str(engines / entry.path), load_external_data=False), entry)
    dims = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim] for v in [*fixed.graph.input, *fixed.graph.output]}
    assert dims == {n: list(s.shape) for n, s in {**entry.inputs, **entry.outputs}.items()}


def test_an_unsupported_operator_in_a_head_graph_fails_the_lint(engines, tmp_path):

    from specexport.exporter.lint import lint_tensorrt

    broken = tmp_path / "engines"
    copy_engines(engines, broken)
    path = broken / "dflash.block.b1.t4.onnx"
    model = onnx.load(str(path), load_external_data=False)
    node = next(n for n in model.graph.node if n.op_type == "Softmax")
    node.op_type = "StringNormalizer"  # no TensorRT importer
    onnx.save(model, str(path))
    report = lint_tensorrt(broken)
    failed = {g.graph: g.problems for g in report.failed}
    assert list(failed) == ["dflash.block.b1.t4"], report.render()
    assert any("operator StringNormalizer is not supported" in p for p in failed["dflash.block.b1.t4"])


# -- the graph TensorRT parses, against the exported graph (the build-time comparison) -------


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_the_graph_tensorrt_parses_agrees_with_the_exported_one(engines, tmp_path, precision):
    from specexport.exporter.lint import has_symbolic_io
    from specexport.exporter.trt_build import tensorrt_graph
    from specexport.exporter.trt_parity import compare, onnx_runner, parity_feeds, parity_record

    for e in head_entries(read_manifest(engines)):
        source = engines / e.path
        graph = tensorrt_graph(e, source, tmp_path / e.name, precision)
        shared = has_symbolic_io(onnx.load(str(source), load_external_data=False))
        assert (graph == source) == (precision == "fp32" and not shared), e.name
        assert not has_symbolic_io(onnx.load(str(graph), load_external_data=False))
        figures = compare(onnx_runner(e, graph), onnx_runner(e, source), parity_feeds(e))
        record = parity_record(e.name, figures, precision, enforce=True)  # raises out of tolerance
        assert record["within_tolerance"] and record["enforced"] and figures["next_tokens_match"], (e.name, figures)
        assert figures["positions"] >= 5 and "present.0.key" in figures["output_rel_diffs"], e.name
        if precision == "fp32":
            assert figures["max_abs_logit_diff"] == 0 and figures["max_rel_output_diff"] == 0, (e.name, figures)
            assert record["max_rel_output_diff_limit"] > 0


def test_the_comparison_reads_every_head_output(engines):
    from specexport.exporter.trt_parity import compared_outputs, parity_feeds

    manifest = read_manifest(engines)
    by_name = {e.name: e for e in head_entries(manifest)}
    assert "hidden_out" in compared_outputs(by_name["eagle.step.b1.t1"])
    assert "block_hidden" in compared_outputs(by_name["dspark.block.b1.t4"])
    block = by_name["dflash.block.b1.t8"]
    feeds = parity_feeds(block)
    assert [int(f["context_valid"][0]) for f in feeds] == [8, 4, 8, 4, 8][: len(feeds)]  # all rows, then half
    assert all(f["input_ids"].shape == (1, 1) and f["context_features"].shape == (1, 8, 256) for f in feeds)


def test_minus_inf_columns_must_stay_minus_inf():
    """A head with a reduced draft vocabulary scatters its logits into the target's: -inf
    elsewhere. Those columns are left out of the figures, and an engine that gives anything
    else there fails; a block head's next_tokens (target ids through d2t) are checked against
    the reference's, not against its draft-vocabulary argmax."""
    from specexport.errors import SpecexportError
    from specexport.exporter.trt_parity import check, compare

    want = np.array([[2.0, -np.inf, 1.0], [0.5, -np.inf, 3.0]], np.float32)  # [T, V]

    def fixed(logits, tokens):
        return lambda feeds: {LOGITS: logits[None], "next_tokens": np.asarray(tokens)[None]}

    same = compare(fixed(want.copy(), [0, 2]), fixed(want, [0, 2]), [{}])
    assert same["max_abs_logit_diff"] == 0 and same["logit_scale"] == 3.0
    leak = want.copy()
    leak[0, 1] = -5.0  # a column the head cannot draft came out finite
    with pytest.raises(SpecexportError, match="nan"):
        check("eagle.step.b1.t1", compare(fixed(leak, [0, 2]), fixed(want, [0, 2]), [{}]), "fp32")
    mapped = compare(fixed(want.copy(), [40, 42]), fixed(want, [40, 42]), [{}])  # d2t: ids past the logits
    assert mapped["next_tokens_match"]
    wrong = compare(fixed(want.copy(), [40, 41]), fixed(want, [40, 42]), [{}])
    with pytest.raises(SpecexportError, match="in-graph argmax"):
        check("dflash.block.b1.t4", wrong, "fp32")


# -- the manifest of a TensorRT build with head engines ---------------------------------------


def test_a_tensorrt_manifest_with_head_engines_reads_back(engines, tmp_path):
    """trt_from_onnx's manifest step with trt_build's entries for every graph (the heads' too),
    minus TensorRT itself: the .plan files are placeholders."""
    from tests.test_contract import assert_round_trip

    again = assert_round_trip(as_tensorrt_build(engines, tmp_path / "trt", fake_plans=False, precision="fp16"))
    again.verify_files()
    assert again.extra["tensorrt_build"]["precision"] == "fp16"
    for head in HEADS:
        onnx_side, trt_side = again.engines_of(head, "onnxruntime"), again.engines_of(head, "tensorrt")
        assert [(e.name, e.role, e.tokens, e.inputs, e.outputs) for e in trt_side] == \
               [(e.name, e.role, e.tokens, e.inputs, e.outputs) for e in onnx_side]
        for e, source in zip(trt_side, onnx_side):
            assert e.path == f"{e.name}.plan" and e.extra["onnx"] == source.path and e.weights is None
    # both catch-up sizes of a chain head come from its one shared graph, each its own engine
    catchup = [e for e in again.engines_of("eagle", "tensorrt") if e.role in ("catchup", "prefill")]
    assert {e.extra["onnx"] for e in catchup} == {"eagle.catchup.onnx"} and len({e.path for e in catchup}) == 2


# -- the runtime --------------------------------------------------------------------------------


def test_without_tensorrt_the_head_engines_ask_for_the_extra(engines, tmp_path):
    from specexport.runtime import load
    from specexport.runtime.engine import EngineOptions, open_engine, open_kv_cache
    from specexport.runtime.trt_engine import require_tensorrt

    try:
        require_tensorrt()
    except BadInput:
        pass
    else:
        pytest.skip("TensorRT is installed here")
    trt_dir = as_tensorrt_build(engines, tmp_path / "engines")
    manifest = Manifest.load(trt_dir)
    head = manifest.engines_of("eagle", "tensorrt")[0]
    attempts = [lambda: load(trt_dir, backend="tensorrt"),
                lambda: open_kv_cache("tensorrt", manifest.models["dflash"], EngineOptions()),
                lambda: open_engine(head, trt_dir, EngineOptions())]
    for attempt in attempts:
        with pytest.raises(BadInput) as err:
            attempt()
        assert err.value.exit_code == 2 and "\n" not in str(err.value)
        assert str(err.value) == "tensorrt is not installed: pip install 'specexport[gpu]'"


# Runs in a child interpreter whose `tensorrt` and `cuda` are the fakes; prints one JSON line.
ON_FAKE_GPU = textwrap.dedent(f"""
    import json, sys
    from specexport.runtime import load
    from specexport.runtime.api import Pipeline
    from specexport.runtime.engine import EngineOptions

    root, heads = sys.argv[1], {tuple(HEADS)!r}
    drafters = ("none", *heads)
    args = dict(max_new_tokens=12, adaptive=False)  # every round drafts: no cost decides it away

    def drafts(pipe):  # every head's proposals in one generate each: the drafts, not only the output
        seen = {{}}
        for h in heads:
            drafter, seen[h] = pipe.drafter(h), []
            propose = drafter.propose
            def recorded(rows, budget, _propose=propose, _seen=seen[h]):
                drafts = _propose(rows, budget)
                if budget.depths[0] > 0:
                    _seen.append([int(t) for t in drafts[0].tokens])
                return drafts
            drafter.propose = recorded
            pipe.generate({PROMPT!r}, drafter=h, **args)
        return seen

    reference = load(root)
    out = {{"onnxruntime": {{d: reference.generate({PROMPT!r}, drafter=d, **args).token_ids for d in drafters}},
            "onnxruntime_drafts": drafts(load(root))}}
    pipes = {{"device": load(root, backend="tensorrt"), "host": load(root, backend="tensorrt", device_kv=False)}}
    pipes["graphs"] = Pipeline(pipes["device"].manifest, EngineOptions(cuda_graphs=True), "tensorrt")
    for key, pipe in pipes.items():
        gens = {{d: pipe.generate({PROMPT!r}, drafter=d, **args) for d in drafters}}
        out[key] = {{
            "tokens": {{d: g.token_ids for d, g in gens.items()}},
            "proposed": {{d: g.stats.proposed for d, g in gens.items()}},
            "drafts": drafts(pipe),
            "backends": {{d: g.backends for d, g in gens.items()}},
            "caches": {{h: type(pipe._caches[(h, 1)].slots[0]).__name__ for h in ("eagle", "mtp")}},  # one head cache
            "engines": {{h: sorted(type(e._engine).__name__ for m in pipe._models.values() if m.name == h
                                   for r in m.runners for e in r._by_size.values() if e.opened)
                         for h in ("eagle", "mtp")}},
        }}
        for h in ("dflash", "dspark"):  # block drafters: their slot's runner
            runner = pipe.drafter(h).slots[0].runner
            out[key]["caches"][h] = type(runner.cache).__name__
            out[key]["engines"][h] = sorted(type(e._engine).__name__ for e in runner._by_size.values() if e.opened)
    print(json.dumps(out))
""")


@pytest.fixture(scope="module")
def on_fake_gpu(engines, tmp_path_factory) -> dict:
    trt_dir = as_tensorrt_build(engines, tmp_path_factory.mktemp("fake-gpu") / "engines")
    return json_from_fake_gpu(ON_FAKE_GPU, trt_dir)


@pytest.mark.parametrize("mode", ["device", "host", "graphs"])
def test_every_head_on_the_fake_tensorrt_drafts_what_it_drafts_on_onnxruntime(on_fake_gpu, mode):
    got = on_fake_gpu[mode]
    assert got["tokens"] == on_fake_gpu["onnxruntime"]
    assert got["drafts"] == on_fake_gpu["onnxruntime_drafts"]  # round by round, the same proposals
    assert all(got["proposed"][h] > 0 for h in HEADS), got["proposed"]  # the heads did draft
    for head in HEADS:
        assert got["backends"][head] == {"target": "tensorrt", head: "tensorrt"}
        assert got["engines"][head] and set(got["engines"][head]) == {"TrtEngine"}, got["engines"]


def test_each_head_keeps_its_own_cache_on_the_device_unless_host_kv(on_fake_gpu):
    assert on_fake_gpu["device"]["caches"] == dict.fromkeys(HEADS, "DeviceKVCache")
    assert on_fake_gpu["graphs"]["caches"] == dict.fromkeys(HEADS, "DeviceKVCache")
    assert on_fake_gpu["host"]["caches"] == dict.fromkeys(HEADS, "KVCache")


def test_the_directory_lint_reports_each_engine_once(engines):
    """The directory walk: every graph the manifest names, a shared catch-up graph once per size."""
    from specexport.exporter.lint import lint_tensorrt

    names = [g.graph for g in lint_tensorrt(engines).graphs]
    raw = json.loads((engines / MANIFEST).read_text())
    assert sorted(names) == sorted(e["name"] for e in raw["engines"] if e["backend"] == "onnxruntime")


# -- on a GPU with TensorRT (skipped elsewhere) ----------------------------------------------


def proposals(pipe, drafter: str) -> list[list[int]]:
    """The drafter's proposals, round by round, over one greedy generate."""
    from tests.runtime.fakes import spy_proposals

    recorded: list[tuple] = []
    spy_proposals(pipe.drafter(drafter), recorded)
    pipe.generate(PROMPT, drafter=drafter, max_new_tokens=16, adaptive=False)
    return [drafts.tolist() for _, drafts, _ in recorded]


@needs_gpu
def test_gpu_head_engines_build_with_parity_and_draft_as_onnxruntime(engines, tmp_path):
    """A real TensorRT build of every head kind (fp32): each head engine within the build-time
    limits against its ONNX graph, the drafts equal onnxruntime's; then --from-onnx in fp16."""
    from specexport.exporter.builder import build_recipe
    from specexport.exporter.recipe import parse_recipe
    from specexport.exporter.trt_from_onnx import rebuild_from_onnx
    from specexport.progress import Reporter
    from specexport.runtime import load

    raw = read_manifest(engines).recipe
    out = tmp_path / "engines"
    recipe = parse_recipe({**raw, "backends": ["onnxruntime", "tensorrt"], "precision": "fp32"}, "recipe")
    build_recipe(recipe, engines.parent, out, False, Reporter(quiet=True))
    for precision in ("fp32", "fp16"):
        if precision == "fp16":
            rebuild_from_onnx(out, Reporter(quiet=True), precision="fp16")
        manifest = read_manifest(out)
        for head in HEADS:
            trt = manifest.engines_of(head, "tensorrt")
            assert [e.name for e in trt] == [e.name for e in manifest.engines_of(head, "onnxruntime")]
            for e in trt:
                assert e.extra["precision"] == precision and e.parity["within_tolerance"], (e.name, e.parity)
        if precision == "fp32":
            reference, compiled = load(out), load(out, backend="tensorrt")
            for head in HEADS:
                assert proposals(compiled, head) == proposals(reference, head), head
