"""Block heads' token trees, DFlash and DSpark (runtime/block_drafter.py BlockSlot.tree): the
greedy block is the spine and each position's top-k hang under it as leaves, the heaviest by
joint draft probability kept. DFlash's trees are checked against the published math's block
(exporter/heads/block_reference.py); both kinds decode exactly as the target alone, and at
batch 2 draft every row's tree in one block call, each the tree its prompt drafts alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.heads.block_checkpoints import (
    PROMPTS,
    build,
    recipe,
    tiny_target,
    write_deepspec_dspark,
    write_zlab_dflash,
)
from tests.lossless import assert_lossless
from tests.tree_checks import (
    assert_batch_of_trees_lossless,
    check_trees,
    rows_per_call,
    spine_choice,
    trees_drafted,
)

NODES, TOP_K = 5, 3
HEADS = {"zlab": ("z-lab", write_zlab_dflash), "ds": ("deepspec", write_deepspec_dspark)}


@pytest.fixture(scope="module")
def target():
    return tiny_target()


@pytest.fixture(scope="module")
def folders(tmp_path_factory, target):
    root = tmp_path_factory.mktemp("block-tree")
    return root, {name: writer(root / name, target) for name, (_, writer) in HEADS.items()}


@pytest.fixture(scope="module")
def pipe(folders):
    """Both heads with tree graphs at batch 1 and 2 (the block graphs batched too)."""
    from specexport.runtime import load

    root, _ = folders
    raw = recipe(*[{"kind": "dflash" if name == "zlab" else "dspark", "name": name, "path": name} for name in HEADS])
    raw["draft"]["tree"] = {"max_nodes": NODES, "top_k": TOP_K}
    raw["shapes"] = {**raw["shapes"], "batch": [1, 2]}
    return load(build(raw, root, root / "engines"))


def reference_nodes(folder, layout: str, target, context: np.ndarray, depth: int, nodes: int = NODES):
    """The published math's block after ``context``: each position's top-k (target ids) under
    the greedy spine (tests/tree_checks.spine_choice)."""
    from specexport.exporter.heads.block import read_checkpoint
    from specexport.exporter.heads.block_reference import reference_block

    ckpt = read_checkpoint(folder, "test")
    with torch.no_grad():
        out = target(torch.from_numpy(context).unsqueeze(0), output_hidden_states=True)
    hidden = tuple(h[0].numpy() for h in out.hidden_states)
    logits, _ = reference_block(layout, ckpt.config, ckpt.tensors, target, hidden, context, len(context) - 1)
    d2t = ckpt.tensors["d2t"].numpy() if "d2t" in ckpt.tensors else None
    levels = []
    for row in torch.from_numpy(np.asarray(logits[:depth])):
        top = torch.topk(torch.log_softmax(row.double(), dim=-1), TOP_K)
        ids = [int(i) + (int(d2t[i]) if d2t is not None else 0) for i in top.indices]
        levels.append((ids, top.values.tolist()))
    return spine_choice(levels, nodes)


def test_dflash_trees_are_the_references_heaviest_candidates(pipe, folders, target):
    _, paths = folders
    checked = sum(check_trees(trees_drafted(pipe, "zlab", prompt, NODES),
                              lambda context, depth, nodes: reference_nodes(paths["zlab"], "z-lab", target, context,
                                                                            depth, nodes),
                              1e-3, 1e-3)
                  for prompt in PROMPTS)
    assert checked >= 6, f"only {checked} trees checked"


@pytest.mark.parametrize("head", list(HEADS))
def test_greedy_block_trees_decode_as_the_target_alone(pipe, head):
    branched = 0
    for prompt in PROMPTS:
        ids = pipe.prompt_ids(prompt)
        base = pipe.generate(prompt_ids=ids, max_new_tokens=20).token_ids
        spec = pipe.generate(prompt_ids=ids, max_new_tokens=20, drafter=head, adaptive=False, tree_nodes=NODES)
        assert spec.stats.tree_nodes > 0, "no tree round ran"
        assert_lossless(pipe, ids, base, spec.token_ids, f"{head} tree on {prompt!r}")
        branched += max(int(np.bincount(t.depths()).max()) for _, t, *_ in trees_drafted(pipe, head, prompt, NODES)) > 1
    assert branched, "no tree branched"


@pytest.mark.parametrize("head", list(HEADS))
def test_each_rows_block_tree_in_a_batch_is_its_own(pipe, head):
    # two prompts decode together: every round one call of the batched block graph drafts both
    # rows, and each row's trees are the ones its prompt's decode alone drafts, round by round
    # (a row reading the other row's slice of the block, or its context, differs); lossless
    drafter = pipe.drafter(head, pipe.batched_target(2).slots)
    with rows_per_call(drafter.calls[2], lambda together, *_: len(together)) as counts:
        together = trees_drafted(pipe, head, PROMPTS[:2], NODES, new_tokens=16)
    assert max(counts, default=0) == 2, "the rows' trees were drafted one row at a time"
    width = pipe.manifest.draft_len  # at B > 1 a row's tree has at most the depth's nodes
    for prompt in PROMPTS[:2]:
        ids = pipe.prompt_ids(prompt)
        alone = [(context, tree) for context, tree, *_ in trees_drafted(pipe, head, prompt, width, new_tokens=16)]
        mine = [(context, tree) for context, tree, *_ in together if list(context[: len(ids)]) == ids]
        assert len(mine) >= 3, f"row {prompt!r} drafted {len(mine)} trees"
        for (context, tree), (want_context, want) in zip(mine, alone):
            assert np.array_equal(context, want_context)
            assert tree.tokens.tolist() == want.tokens.tolist() and tree.parents.tolist() == want.parents.tolist()
            np.testing.assert_allclose(tree.weights, want.weights, rtol=1e-4, atol=1e-6)
    assert_batch_of_trees_lossless(pipe, head, PROMPTS[:2], 20, NODES)
