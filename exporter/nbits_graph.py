"""A lighter MatMulNBits graph: sibling projections fused along N, and Q4_1's offsets as reductions.

On the CPU a decode step of a small model is mostly per-node overhead, so the nodes a quantized
graph adds around its MatMulNBits cost more than their arithmetic (SmolLM2-135M at int4: the
Q4_1 offsets were about 420 of the graph's 794 nodes). Two rewrites cut them:

- ``fuse_siblings``: MatMulNBits nodes reading the same input with the same K, bits, block size
  and accuracy level (gate and up; q, k and v where a graph keeps them apart) become one node
  over the rows of all of them (concatenated along N), then a Split. Blocks run along K within
  one output row, so concatenating rows keeps every row's codes, scales and zero points as they
  were: the kernel computes each output column the same way, one node or several.
- ``add_offset_terms``: Q4_1's per-block offset m (w = d·q + m) as x·m = Σ_blocks m_b·sum(x_b):
  the input's block sums by one pooling node (no dense [K, K/32] 0/1 MatMul), then one small
  MatMul by the offsets [K/32, N] and an Add.

Why the offsets stay beside the kernel: MatMulNBits' integer zero points give d·(q − z) with z
in 0..15, which is d·q + m only where m/d is a whole number in that range; Q4_1's m is its
block's minimum and d its range / 15, so m/d almost never is. Float zero points (z = −m/d) are
accepted, but round d·(q + m/d) differently from d·q + m and send the CPU to a path 6-20× slower
per call (gguf_blocks.py).
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import onnx
from onnx import helper, numpy_helper

from specexport.exporter.gguf_blocks import BLOCK

FUSED_ATTRS = ("K", "bits", "block_size", "accuracy_level")  # what siblings must share


def _attrs(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def node_source(node: onnx.NodeProto) -> str:
    """The weight a MatMulNBits node computes with: the quantizer names B ``<weight>_Q<bits>``;
    a fused node's weight is its members' names joined by ``+``."""
    return node.input[1].rsplit("_Q", 1)[0]


def fuse_siblings(model: onnx.ModelProto, offsets: dict[str, np.ndarray]) -> list[list[str]]:
    """Fuse the MatMulNBits nodes that read one input alike (see the module's docstring) into one
    node and a Split, in place. ``offsets``: Q4_1 offsets [N, K/32] by weight, updated to the fused
    weights' (members fuse only when all or none carry offsets). Returns the fused groups' weights."""
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    uses: dict[str, int] = defaultdict(int)
    for node in graph.node:
        for name in node.input:
            uses[name] += 1
    groups: dict[tuple, list[onnx.NodeProto]] = defaultdict(list)
    for node in graph.node:
        if node.op_type != "MatMulNBits" or len(node.input) > 4 or not _owns_its_weights(node, inits, uses):
            continue
        attrs = _attrs(node)
        key = (node.input[0], *(attrs.get(a) for a in FUSED_ATTRS), len(node.input) == 4 and bool(node.input[3]),
               node_source(node) in offsets)
        groups[key].append(node)
    fused = []
    for members in groups.values():
        if len(members) > 1:
            fused.append(_fuse(graph, members, inits, offsets))
    return fused


def _owns_its_weights(node: onnx.NodeProto, inits: dict, uses: dict[str, int]) -> bool:
    """B, scales and zero points are initializers that no other node reads (a kept 8-bit head's
    blocks may feed the embedding's GatherBlockQuantized too)."""
    return all(name in inits and uses[name] == 1 for name in node.input[1:] if name)


def _fuse(graph: onnx.GraphProto, members: list[onnx.NodeProto], inits: dict,
          offsets: dict[str, np.ndarray]) -> list[str]:
    sources = [node_source(n) for n in members]
    name = "+".join(sources)
    widths = [_attrs(n)["N"] for n in members]
    bits = _attrs(members[0])["bits"]
    inputs = [members[0].input[0]]
    for i, suffix in ((1, f"_Q{bits}"), (2, "_scales"), (3, "_zero_points")):
        if i >= len(members[0].input):
            break
        # B [N, K/bs, blob], scales [N, K/bs] and zero points [N, ...] (or flat): N is outermost in each
        parts = [numpy_helper.to_array(inits[n.input[i]]) for n in members]
        graph.initializer.append(numpy_helper.from_array(np.concatenate(parts, axis=0), f"{name}{suffix}"))
        inputs.append(f"{name}{suffix}")
        for n in members:
            graph.initializer.remove(inits.pop(n.input[i]))
    if sources[0] in offsets:
        offsets[name] = np.concatenate([offsets.pop(s) for s in sources], axis=0)  # [sum N, K/32]
    out = f"{members[0].output[0]}__fused"
    attrs = {**_attrs(members[0]), "N": int(sum(widths))}
    split_sizes = f"{name}__split"
    graph.initializer.append(numpy_helper.from_array(np.array(widths, dtype=np.int64), split_sizes))
    nodes = list(graph.node)
    at = min(nodes.index(n) for n in members)
    outputs = [n.output[0] for n in members]
    for n in members:
        graph.node.remove(n)
    graph.node.insert(at, helper.make_node("MatMulNBits", inputs, [out], name=f"{members[0].name}__fused",
                                           domain="com.microsoft", **attrs))  # [B, T, sum N]
    graph.node.insert(at + 1, helper.make_node("Split", [out, split_sizes], outputs, axis=-1))  # [B, T, N] each
    return sources


def add_offset_terms(model: onnx.ModelProto, offsets: dict[str, np.ndarray]) -> None:
    """After each MatMulNBits whose weight carries Q4_1 offsets [N, K/32] (by ``node_source``),
    add x·m: the input's block sums [.., K/32] times the offsets [K/32, N] (one small fp32 MatMul;
    a thirty-second of the weight's size), then an Add. An input read by several such nodes is
    summed once (``_block_sums``)."""
    graph = model.graph
    sums: dict[str, tuple[str, float]] = {}  # input tensor -> (its block sums, what they are scaled by)
    for node in [n for n in graph.node if n.op_type == "MatMulNBits" and node_source(n) in offsets]:
        source = node_source(node)
        x, y = node.input[0], node.output[0]
        new: list[onnx.NodeProto] = []
        if x not in sums:
            nodes, scale = _block_sums(graph, x, _attrs(node)["K"])
            sums[x] = (f"{x}__block_sums", scale)
            new += nodes
        name, scale = sums[x]
        table = offsets[source].T.astype(np.float32) * np.float32(scale)  # [K/32, N]; × 32: exact
        graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(table), f"{source}_offsets"))
        node.output[0] = f"{y}__codes"
        new += [helper.make_node("MatMul", [name, f"{source}_offsets"], [f"{y}__offsets"]),  # [B, T, N]
                helper.make_node("Add", [f"{y}__codes", f"{y}__offsets"], [y])]
        at = list(graph.node).index(node) + 1
        for i, extra in enumerate(new):
            graph.node.insert(at + i, extra)


