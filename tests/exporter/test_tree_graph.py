"""Tree verify graphs: every row of a token tree, verified in one pass, equals transformers run on
that row's root-to-node path (standard attention with the ancestor mask, ort-gqa with
GroupQueryAttention's position ids and bias); a graph given the causal mask instead fails."""

from __future__ import annotations

import numpy as np
import pytest

from specexport.contract import LOGITS, TREE_MASK
from specexport.exporter.archs import read_decoder
from specexport.exporter.graph_model import StaticDecoder
from specexport.exporter.onnx_export import WeightStore, export_graph, export_tree_graph, tensor_specs
from specexport.exporter.recipe import TinySource
from specexport.exporter.tiny import tiny_model
from specexport.exporter.validate import reference_logits
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
    return attention, model, parts, engines


def run_tree(exported, prompt: np.ndarray, causal: bool = False) -> np.ndarray:
    attention, _, parts, engines = exported
    cache = KVCache(LAYERS, 1, parts.num_key_value_heads, SEQ, parts.head_dim)
    in_place = frozenset({"prefill"}) if attention == "ort-gqa" else frozenset()
    runner = ModelRunner("prefill", [engines["prefill"]], cache, {"prefill": PROMPT}, in_place=in_place)
    runner.forward(prompt[:PROMPT].tolist())
    make = causal_feeds if causal else tree_feeds
    feeds = {**cache.view(), **make(TREE, int(prompt[PROMPT]), PROMPT, attention == "ort-gqa")}
    bound = cache.in_place_outputs() if attention == "ort-gqa" else None
    return engines["tree"].run(feeds, [LOGITS], bound)[LOGITS][0]  # [1+N, V]


def test_each_tree_row_equals_transformers_on_its_path(exported):
    _, model, _, _ = exported
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
    _, model, _, _ = exported
    prompt = np.random.default_rng(0).integers(3, 250, size=PROMPT + 1)
    got = run_tree(exported, prompt, causal=True)
    path = [int(TREE.tokens[n]) for n in TREE.path(5)]  # row 6: node 5, under 3 under 0
    want = reference_logits(model, np.array([*prompt.tolist(), *path], dtype=np.int64))[-1]
    assert np.abs(got[6] - want).max() > 1e-2
