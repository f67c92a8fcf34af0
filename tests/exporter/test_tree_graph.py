"""Tree verify graphs: every row of a token tree, verified in one pass, equals transformers run on
that row's root-to-node path (standard attention with the ancestor mask, ort-gqa with
GroupQueryAttention's position ids and bias); a graph given the causal mask instead fails. A
batched tree graph's rows, each its own tree at its own cache length, equal the batch-1 graph
on each row alone (the build's check), and a graph that verifies every row under row 0's tree
fails that check."""

from __future__ import annotations

import numpy as np
import pytest

from specexport.contract import LOGITS, TREE_MASK
from specexport.errors import SpecexportError
from specexport.exporter.archs import read_decoder
from specexport.exporter.graph_model import StaticDecoder
from specexport.exporter.onnx_export import WeightStore, export_graph, export_tree_graph, tensor_specs
from specexport.exporter.recipe import TinySource
from specexport.exporter.tiny import tiny_model
from specexport.exporter.validate import (
    BatchedGraph,
    GraphUnderTest,
    reference_continuations,
    reference_logits,
    validate_batched_tree,
)
from specexport.runtime.engine import EngineOptions
from specexport.runtime.kv_cache import KVCache
from specexport.runtime.ort_engine import OrtEngine
from specexport.runtime.runner import ModelRunner
from specexport.runtime.tree import DraftTree
from specexport.runtime.tree_verify import tree_feeds

LAYERS, SEQ, PROMPT = 2, 48, 9
# root -> 0, 1, 2; 0 -> 3, 4; 3 -> 5; 1 -> 6
TREE = DraftTree(np.array([40, 41, 42, 43, 44, 45, 46]), np.array([-1, -1, -1, 0, 0, 3, 1]))


def causal_feeds(tree: DraftTree, root: int, length: int, valid_tokens: bool) -> dict:
    """The failing control's feeds: the same rows as a chain (each sees every row before it)."""
    feeds = tree_feeds(tree, root, length, valid_tokens)
    feeds[TREE_MASK] = np.tril(np.ones_like(feeds[TREE_MASK][0]))[None]
    return feeds


@pytest.fixture(scope="module", params=["standard", "ort-gqa"])
def exported(request, tmp_path_factory):
    attention = request.param
    model, tokenizer = tiny_model(TinySource(source="tiny", arch="llama", num_layers=LAYERS))
    parts = read_decoder(model, SEQ, "target")
    root = tmp_path_factory.mktemp(f"tree-{attention}")
    store = WeightStore(root / "target.weights")
    prefill = export_graph(StaticDecoder(parts, SEQ, attention).eval(), 1, PROMPT, 17)
    tree = export_tree_graph(StaticDecoder(parts, SEQ, attention, tree=True).eval(), 1 + TREE.size, 17)
    engines = {}
    for name, proto in (("prefill", prefill), ("tree", tree)):
        store.save(proto, root / f"{name}.onnx")
        engines[name] = OrtEngine(name, root / f"{name}.onnx", tensor_specs(proto, "inputs"),
                                  tensor_specs(proto, "outputs"), EngineOptions())
    store.close()
    return attention, model, parts, engines, root


def run_tree(exported, prompt: np.ndarray, causal: bool = False) -> np.ndarray:
    attention, _, parts, engines, _ = exported
    cache = KVCache(LAYERS, 1, parts.num_key_value_heads, SEQ, parts.head_dim)
    in_place = frozenset({"prefill"}) if attention == "ort-gqa" else frozenset()
    runner = ModelRunner("prefill", [engines["prefill"]], cache, {"prefill": PROMPT}, in_place=in_place)
    runner.forward(prompt[:PROMPT].tolist())
    make = causal_feeds if causal else tree_feeds
    feeds = {**cache.view(), **make(TREE, int(prompt[PROMPT]), PROMPT, attention == "ort-gqa")}
    bound = cache.in_place_outputs() if attention == "ort-gqa" else None
    return engines["tree"].run(feeds, [LOGITS], bound)[LOGITS][0]  # [1+N, V]


