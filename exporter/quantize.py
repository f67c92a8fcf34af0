"""int4 weight-only copies of a graph through onnxruntime's MatMulNBits quantizer.

Every MatMul whose weight is an initializer becomes a MatMulNBits node (blockwise int4 with
per-block scales). The embedding Gather stays fp32 (a lookup reads one row per token). The
output head is quantized only when asked: in the standard graph it is a Gemm, rewritten as a
MatMul first (``gemm_heads_to_matmul``); in the ort-gqa graph it is already a MatMul, kept fp32
with ``keep_head``.
"""

from __future__ import annotations

import logging

import onnx

from specexport.exporter.graph_model import HEAD_WEIGHT

# Weights that stay fp32: the rotary rotate-half matrix (entries 0 and ±1 must stay exact, and
# it is tiny).
KEEP_FP32 = ("rope_rotate",)


def quantize_int4(model: onnx.ModelProto, block_size: int, symmetric: bool, accuracy_level: int | None,
                  keep_head: bool = False) -> onnx.ModelProto:
    """``keep_head``: leave a MatMul output head (graph_model.HEAD_WEIGHT) in fp32."""
    from onnxruntime.quantization.matmul_nbits_quantizer import (
        DefaultWeightOnlyQuantConfig,
        MatMulNBitsQuantizer,
    )

    config = DefaultWeightOnlyQuantConfig(
        block_size=block_size,
        is_symmetric=symmetric,
        accuracy_level=accuracy_level,
        op_types_to_quantize=("MatMul",),
        bits=4,
    )
    kept = (*KEEP_FP32, HEAD_WEIGHT) if keep_head else KEEP_FP32
    keep = [n.name for n in model.graph.node if n.op_type == "MatMul" and any(w in kept for w in n.input)]
    quantizer = MatMulNBitsQuantizer(
        model,
        bits=4,
        block_size=block_size,
        is_symmetric=symmetric,
        accuracy_level=accuracy_level,
        nodes_to_exclude=keep,
        algo_config=config,
    )
    logger = logging.getLogger("onnxruntime.quantization")
    level = logger.level
    logger.setLevel(logging.ERROR)  # it logs every node it visits
    try:
        quantizer.process()
    finally:
        logger.setLevel(level)
    return quantizer.model.model


def count_quantized(model: onnx.ModelProto) -> int:
    return sum(node.op_type == "MatMulNBits" for node in model.graph.node)


def gemm_heads_to_matmul(model: onnx.ModelProto) -> int:
    """Rewrite Gemm(x, W, transB=1) with a constant W and no bias as MatMul(x, Wᵀ), so the
    quantizer (which handles MatMul) reaches the output head too. Returns how many."""
    from onnx import numpy_helper

    inits = {t.name: t for t in model.graph.initializer}
    changed = 0
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
        changed += 1
    return changed
