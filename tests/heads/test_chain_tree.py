"""Chain heads' token trees, EAGLE-3 and MTP (runtime/chain_drafter.py trees and tree_alone, the head's
tree step of exporter/heads/chain_tree.py, runtime/tree.py spine_tree): what the head drafts as a
tree is the reference's own choice, and decoding with it stays the target's.

The reference runs the head's greedy chain after the committed context in plain torch; level j's
top-k tokens are the candidates under the spine node above, each weighing its joint draft
probability, and the tree keeps the N heaviest. A drafter that picked siblings by anything else
(the wrong level's distribution, unnormalised logits, the lightest nodes) fails here."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specexport.exporter.heads.chain_tree import ChainTreeGraph
from tests.heads.chain_checkpoints import write_eagle3, write_mtp_target
from tests.heads.chain_reference import context_states, load_chain_heads, one_torch_thread, reference_levels
from tests.heads.common import PROMPTS, SHAPES, build, build_head_only
from tests.heads.test_eagle3 import TARGET, target_config
from tests.lossless import assert_lossless
from tests.tree_checks import assert_batch_of_trees_lossless, check_trees, spine_choice, trees_drafted

NODES, TOP_K = 5, 3
TREE = {"max_draft": 3, "tree": {"max_nodes": NODES, "top_k": TOP_K}}
# head name -> its recipe: EAGLE-3 (SafeAILab layout) over the tiny llama, MTP (MiMo layout)
# inside a tiny qwen2 target
RECIPES = {
    "e-safe": {"name": "eagle3-tree", "target": TARGET, "attention": "ort-gqa", "draft": TREE,
               "drafters": [{"kind": "eagle3", "name": "e-safe", "path": "safe"}]},
    "m-mimo": {"name": "mtp-tree", "target": {"source": "hf", "path": "t-qwen2"}, "draft": TREE,
               "drafters": [{"kind": "mtp", "name": "m-mimo"}]},
}


@pytest.fixture(scope="module", params=list(RECIPES))
def case(request, tmp_path_factory):
    """(head name, its checkpoint folder, its recipe, the loaded pipeline)."""
    from specexport.runtime import load

    name, root = request.param, tmp_path_factory.mktemp(request.param)
    if name == "e-safe":
        write_eagle3(root / "safe", target_config(), "safeailab")
    else:
        write_mtp_target(root / "t-qwen2", "qwen2", "mimo")
    return name, root, RECIPES[name], load(build(RECIPES[name], root, root / "out"))


def spine_nodes(levels: list[torch.Tensor], nodes: int = NODES) -> tuple[list[tuple[int, ...]], np.ndarray]:
    """Without the tree step: the reference's choice over its greedy chain (level j's top-k under
    the spine node above)."""
    tops = [torch.topk(torch.log_softmax(logits.double(), dim=-1), TOP_K) for logits in levels]
    return spine_choice([(top.indices.tolist(), top.values.tolist()) for top in tops], nodes)


def expanded_nodes(head, target, context: np.ndarray, depth: int,
                   nodes: int = NODES) -> tuple[list[tuple[int, ...]], np.ndarray]:
    """With the tree step: EAGLE-2's expansion by the reference, each expanded node run on its
    own path (its ancestors as the chain's step rows): a level's TOP_K heaviest candidates are
    expanded while their joint probability beats the ``nodes``-th heaviest so far."""
    states = context_states(target, context, depth * TOP_K)
    rows = [int(t) for t in context[1:]]
    with torch.no_grad():
        logits, hidden = head.reference.run(torch.tensor(rows), states, None)
    found = {}  # path -> (log joint, own rows of its children)
    level = []
    top = torch.topk(torch.log_softmax(logits[-1].double(), dim=-1), TOP_K)
    for v, t in zip(top.values, top.indices):
        found[(int(t),)] = (float(v), [hidden[-1]])
        level.append((int(t),))
    for _ in range(1, depth):
        joints = sorted((j for j, _ in found.values()), reverse=True)
        cut = joints[nodes - 1] if len(joints) >= nodes else -np.inf
        chosen = [p for p in sorted(level, key=lambda p: -found[p][0])[:TOP_K] if found[p][0] > cut]
        if not chosen:
            break
        level = []
        for path in chosen:
            joint, own = found[path]
            with torch.no_grad():
                logits, hidden = head.reference.run(torch.tensor(rows + list(path)), states, torch.stack(own))
            top = torch.topk(torch.log_softmax(logits[-1].double(), dim=-1), TOP_K)
            for v, t in zip(top.values, top.indices):
                found[path + (int(t),)] = (joint + float(v), own + [hidden[-1]])
                level.append(path + (int(t),))
    ranked = sorted(found, key=lambda p: -found[p][0])
    return ranked[:nodes], np.array([found[p][0] for p in ranked])


@pytest.mark.parametrize("grown", ["expanded", "spine"])
def test_the_tree_is_the_references_heaviest_candidates(case, grown):
    """Every tree is the reference's own: the same nodes (as token paths) and weights equal to
    their joint draft probabilities. "spine": a build without the head's tree step, where only
    the greedy chain is stepped."""
    name, root, recipe, pipe = case
    target, heads = load_chain_heads(recipe, root)
    head, drafter = heads[name], pipe.drafter(name)
    saved = drafter.tree_steps
    assert saved, "the build has no tree step for the head"
    if grown == "spine":
        drafter.tree_steps = {}
    try:
        with one_torch_thread():
            def reference(context, depth, nodes):
                if grown == "spine":
                    return spine_nodes(reference_levels(head, target, context, depth), nodes)
                return expanded_nodes(head, target, context, depth, nodes)

            checked = sum(check_trees(trees_drafted(pipe, name, prompt, NODES), reference, 1e-3, 1e-3)
                          for prompt in PROMPTS)
    finally:
        drafter.tree_steps = saved
    assert checked >= 6, f"only {checked} trees checked"


def off_spine(tree) -> int:
    """Nodes whose parent is not the first node of the level above (the spine)."""
    depths = tree.depths()
    return sum(parent >= 0 and parent != int(np.flatnonzero(depths == depths[node] - 1)[0])
               for node, parent in enumerate(tree.parents.tolist()))


def test_the_tree_step_expands_siblings_and_the_spine_does_not(case):
    """With the tree step some trees grow under a sibling; without it every node hangs under the
    root or the spine, and trees still branch."""
    name, _, _, pipe = case
    drafter = pipe.drafter(name)
    expanded = [tree for prompt in PROMPTS for _, tree, *_ in trees_drafted(pipe, name, prompt, NODES)]
    saved, drafter.tree_steps = drafter.tree_steps, {}
    try:
        spine = [tree for prompt in PROMPTS for _, tree, *_ in trees_drafted(pipe, name, prompt, NODES)]
    finally:
        drafter.tree_steps = saved
    assert sum(off_spine(t) for t in expanded) > 0, "no tree grew under a sibling"
    assert sum(off_spine(t) for t in spine) == 0
    assert max(int(np.bincount(t.depths()).max()) for t in spine) > 1, "no tree branched"


@pytest.mark.parametrize("adaptive", [False, True])
def test_greedy_tree_decoding_is_the_target_alone(case, adaptive):
    name, _, _, pipe = case
    for prompt in PROMPTS:
        ids = pipe.prompt_ids(prompt)
        base = pipe.generate(prompt_ids=ids, max_new_tokens=20).token_ids
        spec = pipe.generate(prompt_ids=ids, max_new_tokens=20, drafter=name, adaptive=adaptive,
                             tree_nodes=NODES)
        assert spec.stats.tree_nodes > 0, "no tree round ran"
        assert_lossless(pipe, ids, base, spec.token_ids, f"{name} tree on {prompt!r}")


def test_a_long_prompts_catch_up_asks_logits_of_its_last_graph_only(case, monkeypatch):
    """The first tree round catches the head up on the whole prompt; only its last row's logits
    are read, so the rows before the catch-up's largest decoding graph run without them (a
    prompt's logits over the target's vocabulary would be tens of MB). With fill entries
    (ort-gqa builds) the call reads at most 1+D rows and every row before it goes through the
    fill graph, which computes no logits at all (ChainDrafter._read_rows)."""
    name, _, _, pipe = case
    runner = pipe.drafter(name).catchup.runners[0]
    asked = []  # (rows, logits read), in call order; "fill": a fill call's rows (nothing read)
    monkeypatch.setattr(runner, "_run", lambda size, want_logits, want=(), run=runner._run:
                        asked.append((size, want_logits)) or run(size, want_logits, want))
    if runner.fill_sizes:  # without them fill is forward, whose _run calls are recorded already
        monkeypatch.setattr(runner, "fill", lambda tokens, inputs=None, fill=runner.fill:
                            asked.append((len(tokens), "fill")) or fill(tokens, inputs))
    ids = (pipe.prompt_ids(PROMPTS[1]) * 8)[: pipe.max_seq_len - 20]  # room for 8 tokens and a tree
    assert len(ids) > 2 * max(runner.decoding_sizes)
    spec = pipe.generate(prompt_ids=ids, max_new_tokens=8, drafter=name, tree_nodes=NODES)
    assert spec.stats.tree_nodes > 0
    first = next(i for i, (_, read) in enumerate(asked) if read is True)  # the first round's call
    widest = runner.verify_limit if runner.fill_sizes else max(runner.decoding_sizes)
    assert sum(size for size, _ in asked[:first]) >= len(ids) - 1 - widest, asked
    assert asked[first][0] <= widest, asked
    assert not runner.fill_sizes or all(read == "fill" for _, read in asked[:first]), asked


def test_an_adaptive_tree_stops_growing_where_the_round_would_cut(case, monkeypatch):
    """Alone and adaptive, the head stops at a level none of whose nodes the round's tree size
    would verify (runtime/tree.py expansion_budget): the same trees are verified (the same
    tokens, rounds, nodes and acceptances) with fewer tree-step calls than without it. The
    head's steps are free here; what pricing them changes is tests/runtime/test_tree_hint.py's."""
    from specexport.runtime.adaptive import DepthPolicy
    from specexport.runtime.policy import SpeculationPolicy
    from specexport.runtime.tree_verify import TreeVerifier

    name, _, _, pipe = case
    # the build's measured costs vary: fixed ones, so that both runs draft alike and deep enough
    # to step (every round at the full depth; tree passes cost more with more rows)
    monkeypatch.setattr(DepthPolicy, "best_depth", lambda self, tag, limit, batch=1, sunk=False, remaining=0: limit)
    monkeypatch.setattr(TreeVerifier, "cost", lambda self, rows, batch=1: 0.02 + 0.002 * rows ** 2)
    monkeypatch.setattr(pipe.drafter(name), "round_cost", lambda k, costs=None: 0.0)
    engine = pipe.drafter(name).tree_steps[1]
    calls = []
    monkeypatch.setattr(engine, "run", lambda *args, run=engine.run: calls.append(1) or run(*args))

    def decode():
        calls.clear()
        outs = [pipe.generate(prompt_ids=pipe.prompt_ids(p), max_new_tokens=20, drafter=name, tree_nodes=NODES)
                for p in PROMPTS]
        return [(g.token_ids, g.stats.rounds, g.stats.tree_nodes, g.stats.accepted) for g in outs], len(calls)

    hinted, hinted_calls = decode()
    monkeypatch.setattr(SpeculationPolicy, "_size_hint", lambda self, sizer: None)
    grown, grown_calls = decode()
    assert hinted == grown
    assert sum(rounds for _, rounds, _, _ in hinted) > 3 * len(PROMPTS)
    assert hinted_calls < grown_calls, (hinted_calls, grown_calls)


@pytest.fixture(scope="module")
def batched_eagle3(tmp_path_factory):
    """The EAGLE-3 tree recipe at batch 1 and 2: (its folder, recipe, pipeline)."""
    from specexport.runtime import load

    root = tmp_path_factory.mktemp("e-safe-batched")
    write_eagle3(root / "safe", target_config(), "safeailab")
    recipe = {**RECIPES["e-safe"], "shapes": {**SHAPES, "batch": [1, 2]}}
    return root, recipe, load(build(recipe, root, root / "out"))


def test_each_rows_tree_in_a_batch_is_the_references(batched_eagle3):
    # two prompts decode together: each row's tree is expanded over its own slot of the head's
    # cache (its own committed rows and tree-step rows) and equals the reference's; lossless
    root, recipe, pipe = batched_eagle3
    target, heads = load_chain_heads(recipe, root)
    with one_torch_thread():
        trees = trees_drafted(pipe, "e-safe", PROMPTS[:2], NODES)
        checked = check_trees(trees, lambda context, depth, nodes: expanded_nodes(heads["e-safe"], target, context,
                                                                                  depth, nodes), 1e-3, 1e-3)
    second = pipe.prompt_ids(PROMPTS[1])
    assert any(nodes < NODES and list(context[: len(second)]) == second for context, _, _, nodes in trees), \
        "row 1 drafted no tree beside row 0"
    assert checked >= 4, f"only {checked} trees checked"
    assert pipe.drafter("e-safe", 2).tree_steps[2].opened, "the rows' trees were not grown by the batch's tree step"
    assert_batch_of_trees_lossless(pipe, "e-safe", PROMPTS[:2], 20, NODES, adaptive=True)


class RowZeroLevel(ChainTreeGraph):
    """The failing control's tree step: every batch row's nodes placed and masked as row 0's
    (its write slot, offsets and cache mask), as a graph that broadcast one row's level would."""

    def forward(self, input_ids, features, cache_length, tree_offsets, tree_past_mask, *past):
        return super().forward(input_ids, features, cache_length[:1].expand_as(cache_length),
                               tree_offsets[:1].expand_as(tree_offsets), tree_past_mask[:1].expand_as(tree_past_mask),
                               *past)


