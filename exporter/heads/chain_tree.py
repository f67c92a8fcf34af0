"""A chain head's tree step (EAGLE-3, MTP): one level of a draft tree in one call (Role.TREE).

EAGLE-2's expansion drafts a tree level by level: the best nodes of a level are fed to the head
together, each as one row (its token, the head's own hidden of its parent's row), and each row's
logits give that node's children. Their ancestors differ, so the head's cache is no longer a
line: the committed rows sit at 0..L-1, and every expanded node's row is appended after them in
expansion order. Row t of a call therefore takes its position (L + its depth - 1, passed as an
offset from the write slot, contract.TREE_OFFSETS) and the cache slots it may see
(TREE_PAST_MASK: the committed rows and its ancestors' rows); it sees itself among the new rows,
and not its siblings. Everything else is the step graph's module (chain.ChainGraph.decode).
With batch sizes above 1 the graph's batch is symbolic (one file, an entry per batch size, as
the head's catch-up and step graphs): batch row r holds the level of the sequence in slot r.

Validated at build time against the kind's reference forward run on each node's own path (its
ancestors as the chain's step rows), two levels deep on real text; each batch size row by row
against the batch-1 graph, the rows at their own committed lengths, levels and masks.
"""

from __future__ import annotations

import numpy as np
import torch

from specexport.contract import (
    CACHE_LENGTH,
    DRAFT_FEATURES,
    HIDDEN_OUT,
    INPUT_IDS,
    LOGITS,
    NEXT_TOKENS,
    TREE_OFFSETS,
    TREE_PAST_MASK,
    Role,
    past_names,
    present_names,
)
from specexport.exporter.heads.base import HeadContext
from specexport.exporter.heads.chain import ChainGraph, _draftable, target_states
from specexport.exporter.onnx_export import export_module
from specexport.exporter.validate import Parity, check_batched_rows
from specexport.runtime.chain_drafter import TreeLevel, tree_step_feeds


class ChainTreeGraph(ChainGraph):
    """forward(input_ids [1,T], draft_features [1,T,H], cache_length [1], tree_offsets [1,T],
    tree_past_mask [1,T,S_max], *past) -> the step graph's outputs; presents are the T rows, to
    be written at cache_length onwards."""

    def __init__(self, spec, target_taps: tuple[int, ...], max_seq_len: int):
        super().__init__(spec, target_taps, max_seq_len, step=True)

    def forward(self, input_ids, features, cache_length, tree_offsets, tree_past_mask, *past):
        batch, tokens = input_ids.shape
        positions = cache_length.unsqueeze(1) + tree_offsets  # [B, T]
        itself = torch.eye(tokens, dtype=torch.bool).unsqueeze(0).expand(batch, tokens, tokens)  # [B, T, T]
        return self.decode(input_ids, features, positions, torch.cat((tree_past_mask, itself), dim=-1), past)


def tree_graph_io(num_layers: int) -> tuple[list[str], list[str]]:
    inputs = [INPUT_IDS, DRAFT_FEATURES, CACHE_LENGTH, TREE_OFFSETS, TREE_PAST_MASK, *past_names(num_layers)]
    return inputs, [LOGITS, NEXT_TOKENS, *present_names(num_layers), HIDDEN_OUT]


