"""TensorRT engine building (the `tensorrt` backend of `specexport build`).

Every ONNX graph of the build becomes a serialized engine (``<graph>.plan``) beside it, with
the shapes exactly as exported (no optimization profiles: every input is static). Networks
are strongly typed, the mode TensorRT recommends since 10.12 (weak typing and the FP16/BF16
builder flags are deprecated, and gone in 11): the precision lives in the graph. fp32 builds
the exported graph as it is, with TF32 off so that matmuls stay fp32; fp16 and bf16 build a
cast copy (``cast_precision``) whose inputs and outputs keep their fp32 types, so the manifest's
specs and the runtime's buffers do not change with the precision.

One timing cache per TensorRT version and GPU is kept beside the engine directory and reused
by every build. Each engine is run beside its ONNX graph right after it is built
(exporter/trt_parity.py); the figures go into its manifest entry's ``parity``. Graphs with
onnxruntime contrib operators (the quantized-self drafter's MatMulNBits) are left out with a
warning; the lint says why.

The hidden-state heads' graphs take the same path: a block head's graphs and a chain head's
step graph are static as exported; a chain head's catch-up sizes share one graph with a
symbolic token count (onnxruntime holds its weights once), which TensorRT is given once per
size, fixed to that entry's shapes (``lint.static_graph``), so every engine is static.
"""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import onnx
from onnx import helper, numpy_helper

from specexport import atomic
from specexport.backends import BACKENDS, ONNXRUNTIME, TENSORRT
from specexport.contract import EngineEntry
from specexport.errors import BadInput, SpecexportError
from specexport.exporter.lint import has_symbolic_io, lint_model, static_graph, tensor_types
from specexport.exporter.trt_parity import engine_parity
from specexport.progress import Reporter
from specexport.runtime import trt_engine

if TYPE_CHECKING:
    import tensorrt as trt

    from specexport.exporter.recipe import Recipe

PRECISIONS = ("fp32", "fp16", "bf16")
DEFAULT_WORKSPACE_MB = 4096  # per engine, the builder's scratch for tactics


def require_tensorrt() -> None:
    """The tensorrt package, or an error naming the extra to install (exit code 2)."""
    trt_engine.require_tensorrt()


@dataclass(frozen=True)
class TrtBuildOptions:
    precision: str = "fp32"  # fp32 | fp16 | bf16 (weights and activations)
    workspace_mb: int = DEFAULT_WORKSPACE_MB  # MemoryPoolType.WORKSPACE limit
    optimization_level: int = 3  # builder_optimization_level, 0-5 (TensorRT's default is 3)
    timing_cache_dir: Path | None = None  # None: beside the engine directory; relative: from there
    enforce_parity: bool = True  # fail the build when an engine differs from its ONNX graph

    @classmethod
    def from_recipe(cls, recipe: Recipe, precision: str | None = None, workspace_mb: int | None = None) -> TrtBuildOptions:
        """The recipe's `precision` and `tensorrt:` section; arguments (the command line's
        --precision, say) win over the recipe."""
        section = recipe.tensorrt
        return cls(
            precision=precision or recipe.precision,
            workspace_mb=workspace_mb or section.workspace_mb,
            optimization_level=section.builder_optimization_level,
            timing_cache_dir=section.timing_cache_dir,
            enforce_parity=section.parity == "enforce",
        )

    def timing_cache_folder(self, default: Path) -> Path:
        """Where the timing caches go: ``default`` (beside the engine directory), or the
        recipe's folder, relative to ``default`` (an absolute one stands alone)."""
        return default / self.timing_cache_dir if self.timing_cache_dir is not None else default

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise BadInput(f"precision must be one of {', '.join(PRECISIONS)} (got {self.precision!r})")
        if self.workspace_mb < 1:
            raise BadInput(f"the TensorRT workspace must be at least 1 MB (got {self.workspace_mb})")
        if not 0 <= self.optimization_level <= 5:
            raise BadInput(f"tensorrt.builder_optimization_level must be 0 to 5 (got {self.optimization_level})")


# -- precision: a cast copy of the graph ----------------------------------------------------

