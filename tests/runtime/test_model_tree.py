"""A draft model's token trees (runtime/drafters.py ModelDrafter.trees): the int4 copy of
the target and a separate draft model draft their greedy chain as the spine with each step's
top-k as leaves. Every tree is checked against the same model run from an empty cache on the
committed context (so a round that left a stale draft row in the cache, after a path that ended
on a leaf, is caught), and decoding with trees stays exactly the target's; the same holds for
each row of a batch, every row drafting its own tree over its own cache row. The int4 copy here
computes its own K/V (``share_target_cache`` off: its trees are its own model's, checkable from
an empty cache); over the target's K/V its drafts are tests/runtime/test_shared_cache.py's."""

from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import TINY_SHAPE
from tests.lossless import assert_lossless
from tests.runtime.own_cache import use_own_cache
from tests.tree_checks import (
    assert_batch_of_trees_lossless,
    check_trees,
    rows_per_call,
    spine_choice,
    trees_drafted,
)

NODES, TOP_K = 6, 4
DRAFTERS = ("quantized-self", "draft-model")
PROMPTS = ["a b a b a b a b", "The cat sat on the mat. The cat", "1, 2, 3, 1, 2, 3"]


@pytest.fixture(scope="module")
def pipe(tiny_engines):
    from specexport.runtime import load

    engines = tiny_engines.get("llama", drafters=DRAFTERS, attention="ort-gqa", tree_nodes=NODES, **TINY_SHAPE)
    pipe = load(engines, threads=2)
    use_own_cache(pipe)
    return pipe


def fresh_levels(pipe, name: str, context: np.ndarray, depth: int) -> list[np.ndarray]:
    """The draft model's log q at each level of its greedy chain after ``context``, from an empty
    cache (its batch-1 runner; the decode that used it is over)."""
    runner = pipe.drafter(name).model.runners[0]
    runner.cache.set_length(0)
    logits = runner.forward(context, want_logits=True).logits[-1]  # [V]
    levels = []
    for _ in range(depth):
        levels.append(logits - np.logaddexp.reduce(logits.astype(np.float64)))
        logits = runner.forward([int(np.argmax(logits))], want_logits=True).logits[-1]
    return levels


def spine_reference(pipe, name: str):
    """check_trees' reference: the model's own spine and siblings from an empty cache."""
    def reference(context, depth, nodes):
        levels = fresh_levels(pipe, name, context, depth)  # [V] log q each
        return spine_choice([(np.argsort(-logp, kind="stable")[:TOP_K], np.sort(logp)[::-1][:TOP_K])
                             for logp in levels], nodes)

    return reference


def weight_rel(pipe, name: str) -> float:
    """How closely a drafted tree's weights must match the fresh reference's: 1e-4, unless the
    model's kernels on this machine compute a row alone differently from the same row in a
    multi-row call (the build's kernel probe: ``exactness``, ``one_row_equal`` false; the int4
    copy is a drafter and is not padded for it). Then its rows during decoding and the
    reference's prefill went through different kernels: on an AVX2 CPU without VNNI one tree in
    fifteen was 5.7% off (the rest within 3e-6). The paths are still checked exactly."""
    info = pipe.manifest.models[name].info  # an int4 copy's probe sits in its info, beside its bits
    kernels = (info.get("exactness") or {}).get("kernels", [])
    return 0.1 if any(not k.get("one_row_equal", True) for k in kernels) else 1e-4


@pytest.mark.parametrize("name", DRAFTERS)
def test_each_tree_is_the_models_own_spine_and_siblings(pipe, name):
    reference = spine_reference(pipe, name)
    checked = sum(check_trees(trees_drafted(pipe, name, prompt, NODES, new_tokens=16), reference, 1e-4,
                              weight_rel(pipe, name))
                  for prompt in PROMPTS)
    assert checked >= 6, f"only {checked} trees checked"


@pytest.mark.parametrize("name", DRAFTERS)
def test_greedy_model_trees_decode_as_the_target_alone(pipe, name):
    for prompt in PROMPTS:
        ids = pipe.prompt_ids(prompt)
        base = pipe.generate(prompt_ids=ids, max_new_tokens=24).token_ids
        spec = pipe.generate(prompt_ids=ids, max_new_tokens=24, drafter=name, adaptive=False, tree_nodes=NODES)
        assert spec.stats.tree_nodes > 0, "no tree round ran"
        assert_lossless(pipe, ids, base, spec.token_ids, f"{name} tree on {prompt!r}")