def export_chain_tree(graph: ChainTreeGraph, rows: int, opset: int, symbolic_batch: bool = False):
    """One graph of ``rows`` nodes per call (the recipe's draft.tree.top_k): batch 1, or with
    ``symbolic_batch`` any batch (traced at 2; the batched loop's tree steps share the file, as
    the head's catch-up and step graphs do)."""
    spec = graph.spec
    b = 2 if symbolic_batch else 1
    example = (torch.zeros(b, rows, dtype=torch.int64), torch.zeros(b, rows, spec.hidden),
               torch.zeros(b, dtype=torch.int64), torch.zeros(b, rows, dtype=torch.int64),
               torch.zeros(b, rows, graph.s_max, dtype=torch.bool),
               *[torch.zeros(b, spec.kv_heads, graph.s_max, spec.head_dim) for _ in range(2 * len(spec.layers))])
    if not symbolic_batch:
        return export_module(graph, example, *tree_graph_io(len(spec.layers)), opset)
    batch = {0: torch.export.Dim.DYNAMIC}
    # keyed by forward's argument names
    dims = {INPUT_IDS: batch, "features": batch, CACHE_LENGTH: batch, TREE_OFFSETS: batch,
            TREE_PAST_MASK: batch, "past": tuple(batch for _ in range(2 * len(spec.layers)))}
    return export_module(graph, example, *tree_graph_io(len(spec.layers)), opset, dims)


def build_chain_tree(ctx: HeadContext, spec, store, rows: int) -> tuple[str, object, dict[str, int]]:
    """Export and register the head's tree step of ``rows`` nodes, with entries at every batch
    size of the recipe over the same file; returns (batch-1 engine name, path, batched engine
    name -> batch)."""
    module = ChainTreeGraph(spec, ctx.target_taps, ctx.max_seq_len).eval()
    with ctx.step("export", f"{ctx.name} tree step t{rows}") as s:
        proto = export_chain_tree(module, rows, ctx.opset, symbolic_batch=bool(ctx.batches))
        s.detail = f"{len(proto.graph.node)} nodes"
    name, path = ctx.save_graph(proto, Role.TREE, rows, store)
    batched = {n: b for n, (b, _) in ctx.save_batched(proto, path, {rows: Role.TREE}, store).items()}
    return name, path, batched