def _block_sums(graph: onnx.GraphProto, x: str, k: int) -> tuple[list[onnx.NodeProto], float]:
    """Nodes computing ``x``'s sums over each block of 32 as ``{x}__block_sums`` [.., K/32], and
    the factor the sums come out divided by (the offsets are scaled by it).

    A [B, T, K] input (every projection input of our graphs): one AveragePool over the last
    axis, whose means are the sums / 32 exactly (a power of two), and whose sums round as the
    dense 0/1 MatMul this replaces did (the same outputs, bit for bit, on SmolLM2). Any other
    rank: a Reshape to [.., K/32, 32] and a ReduceSum (two nodes; its sums round differently)."""
    out = f"{x}__block_sums"
    rank = _rank(graph, x) or 3  # unrecorded: [batch, tokens, features], as every graph of ours
    if rank == 3:
        return [helper.make_node("AveragePool", [x], [out], kernel_shape=[BLOCK], strides=[BLOCK])], float(BLOCK)
    shape, axis = f"gguf_blocks_of_{k}_rank{rank}", "gguf_block_axis"
    have = {t.name for t in graph.initializer}
    if shape not in have:  # 0 keeps a leading dimension
        graph.initializer.append(numpy_helper.from_array(
            np.array([0] * (rank - 1) + [k // BLOCK, BLOCK], dtype=np.int64), shape))
    if axis not in have:
        graph.initializer.append(numpy_helper.from_array(np.array([-1], dtype=np.int64), axis))
    return [helper.make_node("Reshape", [x, shape], [f"{x}__blocks"]),  # [.., K/32, 32]
            helper.make_node("ReduceSum", [f"{x}__blocks", axis], [out], keepdims=0)], 1.0  # [.., K/32]


def _rank(graph: onnx.GraphProto, name: str) -> int | None:
    """``name``'s rank where the graph records it (value_info or an input), else None."""
    for info in (*graph.value_info, *graph.input):
        if info.name == name and info.type.tensor_type.HasField("shape"):
            return len(info.type.tensor_type.shape.dim)
    return None


def lighten(model: onnx.ModelProto, offsets: dict[str, np.ndarray]) -> list[list[str]]:
    """Both rewrites, in place: siblings fused, then the offsets of the (fused) weights added.
    ``offsets`` is consumed (keyed by the fused weights afterwards). Returns the fused groups."""
    fused = fuse_siblings(model, offsets)
    add_offset_terms(model, offsets)
    return fused
