"""Trace a StaticDecoder to ONNX with static shapes, and keep one weights file per model.

Every graph of a model (prefill, verify, decode, probes) holds the same weights. Rather than
one external-data file per graph, ``WeightStore`` writes each distinct tensor once (keyed by
its bytes) into ``<model>.weights`` and points every graph's initializer at that offset.
"""

from __future__ import annotations

import hashlib
import io
import logging
import warnings
from contextlib import redirect_stdout
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import numpy_helper

from specexport.contract import (
    AUX_HIDDEN_STATES,
    CACHE_LENGTH,
    CHAIN_TREE_INPUTS,
    INPUT_IDS,
    TensorSpec,
    graph_inputs,
    graph_outputs,
)
from specexport.errors import SpecexportError
from specexport.exporter.graph_model import StaticDecoder

# Tensors at least this large go to the shared file; smaller ones stay inside the graph.
_EXTERNAL_MIN_BYTES = 1024
# Offsets aligned to pages so that runtimes can memory-map the file.
_ALIGN = 4096


def graph_io(num_layers: int, taps: tuple[int, ...] = (), valid_tokens: bool = False,
             state_layers: int = 0, tree: bool = False) -> tuple[list[str], list[str]]:
    """Input and output names, in the order StaticDecoder.forward takes and returns them.
    ``num_layers``: the layers with a KV cache; ``state_layers``: the linear-attention layers
    (a recurrent state: past_state.{j}.conv|recurrent in, present_state.{j}.* out); ``tree``: a
    tree verify graph."""
    return (graph_inputs(num_layers, valid_tokens, state_layers, tree),
            graph_outputs(num_layers, state_layers) + ([AUX_HIDDEN_STATES] if taps else []))


def tree_example(batch: int, tokens: int) -> tuple[torch.Tensor, ...]:
    """A chain as the example tree: offsets [B, T] and the causal mask [B, T, T]."""
    offsets = torch.arange(tokens, dtype=torch.int64).expand(batch, tokens).contiguous()  # [B, T]
    causal = torch.ones(tokens, tokens, dtype=torch.bool).tril().expand(batch, tokens, tokens).contiguous()
    return offsets, causal


def example_inputs(decoder: StaticDecoder, batch: int, tokens: int) -> tuple[torch.Tensor, ...]:
    ids = torch.zeros(batch, tokens, dtype=torch.int64)  # [B, T]
    cache_length = torch.zeros(batch, dtype=torch.int64)  # [B]
    tree = tree_example(batch, tokens) if decoder.tree else ()
    valid = (torch.full((batch,), tokens, dtype=torch.int64),) if decoder.takes_valid_tokens else ()  # [B]
    kv_shape = (batch, decoder.n_kv, decoder.max_seq_len, decoder.head_dim)
    past = [torch.zeros(kv_shape) for _ in range(2 * decoder.num_layers)]  # [B, n_kv, S_max, hd]
    layout = decoder.state_layout  # linear-attention layers: [B, C, K-1] and [B, Hv, dk, dv] each
    state = [torch.zeros(shape) for shape in layout.shapes(batch).values()] if layout is not None else []
    return (ids, cache_length, *tree, *valid, *past, *state)


# The symbolic dimensions of a shared graph (one graph per model for every size).
TOKENS_DIM = "tokens"
BATCH_DIM = "batch"
MAX_BATCH = 256


def export_tree_graph(decoder: StaticDecoder, tokens: int | None, opset: int, batch: int | None = 1) -> onnx.ModelProto:
    """A tree verify graph (decoder.tree): ``batch`` rows of T = ``tokens`` tree rows, every
    dimension static, or with ``tokens=None`` the row count symbolic (``TOKENS_DIM``, ort-gqa:
    one graph for every tree size, so a small tree runs only its own rows) and with
    ``batch=None`` the batch too (``BATCH_DIM``: every batch size shares the weights)."""
    inputs, outputs = graph_io(decoder.num_layers, decoder.taps, decoder.takes_valid_tokens, 0, tree=True)
    if tokens is not None and batch is not None:
        return export_module(decoder, example_inputs(decoder, batch, tokens), inputs, outputs, opset)
    # Traced at 2 rows of 4 tree rows (torch.export specializes sizes 0 and 1).
    t = torch.export.Dim(TOKENS_DIM, min=2, max=decoder.max_seq_len) if tokens is None else None
    b = torch.export.Dim(BATCH_DIM, min=1, max=MAX_BATCH) if batch is None else None
    rows = {0: b} if b is not None else {}
    per_token = {**rows, **({1: t} if t is not None else {})} or None
    # keyed by forward's argument names; the tree inputs (offsets [B, T], mask [B, T, T]) are
    # the first two of *inputs
    mask = {**rows, **({1: t, 2: t} if t is not None else {})} or None
    dims = {INPUT_IDS: per_token, CACHE_LENGTH: rows or None,
            "inputs": (per_token, mask, *((rows or None) for _ in range(len(inputs) - 4)))}
    example = example_inputs(decoder, 2 if batch is None else batch, 4 if tokens is None else tokens)
    return export_module(decoder, example, inputs, outputs, opset, dims)