_LOW = {"fp16": onnx.TensorProto.FLOAT16, "bf16": onnx.TensorProto.BFLOAT16}
_FLOAT = onnx.TensorProto.FLOAT
# Kept in fp32: the sum of squares of RMSNorm/LayerNorm overflows fp16 once activations pass
# ~256, and rotary angles (position x frequency) need fp32 resolution at long positions.
KEEP_FP32_OPS = frozenset({"Pow", "ReduceMean", "ReduceSum", "ReduceSumSquare", "ReduceL2", "Sqrt", "Reciprocal",
                           "Cos", "Sin"})
# Elementwise ops that stay fp32 when their non-constant inputs already are (eps + variance).
_FOLLOW_FP32 = frozenset({"Add", "Sub", "Mul", "Div", "Neg", "Sqrt", "Reciprocal", "Max", "Min"})
# Ops whose float inputs are only read for their shape or converted: no cast in front of them.
_ANY_FLOAT_INPUT = frozenset({"Cast", "Shape", "Size"})


def _low_array(array: np.ndarray, low: int) -> np.ndarray:
    """fp32 values in the low type; finite values beyond its range are clipped, not made inf
    (a mask's float32-min must stay finite: 0 x inf would be NaN)."""
    dtype = helper.tensor_dtype_to_np_dtype(low)
    limit = float(np.finfo(np.float16).max) if low == onnx.TensorProto.FLOAT16 else 3.3895313892515355e38
    finite = np.isfinite(array)
    clipped = np.where(finite, np.clip(array, -limit, limit), array)
    return clipped.astype(dtype)


def _convert_tensor(tensor: onnx.TensorProto, low: int) -> onnx.TensorProto:
    converted = numpy_helper.from_array(_low_array(numpy_helper.to_array(tensor), low), tensor.name)
    return converted


def _fp32_nodes(graph: onnx.GraphProto, float_tensors: set[str], constants: set[str]) -> set[int]:
    """Indices of the nodes that keep computing in fp32."""
    producer = {out: i for i, node in enumerate(graph.node) for out in node.output}
    keep: set[int] = set()
    # Rotary angles: everything upstream of Cos/Sin (never the activations, for RoPE).
    stack = [i for i, n in enumerate(graph.node) if n.op_type in ("Cos", "Sin")]
    while stack:
        i = stack.pop()
        if i in keep:
            continue
        keep.add(i)
        stack += [producer[x] for x in graph.node[i].input if x in float_tensors and x in producer]
    # Norm statistics, and the elementwise ops fed only by them.
    for i, node in enumerate(graph.node):  # nodes are topologically sorted
        if node.op_type in KEEP_FP32_OPS:
            keep.add(i)
        elif node.op_type in _FOLLOW_FP32:
            live = [x for x in node.input if x in float_tensors and x not in constants]
            if live and all(x in producer and producer[x] in keep for x in live):
                keep.add(i)
    return keep