@pytest.mark.parametrize("name", DRAFTERS)
def test_a_wide_gap_goes_in_without_logits_but_its_last_graph(pipe, name, monkeypatch):
    """After rounds at depth 0 a draft model's cache lacks what was committed meanwhile. Only the
    last row's logits are read, so the gap goes in without them but for the last graph-full
    (a long gap's logits over the vocabulary would be MBs): the rows before it through the
    model's fill graph (Role.FILL, no logits computed at all), and the tree is the same."""
    from specexport.runtime.acceptance import Sampling
    from specexport.runtime.drafters import DraftBudget, DraftRow

    drafter = pipe.drafter(name)
    runner = drafter.model.runners[0]
    context = np.array((pipe.prompt_ids(PROMPTS[1]) * 4)[: pipe.max_seq_len - 12])
    assert len(context) > 6 + 2 * max(runner.decoding_sizes)
    row = DraftRow(context, Sampling(), np.random.default_rng(0))
    drafter.join(0, context[:6], {})  # the prompt, then every round since at depth 0
    assert runner.fill_sizes, "an ort-gqa draft model has fill entries"  # so fill never runs _run itself
    asked = []  # (rows, logits read), in call order; "fill": a fill call's rows (nothing read)
    monkeypatch.setattr(runner, "_run", lambda size, want_logits, want=(), run=runner._run:
                        asked.append((size, want_logits)) or run(size, want_logits, want))
    monkeypatch.setattr(runner, "fill", lambda tokens, inputs=None, fill=runner.fill:
                        asked.append((len(tokens), "fill")) or fill(tokens, inputs))
    tree = drafter.propose([row], DraftBudget([3], NODES, TOP_K))[0]
    first = next(i for i, (_, want_logits) in enumerate(asked) if want_logits is True)
    assert sum(size for size, _ in asked[:first]) >= len(context) - 6 - max(runner.decoding_sizes), asked
    assert any(read == "fill" for _, read in asked[:first]), asked
    assert asked[first][0] <= max(runner.decoding_sizes), asked
    drafter.join(0, context, {})  # the same context fed whole at join: the same tree
    again = drafter.propose([row], DraftBudget([3], NODES, TOP_K))[0]
    assert again.tokens.tolist() == tree.tokens.tolist() and again.parents.tolist() == tree.parents.tolist()


@pytest.fixture(scope="module")
def batched(tiny_engines):
    from specexport.runtime import load

    engines = tiny_engines.get("llama", drafters=DRAFTERS, attention="ort-gqa", batch=(1, 2), tree_nodes=NODES,
                               **TINY_SHAPE)
    pipe = load(engines, threads=2)
    use_own_cache(pipe, slots=(1, pipe.batched_target(2).slots))
    return pipe


@pytest.mark.parametrize("name", DRAFTERS)
def test_each_rows_tree_in_a_batch_is_the_models_own(batched, name):
    # two prompts decode together: each row's trees come from its own slot's cache row (a tree
    # drafted from the other row's, or a stale one, fails the reference), both rows' spines
    # stepped in one call of the model; lossless per row
    model = batched.drafter(name, batched.batched_target(2).slots).model
    with rows_per_call(model, lambda n, feed, *_: len(feed)) as counts:
        trees = trees_drafted(batched, name, PROMPTS[:2], NODES, new_tokens=16)
    assert max(counts, default=0) == 2, "the rows' trees were drafted one row at a time"
    together = [t for t in trees if t[3] < NODES]  # rounds of both rows: at most the depth each
    second = batched.prompt_ids(PROMPTS[1])
    assert any(list(context[: len(second)]) == second for context, *_ in together), "row 1 drafted no tree"
    assert check_trees(trees, spine_reference(batched, name), 1e-4, weight_rel(batched, name)) >= 6
    assert_batch_of_trees_lossless(batched, name, PROMPTS[:2], 24, NODES)


@pytest.mark.parametrize("rule", ["right", "control-residual-keeps-rejected", "control-no-renormalisation"])
def test_sampled_model_trees_follow_the_target(pipe, rule, monkeypatch):
    # the int4 copy's siblings are the target's likely tokens, so the sibling rule decides what
    # comes out: two sampled tokens (T = 1, top-k 3) through its trees are distributed as the
    # target's under tree_rejection; the same draws under a wrong sibling rule (the failing
    # controls of tests/runtime/test_tree.py, run through the loop here) fail
    import specexport.runtime.acceptance as acceptance
    from specexport.runtime.acceptance import Sampling
    from tests.lossless import assert_sampled_as_target, exact_sequence_probs, sample_counts
    from tests.runtime.test_tree import _no_renormalisation, _residual_keeps_rejected

    wrong = {"control-residual-keeps-rejected": _residual_keeps_rejected,
             "control-no-renormalisation": _no_renormalisation}
    if rule in wrong:
        monkeypatch.setattr(acceptance, "tree_rejection", wrong[rule])
    ids = pipe.prompt_ids(PROMPTS[0])
    exact = exact_sequence_probs(pipe, ids, Sampling(1.0, top_k=3), 2)
    draws = 1500
    counts, stats = sample_counts(pipe, ids, draws, drafter="quantized-self", tree_nodes=NODES, max_new_tokens=2,
                                  temperature=1.0, top_k=3, adaptive=False)
    assert sum(s.tree_nodes for s in stats) >= draws  # every draw verified a tree
    assert sum(s.accepted for s in stats) > draws // 10  # and a node was often kept
    assert_sampled_as_target(counts, exact, draws, right_rule=rule == "right")
