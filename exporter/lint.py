"""`specexport lint --for tensorrt`: will TensorRT's ONNX parser take these graphs?

Pure `onnx`, no TensorRT needed, so it runs on any machine before a GPU build. Per graph it
checks: every graph input and output has a static shape; every operator is one the parser
imports at the graph's opset, for the data type it is given; no tensor has a dtype TensorRT
rejects. The tables follow onnx-tensorrt (TensorRT 10.x): its importer registry and type
checks in onnxOpImporters.cpp, and docs/operators.md (opsets 9 to 22).

In an engine directory, a graph file that several static sizes share (a chain head's catch-up
graph, its token count symbolic) is checked once per engine, fixed to that engine's shapes
(``static_graph``): that is what the TensorRT build compiles.

A graph that uses onnxruntime contrib operators (com.microsoft, e.g. MatMulNBits in the
quantized-self drafter) is reported as ``skip``: `specexport build` leaves it out of the
TensorRT compile with a warning, and the onnxruntime backend still runs it. Only ``fail``
graphs (which the compile would attempt and TensorRT would reject) make the lint exit
non-zero, unless ``strict`` counts skipped graphs too.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

import onnx

from specexport.backends import ONNXRUNTIME
from specexport.contract import MANIFEST, EngineEntry, read_manifest
from specexport.errors import BadInput

MIN_OPSET, MAX_OPSET = 9, 22
ONNX_DOMAINS = ("", "ai.onnx")
ORT_DOMAIN = "com.microsoft"

_T = onnx.TensorProto

# Operators with an importer in onnx-tensorrt's parser (onnxOpImporters.cpp, TensorRT 10.x).
SUPPORTED_OPS = frozenset("""
Abs Acos Acosh Add And ArgMax ArgMin Asin Asinh Atan Atanh AveragePool BatchNormalization Cast CastLike
Ceil Celu Clip Concat Constant ConstantOfShape Conv ConvTranspose Cos Cosh CumSum DeformConv DepthToSpace
DequantizeLinear Div Dropout Einsum Elu Equal Erf Exp Expand EyeLike Flatten Floor GRU Gather
GatherElements GatherND Gelu Gemm GlobalAveragePool GlobalLpPool GlobalMaxPool Greater GreaterOrEqual
GridSample GroupNormalization HardSigmoid HardSwish Hardmax Identity If ImageScaler InstanceNormalization
IsInf IsNaN LRN LSTM LayerNormalization LeakyRelu Less LessOrEqual Log LogSoftmax Loop LpNormalization
LpPool MatMul Max MaxPool Mean MeanVarianceNormalization Min Mish Mod Mul Neg NonMaxSuppression NonZero
Not OneHot Or PRelu Pad ParametricSoftplus Pow QuantizeLinear RNN RandomNormal RandomNormalLike
RandomUniform RandomUniformLike Range Reciprocal ReduceL1 ReduceL2 ReduceLogSum ReduceLogSumExp ReduceMax
ReduceMean ReduceMin ReduceProd ReduceSum ReduceSumSquare Relu Reshape Resize ReverseSequence RoiAlign
Round ScaledTanh Scan Scatter ScatterElements ScatterND Selu Shape Shrink Sigmoid Sign Sin Sinh Size
Slice Softmax Softplus Softsign SpaceToDepth Split Sqrt Squeeze Sub Sum Tan Tanh ThresholdedRelu Tile
TopK Transpose Trilu Unsqueeze Upsample Where Xor
""".split())

# Types an importer refuses outright (its notInvalidType checks): op -> {input index: types}.
_INT = frozenset({_T.INT32, _T.INT64})
_BOOL_U8 = frozenset({_T.BOOL, _T.UINT8})
REJECTED_TYPES: dict[str, dict[int, frozenset[int]]] = {
    "MatMul": {0: _INT}, "Gemm": {0: _INT}, "PRelu": {0: _INT, 1: _INT},
    "Hardmax": {0: _INT | _BOOL_U8 | {_T.INT8}},
    "GridSample": {0: _BOOL_U8, 1: _BOOL_U8}, "Resize": {0: _BOOL_U8}, "Upsample": {0: _BOOL_U8},
    "SpaceToDepth": {0: _BOOL_U8}, "DepthToSpace": {0: _BOOL_U8},
}
# Floating-point math: TensorRT's unary, activation, matmul, pooling and normalization layers
# take FP32 / FP16 / BF16 only (the "Supported Types" column of operators.md).
FLOAT_ONLY = frozenset("""
Acos Acosh Asin Asinh Atan Atanh Ceil Cos Cosh Erf Exp Floor Log Reciprocal Round Sin Sinh Sqrt Tan Tanh
Sigmoid Softmax LogSoftmax Softplus Softsign Elu Selu Celu LeakyRelu HardSigmoid HardSwish ThresholdedRelu
ScaledTanh ParametricSoftplus Mish Conv ConvTranspose AveragePool MaxPool GlobalAveragePool GlobalMaxPool
GlobalLpPool LpPool BatchNormalization InstanceNormalization LayerNormalization GroupNormalization
LpNormalization MeanVarianceNormalization LRN RNN GRU LSTM
""".split())
_FLOATS = frozenset({_T.FLOAT, _T.FLOAT16, _T.BFLOAT16, _T.DOUBLE})

# Tensor types TensorRT handles at all; UINT8 only at the network's inputs and outputs.
TRT_DTYPES = frozenset({_T.FLOAT, _T.FLOAT16, _T.BFLOAT16, _T.INT32, _T.INT64, _T.BOOL, _T.INT8, _T.INT4,
                        _T.FLOAT8E4M3FN, _T.UINT8, _T.DOUBLE})
_IO_ONLY = frozenset({_T.UINT8})

ORT_ONLY_HINT = {
    "MatMulNBits": "onnxruntime's int4 weight-only matmul; a TensorRT int4 engine needs a Q/DQ export "
                   "(DequantizeLinear on INT4 blocks before MatMul), which specexport does not write yet",
}


def dtype_name(code: int) -> str:
    return onnx.TensorProto.DataType.Name(code)


@dataclass
class GraphReport:
    graph: str
    status: str = "ok"  # ok | skip | fail
    problems: list[str] = field(default_factory=list)  # why it fails (or is skipped)
    notes: list[str] = field(default_factory=list)  # worth knowing, not fatal
    opset: int | None = None
    nodes: int = 0


@dataclass
class LintReport:
    target: str
    graphs: list[GraphReport]
    strict: bool = False

    @property
    def failed(self) -> list[GraphReport]:
        bad = ("fail", "skip") if self.strict else ("fail",)
        return [g for g in self.graphs if g.status in bad]

    @property
    def ok(self) -> bool:
        return not self.failed

    def to_dict(self) -> dict:
        return {"for": "tensorrt", "target": self.target, "ok": self.ok, "strict": self.strict,
                "graphs": [asdict(g) for g in self.graphs]}

    def render(self) -> str:
        lines = []
        for g in self.graphs:
            lines.append(f"{g.status.upper():<4}  {g.graph}  (opset {g.opset}, {g.nodes} nodes)")
            lines += [f"      - {p}" for p in g.problems]
            lines += [f"      . {n}" for n in g.notes]
        counts = {s: sum(g.status == s for g in self.graphs) for s in ("ok", "skip", "fail")}
        verdict = "ok" if self.ok else "problems found"
        lines.append(
            f"tensorrt lint of {self.target}: {counts['ok']} ok, {counts['skip']} skipped "
            f"(onnxruntime-only, not compiled), {counts['fail']} failing: {verdict}"
        )
        return "\n".join(lines)


# -- one graph ------------------------------------------------------------------------------


def _shape_problem(value: onnx.ValueInfoProto) -> str | None:
    ttype = value.type.tensor_type
    if not ttype.HasField("shape"):
        return "has no shape (rank unknown)"
    dims = []
    for d in ttype.shape.dim:
        if d.HasField("dim_value") and d.dim_value > 0:
            dims.append(str(d.dim_value))
        else:
            dims.append(d.dim_param or "?")
    if all(x.isdigit() for x in dims):
        return None
    return f"has a dynamic shape [{', '.join(dims)}]"


def tensor_types(model: onnx.ModelProto) -> dict[str, int]:
    """tensor name -> element type, from graph I/O, initializers, value_info and Constant nodes."""
    g = model.graph
    types = {v.name: v.type.tensor_type.elem_type for v in [*g.input, *g.output, *g.value_info]
             if v.type.HasField("tensor_type")}
    types.update({t.name: t.data_type for t in g.initializer})
    for node in g.node:
        if node.op_type == "Constant":
            for a in node.attribute:
                if a.name == "value":
                    types[node.output[0]] = a.t.data_type
    return types


def _count(names: list[str], what: str) -> str:
    shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
    return f"{len(names)} {what}{'s' * (len(names) > 1)} ({shown})"


def lint_model(model: onnx.ModelProto, name: str) -> GraphReport:
    report = GraphReport(name, nodes=len(model.graph.node))
    opsets = {o.domain: o.version for o in model.opset_import}
    report.opset = opsets.get("", opsets.get("ai.onnx"))
    problems, ort_ops = report.problems, []
    if report.opset is None or not MIN_OPSET <= report.opset <= MAX_OPSET:
        problems.append(f"opset {report.opset} is outside the {MIN_OPSET}-{MAX_OPSET} that TensorRT 10's parser supports")

    g = model.graph
    io_names = {v.name for v in [*g.input, *g.output]}
    for value in [*g.input, *g.output]:
        why = _shape_problem(value)
        if why:
            problems.append(f"{'input' if value in g.input else 'output'} {value.name} {why}; "
                            "TensorRT engines here are built for static shapes only")

    try:  # fills value_info for graphs that lack it; unknown (contrib) ops are left alone
        model = onnx.shape_inference.infer_shapes(model)
    except Exception as err:  # noqa: BLE001 - a lint reports, it does not crash
        report.notes.append(f"shape inference failed ({type(err).__name__}); dtypes checked from what the graph declares")
    types = tensor_types(model)

    dynamic = sum(1 for v in model.graph.value_info if v.name not in io_names and _shape_problem(v))
    if dynamic:
        report.notes.append(f"{dynamic} intermediate tensors have data-dependent shapes (slower in TensorRT)")

    bad_types: dict[tuple[int, str], list[str]] = {}
    for tensor, code in sorted(types.items()):
        if code not in TRT_DTYPES:
            bad_types.setdefault((code, "a type TensorRT rejects"), []).append(tensor)
        elif code in _IO_ONLY and tensor not in io_names:
            bad_types.setdefault((code, "which TensorRT allows only as a network input or output"), []).append(tensor)
    for (code, why), names in bad_types.items():
        problems.append(f"{_count(names, 'tensor')} {'is' if len(names) == 1 else 'are'} {dtype_name(code)}, {why}")
    if any(code == _T.DOUBLE for code in types.values()):
        report.notes.append("DOUBLE tensors are cast down to FLOAT by TensorRT")

    unsupported: dict[str, int] = {}
    bad_inputs: dict[tuple[str, int, int], list[str]] = {}
    for node in model.graph.node:
        if node.domain not in ONNX_DOMAINS:
            if node.domain == ORT_DOMAIN:
                ort_ops.append(node.op_type)
            else:
                key = f"{node.domain}::{node.op_type}"
                unsupported[key] = unsupported.get(key, 0) + 1
            continue
        if node.op_type not in SUPPORTED_OPS:
            unsupported[node.op_type] = unsupported.get(node.op_type, 0) + 1
            continue
        rejected = dict(REJECTED_TYPES.get(node.op_type, {}))
        if node.op_type in FLOAT_ONLY:
            rejected[0] = frozenset(TRT_DTYPES - _FLOATS)
        for index, bad in rejected.items():
            given = types.get(node.input[index]) if len(node.input) > index else None
            if given is not None and given in bad:
                bad_inputs.setdefault((node.op_type, given, index), []).append(node.name or node.output[0])
    for (op, code, index), names in bad_inputs.items():
        problems.append(f"TensorRT's {op} does not take {dtype_name(code)} (input {index}): {_count(names, 'node')}")
    for op, count in sorted(unsupported.items()):
        plugin = " (a custom domain: needs a TensorRT plugin)" if "::" in op else ""
        problems.append(f"operator {op} is not supported by TensorRT's ONNX parser{plugin} ({count} nodes)")

    if ort_ops:
        kinds = sorted(set(ort_ops))
        hints = "; ".join(f"{op}: {ORT_ONLY_HINT[op]}" for op in kinds if op in ORT_ONLY_HINT)
        report.problems.insert(0, f"onnxruntime contrib operators {', '.join(f'{ORT_DOMAIN}::{op}' for op in kinds)} "
                                  f"({len(ort_ops)} nodes) cannot run in TensorRT" + (f" ({hints})" if hints else ""))
    if problems and not ort_ops:
        report.status = "fail"
    elif ort_ops:
        # onnxruntime-only graph: left out of the TensorRT compile; other problems are listed too
        report.status = "skip"
    return report


def _load(path: Path) -> onnx.ModelProto:
    try:
        return onnx.load(str(path), load_external_data=False)
    except Exception as err:  # noqa: BLE001
        raise BadInput(f"{path}: not a readable ONNX file ({type(err).__name__}: {err})") from None


def lint_file(path: Path) -> GraphReport:
    return lint_model(_load(path), path.stem)


def has_symbolic_io(model: onnx.ModelProto) -> bool:
    return any(_shape_problem(v) for v in [*model.graph.input, *model.graph.output])


def static_graph(model: onnx.ModelProto, entry: EngineEntry) -> onnx.ModelProto:
    """``model`` with every input and output fixed to ``entry``'s static shape: what TensorRT
    is given for one engine of a graph several sizes share (a chain head's catch-up graph has a
    symbolic token count; onnxruntime runs every size from it). A static graph comes back as is."""
    if not has_symbolic_io(model):
        return model
    fixed = onnx.ModelProto()
    fixed.CopyFrom(model)
    specs = {**entry.inputs, **entry.outputs}
    for value in [*fixed.graph.input, *fixed.graph.output]:
        if value.name not in specs:
            raise BadInput(f"{entry.path}: the graph's {value.name} is not in the manifest entry {entry.name}; "
                           "rebuild the engine directory")
        dims = value.type.tensor_type.shape.dim
        del dims[:]
        for size in specs[value.name].shape:
            dims.add().dim_value = size
    del fixed.graph.value_info[:]  # symbolic inside too: shape inference redoes it from the fixed I/O
    return fixed


def lint_entries(path: Path, entries: list[EngineEntry]) -> list[GraphReport]:
    """One graph file of an engine directory as the TensorRT compile sees it: once, or, when its
    shapes are symbolic and TensorRT would compile it, once per engine fixed to that engine's shapes."""
    model = _load(path)
    whole = lint_model(model, path.stem)
    if whole.status == "skip" or not entries or not has_symbolic_io(model):
        return [whole]
    return [lint_model(static_graph(model, e), e.name) for e in entries]


