"""One-token calls of a quantized graph run as two tokens, so decode and verify agree bit for bit.

onnxruntime's MatMulNBits takes a one-row kernel when the matmul has a single row and another
path for more rows (measured: logits differ by up to 0.7 on SmolLM2 int4 at accuracy level 4,
and 7e-5 at level 1), while rows of a call with two or more rows are independent of how many
rows run (equal bit for bit at 2, 3, 6, 8, 16 and 42 rows). GroupQueryAttention, too, has a
path of its own for one token per sequence (batched decode rows differed from the same rows
verified). A target whose single-token decode and multi-token verify compute differently is
not lossless: greedy speculation would emit what the one-token decode never would. So the graph
pads a one-token call with a second token per row (token 0, counted in ``valid_tokens``) and
returns the first only: every call then takes the multi-token paths, and the target alone is
the same function as the target under speculation.

The pad row's K/V lands one position past the call's tokens, in the in-place cache (ort-gqa);
the next call writes that position before anything reads it (the cache length decides what
attention sees). Where that position is past the cache's end, no row is padded: the last
position of a full cache is the one place the one-row kernel still runs.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from specexport.contract import (
    AUX_HIDDEN_STATES,
    CACHE_LENGTH,
    INPUT_IDS,
    LOGITS,
    NEXT_TOKENS,
    TREE_MASK,
    TREE_OFFSETS,
    VALID_TOKENS,
)

PADDED = f"{INPUT_IDS}__padded"
VALID_PADDED = f"{VALID_TOKENS}__padded"
# outputs with a token axis at 1 ([B, T, ...]); the in-place presents have none
TOKEN_OUTPUTS = (LOGITS, NEXT_TOKENS, AUX_HIDDEN_STATES)


def pad_single_rows(model: onnx.ModelProto, max_seq_len: int) -> None:
    """Rewrite ``model`` (an ort-gqa graph with symbolic batch and tokens) in place so that a
    call of one row pads a second (see the module's docstring)."""
    graph = model.graph
    if any(n.output and n.output[0] == PADDED for n in graph.node):
        return
    nodes = pad_count_nodes(graph, max_seq_len)
    nodes += [
        helper.make_node("Concat", ["rowpad_zeros3", "rowpad_count"], ["rowpad_pads"], axis=0),  # [4]
        helper.make_node("Pad", [INPUT_IDS, "rowpad_pads"], [PADDED], mode="constant"),  # [B, T + pad]
        helper.make_node("Add", [VALID_TOKENS, "rowpad_added"], [VALID_PADDED]),  # [B]
    ]
    renamed = {INPUT_IDS: PADDED, VALID_TOKENS: VALID_PADDED}
    if TREE_OFFSETS in {i.name for i in graph.input}:  # a target that verifies trees on this graph
        nodes += _padded_tree_inputs(graph)
        renamed.update({TREE_OFFSETS: f"{TREE_OFFSETS}__padded", TREE_MASK: f"{TREE_MASK}__padded"})
    head = len(nodes)  # these run before the graph's own nodes; the slices after
    for node in graph.node:
        for i, name in enumerate(node.input):
            if name in renamed:
                node.input[i] = renamed[name]
    # each token output is computed over the padded rows, then cut back to the call's T
    outputs = {o.name for o in graph.output}
    for name in TOKEN_OUTPUTS:
        if name not in outputs:
            continue
        inner = f"{name}__padded"
        for node in graph.node:  # its producer and every consumer inside the graph read the padded rows
            for names in (node.output, node.input):
                for i, tensor in enumerate(names):
                    if tensor == name:
                        names[i] = inner
        nodes.append(helper.make_node("Slice", [inner, "rowpad_zero", "rowpad_tokens", "rowpad_one"], [name]))
    graph.node.extend(nodes[head:])
    for node in reversed(nodes[:head]):
        graph.node.insert(0, node)


def pad_count_nodes(graph: onnx.GraphProto, max_seq_len: int) -> list[onnx.NodeProto]:
    """Nodes (and their constants, added to ``graph``) computing what a pad adds to a call:
    rowpad_tokens [1] (the call's T), rowpad_count [1] (1 for a one-token call with room in the
    cache past it, else 0) and rowpad_added [B] (rowpad_count for each row with tokens, 0 for an
    idle row, which stays idle and writes nothing)."""
    consts = {
        "rowpad_two": np.array([2], dtype=np.int64),
        "rowpad_zero": np.array([0], dtype=np.int64),
        "rowpad_one": np.array([1], dtype=np.int64),
        "rowpad_zeros3": np.zeros(3, dtype=np.int64),
        "rowpad_seq": np.array([max_seq_len], dtype=np.int64),
    }
    graph.initializer.extend(numpy_helper.from_array(v, k) for k, v in consts.items())
    return [
        helper.make_node("Shape", [INPUT_IDS], ["rowpad_shape"]),  # [2]: B, T
        helper.make_node("Gather", ["rowpad_shape", "rowpad_one"], ["rowpad_tokens"], axis=0),  # [1]: T
        helper.make_node("Sub", ["rowpad_two", "rowpad_tokens"], ["rowpad_short"]),
        helper.make_node("Max", ["rowpad_short", "rowpad_zero"], ["rowpad_want"]),  # [1]: 1 for one token, else 0
        # room past the call's tokens in the cache: max_seq_len - (cache_length + T), at least 0
        helper.make_node("ReduceMax", [CACHE_LENGTH], ["rowpad_filled"], keepdims=1),  # [1]
        helper.make_node("Add", ["rowpad_filled", "rowpad_tokens"], ["rowpad_end"]),
        helper.make_node("Sub", ["rowpad_seq", "rowpad_end"], ["rowpad_room_signed"]),
        helper.make_node("Max", ["rowpad_room_signed", "rowpad_zero"], ["rowpad_room"]),
        helper.make_node("Min", ["rowpad_want", "rowpad_room"], ["rowpad_count"]),
        # the pad token counts as real in every row that has tokens (an idle row stays idle, writing
        # nothing): GroupQueryAttention's path for rows marked padding rounds differently from its
        # path for full rows, and int8 activations magnify that
        helper.make_node("Greater", [VALID_TOKENS, "rowpad_zero"], ["rowpad_busy"]),  # [B] bool
        helper.make_node("Cast", ["rowpad_busy"], ["rowpad_busy_count"], to=onnx.TensorProto.INT64),
        helper.make_node("Mul", ["rowpad_busy_count", "rowpad_count"], ["rowpad_added"]),  # [B]
    ]


def _padded_tree_inputs(graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    """The tree inputs of a graph that verifies trees too, padded with the call's pad row: its
    offset the last row's (the pad row's own position is never read), and a mask row and
    column of True. The real rows stay as they were: GroupQueryAttention masks causally by slot
    besides the bias, so no real row sees the pad row after it, and the pad row sees rows (no
    row of all -inf)."""
    graph.initializer.extend([numpy_helper.from_array(np.zeros(4, dtype=np.int64), "rowpad_zeros4"),
                              numpy_helper.from_array(np.array(True), "rowpad_true")])
    return [
        helper.make_node("Pad", [TREE_OFFSETS, "rowpad_pads"], [f"{TREE_OFFSETS}__padded"], mode="edge"),  # [B, T + pad]
        helper.make_node("Concat", ["rowpad_zeros4", "rowpad_count", "rowpad_count"], ["rowpad_mask_pads"], axis=0),
        helper.make_node("Pad", [TREE_MASK, "rowpad_mask_pads", "rowpad_true"], [f"{TREE_MASK}__padded"],
                         mode="constant"),  # [B, T + pad, T + pad]
    ]
