"""A few ONNX graphs written as protobuf bytes by hand: the runtime imports neither ``onnx`` nor
``protobuf``, and the device store's copies (runtime/device_store.py) need graphs of two ops.

Only the fields these graphs use are written (onnx.proto's field numbers): a model of an opset
(and com.microsoft's), a graph of nodes with int and float attributes, raw-data initializers, and
inputs/outputs with an element type and named dims.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

# onnx.TensorProto.DataType of the dtypes a cache, an index or a quantized weight has
ELEMENT_TYPES = {"float32": 1, "uint8": 2, "int32": 6, "int64": 7, "float16": 10, "bfloat16": 16}
IR_VERSION = 8
OPSET = 16


def element_type(dtype: str | np.dtype) -> int:
    name = np.dtype(dtype).name if not isinstance(dtype, str) else dtype
    if name not in ELEMENT_TYPES:
        raise ValueError(f"no ONNX element type for dtype {name} (known: {', '.join(ELEMENT_TYPES)})")
    return ELEMENT_TYPES[name]


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        out.append(low | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (wire type 2): strings, bytes and nested messages."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _int(number: int, value: int) -> bytes:
    """A varint field (wire type 0)."""
    return _varint(number << 3) + _varint(value)


def _text(number: int, value: str) -> bytes:
    return _field(number, value.encode())


@dataclass(frozen=True)
class Value:
    """A graph input or output: its name, element type and dims (a str is a named dim)."""

    name: str
    dtype: str
    dims: tuple[int | str, ...]

    def encode(self) -> bytes:  # ValueInfoProto{name=1, type=2{tensor_type=1{elem_type=1, shape=2{dim=1}}}}
        dims = b"".join(_field(1, _int(1, d) if isinstance(d, int) else _text(2, d)) for d in self.dims)
        tensor = _int(1, element_type(self.dtype)) + _field(2, dims)
        return _text(1, self.name) + _field(2, _field(1, tensor))


def _attribute(name: str, value: int | float) -> bytes:
    """AttributeProto{name=1, f=2 (fixed32), i=3, type=20 (FLOAT=1, INT=2)}; ints >= 0 only."""
    if isinstance(value, float):
        return _text(1, name) + _varint(2 << 3 | 5) + struct.pack("<f", value) + _int(20, 1)
    if value < 0:
        raise ValueError(f"attribute {name}: negative ints are not written ({value})")
    return _text(1, name) + _int(3, value) + _int(20, 2)


@dataclass(frozen=True)
class Node:
    op: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    domain: str = ""  # "com.microsoft" for onnxruntime's contrib ops
    attributes: tuple[tuple[str, int | float], ...] = ()

    def encode(self) -> bytes:  # NodeProto{input=1, output=2, name=3, op_type=4, attribute=5, domain=7}
        return (b"".join(_text(1, i) for i in self.inputs) + b"".join(_text(2, o) for o in self.outputs)
                + _text(3, f"{self.op}_{self.outputs[0]}") + _text(4, self.op)
                + b"".join(_field(5, _attribute(k, v)) for k, v in self.attributes)
                + (_text(7, self.domain) if self.domain else b""))


def tensor_bytes(name: str, array: np.ndarray) -> bytes:
    """A TensorProto{dims=1, data_type=2, name=8, raw_data=9} holding ``array`` (little-endian)."""
    array = np.ascontiguousarray(array)
    return (b"".join(_int(1, d) for d in array.shape) + _int(2, element_type(array.dtype)) + _text(8, name)
            + _field(9, array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes()))


def model_bytes(name: str, nodes: Sequence[Node], inputs: Sequence[Value], outputs: Sequence[Value],
                initializers: dict[str, np.ndarray] | None = None) -> bytes:
    """A serialized ModelProto of one graph in the default domain at OPSET (and com.microsoft
    at 1 where a node is of that domain)."""
    graph = (b"".join(_field(1, n.encode()) for n in nodes) + _text(2, name)
             + b"".join(_field(5, tensor_bytes(k, v)) for k, v in (initializers or {}).items())
             + b"".join(_field(11, v.encode()) for v in inputs) + b"".join(_field(12, v.encode()) for v in outputs))
    opsets = _field(8, _text(1, "") + _int(2, OPSET))  # OperatorSetIdProto{domain=1, version=2}
    if any(n.domain == "com.microsoft" for n in nodes):
        opsets += _field(8, _text(1, "com.microsoft") + _int(2, 1))
    return _int(1, IR_VERSION) + _text(2, "specexport") + _field(7, graph) + opsets


def copy_positions_graph(count: int, dtype: str) -> bytes:
    """``count`` independent copies between 4-d tensors: out.i = ScatterND(into.i, dst,
    GatherND(from.i, src)), where src and dst [m, 3] index the first three dims and a slice of
    the last moves (a K/V position of one head: (row, head, position) -> [hd]). Bound with
    out.i at into.i's address it writes into.i in place; everything is gathered before anything
    is written, so overlapping positions of one tensor copy as if through a buffer."""
    inputs = [Value("src", "int64", ("m", 3)), Value("dst", "int64", ("m", 3))]
    outputs, nodes = [], []
    for i in range(count):
        inputs += [Value(f"into.{i}", dtype, (f"a{i}", f"b{i}", f"c{i}", f"d{i}")),
                   Value(f"from.{i}", dtype, (f"e{i}", f"f{i}", f"g{i}", f"d{i}"))]
        outputs.append(Value(f"out.{i}", dtype, (f"a{i}", f"b{i}", f"c{i}", f"d{i}")))
        nodes += [Node("GatherND", (f"from.{i}", "src"), (f"moved.{i}",)),
                  Node("ScatterND", (f"into.{i}", "dst", f"moved.{i}"), (f"out.{i}",))]
    return model_bytes("copy_positions", nodes, inputs, outputs)