def cast_precision(model: onnx.ModelProto, precision: str, low_io: frozenset[str] = frozenset()) -> onnx.ModelProto:
    """A copy of ``model`` computing in fp16 or bf16, its float inputs and outputs still fp32
    except those named in ``low_io``, which take the low type (an onnxruntime GPU graph's KV
    cache: GroupQueryAttention reads and updates it in place in its own type).

    Casts are inserted where a tensor's type and its consumer's precision differ; float
    initializers, Constant values and Cast/ConstantOfShape targets follow their node.
    """
    low = _LOW[precision]
    model = onnx.shape_inference.infer_shapes(model)
    g = model.graph
    types = tensor_types(model)
    float_tensors = {name for name, code in types.items() if code == _FLOAT}
    initializers = {t.name for t in g.initializer}
    constant_nodes = {n.output[0] for n in g.node if n.op_type == "Constant"}
    keep = _fp32_nodes(g, float_tensors, initializers | constant_nodes)

    consumers: dict[str, list[int]] = {}
    for i, node in enumerate(g.node):
        for x in node.input:
            consumers.setdefault(x, []).append(i)
    graph_inputs = {v.name for v in g.input}

    def wants_low(i: int) -> bool:
        return i not in keep

    # What each float tensor is, after the rewrite ("home" type).
    home: dict[str, int] = {name: low if name in low_io else _FLOAT for name in graph_inputs & float_tensors}
    for t in g.initializer:  # a constant goes low unless only fp32 nodes read it
        if t.data_type == _FLOAT:
            home[t.name] = low if any(wants_low(c) for c in consumers.get(t.name, [])) else _FLOAT
    new_inits = [_convert_tensor(t, low) if home.get(t.name) == low else t for t in g.initializer]

    nodes: list[onnx.NodeProto] = []
    casts: dict[tuple[str, int], str] = {}

    def cast(name: str, to: int) -> str:
        key = (name, to)
        if key not in casts:
            casts[key] = f"{name}__as_{onnx.TensorProto.DataType.Name(to).lower()}"
            nodes.append(helper.make_node("Cast", [name], [casts[key]], to=to, name=f"{casts[key]}__cast"))
        return casts[key]

    for i, node in enumerate(g.node):
        node = onnx.NodeProto.FromString(node.SerializeToString())
        if node.op_type == "Constant" and node.output[0] in float_tensors:
            target = low if any(wants_low(c) for c in consumers.get(node.output[0], [])) else _FLOAT
            for a in node.attribute:
                if a.name == "value" and target == low:
                    a.t.CopyFrom(_convert_tensor(a.t, low))
            home[node.output[0]] = target
            nodes.append(node)
            continue
        precision_of_node = low if wants_low(i) else _FLOAT
        for a in node.attribute:  # dtype-carrying attributes follow the node
            if node.op_type == "Cast" and a.name == "to" and a.i == _FLOAT:
                a.i = precision_of_node
            elif node.op_type == "ConstantOfShape" and a.name == "value" and a.t.data_type == _FLOAT:
                a.t.CopyFrom(_convert_tensor(a.t, precision_of_node) if precision_of_node == low else a.t)
            elif a.name == "dtype" and a.type == onnx.AttributeProto.INT and a.i == _FLOAT:
                a.i = precision_of_node
        if node.op_type not in _ANY_FLOAT_INPUT:
            for k, x in enumerate(node.input):
                if x in home and home[x] != precision_of_node:
                    node.input[k] = cast(x, precision_of_node)
        for out in node.output:
            if out in float_tensors:
                home[out] = precision_of_node
        nodes.append(node)

    # Float graph outputs are fp32 again (low_io's: low): where the producer's type differs it
    # writes a renamed tensor, and a Cast the output.
    renames = {}
    for value in g.output:
        wanted = low if value.name in low_io else _FLOAT
        if value.name in float_tensors and home.get(value.name) != wanted:
            renames[value.name] = (f"{value.name}__{precision}" if wanted == _FLOAT else f"{value.name}__fp32", wanted)
    for node in nodes:
        node.output[:] = [renames[x][0] if x in renames else x for x in node.output]
        node.input[:] = [renames[x][0] if x in renames else x for x in node.input]
    for name, (inner, wanted) in renames.items():
        nodes.append(helper.make_node("Cast", [inner], [name], to=wanted,
                                      name=f"{name}__to_fp32" if wanted == _FLOAT else f"{name}__to_{precision}"))
    for value in [*g.input, *g.output]:  # the low inputs and outputs change their declared type
        if value.name in low_io and value.name in float_tensors:
            value.type.tensor_type.elem_type = low

    del g.node[:]
    g.node.extend(_topological(nodes, {v.name for v in g.input} | {t.name for t in new_inits}))
    del g.initializer[:]
    g.initializer.extend(new_inits)
    del g.value_info[:]  # types changed; inference below rebuilds what it can
    return onnx.shape_inference.infer_shapes(model, strict_mode=True, data_prop=True)


def _topological(nodes: list[onnx.NodeProto], available: set[str]) -> list[onnx.NodeProto]:
    """Nodes in an order where every input is produced first (new Casts were appended)."""
    ready = set(available) | {""}
    pending, ordered = list(nodes), []
    while pending:
        progress = [n for n in pending if all(x in ready for x in n.input)]
        if not progress:
            missing = sorted({x for n in pending for x in n.input if x not in ready})[:3]
            raise SpecexportError(f"cast to lower precision left unconnected inputs: {missing}")
        for n in progress:
            ordered.append(n)
            ready.update(n.output)
        ids = {id(n) for n in progress}
        pending = [n for n in pending if id(n) not in ids]
    return ordered


# -- building -------------------------------------------------------------------------------


