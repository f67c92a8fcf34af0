"""What a quantized graph pads so its one-token decode computes what its verify computes, decided
by probing the build machine's kernels (runtime/kernel_probe.py) instead of assumed.

The kernels of a graph (each distinct MatMulNBits, fp32 MatMul and GroupQueryAttention) are
probed at the build's thread count and the engine's largest call; the graph is then padded
exactly as much as the probe says (PAD_REWRITES), and a configuration no pad makes exact is
refused in one line. The probe goes into the manifest (``quantization.exactness``), where the
runtime re-probes it at load (kernel_probe.check_engine).
"""

from __future__ import annotations

from collections.abc import Callable

import onnx
from onnx import helper

from specexport.errors import BadInput
from specexport.exporter.attention_pad import GQA, has_tree_inputs, pad_attention_rows
from specexport.exporter.row_pad import pad_single_rows
from specexport.runtime import kernel_probe
from specexport.runtime.kernel_probe import PADS, Attention, FloatMatMul, Kernel, Probe, QuantMatMul

# what each verdict does to a graph: (model, max_seq_len) -> None, in place
PAD_REWRITES: dict[str, Callable[[onnx.ModelProto, int], None]] = {
    "none": lambda model, max_seq_len: None,
    "attention": pad_attention_rows,
    "all": pad_single_rows,
}
DESCRIPTIONS = {"none": "not padded (this CPU's kernels compute a row alone as in verify)",
                "attention": "attention padded to two query rows",
                "all": "padded to two rows"}
# a drafter head's graph (exporter/heads/) has no pad rewrite: its probe must find nothing to pad
HEAD_REWRITES = {"none": PAD_REWRITES["none"]}


def kernels_in(model: onnx.ModelProto) -> list[Kernel]:
    """Each distinct kernel ``model``'s rows go through that may compute a row alone differently."""
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    shapes = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim] for v in graph.input}
    found: list[Kernel] = []
    for node in graph.node:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if node.op_type == "MatMulNBits":
            found.append(QuantMatMul(attrs["K"], attrs["N"], attrs["bits"], attrs["block_size"],
                                     attrs.get("accuracy_level", 0), len(node.input) > 3 and bool(node.input[3])))
        elif node.op_type == "MatMul" and node.input[1] in inits and len(inits[node.input[1]].dims) == 2:
            k, n = inits[node.input[1]].dims
            found.append(FloatMatMul(int(k), int(n)))
        elif node.op_type == GQA:
            past = shapes.get(node.input[3]) or []  # [B, n_kv, S_max, hd]
            head_dim = int(past[3])  # the cache's static dims: every ort-gqa graph's
            found.append(Attention(attrs["num_heads"], attrs["kv_num_heads"], head_dim, int(past[2]),
                                   round(float(attrs.get("scale", 0.0)), 7), attrs.get("do_rotary", 0),
                                   round(float(attrs.get("softcap", 0.0)), 7), max(attrs.get("local_window_size", 0), 0),
                                   len(node.input) > 16 and bool(node.input[16])))
    return list(dict.fromkeys(found))


class RowExactness:
    """Pads each graph of one model as the build machine's kernels need, and records what it did.
    ``prober``: kernel_probe.probe (a test passes its own verdicts). ``rewrites``: the pads this
    kind of graph can take (PAD_REWRITES for a decoder's ort-gqa graphs, HEAD_REWRITES for a
    head's); a verdict beyond them is refused in one line, whose fix is ``fix``."""

    def __init__(self, model: str, threads: int | None, max_rows: int, max_tokens: int,
                 prober: Callable[..., Probe] | None = None,
                 rewrites: dict[str, Callable[[onnx.ModelProto, int], None]] = PAD_REWRITES,
                 label: str | None = None, fix: str = "use precision: fp32"):
        self.model = model
        self.threads = threads
        self.max_rows = max_rows
        self.max_tokens = max_tokens
        self.prober = prober
        self.rewrites = rewrites
        self.label = label or f"model '{model}' at this quantization"
        self.fix = fix
        self.probes: list[Probe] = []
        self.applied: list[str] = []  # the pad each graph got
        self.held = True  # False: the graphs are only observed, not held to agree (observe)

    def pad(self, model: onnx.ModelProto, max_seq_len: int, largest: tuple[int, int] | None = None) -> str:
        """Pad ``model`` in place as the probe says; returns the pad applied (PADS). ``largest``:
        (rows, tokens) of this graph's largest call where it is not the model's (a head's graphs
        differ); the record keeps the largest probed."""
        if largest is not None:
            self.max_rows, self.max_tokens = max(self.max_rows, largest[0]), max(self.max_tokens, largest[1])
        rows, tokens = largest or (self.max_rows, self.max_tokens)
        prober = self.prober or kernel_probe.probe
        probe = prober(kernels_in(model), self.threads, rows, tokens)
        if probe.refusal is not None:
            raise BadInput(f"recipe: {self.label}: {probe.refusal}")
        pad = probe.pad
        if pad == "attention" and has_tree_inputs(model.graph):
            pad = "all"  # the attention pad handles chains; a tree graph takes row_pad's
        if pad not in self.rewrites:
            differs = "; ".join(kernel_probe.describe(k) for k, agreed in probe.kernels if not agreed.one_row_equal)
            raise BadInput(f"recipe: {self.label}: on this CPU a row alone differs from the same row in a "
                           f"multi-row call ({differs}) and this graph has no pad that makes them agree: {self.fix}")
        self.rewrites[pad](model, max_seq_len)
        self.probes.append(probe)
        self.applied.append(pad)
        return pad

    def observe(self, model: onnx.ModelProto) -> Probe:
        """Probe and record ``model``'s kernels without padding it or refusing it: a graph not held
        to agree row for row (the quantized-self drafter: a drafter's rows do not decide the output)."""
        prober = self.prober or kernel_probe.probe
        probe = prober(kernels_in(model), self.threads, self.max_rows, self.max_tokens)
        self.probes.append(probe)
        self.applied.append("none")
        self.held = False
        return probe

    @property
    def least_pad(self) -> str:
        """The least any graph of the model was padded: what a CPU at load must not need more of."""
        return min(self.applied, key=PADS.index) if self.applied else "all"

    def describe(self) -> str:
        return DESCRIPTIONS[self.least_pad]

    def record(self) -> dict:
        """The manifest's ``quantization.exactness``: the pad, and each kernel's agreement here."""
        kernels: dict[Kernel, dict] = {}
        for probe in self.probes:
            for kernel, row in zip((k for k, _ in probe.kernels), probe.record()["kernels"]):
                kernels.setdefault(kernel, row)
        threads = self.probes[0].threads if self.probes else self.threads  # what the sessions ran on
        return {"pad": self.least_pad, "threads": threads, "max_rows": self.max_rows,
                "max_tokens": self.max_tokens, "cpu_flags": kernel_probe.cpu_flags(), "kernels": list(kernels.values()),
                **({} if self.held else {"held": False})}
