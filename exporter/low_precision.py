"""fp16 and bf16 onnxruntime graphs: the exported fp32 graph cast to a 16-bit float.

The cast is the TensorRT build's (trt_build.cast_precision: norms' statistics and rotary
angles stay fp32), with one difference: the KV cache inputs and outputs take the low type too,
because onnxruntime's GroupQueryAttention reads and updates the cache in place in its own
type (its CUDA kernel runs fp16 and bf16 only). Logits and tapped hidden states stay fp32: the
runtime's sampling and the drafter heads read them as they are.

What the CPU onnxruntime (1.32) runs of these graphs, measured on the tiny llama: fp16 graphs
load and run (its fp16 kernels, and fp32 ones behind casts it inserts where it has none), so
the build validates them here; bf16 graphs do not load (no bf16 kernel for Div, among others).
The build validates every graph on onnxruntime's CPU provider (onnxruntime-gpu's too), with
host numpy caches (numpy has no bfloat16 of its own), so a bf16 build is refused in one line
(``bf16_refusal``) until validation runs on the CUDA provider through the device cache store.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from specexport.contract import is_kv
from specexport.exporter.recipe import LOW_PRECISIONS
from specexport.exporter.trt_build import cast_precision

_ELEMENT_TYPE = {"fp16": onnx.TensorProto.FLOAT16, "bf16": onnx.TensorProto.BFLOAT16}


def kv_dtype(precision: str) -> str:
    """The KV cache's numpy dtype name for graphs of ``precision`` (bfloat16: ml_dtypes')."""
    if precision not in LOW_PRECISIONS:
        return "float32"
    return np.dtype(helper.tensor_dtype_to_np_dtype(_ELEMENT_TYPE[precision])).name


def low_precision_graph(model: onnx.ModelProto, precision: str) -> onnx.ModelProto:
    """``model`` computing in ``precision`` (fp16 | bf16), its KV cache in that type too."""
    cache = frozenset(v.name for v in [*model.graph.input, *model.graph.output]
                      if is_kv(v.name))
    return cast_precision(model, precision, low_io=cache)


def bf16_refusal(precision: str) -> str | None:
    """Why the build cannot validate graphs of ``precision``; None when it can."""
    if precision != "bf16":
        return None
    return ("precision bf16: the build validates every graph on onnxruntime's CPU provider, which has no bf16 "
            "kernels for them (validating on the CUDA provider of onnxruntime-gpu, specexport[cuda], is not built "
            "yet); use precision: fp16")