def validate_chain_tree(ctx: HeadContext, reference, name: str, path, batched: dict[str, int], rows: int,
                        cache) -> None:
    """The tree step against the reference on each node's path. ``cache`` holds the catch-up
    rows of the builder's reference text (chain.validate_chain's); it is written past L. With
    L rows committed, level 1 is ``rows`` siblings under the last committed row (the text's next
    token among them), level 2 the children of two of them, written after level 1 (so a row that
    saw its siblings' or its cousins' slots would differ)."""
    from specexport.runtime.engine import EngineOptions
    from specexport.runtime.ort_engine import OrtEngine

    engine = OrtEngine(name, path, *ctx.builder.specs[name], EngineOptions(threads=ctx.threads))
    s_max = ctx.max_seq_len
    ids = ctx.reference_ids(s_max)  # [S]
    states = target_states(ctx, ids)
    length = min(s_max // 2, s_max - 2 * rows - 2)  # L: committed rows
    context = ids[1 : length + 1].tolist()  # rows 0..L-1: token x_{p+1}
    with torch.no_grad():
        _, hidden = reference.run(torch.tensor(context), states, None)  # [L, H]
    parity = Parity()
    with ctx.step("validate", f"{ctx.name} tree step") as s:
        level1 = [int(ids[length + 1 + i]) for i in range(rows)]  # distinct enough: the text's next tokens
        feeds = tree_step_feeds(cache.view(), rows, [TreeLevel(level1, np.repeat(hidden[-1:].numpy(), rows, 0),
                                                               length, length, length, [[] for _ in level1])])
        layers = len(cache.view()) // 2
        out = engine.run(feeds, [LOGITS, NEXT_TOKENS, HIDDEN_OUT, *present_names(layers)])
        cache.rows_store.write(out, [(0, length, rows)])  # level 1's K/V at L.. (present.* [1, n_kv, T, hd])
        paths = {i: ([level1[i]], [hidden[-1]], out[HIDDEN_OUT][0, i]) for i in range(rows)}
        _check_rows(reference, states, context, paths, out, range(rows), parity)
        # level 2: children of nodes 0 and 1 alternately, at slot L + rows onwards
        parents = [i % 2 for i in range(rows)]
        level2 = [int(ids[length + 2 + i]) for i in range(rows)]
        feeds = tree_step_feeds(cache.view(), rows, [TreeLevel(level2, np.stack([out[HIDDEN_OUT][0, p] for p in parents]),
                                                               length + rows, length + 1, length,
                                                               [[length + p] for p in parents])])
        out2 = engine.run(feeds, [LOGITS, NEXT_TOKENS, HIDDEN_OUT])
        deeper = {i: (paths[p][0] + [level2[i]], paths[p][1] + [torch.from_numpy(paths[p][2])], None)
                  for i, p in enumerate(parents)}
        _check_rows(reference, states, context, deeper, out2, range(rows), parity)
        figures = {**parity.to_dict(), "cache_lengths": [length], "levels": 2}
        ctx.record_parity(name, figures, reference=f"{reference.name}, each node's path")
        s.detail = f"{2 * rows} nodes on their paths, argmax agreement {figures['argmax_agreement']:.1%}"
    if batched:
        with ctx.step("validate", f"{ctx.name} batched tree steps") as s:
            for batched_name, batch in batched.items():
                big = OrtEngine(batched_name, path, *ctx.builder.specs[batched_name], EngineOptions(threads=ctx.threads))
                levels = batched_levels(batch, rows, s_max, ids, hidden.numpy())
                fed = tree_step_feeds(cache.view(), rows, levels)  # [B, ...] besides the cache
                parity, worst = check_batched_rows(
                    batched_name, big, engine, cache.view(),
                    [{k: v[b : b + 1] for k, v in fed.items() if k not in cache.view()} for b in range(batch)],
                    [0 if level is None else len(level.tokens) for level in levels],
                    [LOGITS, NEXT_TOKENS, HIDDEN_OUT, *present_names(len(cache.view()) // 2)], _draftable)
                ctx.record_parity(batched_name, {**parity.to_dict(), "max_rel_output_diff": worst},
                                  reference="the batch-1 tree step, row by row")
            s.detail = f"{len(batched)} batch sizes, each row its own level and cache length, against batch 1"


def batched_levels(batch: int, rows: int, s_max: int, ids: np.ndarray, hidden: np.ndarray) -> list[TreeLevel | None]:
    """The rows of a batched tree step's check: committed lengths spread over the cache, T, T-1,
    ... nodes, and from 3 rows on the last row idle. Even rows take a first level (siblings
    under the last committed row), odd rows a second one (under nodes 0 and 1 of a first level
    written after the committed rows), so the rows differ in positions, writes and masks.
    ``hidden`` [L, H]: the reference's own rows of the validation text (stand-in features)."""
    span = s_max - 3 * rows - 2  # a second level's rows fit past every committed length
    levels: list[TreeLevel | None] = []
    for r in range(batch):
        length, count = max(1, span * (r + 1) // batch), rows - r % rows
        tokens = [int(t) for t in ids[length + 1 : length + 1 + count]]
        features = hidden[np.arange(length - 1, length - 1 + count) % len(hidden)]  # [count, H]
        if batch > 2 and r == batch - 1:
            levels.append(None)  # idle: nothing read, nothing written
        elif r % 2 == 0:
            levels.append(TreeLevel(tokens, features, length, length, length, [[] for _ in tokens]))
        else:
            levels.append(TreeLevel(tokens, features, length + rows, length + 1, length,
                                    [[length + i % 2] for i in range(count)]))
    return levels


def _check_rows(reference, states, context: list[int], paths: dict, out: dict, rows, parity: Parity) -> None:
    """Row i of ``out`` against the reference over context + its path (tokens, own rows)."""
    for i in rows:
        tokens, own, _ = paths[i]
        with torch.no_grad():
            want, _ = reference.run(torch.tensor(context + tokens), states, torch.stack(own))
        parity.add(*_draftable(out[LOGITS][0, i : i + 1], want[-1:].numpy(), out[NEXT_TOKENS][0, i : i + 1]))