def timing_cache_path(directory: Path, trt_version: str, device: trt_engine.CudaDevice) -> Path:
    """One cache per TensorRT version and GPU: tactic timings mean nothing elsewhere."""
    gpu = re.sub(r"[^A-Za-z0-9]+", "-", device.name).strip("-").lower() or "gpu"
    return directory / f".specexport-trt{trt_version}-sm{device.compute_capability.replace('.', '')}-{gpu}.timing-cache"


def _make_logger(reporter: Reporter, seen: list[str]) -> trt.ILogger:
    """TensorRT's build log at warning level, shown through the progress display."""
    import tensorrt as trt

    class ReporterLogger(trt.ILogger):
        def __init__(self) -> None:
            trt.ILogger.__init__(self)

        def log(self, severity: trt.ILogger.Severity, msg: str) -> None:
            if severity <= trt.ILogger.Severity.WARNING:  # INTERNAL_ERROR 0, ERROR 1, WARNING 2
                seen.append(msg)
                reporter.warn(f"tensorrt: {msg}")

    return ReporterLogger()


def _parse(builder: trt.Builder, logger: trt.ILogger, path: Path,
           name: str) -> tuple[trt.INetworkDefinition, trt.OnnxParser]:
    """A strongly typed network from an ONNX file. The parser owns the weights: keep it
    alive until the network is built."""
    import tensorrt as trt

    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(path)):
        errors = [parser.get_error(i) for i in range(parser.num_errors)]
        detail = "; ".join(f"{e.node_name() or e.node()}: {e.desc()}" for e in errors[:3]) or "no details"
        raise SpecexportError(f"TensorRT could not parse {name}: {detail}")
    for i in range(network.num_inputs):  # the lint checked the ONNX; this checks TensorRT's view
        tensor = network.get_input(i)
        dims = tensor.shape
        if any(dims[d] < 0 for d in range(len(dims))):
            raise SpecexportError(f"{name}: input {tensor.name} has a dynamic shape in TensorRT's view")
    return network, parser


