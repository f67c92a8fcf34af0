"""int4 weight-only copies of a graph through onnxruntime's MatMulNBits quantizer.

Every MatMul whose weight is an initializer becomes a MatMulNBits node (blockwise int4 with
per-block scales). The embedding Gather stays fp32 (a lookup reads one row per token). The
output head is quantized only when asked: in the standard graph it is a Gemm, rewritten as a
MatMul first (``gemm_heads_to_matmul``); in the ort-gqa graph it is already a MatMul, kept fp32
with ``keep_head``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import numpy_helper

from specexport.exporter.gguf_blocks import BLOCK, DEFAULT_ZERO_POINT, Blocks, RowIndex
from specexport.exporter.graph_model import HEAD_WEIGHT
from specexport.exporter.nbits_graph import lighten, node_source

# Weights that stay fp32: the rotary rotate-half matrix (entries 0 and ±1 must stay exact, and
# it is tiny; the target graph calls it rope_rotate, a head's graph rotate).
KEEP_FP32 = ("rope_rotate", "rotate")
EMBEDDING_BITS = 8  # a drafter head's embedding table, gathered from blocks (exactly Q8_0's values)


@dataclass(frozen=True)
class WeightQuant:
    """How a graph's MatMul weights become MatMulNBits: the body at ``bits``, the output head
    at ``head_bits`` (None: kept fp32)."""

    bits: int
    block_size: int
    symmetric: bool
    accuracy_level: int | None
    head_bits: int | None


def quantize_int4(model: onnx.ModelProto, block_size: int, symmetric: bool, accuracy_level: int | None,
                  keep_head: bool = False) -> onnx.ModelProto:
    """The quantized-self drafter's copy: every MatMul at 4 bits. ``keep_head``: leave a MatMul
    output head (graph_model.HEAD_WEIGHT) in fp32."""
    spec = WeightQuant(4, block_size, symmetric, accuracy_level, None if keep_head else 4)
    return quantize_weights(model, spec, heads=(HEAD_WEIGHT,))[0]


def quantize_weights(model: onnx.ModelProto, spec: WeightQuant, heads: tuple[str, ...] = (HEAD_WEIGHT,),
                     gguf: RowIndex | None = None, light: bool = True) -> tuple[onnx.ModelProto, list[dict]]:
    """``model`` with its MatMul weights quantized as ``spec`` says; ``heads``: the output
    head's weight names (a Gemm head is rewritten as a MatMul first). ``gguf``: the source's
    exact blocks, copied where a weight is one of them at the same bits and block size. Returns
    the model and a row per quantized weight (report_rows; a kept Q4_1 weight's row carries its
    ``offsets`` [N, K/32]). ``light``: siblings fused and the offsets added (nbits_graph.lighten);
    else one MatMulNBits per weight and no offset terms yet, for ``dequantized`` to read weight
    by weight before the caller lightens the graph."""
    heads = (*heads, *gemm_heads_to_matmul(model)) if spec.head_bits is not None else heads
    weights = _matmul_weights(model)  # initializer name -> [K, N] fp32, before quantization
    head_nodes = [n.name for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in heads]
    fixed = [n.name for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in KEEP_FP32]
    model = _run_quantizer(model, spec.bits, spec, exclude=head_nodes + fixed)
    if spec.head_bits is not None and head_nodes:
        model = _run_quantizer(model, spec.head_bits, spec, include=head_nodes)
    rows = []
    inits = {t.name: t for t in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type != "MatMulNBits":
            continue
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        source = node_source(node)  # the quantizer names B "<weight>_Q4"
        row = {"weight": source, "head": source in heads, "bits": attrs["bits"], "kept": False}
        found = gguf.find(weights[source].T) if gguf is not None and source in weights else None
        if found is not None:
            row.update(gguf=found.name, gguf_kind=found.kind)
            blocks = found.blocks()
            if blocks is None:
                row["why"] = found.why_not()
            elif blocks.bits != attrs["bits"] or attrs["block_size"] != BLOCK:
                row["why"] = (f"{blocks.type} is {blocks.bits}-bit blocks of {BLOCK}; the recipe asks "
                              f"{attrs['bits']}-bit blocks of {attrs['block_size']}")
            else:
                blocks = blocks.centered() if attrs["bits"] == 4 else blocks
                _copy_blocks(model, node, inits, blocks)
                row["kept"] = True
                if blocks.offsets is not None:
                    row["offsets"] = blocks.offsets  # [N, nb]
        rows.append(row)
    exact_8bit = {r["weight"] for r in rows if r["kept"] and r["bits"] == 8 and "offsets" not in r}
    for row in rows:
        if row["weight"] in exact_8bit and _gather_from_blocks(model, row["weight"]):
            row["embedding"] = "gathered from the same blocks"
    if light:
        lighten(model, {r["weight"]: r["offsets"] for r in rows if "offsets" in r})
    return model, rows


def quantize_head_graph(model: onnx.ModelProto, spec: WeightQuant) -> tuple[onnx.ModelProto, dict]:
    """A drafter head's graph (EAGLE-3, MTP, DFlash, DSpark) at ``spec``: every MatMul over a
    constant weight (its layer, fc and lm_head) as MatMulNBits at ``spec.bits``, and its
    embedding table, the largest constant a Gather reads, as 8-bit blocks along the hidden axis
    (GatherBlockQuantized; symmetric blocks of 32 reproduce a GGUF Q8_0 table bit for bit, and
    take a quarter of the fp32 table's memory). Returns the model and what it quantized."""
    gemm_heads_to_matmul(model)  # a block head's Gemm lm_head (its table then feeds the Gather alone)
    fixed = [n.name for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in KEEP_FP32]
    model = _run_quantizer(model, spec.bits, spec, exclude=fixed)
    embedded = _embedding_to_blocks(model, BLOCK)
    return model, {"bits": spec.bits, "block_size": spec.block_size, "symmetric": spec.symmetric,
                   "accuracy_level": spec.accuracy_level, "matmuls": count_quantized(model),
                   "embedding_bits": EMBEDDING_BITS if embedded else None}


def _embedding_to_blocks(model: onnx.ModelProto, block: int) -> bool:
    """Replace the Gather of the largest 2-D constant table [V, H] (axis 0) with
    GatherBlockQuantized over symmetric 8-bit blocks of ``block`` along H. Returns whether it did."""
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    tables = [n for n in graph.node if n.op_type == "Gather" and n.input[0] in inits
              and len(inits[n.input[0]].dims) == 2 and inits[n.input[0]].dims[1] % block == 0
              and next((a.i for a in n.attribute if a.name == "axis"), 0) == 0]
    if not tables:
        return False
    gather = max(tables, key=lambda n: int(np.prod(inits[n.input[0]].dims)))
    name = gather.input[0]
    if sum(name in n.input for n in graph.node) != 1:
        return False  # the table feeds something else too: leave it whole
    table = numpy_helper.to_array(inits[name]).astype(np.float32)  # [V, H]
    vocab, hidden = table.shape
    blocks = table.reshape(vocab, hidden // block, block)  # [V, H/32, 32]
    amax = np.abs(blocks).max(axis=-1)  # [V, H/32]
    scales = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
    codes = np.clip(np.rint(blocks / scales[..., None]), -127, 127).astype(np.int16) + 128  # zero point 128
    graph.initializer.extend([
        numpy_helper.from_array(codes.reshape(vocab, hidden).astype(np.uint8), f"{name}_codes"),  # [V, H]
        numpy_helper.from_array(scales, f"{name}_scales"),  # [V, H/32]
        numpy_helper.from_array(np.full((vocab, hidden // block), 128, dtype=np.uint8), f"{name}_zero_points"),
    ])
    index = list(graph.node).index(gather)
    graph.node.remove(gather)
    graph.node.insert(index, onnx.helper.make_node(
        "GatherBlockQuantized", [f"{name}_codes", gather.input[1], f"{name}_scales", f"{name}_zero_points"],
        list(gather.output), domain="com.microsoft", gather_axis=0, quantize_axis=1, block_size=block,
        bits=EMBEDDING_BITS))  # [..., H]
    graph.initializer.remove(inits[name])
    return True


def _gather_from_blocks(model: onnx.ModelProto, source: str) -> bool:
    """Where the embedding gathers rows of ``source`` (a tied head, [hidden, V], axis 1) and the
    head's 8-bit blocks hold it exactly (kept GGUF blocks), gather the embedding from those
    blocks instead (GatherBlockQuantized: the same values, bit for bit), and drop the fp32 table:
    SmolLM2's 113 MB embedding becomes 28 MB of codes. Returns whether it did."""
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    head = next((n for n in graph.node if n.op_type == "MatMulNBits" and n.input[1] == f"{source}_Q8"), None)
    gathers = [n for n in graph.node if n.op_type == "Gather" and n.input[0] == source]
    if head is None or len(gathers) != 1 or len(head.input) < 4 or source not in inits:
        return False
    gather = gathers[0]
    axis = next((a.i for a in gather.attribute if a.name == "axis"), 0)
    if axis != 1 or any(source in n.input for n in graph.node if n is not gather):
        return False
    codes = numpy_helper.to_array(inits[head.input[1]])  # [V, K/32, 32]
    vocab = codes.shape[0]
    graph.initializer.append(numpy_helper.from_array(codes.reshape(vocab, -1), f"{source}_codes_by_row"))  # [V, K]
    rows = f"{gather.output[0]}__rows"
    block = next(a.i for a in head.attribute if a.name == "block_size")
    index = list(graph.node).index(gather)
    graph.node.remove(gather)
    graph.node.insert(index, onnx.helper.make_node(
        "GatherBlockQuantized", [f"{source}_codes_by_row", gather.input[1], head.input[2], head.input[3]], [rows],
        domain="com.microsoft", gather_axis=0, quantize_axis=1, block_size=block, bits=8))  # [n, hidden]
    graph.node.insert(index + 1, onnx.helper.make_node("Transpose", [rows], [gather.output[0]], perm=[1, 0]))  # [hidden, n]
    graph.initializer.remove(inits[source])
    return True


def _matmul_weights(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    inits = {t.name: t for t in model.graph.initializer}
    return {n.input[1]: numpy_helper.to_array(inits[n.input[1]]) for n in model.graph.node
            if n.op_type == "MatMul" and n.input[1] in inits and len(inits[n.input[1]].dims) == 2}


def _run_quantizer(model: onnx.ModelProto, bits: int, spec: WeightQuant, exclude: list[str] | None = None,
                   include: list[str] | None = None) -> onnx.ModelProto:
    from onnxruntime.quantization.matmul_nbits_quantizer import (
        DefaultWeightOnlyQuantConfig,
        MatMulNBitsQuantizer,
    )

    config = DefaultWeightOnlyQuantConfig(block_size=spec.block_size, is_symmetric=spec.symmetric,
                                          accuracy_level=spec.accuracy_level, op_types_to_quantize=("MatMul",),
                                          bits=bits)
    quantizer = MatMulNBitsQuantizer(model, bits=bits, block_size=spec.block_size, is_symmetric=spec.symmetric,
                                     accuracy_level=spec.accuracy_level, nodes_to_exclude=exclude or [],
                                     nodes_to_include=include, algo_config=config)
    logger = logging.getLogger("onnxruntime.quantization")
    level = logger.level
    logger.setLevel(logging.ERROR)  # it logs every node it visits
    try:
        quantizer.process()
    finally:
        logger.setLevel(level)
    return quantizer.model.model


def _copy_blocks(model: onnx.ModelProto, node: onnx.NodeProto, inits: dict, blocks: Blocks) -> None:
    """Overwrite the node's codes, scales and zero points with the GGUF blocks (rows in the
    graph's order): B [N, K/32, 32·bits/8], scales [N, K/32], zero points per block."""
    codes = blocks.codes  # [N, K]
    scales = blocks.scales  # [N, nb]
    n, k = codes.shape
    nb = k // BLOCK
    if blocks.bits == 4:
        pairs = codes.reshape(n, nb, BLOCK // 2, 2)
        packed = (pairs[..., 0] | (pairs[..., 1] << 4)).astype(np.uint8)  # [N, nb, 16]: low nibble first
        zero = np.full((n, (nb + 1) // 2), blocks.zero_point | (blocks.zero_point << 4), dtype=np.uint8)
    else:
        packed = codes.reshape(n, nb, BLOCK).astype(np.uint8)  # [N, nb, 32]
        zero = np.full((n, nb), blocks.zero_point, dtype=np.uint8)
    _set(inits, node.input[1], packed)
    _set(inits, node.input[2], scales.astype(np.float32))
    default = blocks.zero_point == DEFAULT_ZERO_POINT[blocks.bits]
    if len(node.input) > 3 and node.input[3] and default and blocks.bits == 4:
        # no zero-point input: the kernel's faster path (gguf_blocks.Blocks.centered), same weights
        model.graph.initializer.remove(inits.pop(node.input[3]))
        if len(node.input) == 4:
            del node.input[3]
        else:  # g_idx or a bias follows: keep its position
            node.input[3] = ""
    elif len(node.input) > 3 and node.input[3]:
        _set(inits, node.input[3], zero)
    elif not default:  # a symmetric recipe's node: the default would be 2^(bits-1)
        name = f"{node.input[1]}_gguf_zero_points"
        model.graph.initializer.append(numpy_helper.from_array(zero, name))
        node.input.append(name)


def _set(inits: dict, name: str, value: np.ndarray) -> None:
    tensor = inits[name]
    if tuple(tensor.dims) != value.shape:
        raise ValueError(f"{name}: GGUF blocks of shape {value.shape} do not fit {tuple(tensor.dims)}")
    tensor.CopyFrom(numpy_helper.from_array(value, name))


def dequantized(model: onnx.ModelProto, offsets: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """Each MatMulNBits node's weight as the kernel sees it: source weight name -> [K, N] fp32
    (the validation reference's weights); ``offsets``: Q4_1 blocks' per-block offsets [N, K/32]
    by source weight, added (the graph adds them beside the kernel)."""
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    out = {}
    for node in model.graph.node:
        if node.op_type != "MatMulNBits":
            continue
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        bits, bs, k, n = attrs["bits"], attrs["block_size"], attrs["K"], attrs["N"]
        raw = inits[node.input[1]]  # [N, nb, blob]
        if bits == 4:
            codes = np.stack([raw & 0x0F, raw >> 4], axis=-1).reshape(n, -1)  # [N, nb·bs]
        else:
            codes = raw.reshape(n, -1)
        nb = raw.shape[1]
        if len(node.input) > 3 and node.input[3]:
            zp = inits[node.input[3]]
            zero = (np.stack([zp & 0x0F, zp >> 4], axis=-1).reshape(n, -1)[:, :nb] if bits == 4
                    else zp.reshape(n, nb)).astype(np.float32)
        else:
            zero = np.full((n, nb), 1 << (bits - 1), dtype=np.float32)
        scales = inits[node.input[2]].reshape(n, nb)
        w = (codes.reshape(n, nb, bs).astype(np.float32) - zero[:, :, None]) * scales[:, :, None]
        source = node_source(node)  # a fused node's: its weights joined by "+"
        if offsets and source in offsets:
            w = w + offsets[source][:, :, None]
        out[source] = np.ascontiguousarray(w.reshape(n, nb * bs)[:, :k].T)  # [K, N]
    return out


def report_rows(rows: list[dict], kind_of) -> dict[str, dict]:
    """Per tensor kind (``kind_of(row)``): how many weights, how many kept from the GGUF, and why
    the others were requantized."""
    kinds: dict[str, dict] = {}
    for row in rows:
        entry = kinds.setdefault(kind_of(row), {"weights": 0, "kept": 0, "bits": row["bits"], "why": set()})
        entry["weights"] += 1
        entry["kept"] += row["kept"]
        if not row["kept"] and row.get("why"):
            entry["why"].add(row["why"])
    return {k: {**v, "why": sorted(v["why"])} for k, v in sorted(kinds.items())}


def count_quantized(model: onnx.ModelProto) -> int:
    return sum(node.op_type == "MatMulNBits" for node in model.graph.node)


def gemm_heads_to_matmul(model: onnx.ModelProto) -> list[str]:
    """Rewrite Gemm(x, W, transB=1) with a constant W and no bias as MatMul(x, Wᵀ), so the
    quantizer (which handles MatMul) reaches the output head too. Returns the new weights' names."""
    inits = {t.name: t for t in model.graph.initializer}
    changed = []
    for node in model.graph.node:
        attrs = {a.name: a for a in node.attribute}
        if (node.op_type != "Gemm" or len(node.input) != 2 or node.input[1] not in inits
                or attrs.get("transB") is None or attrs["transB"].i != 1
                or ("transA" in attrs and attrs["transA"].i) or any(
                    k in attrs and attrs[k].f != 1.0 for k in ("alpha", "beta"))):
            continue
        weight = numpy_helper.to_array(inits[node.input[1]])  # [V, hidden]
        name = f"{node.input[1]}_transposed"
        model.graph.initializer.append(numpy_helper.from_array(weight.T.copy(), name))  # [hidden, V]
        node.op_type = "MatMul"
        del node.attribute[:]
        node.input[1] = name
        changed.append(name)
    return changed