def test_each_tree_row_equals_transformers_on_its_path(exported):
    _, model, _, _, _ = exported
    prompt = np.random.default_rng(0).integers(3, 250, size=PROMPT + 1)
    got = run_tree(exported, prompt)
    worst = 0.0
    for row in range(1 + TREE.size):
        path = [int(TREE.tokens[n]) for n in TREE.path(row - 1)]
        want = reference_logits(model, np.array([*prompt.tolist(), *path], dtype=np.int64))[-1]  # [V]
        worst = max(worst, float(np.abs(got[row] - want).max()))
        assert int(got[row].argmax()) == int(want.argmax()), row
    assert worst < 1e-3, worst


def test_a_tree_run_as_a_chain_differs(exported):
    # the failing control: the same rows under a causal mask see their siblings and cousins
    _, model, _, _, _ = exported
    prompt = np.random.default_rng(0).integers(3, 250, size=PROMPT + 1)
    got = run_tree(exported, prompt, causal=True)
    path = [int(TREE.tokens[n]) for n in TREE.path(5)]  # row 6: node 5, under 3 under 0
    want = reference_logits(model, np.array([*prompt.tolist(), *path], dtype=np.int64))[-1]
    assert np.abs(got[6] - want).max() > 1e-2


class RowZeroTree(StaticDecoder):
    """The failing control's graph: every row of a batch verified under row 0's tree (its depth
    offsets and ancestor mask), as a graph that broadcast one row's tree would."""

    def forward(self, input_ids, cache_length, *inputs):
        offsets, mask, *rest = inputs  # [B, T], [B, T, T]
        return super().forward(input_ids, cache_length, offsets[:1].expand_as(offsets), mask[:1].expand_as(mask), *rest)


@pytest.mark.parametrize("graph_class", [StaticDecoder, RowZeroTree])
def test_batched_tree_rows_equal_batch_1(exported, tmp_path, graph_class):
    attention, _, parts, engines, root = exported
    rows = 1 + TREE.size
    store = WeightStore(tmp_path / "batched.weights")
    proto = export_tree_graph(graph_class(parts, SEQ, attention, tree=True).eval(), rows, 17, batch=3)
    store.save(proto, tmp_path / "batched.onnx")
    store.close()
    specs = {"batched": (tensor_specs(proto, "inputs", rows, 3), tensor_specs(proto, "outputs", rows, 3)),
             "tree": (engines["tree"].inputs, engines["tree"].outputs)}
    cache = KVCache(LAYERS, 1, parts.num_key_value_heads, SEQ, parts.head_dim)
    ids = np.random.default_rng(1).integers(3, 250, size=SEQ)
    in_place = frozenset({"prefill"}) if attention == "ort-gqa" else frozenset()
    ModelRunner("prefill", [engines["prefill"]], cache, {"prefill": PROMPT}, in_place=in_place).forward(
        ids[: SEQ - rows].tolist())  # the rows' contexts: every cache length the check uses is filled
    check = (BatchedGraph("batched", tmp_path / "batched.onnx", rows, 3), GraphUnderTest("tree", root / "tree.onnx", rows),
             specs, cache, ids, None, attention == "ort-gqa")
    if graph_class is RowZeroTree:
        with pytest.raises(SpecexportError, match="row 1 .* differs"):
            validate_batched_tree(*check)
    else:
        figures = validate_batched_tree(*check)
        assert figures["max_abs_logit_diff"] < 1e-4 and figures["rows"][1][1] == TREE.size


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma2", "gemma3_text", "phi3", "glm4_moe", "deepseek_v3"])
def test_the_builds_cached_reference_equals_a_full_pass_per_path(arch):
    # validate_tree runs the prompt once and each path from a copy of transformers' cache; each
    # path's last logits must be those of a full pass over prompt + path (without the copy, each
    # path after the first sees the earlier ones in the cache: max |Δ| 16.8 on llama).
    model, _ = tiny_model(TinySource(source="tiny", arch=arch, num_layers=2))
    rng = np.random.default_rng(1)
    prefix = rng.integers(3, 250, size=12)
    paths = [rng.integers(3, 250, size=n) for n in (1, 3, 2, 4)]
    got = reference_continuations(model, prefix, paths)  # [4, V]
    for row, path in enumerate(paths):
        want = reference_logits(model, np.concatenate([prefix, path]))[-1]  # [V]
        assert np.abs(got[row] - want).max() < 1e-4, (arch, row)