def compile_engines(tmp: Path, engines: list[EngineEntry], recipe: Recipe, reporter: Reporter,
                    timing_cache_dir: Path, options: TrtBuildOptions | None = None) -> list[EngineEntry]:
    """Build a TensorRT engine for every onnxruntime graph in ``engines`` (the target's, a draft
    model's, a hidden-state head's: each entry its own static engine, also where several sizes
    share one graph file); return their manifest entries (backend "tensorrt"). The ONNX files
    stay: they are what `specexport build --from-onnx` rebuilds from on another machine."""
    require_tensorrt()
    import tensorrt as trt

    opts = options or TrtBuildOptions.from_recipe(recipe)
    device = trt_engine.cuda_device()
    messages: list[str] = []
    logger = _make_logger(reporter, messages)
    builder = trt.Builder(logger)
    cache_file = timing_cache_path(opts.timing_cache_folder(timing_cache_dir), trt.__version__, device)
    cache_config = builder.create_builder_config()
    cache = cache_config.create_timing_cache(cache_file.read_bytes() if cache_file.is_file() else b"")
    scratch = tmp / ".tensorrt-scratch"
    entries: list[EngineEntry] = []
    try:
        for onnx_entry in [e for e in engines if e.backend == ONNXRUNTIME]:
            source = tmp / onnx_entry.path
            if not _compilable(onnx_entry, source, reporter):
                continue
            with reporter.step("tensorrt", onnx_entry.name) as s:
                plan = tmp / f"{onnx_entry.name}{BACKENDS[TENSORRT].suffix}"
                graph = tensorrt_graph(onnx_entry, source, scratch, opts.precision)
                del messages[:]
                network, parser = _parse(builder, logger, graph, onnx_entry.name)
                serialized = builder.build_serialized_network(network, _builder_config(builder, cache, opts, reporter))
                del network, parser
                if serialized is None:
                    why = messages[-1] if messages else "see the warnings above"
                    raise SpecexportError(f"TensorRT failed to build {onnx_entry.name}: {why}")
                with open(plan, "wb") as fh:
                    fh.write(serialized)
                s.detail = f"{opts.precision}, {plan.stat().st_size / 1e6:.1f} MB"
            entry = _entry(onnx_entry, plan, trt.__version__, device, opts)
            with reporter.step("tensorrt", f"{onnx_entry.name} parity") as s:
                # the plan against its fp32 ONNX graph on onnxruntime; out of tolerance fails here
                p = engine_parity(entry, tmp, source, opts.precision, device, opts.enforce_parity)
                entry = replace(entry, parity=p)
                s.detail = (f"max |Δlogit| {p['max_abs_logit_diff']:.2e} (scale {p['logit_scale']:.3g}), "
                            f"argmax agreement {p['argmax_agreement']:.1%}")
                if "max_rel_output_diff" in p:
                    s.detail += f", max |Δ|/scale of {p['worst_output']} {p['max_rel_output_diff']:.2e}"
            entries.append(entry)
            shutil.rmtree(scratch, ignore_errors=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        _save_cache(cache_file, cache.serialize())
    if not entries:
        reporter.warn("tensorrt: no graph of this recipe can be built by TensorRT")
    return entries


def _compilable(entry: EngineEntry, source: Path, reporter: Reporter) -> bool:
    """The lint of what TensorRT will be given for ``entry`` (its graph at the entry's static
    shapes): False, with a warning, for an onnxruntime-only graph; a failing one stops the build."""
    lint = lint_model(static_graph(onnx.load(str(source), load_external_data=False), entry), entry.name)
    if lint.status == "skip":
        reporter.warn(f"{entry.name}: not compiled for TensorRT: {lint.problems[0]}")
        return False
    if lint.status == "fail":
        raise SpecexportError(f"{entry.name} cannot be built by TensorRT: {'; '.join(lint.problems)}")
    return True


def _builder_config(builder: trt.Builder, cache: trt.ITimingCache, opts: TrtBuildOptions,
                    reporter: Reporter) -> trt.IBuilderConfig:
    """One engine's builder settings: workspace, optimization level, fp32 without TF32, the
    shared timing cache."""
    import tensorrt as trt

    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, opts.workspace_mb << 20)
    config.builder_optimization_level = opts.optimization_level
    if opts.precision == "fp32":
        config.clear_flag(trt.BuilderFlag.TF32)  # fp32 means fp32: parity with onnxruntime
    if not config.set_timing_cache(cache, False):
        reporter.warn("tensorrt: the timing cache does not match this build; timing from scratch")
    return config


def tensorrt_graph(entry: EngineEntry, source: Path, scratch: Path, precision: str) -> Path:
    """The ONNX file TensorRT parses for ``entry``: the exported graph itself when it is static
    and fp32; otherwise a copy in ``scratch`` (weights beside it) fixed to the entry's shapes (a
    graph several sizes share, like a chain head's catch-up graph) and cast to ``precision``."""
    if precision == "fp32" and not has_symbolic_io(onnx.load(str(source), load_external_data=False)):
        return source
    model = static_graph(onnx.load(str(source)), entry)  # weights loaded from the .weights file
    if precision != "fp32":
        model = cast_precision(model, precision)
    scratch.mkdir(exist_ok=True)
    stem = f"{entry.name}.{precision}"
    out = scratch / f"{stem}.onnx"
    onnx.save(model, str(out), save_as_external_data=True, all_tensors_to_one_file=True,
              location=f"{stem}.weights", size_threshold=1024)
    return out


def _save_cache(path: Path, data: object) -> None:
    """Write the timing cache atomically: concurrent builds on one machine share it."""
    atomic.write_bytes(path, memoryview(data))  # type: ignore[arg-type]


def _entry(onnx_entry: EngineEntry, plan: Path, trt_version: str, device: trt_engine.CudaDevice,
           opts: TrtBuildOptions) -> EngineEntry:
    """The manifest entry of ``plan``: its ONNX graph's entry compiled for TensorRT (the
    contract keeps name, role, shapes and KV update; this adds what the engine was built with)."""
    extra = {
        "tensorrt_version": trt_version,
        "device_name": device.name,
        "compute_capability": device.compute_capability,
        "precision": opts.precision,
        "strongly_typed": True,
        "workspace_mb": opts.workspace_mb,
        "optimization_level": opts.optimization_level,
        "onnx": onnx_entry.path,
    }
    return onnx_entry.compiled(TENSORRT, plan.name, extra)