def export_graph(decoder: StaticDecoder, batch: int | None, tokens: int | None, opset: int) -> onnx.ModelProto:
    """torch.export-based ONNX export of a decoder graph; every dimension static, or with
    ``tokens=None`` the token count symbolic (``TOKENS_DIM``) and with ``batch=None`` the batch
    too (``BATCH_DIM``): one graph serving every size. A model with linear-attention layers
    unrolls its recurrence over the tokens: its graphs are static (one per size)."""
    state_layers = decoder.state_layers
    inputs, outputs = graph_io(decoder.num_layers, decoder.taps, decoder.takes_valid_tokens, state_layers)
    if state_layers and (tokens is None or batch is None):
        raise ValueError(f"a model with linear-attention layers ({state_layers}) unrolls its recurrence over the "
                         "tokens: export it with a static batch and token count (one graph per size), not "
                         f"a symbolic {'token count' if tokens is None else 'batch'}")
    if tokens is not None and batch is not None:
        return export_module(decoder, example_inputs(decoder, batch, tokens), inputs, outputs, opset)
    # Traced at 2 rows of 4 tokens (torch.export specializes sizes 0 and 1).
    t = None if tokens is not None else {1: torch.export.Dim(TOKENS_DIM, min=1, max=decoder.max_seq_len)}
    b = torch.export.Dim(BATCH_DIM, min=1, max=MAX_BATCH) if batch is None else None
    rows = {0: b} if b is not None else None
    # keyed by forward's argument names (input_ids, cache_length, *inputs)
    dims = {INPUT_IDS: {**(t or {}), **(rows or {})} or None, CACHE_LENGTH: rows,
            "inputs": tuple(rows for _ in range(len(inputs) - 2))}
    example = example_inputs(decoder, 2 if batch is None else batch, 4 if tokens is None else tokens)
    return export_module(decoder, example, inputs, outputs, opset, dims)


def export_module(module: torch.nn.Module, example: tuple[torch.Tensor, ...], inputs: list[str],
                  outputs: list[str], opset: int, dynamic_shapes: dict | None = None) -> onnx.ModelProto:
    """torch.export-based ONNX export of any module (decoders, drafter heads): the example
    inputs fix every dimension, but those ``dynamic_shapes`` (torch.export's form, by forward's
    argument names) makes symbolic; ``inputs``/``outputs`` name them in forward's order."""
    # The exporter narrates each stage on stdout and warns about unrelated optional
    # packages; our own progress display says what is happening.
    quiet_loggers = [logging.getLogger(n) for n in ("torch.onnx", "torch.export", "onnxscript", "onnx_ir")]
    levels = [lg.level for lg in quiet_loggers]
    try:
        for lg in quiet_loggers:
            lg.setLevel(logging.ERROR)
        with warnings.catch_warnings(), redirect_stdout(io.StringIO()), torch.no_grad():
            warnings.simplefilter("ignore")
            traced = module
            if dynamic_shapes is not None:
                # torch.onnx.export turns the tuple of a *args entry into a list, which
                # torch.export then refuses: export first, then translate the program.
                traced = torch.export.export(module, example, dynamic_shapes=dynamic_shapes)
            program = torch.onnx.export(
                traced,
                example,
                None,
                input_names=inputs,
                output_names=outputs,
                opset_version=opset,
                dynamo=True,
                optimize=True,
                verbose=False,
            )
    finally:
        for lg, level in zip(quiet_loggers, levels):
            lg.setLevel(level)
    model = program.model_proto
    _drop_unused_optional_outputs(model)
    if dynamic_shapes is not None:
        _name_symbolic_dims(model)
    return model


def _name_symbolic_dims(model: onnx.ModelProto) -> None:
    """torch names a symbolic size after its symbol (s70); give the graph's inputs and
    outputs the dimension's own name: ``BATCH_DIM`` on axis 0, ``TOKENS_DIM`` on axis 1 of
    input_ids."""
    ids = next(v for v in model.graph.input if v.name == INPUT_IDS).type.tensor_type.shape.dim
    names = {d.dim_param: name for d, name in zip(ids, (BATCH_DIM, TOKENS_DIM)) if d.dim_param}
    symbols = {d.dim_param for v in model.graph.input for d in v.type.tensor_type.shape.dim if d.dim_param}
    if not names or symbols - set(names):
        raise SpecexportError(f"a shared graph's symbolic sizes must be input_ids' batch and tokens; found {sorted(symbols)}")
    for value in [*model.graph.input, *model.graph.output, *model.graph.value_info]:
        for d in value.type.tensor_type.shape.dim:
            if d.dim_param in names:
                d.dim_param = names[d.dim_param]