# -- an engine directory, a folder of graphs, or one file -----------------------------------


def graph_files(target: Path) -> list[Path]:
    """The ONNX graphs to lint: an engine directory's onnxruntime engines, or *.onnx files."""
    if not target.exists():
        raise BadInput(f"{target}: no such file or directory")
    if target.is_file():
        return [target]
    if (target / MANIFEST).is_file():  # an engine directory: read through the one manifest reader
        # each file once: the entries of an ort-gqa model are sizes of one graph
        paths = list(dict.fromkeys(target / e.path for e in read_manifest(target).engines
                                   if e.backend == ONNXRUNTIME))
    else:
        paths = sorted(target.glob("*.onnx"))
    if not paths:
        raise BadInput(f"{target}: no ONNX graphs to lint (expected an engine directory or .onnx files)")
    missing = [p for p in paths if not p.is_file()]
    if missing:
        raise BadInput(f"{missing[0]}: graph named in the manifest is missing; rebuild the engine directory")
    return paths


def lint_tensorrt(target: str | Path, strict: bool = False) -> LintReport:
    target = Path(target)
    paths = graph_files(target)
    by_file: dict[Path, list[EngineEntry]] = {}
    if target.is_dir() and (target / MANIFEST).is_file():
        for e in read_manifest(target).engines:
            if e.backend == ONNXRUNTIME:
                by_file.setdefault(target / e.path, []).append(e)
    return LintReport(str(target), [r for p in paths for r in lint_entries(p, by_file.get(p, []))], strict)