@pytest.mark.parametrize("graph_class", [ChainTreeGraph, RowZeroLevel])
def test_the_batched_tree_step_is_checked_row_by_row(tmp_path, monkeypatch, graph_class):
    # the build runs the batch-2 and batch-3 tree steps on rows at their own cache lengths and
    # levels against the batch-1 graph on each row alone; a graph mixing rows fails the build
    from specexport.errors import SpecexportError
    from specexport.exporter.heads import chain_tree

    write_eagle3(tmp_path / "safe", target_config(), "safeailab")
    recipe = {**RECIPES["e-safe"], "shapes": {**SHAPES, "batch": [1, 2, 3]}}
    monkeypatch.setattr(chain_tree, "ChainTreeGraph", graph_class)
    if graph_class is RowZeroLevel:
        with pytest.raises(SpecexportError, match="row 1 .* differs"):
            build_head_only(recipe, tmp_path, tmp_path / "head")
        return
    builder = build_head_only(recipe, tmp_path, tmp_path / "head")
    batched = [e for e in builder.engines if e.role.value == "tree" and e.batch > 1]
    assert sorted(e.batch for e in batched) == [2, 3], batched
    for entry in batched:
        figures = entry.parity
        assert figures["argmax_agreement"] == 1.0 and figures["max_rel_output_diff"] < 1e-5, (entry.name, figures)