# Fused onnxruntime kernels whose optional outputs we never read: (domain, op) -> output indices.
_OPTIONAL_OUTPUTS = {("com.microsoft", "SkipSimplifiedLayerNormalization"): (1, 2)}  # mean, 1/std


def drop_outputs(model: onnx.ModelProto, names: set[str]) -> None:
    """Remove graph outputs ``names`` and every node left computing nothing that is read (in
    place): a copy of a graph that needs fewer outputs (the int4 drafter needs no taps)."""
    kept = [value for value in model.graph.output if value.name not in names]
    del model.graph.output[:]
    model.graph.output.extend(kept)
    while True:
        used = {name for node in model.graph.node for name in node.input} | {v.name for v in model.graph.output}
        live = [node for node in model.graph.node if any(out in used for out in node.output if out)]
        if len(live) == len(model.graph.node):
            return
        del model.graph.node[:]
        model.graph.node.extend(live)


def _drop_unused_optional_outputs(model: onnx.ModelProto) -> None:
    """Blank the names of optional outputs nothing reads, so the kernel does not produce them
    (torch.onnx.ops.symbolic_multi_out names every output it declares)."""
    used = {name for node in model.graph.node for name in node.input}
    used |= {value.name for value in model.graph.output}
    for node in model.graph.node:
        for index in _OPTIONAL_OUTPUTS.get((node.domain, node.op_type), ()):
            if index < len(node.output) and node.output[index] not in used:
                node.output[index] = ""


class WeightStore:
    """One append-only weights file shared by all graphs of a model."""

    def __init__(self, path: Path):
        self.path = path
        self.location = path.name
        self._offsets: dict[str, tuple[int, int]] = {}  # sha256 -> (offset, length)
        self._fh = open(path, "wb")

    def close(self) -> None:
        self._fh.close()

    def _place(self, raw: bytes) -> tuple[int, int]:
        key = hashlib.sha256(raw).hexdigest()
        if key not in self._offsets:
            offset = self._fh.tell()
            pad = (-offset) % _ALIGN
            if pad:
                self._fh.write(b"\0" * pad)
                offset += pad
            self._fh.write(raw)
            self._offsets[key] = (offset, len(raw))
        return self._offsets[key]

    def save(self, model: onnx.ModelProto, path: Path) -> None:
        """Externalize the model's weights into the store, then write the graph itself."""
        self.externalize(model)
        self._fh.flush()
        onnx.save(model, str(path))

    def externalize(self, model: onnx.ModelProto) -> None:
        """Move the model's large initializers into the store (in place)."""
        for tensor in model.graph.initializer:
            if tensor.data_location == onnx.TensorProto.EXTERNAL:
                raise ValueError(f"initializer {tensor.name} is already external")
            raw = tensor.raw_data or numpy_helper.to_array(tensor).tobytes()
            if len(raw) < _EXTERNAL_MIN_BYTES:
                continue
            offset, length = self._place(raw)
            tensor.ClearField("raw_data")
            for field in ("float_data", "int32_data", "int64_data", "double_data", "uint64_data"):
                tensor.ClearField(field)
            del tensor.external_data[:]
            for key, value in (("location", self.location), ("offset", offset), ("length", length)):
                entry = tensor.external_data.add()
                entry.key, entry.value = key, str(value)
            tensor.data_location = onnx.TensorProto.EXTERNAL


def tensor_specs(model: onnx.ModelProto, which: str, tokens: int | None = None,
                 batch: int = 1) -> dict[str, TensorSpec]:
    """name -> dtype and static shape of the graph's inputs or outputs, for the manifest. A
    shared graph's ``TOKENS_DIM`` takes ``tokens`` and its ``BATCH_DIM`` ``batch``: each
    manifest entry is one static size of it."""
    values = model.graph.input if which == "inputs" else model.graph.output
    specs = {}
    for value in values:
        ttype = value.type.tensor_type
        dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(ttype.elem_type)).name
        shape = []
        for d in ttype.shape.dim:
            if d.HasField("dim_value"):
                shape.append(d.dim_value)
            elif d.dim_param == TOKENS_DIM and tokens is not None:
                shape.append(tokens)
            elif d.dim_param == BATCH_DIM:
                shape.append(batch)
            else:  # the runtime's buffers are static
                raise SpecexportError(f"graph {which[:-1]} {value.name} has a dynamic shape; every dimension "
                                      f"must be static{'' if tokens is None else ' but the token count'}")
        specs[value.name] = TensorSpec(dtype, tuple(shape))
    return specs


def chain_inputs(model: onnx.ModelProto, tokens: int, batch: int = 1) -> dict[str, TensorSpec]:
    """``tensor_specs`` of a chain entry's inputs: a graph that verifies trees too keeps its tree
    offsets and mask out of the entry, and the backend feeds a chain's (contract.CHAIN_TREE_INPUTS);
    an entry listing them would be fed blank ones (every row masked from itself)."""
    return {name: spec for name, spec in tensor_specs(model, "inputs", tokens, batch).items()
            if name not in CHAIN_TREE_INPUTS}
