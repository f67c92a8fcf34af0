"""`device: cuda` in a recipe: graphs whose every node onnxruntime's CUDA provider runs.

The runtime refuses a cuda session that places a computation on tensors on the CPU
(runtime/placement.py), so a graph with one node the CUDA provider has no kernel for is refused
when it is loaded. This module refuses such a recipe before anything is exported, gives the
defaults that avoid it (fp16 graphs with onnxruntime's GroupQueryAttention, whose CUDA kernel
runs fp16 and bf16 only), and lists in each graph the integer arithmetic onnxruntime may keep
on the CPU.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import onnx

from specexport.backends import TENSORRT
from specexport.exporter.lint import tensor_types
from specexport.runtime.placement import HOST_NODES

if TYPE_CHECKING:
    from specexport.exporter.recipe import Recipe

# what device: cuda means where the recipe names no precision or attention
CUDA_DEFAULTS = {"precision": "fp16", "attention": "ort-gqa"}
# the precisions onnxruntime's CUDA GroupQueryAttention runs
GQA_CUDA_PRECISIONS = ("fp16", "bf16")
# the element types of host arithmetic
_HOST_TYPES = frozenset({onnx.TensorProto.INT32, onnx.TensorProto.INT64, onnx.TensorProto.BOOL})
# ops that read only their input's shape, never its values
_SHAPE_READERS = frozenset({"Shape", "Size"})


def cuda_refusal(recipe: Recipe) -> str | None:
    """Why ``recipe``'s graphs would place a node on the CPU under onnxruntime's CUDA provider
    (one line, naming the field and the fix); None when every node runs on the GPU."""
    if TENSORRT in recipe.backends:
        return ("device: cuda builds onnxruntime graphs for its CUDA provider; TensorRT engines run on the GPU "
                "already: use backends: [onnxruntime], or drop device for a TensorRT build")
    gqa = recipe.attention == "ort-gqa"
    if gqa and recipe.precision not in GQA_CUDA_PRECISIONS:
        return (f"device: cuda with precision {recipe.precision} and attention ort-gqa: onnxruntime's CUDA "
                f"GroupQueryAttention runs fp16 or bf16 only, so that node would run on the CPU; "
                f"use precision: fp16 (the default for cuda) or bf16")
    if recipe.precision not in ("fp32", *GQA_CUDA_PRECISIONS):
        return (f"device: cuda with precision {recipe.precision}: quantized (MatMulNBits) graphs compute in fp32 "
                "and are built for the CPU; use precision: fp16 (the default for cuda)")
    if gqa and recipe.draft.tree.max_nodes > 0:
        return ("device: cuda with draft.tree: the ort-gqa target graph that also verifies trees gives every call "
                "GroupQueryAttention an attention bias, which onnxruntime's CUDA kernel runs unfused or refuses; "
                "drop draft.tree for a GPU build")
    for i, drafter in enumerate(recipe.drafters):
        own = getattr(drafter, "precision", None)
        if drafter.kind == "model" and gqa and own is not None and own not in GQA_CUDA_PRECISIONS:
            return (f"drafters.{i}.precision: {own} with device: cuda and attention ort-gqa would run the draft "
                    f"model's GroupQueryAttention on the CPU; leave it unset (the recipe's {recipe.precision})")
    return None


def mark_host_nodes(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with the nodes onnxruntime may keep on the CPU listed in its metadata
    (runtime/placement.py HOST_NODES): those that read and write only integers or booleans (or
    read only a shape), the shape and length arithmetic (cache length + tokens, ReduceMax,
    Cast) whose results CUDA kernels read from host memory, such as GroupQueryAttention's
    total_sequence_length. A node that reads or writes a float (ArgMax over the logits
    included) is a computation on tensors and must run on the GPU."""
    types = tensor_types(model)

    def integer(names) -> bool:
        return all(types.get(x) in _HOST_TYPES for x in names if x)

    host = sorted(n.name for n in model.graph.node
                  if n.output and integer(n.output) and (n.op_type in _SHAPE_READERS or integer(n.input)))
    kept = [p for p in model.metadata_props if p.key != HOST_NODES]
    del model.metadata_props[:]
    model.metadata_props.extend(kept)
    model.metadata_props.add(key=HOST_NODES, value=",".join(host))
    return model
