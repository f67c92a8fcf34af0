"""One-token calls run GroupQueryAttention on two query rows, the rest of the graph on one.

Where the machine's matmul kernels compute a row alone as they do inside a bigger call (the
probe, runtime/kernel_probe.py: AVX512-VNNI with 4-bit blocks of 16 or 32, or 8-bit blocks),
only the attention still differs: its one-token path multiplies probabilities by V through
sgemm's one-row branch. So instead of padding the whole graph (exporter/row_pad.py), each
GroupQueryAttention of a one-token call gets a second query row, a copy of the real one (its
Q, K and V "edge"-padded along the token axis), one position past it: its K/V land in the cache
one slot past the call's token, where row_pad's pad row lands too (the next call writes that
slot before anything reads it), and only the first row's output goes on. The pad is added only
where the cache has room, and to rows with tokens (row_pad.pad_count_nodes' rules).

A graph that verifies trees on the same graph (tree inputs) is padded in full instead:
exact_rows picks row_pad there.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from specexport.exporter.row_pad import pad_count_nodes

GQA = "GroupQueryAttention"
# GroupQueryAttention's inputs by position (com.microsoft opset 1)
QUERY, KEY, VALUE, SEQLENS_K, TOTAL, QUERY_SEQLENS = 0, 1, 2, 5, 6, 16
POSITION_IDS, ATTENTION_BIAS = 9, 10
MARK = "attnpad_pads"  # a graph already padded has this tensor


def has_tree_inputs(graph: onnx.GraphProto) -> bool:
    """Does any GroupQueryAttention take position ids or a bias (a tree's)?"""
    return any(n.op_type == GQA and any(len(n.input) > i and n.input[i] for i in (POSITION_IDS, ATTENTION_BIAS))
               for n in graph.node)


def pad_attention_rows(model: onnx.ModelProto, max_seq_len: int) -> None:
    """Rewrite ``model`` (an ort-gqa chain graph, symbolic batch and tokens) in place so that each
    GroupQueryAttention of a one-token call runs two query rows (see the module's docstring)."""
    graph = model.graph
    if any(MARK in n.output for n in graph.node):
        return
    if has_tree_inputs(graph):
        raise ValueError("pad_attention_rows: a tree graph's attention takes position ids and a bias; pad it in full")
    graph.initializer.extend([numpy_helper.from_array(np.zeros(4, dtype=np.int64), "attnpad_zeros4"),
                              numpy_helper.from_array(np.zeros(1, dtype=np.int64), "attnpad_zero")])
    head = pad_count_nodes(graph, max_seq_len)
    head += [
        helper.make_node("Concat", ["attnpad_zeros4", "rowpad_count", "attnpad_zero"], [MARK], axis=0),  # [6]
        helper.make_node("Cast", ["rowpad_count"], ["attnpad_count32"], to=onnx.TensorProto.INT32),  # [1]
        helper.make_node("Squeeze", ["attnpad_count32"], ["attnpad_count32_scalar"]),  # []
        helper.make_node("Cast", ["rowpad_added"], ["attnpad_added32"], to=onnx.TensorProto.INT32),  # [B]
    ]
    made: dict[str, str] = {}  # an input tensor -> its padded tensor, made once however many nodes read it
    body = list(graph.node)
    for node in body:
        if node.op_type != GQA:
            continue
        for index, how in ((QUERY, "rows"), (KEY, "rows"), (VALUE, "rows"), (SEQLENS_K, "added"),
                           (TOTAL, "count"), (QUERY_SEQLENS, "added")):
            if len(node.input) <= index or not node.input[index]:
                continue
            name = node.input[index]
            if name not in made:
                made[name] = f"{name}__attnpad"
                head.append(_padded(name, made[name], how))
            node.input[index] = made[name]
        out = node.output[0]  # [B, T + pad, H·hd] -> the first T rows
        node.output[0] = f"{out}__attnpad"
        head.append(helper.make_node("Slice", [node.output[0], "rowpad_zero", "rowpad_tokens", "rowpad_one"], [out]))
    del graph.node[:]
    graph.node.extend(_sorted(head + body, graph))  # the new nodes read the layers' tensors: sort


def _sorted(nodes: list[onnx.NodeProto], graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    """``nodes`` in an order where each runs after what it reads (stable: a node stays as early
    as its inputs let it, so the graph's own order is kept)."""
    ready = {i.name for i in graph.input} | {t.name for t in graph.initializer} | {""}
    pending, ordered = list(nodes), []
    while pending:
        waiting = []
        for node in pending:
            if all(name in ready for name in node.input):
                ordered.append(node)
                ready.update(node.output)
            else:
                waiting.append(node)
        if len(waiting) == len(pending):
            raise ValueError(f"pad_attention_rows: no order runs {waiting[0].op_type} {waiting[0].name}")
        pending = waiting
    return ordered


def _padded(name: str, padded: str, how: str) -> onnx.NodeProto:
    """The node making ``padded`` from ``name``: its last token row repeated rowpad_count times
    ("rows", [B, T, D] -> [B, T + pad, D]); plus the pad for each busy row ("added", [B] int32);
    plus the pad ("count", the total length [] int32)."""
    if how == "rows":
        return helper.make_node("Pad", [name, MARK], [padded], mode="edge")
    if how == "added":
        return helper.make_node("Add", [name, "attnpad_added32"], [padded])
    return helper.make_node("Add", [name, "attnpad_count32_scalar"], [padded])
