"""int4 weight-only copies of a graph through onnxruntime's MatMulNBits quantizer.

Every MatMul whose weight is an initializer becomes a MatMulNBits node (blockwise int4 with
per-block scales). The embedding Gather and the Gemm of the output head stay fp32: the head
decides which token the drafter proposes, and its error would cost acceptance.
"""

from __future__ import annotations

import logging

import onnx


def quantize_int4(model: onnx.ModelProto, block_size: int, symmetric: bool, accuracy_level: int | None) -> onnx.ModelProto:
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
    quantizer = MatMulNBitsQuantizer(
        model,
        bits=4,
        block_size=block_size,
        is_symmetric=symmetric,
        accuracy_level=accuracy_level,
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
