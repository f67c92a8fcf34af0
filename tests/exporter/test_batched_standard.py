"""Batched engines with `attention: standard` (TensorRT's path): `shapes.batch: [1, 4]` builds
the decode, catch-up and verify graphs again at batch 4, each a static graph of its own (every
shape fixed) that returns only the new K/V (kv_update append: the runtime writes each row's first
real positions into that row's cache). The target, the int4 copy, a draft model and the
hidden-state heads all get them. The build checks every batched graph row by row against the
batch-1 graph of its size: rows at different cache lengths, with different counts of real tokens
(the rest padding), and an idle row; a graph whose mask ignored each row's own cache length
fails that check, though its batch-1 behaviour is unchanged."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest

from specexport.contract import (
    BATCHED_ROLES,
    CACHE_LENGTH,
    INPUT_IDS,
    LOGITS,
    VALID_TOKENS,
    KVUpdate,
    Role,
    engine_name,
    present_names,
    read_manifest,
)
from specexport.errors import SpecexportError
from tests.conftest import run_cli, tiny_recipe

MAX_SEQ_LEN = 48
DECODERS = ("target", "quantized-self", "draft-model")  # models with decoder graphs (StaticDecoder)
HEADS = ("eagle3",)  # a chain head (block heads batch the same way: HeadContext.batches)


@pytest.fixture(scope="module")
def standard_batched(tmp_path_factory) -> Path:
    """A tiny standard-attention build with batch sizes 1 and 4: a qwen3 target, its int4 copy,
    a draft model and an EAGLE-3 head."""
    from tests.heads.block_checkpoints import TARGET, build, tiny_target
    from tests.heads.chain_checkpoints import write_eagle3

    root = tmp_path_factory.mktemp("standard-batched")
    target = tiny_target()
    write_eagle3(root / "eagle3", target.config, "speculators", layer_ids=[0, 1, 3])
    raw = {"name": "standard-batched", "target": TARGET, "attention": "standard",
           "drafters": [{"kind": "ngram"}, {"kind": "quantized-self"},
                        {"kind": "model", "name": "draft-model",
                         "model": {"source": "tiny", "arch": "llama", "seed": 7, "num_layers": 1}},
                        *({"kind": kind, "name": kind, "path": kind} for kind in HEADS)],
           "shapes": {"batch": [1, 4], "max_seq_len": MAX_SEQ_LEN, "prefill_chunk": 8},
           "draft": {"tile": 128, "max_draft": 3}}
    return build(raw, root, root / "engines")


def test_a_standard_recipe_may_have_batch_sizes_above_one(tmp_path):
    code, out, err = run_cli("plan", tiny_recipe(tmp_path / "r.yaml", batch=(1, 4)))
    assert code == 0, err


def test_every_decoding_role_gets_a_static_append_graph_at_batch_4(standard_batched):
    manifest = read_manifest(standard_batched)
    verify = manifest.draft_len + 1
    assert {(e.model, e.role, e.tokens) for e in manifest.engines if e.batch == 4 and e.model == "target"} == {
        ("target", Role.DECODE, 1), ("target", Role.CATCHUP, 2), ("target", Role.VERIFY, verify)}
    for model in DECODERS:
        entries = [e for e in manifest.engines if e.model == model]
        assert manifest.batch_sizes(model) == [1, 4], model
        single = {(e.role, e.tokens) for e in entries if e.batch == 1 and e.role in BATCHED_ROLES}
        assert {(e.role, e.tokens) for e in entries if e.batch == 4} == single, model
        assert not [e for e in entries if e.batch > 1 and e.role not in BATCHED_ROLES]
        info = manifest.models[model]
        for e in (e for e in entries if e.batch == 4):
            assert e.name == engine_name(model, e.role, 4, e.tokens)
            assert e.path == f"{e.name}.onnx" and e.kv_update == KVUpdate.APPEND  # a graph of its own
            assert e.inputs[INPUT_IDS].shape == (4, e.tokens) and e.inputs[CACHE_LENGTH].shape == (4,)
            assert VALID_TOKENS not in e.inputs  # append: the runtime keeps each row's real positions
            for name in present_names(info.num_layers):
                assert e.outputs[name].shape == (4, info.num_kv_heads, e.tokens, info.head_dim)
            graph = onnx.load(str(standard_batched / e.path), load_external_data=False)
            dims = [d for v in [*graph.graph.input, *graph.graph.output] for d in v.type.tensor_type.shape.dim]
            assert all(d.HasField("dim_value") for d in dims), e.name  # every shape static
    for model in HEADS:  # the heads' round graphs at batch 4 too (append, as every head graph)
        assert {e.role for e in manifest.engines if e.model == model and e.batch == 4} == {Role.CATCHUP, Role.STEP}
        assert all(e.kv_update == KVUpdate.APPEND for e in manifest.engines if e.model == model)


def test_the_build_checked_each_batched_graph_row_by_row(standard_batched):
    from specexport.exporter.validate import row_plan

    batched = [e for e in read_manifest(standard_batched).engines if e.batch == 4]
    assert {e.model for e in batched} == {*DECODERS, *HEADS}
    for e in batched:
        parity = e.parity
        assert parity["reference"] == "the batch-1 graph, row by row", e.name
        assert parity["max_rel_output_diff"] <= 1e-4, e.name  # presents (and taps) of the real positions
        if e.model in DECODERS:
            assert [tuple(r) for r in parity["rows"]] == row_plan(4, e.tokens, MAX_SEQ_LEN)
            assert {LOGITS, *present_names(1)} <= set(parity["outputs_compared"])
        if e.model != "quantized-self":  # fp32: enforced, and the rows equal batch 1 to float noise
            assert parity["enforced"] is True and parity["argmax_agreement"] == 1.0, e.name
            assert parity["max_abs_logit_diff"] < 1e-4, e.name
    target = [e for e in batched if e.model == "target"]
    assert all("aux_hidden_states" in e.parity["outputs_compared"] for e in target)  # the heads' taps


def test_tensorrt_takes_every_batched_standard_graph(standard_batched):
    """The lint passes every batched graph as TensorRT's compile sees it, and the compile's own
    filter (trt_build._compilable) keeps them: each is parsed as exported (static, fp32)."""
    from specexport.exporter.lint import lint_tensorrt
    from specexport.exporter.trt_build import _compilable, tensorrt_graph
    from specexport.progress import Reporter

    report = lint_tensorrt(standard_batched)
    status = {g.graph: g.status for g in report.graphs}
    assert report.ok, report.render()
    for e in read_manifest(standard_batched).engines:
        if e.batch == 1 or e.model == "quantized-self":  # MatMulNBits: onnxruntime only (skipped)
            continue
        assert status[e.name] == "ok", e.name
        source = standard_batched / e.path
        assert _compilable(e, source, Reporter(quiet=True)), e.name
        if e.model in DECODERS:
            assert tensorrt_graph(e, source, standard_batched / "scratch", "fp32") == source


def _mask_from_the_longest_row(path: Path, out: Path) -> None:
    """A copy of a batched decoder graph whose mask lets every row see as many cache slots as
    the longest row (cache_length's maximum in place of each row's own): the bug the row check
    is for. At batch 1 the graph would compute exactly what it did."""
    model = onnx.load(str(path))  # weights loaded from the model's weights file
    nodes = model.graph.node
    at, lengths = next((i, n.output[0]) for i, n in enumerate(nodes) if n.op_type == "Reshape"
                       and n.input[0] == CACHE_LENGTH)  # [B, 1, 1]
    less = [n for n in nodes if n.op_type == "Less" and lengths in n.input]  # slot < cache_length
    assert len(less) == 1
    less[0].input[list(less[0].input).index(lengths)] = "longest_row"
    nodes.insert(at + 1, onnx.helper.make_node("ReduceMax", [lengths], ["longest_row"], keepdims=1))  # [1, 1, 1]
    onnx.save(model, str(out), save_as_external_data=True, location=out.stem + ".weights")
    onnx.checker.check_model(str(out))


def test_a_mask_that_ignores_each_rows_cache_length_fails_the_row_check(standard_batched, tmp_path):
    from specexport.exporter.onnx_export import tensor_specs
    from specexport.exporter.validate import BatchedGraph, GraphUnderTest, validate_batched_append
    from specexport.runtime.kv_cache import KVCache

    manifest = read_manifest(standard_batched)
    verify = next(e for e in manifest.engines if e.model == "target" and e.batch == 4 and e.role == Role.VERIFY)
    single = next(e for e in manifest.engines if e.model == "target" and e.batch == 1 and e.tokens == verify.tokens)
    info = manifest.models["target"]
    rng = np.random.default_rng(0)
    cache = KVCache(info.num_layers, 1, info.num_kv_heads, info.max_seq_len, info.head_dim)
    for array in cache.view().values():  # every slot holds data the mask must hide past a row's length
        array[...] = rng.standard_normal(array.shape)
    ids = rng.integers(3, info.vocab_size, size=MAX_SEQ_LEN)  # [S]
    specs = {e.name: (e.inputs, e.outputs) for e in (verify, single)}
    alone = {single.tokens: GraphUnderTest(single.name, standard_batched / single.path, single.tokens)}

    good = BatchedGraph(verify.name, standard_batched / verify.path, verify.tokens, 4)
    figures = validate_batched_append([good], alone, specs, cache, ids, None)[verify.name]
    assert figures["max_abs_logit_diff"] < 1e-4 and figures["argmax_agreement"] == 1.0

    broken = tmp_path / f"{verify.name}.onnx"
    _mask_from_the_longest_row(standard_batched / verify.path, broken)
    assert tensor_specs(onnx.load(str(broken), load_external_data=False), "inputs") == verify.inputs
    with pytest.raises(SpecexportError, match=r"row 0 .* differs in .* from the batch-1 graph run on that row alone"):
        validate_batched_append([BatchedGraph(verify.name, broken, verify.tokens, 4)], alone, specs, cache, ids, None)


# -- the runtime on them: one decode loop, rows of append graphs -------------------------------

PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [11, 12, 13], [20, 21, 22, 20, 21, 22, 20], [30] * 9,
           [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52], [60, 61]]


@pytest.mark.parametrize("drafter", ["none", "ngram", "quantized-self", "draft-model", "eagle3"])
def test_each_request_under_batching_gives_its_batch_1_output(standard_batched, drafter):
    """Six requests through four slots of append graphs (each row's real positions written into
    its cache row, padding and idle rows never): every request's greedy tokens are its own
    batch-1 generate's, and the batched rounds did verify drafts."""
    from specexport.runtime import load

    pipe = load(standard_batched)
    budgets = [9, 14, 6, 12, 10, 16]
    alone = [pipe.generate(prompt_ids=p, drafter=drafter, max_new_tokens=n, adaptive=False).token_ids
             for p, n in zip(PROMPTS, budgets)]
    loop = pipe.batch_loop(drafter=drafter, adaptive=False, schedule=False)
    assert loop.target.slots == 4 and {b for b, _ in loop.target.calls} == {4}  # static append graphs at batch 4
    for i, (prompt, budget) in enumerate(zip(PROMPTS, budgets)):
        request, _ = pipe.batch_request(prompt, max_new_tokens=budget)
        loop.submit(i, request)
    done: dict = {}
    for ended in loop.run():
        done.update(ended)
    assert [done[i].tokens for i in range(len(PROMPTS))] == alone
    if drafter != "none":
        assert sum(done[i].stats.proposed for i in done) > 0


def test_serve_answers_concurrent_requests_on_a_standard_directory(standard_batched):
    """`specexport serve` on append graphs: eight concurrent completions over four slots, each
    its batch-1 output (127.0.0.1 only)."""
    from specexport.cli.serve import check_servable
    from specexport.runtime import load
    from specexport.serve.app import create_app
    from specexport.serve.config import ServeConfig
    from tests.serve.common import concurrent_token_ids, running

    assert check_servable(standard_batched, "ngram", None) == "ngram"
    pipe = load(standard_batched)
    wants = [pipe.generate(prompt_ids=PROMPTS[i % len(PROMPTS)], drafter="ngram", max_new_tokens=10).token_ids
             for i in range(8)]
    with running(create_app(ServeConfig(str(standard_batched), "tiny", drafter="ngram", threads=2))) as url:
        got = concurrent_token_ids(url, "tiny", [PROMPTS[i % len(PROMPTS)] for i in range(8)], [10] * 8)
    assert got == wants