def test_a_batch_grows_each_rows_tree_as_its_slot_alone(batched_eagle3):
    # at every batched round of a decode, the batch's trees (one catch-up call, one tree step a
    # level for both rows) are grown again slot by slot from the same state: the same trees,
    # and the same rows written into each slot's part of the head's cache (a batched step that
    # wrote or read another row's slot differs here even where no deep node makes the cut)
    _, _, pipe = batched_eagle3
    drafter = pipe.drafter("e-safe", 2)
    tensors = drafter.catchup.caches.store.rows()  # views of every slot's row of the head cache
    compared = []
    batched_trees = drafter.trees

    def both(rows, budget):
        depths, nodes, top_k = budget.depths, budget.nodes, budget.top_k
        state = ([list(p) for p in drafter._pending], list(drafter._committed),
                 {k: v.copy() for k, v in tensors.items()})
        got = batched_trees(rows, budget)
        after = {k: v.copy() for k, v in tensors.items()}
        drafter._pending, drafter._committed = [list(p) for p in state[0]], list(state[1])
        for name, array in tensors.items():
            array[...] = state[2][name]
        want = [drafter.tree_alone(row, depth, nodes, top_k, slot=r) if depth > 0 else None
                for r, (row, depth) in enumerate(zip(rows, depths))]
        for g, w in zip(got, want):
            assert (g is None) == (w is None)
            if g is not None:
                assert g.tokens.tolist() == w.tokens.tolist() and g.parents.tolist() == w.parents.tolist()
                assert g.weights == pytest.approx(w.weights, rel=1e-3)
        for name, array in tensors.items():
            np.testing.assert_allclose(after[name][: len(rows)], array[: len(rows)], atol=1e-4, err_msg=name)
        compared.append(sum(t is not None for t in got))
        return want

    drafter.trees = both
    try:
        ids = [pipe.prompt_ids(p) for p in PROMPTS[:2]]
        pipe.generate_batch(ids, drafter="e-safe", max_new_tokens=16, tree_nodes=NODES, max_batch=2, schedule=False,
                            adaptive=False)
    finally:
        del drafter.trees
    assert sum(n == 2 for n in compared) >= 3, compared
