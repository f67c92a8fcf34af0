"""A model built at `precision: int4 | int8`: its graph's weights quantized, its GGUF blocks
kept where they map, the graph lightened (nbits_graph), its one-row calls padded as the
machine's kernels need (exact_rows), and the reference it is validated against.

The build validates a quantized graph against transformers running the same model with every
quantized weight replaced by what the kernel computes with (``dequantized_reference``): the
quantization error is the recipe's choice, so what the build checks is that the graph
computes that model (limits per accuracy level: validate.TOLERANCES).
"""

from __future__ import annotations

import copy
import hashlib
from pathlib import Path

import numpy as np
import onnx

from specexport.exporter.exact_rows import RowExactness
from specexport.exporter.gguf_blocks import RowIndex
from specexport.exporter.nbits_graph import lighten
from specexport.exporter.quantize import (
    WeightQuant,
    count_quantized,
    dequantized,
    quantize_weights,
    report_rows,
)
from specexport.exporter.recipe import GgufSource, Quantization
from specexport.exporter.row_pad import pad_single_rows

BITS = {"int4": 4, "int8": 8}


def channel_keys(weight: np.ndarray) -> list[bytes]:
    """Each output channel of ``weight`` [out, in] by value: a graph may fuse several Linear
    weights into one MatMul (q, k and v) or reorder their channels, so weights are matched
    channel by channel."""
    rows = np.ascontiguousarray(weight, dtype=np.float32)
    return [hashlib.sha1(row.tobytes()).digest() for row in rows]


class Quantizer:
    """Quantizes one model's exported graph(s) as the recipe says, and reports what it did."""

    def __init__(self, options: Quantization, precision: str, source, base: Path, model: str,
                 exactness: RowExactness | None = None):
        """``exactness``: what decides each graph's pad (None: padded in full, row_pad)."""
        self.options = options
        self.exactness = exactness
        self.precision = precision
        bits = BITS[precision]
        head = {"int4": 4, "int8": 8, "fp32": None}[options.head] if options.head else bits
        self.spec = WeightQuant(bits, options.block_size, options.symmetric, options.accuracy_level, head)
        self.model = model
        self.gguf: RowIndex | None = None
        if isinstance(source, GgufSource) and options.gguf == "keep":
            from specexport.exporter.sources import gguf_path

            self.gguf = RowIndex.of_file(gguf_path(source, base, "target"))
        self.rows: list[dict] = []
        # fp32 output channel (by value) -> (the graph weight holding it, its column there)
        self.channels: dict[bytes, tuple[str, int]] = {}
        self.weights: dict[str, np.ndarray] = {}  # source name -> [K, N] as the kernel computes with it
        self.fused: list[list[str]] = []  # weights computed by one MatMulNBits (nbits_graph.fuse_siblings)
        self.nodes = 0  # MatMulNBits nodes in the quantized graph

    def apply(self, proto: onnx.ModelProto, max_seq_len: int) -> onnx.ModelProto:
        inits = {t.name: t for t in proto.graph.initializer}
        for name in {n.input[1] for n in proto.graph.node if n.op_type == "MatMul" and n.input[1] in inits}:
            weight = onnx.numpy_helper.to_array(inits[name])  # [K, N]
            if weight.ndim == 2:
                for column, key in enumerate(channel_keys(weight.T)):
                    self.channels.setdefault(key, (name, column))
        model, rows = quantize_weights(proto, self.spec, gguf=self.gguf, light=False)
        for row in rows:
            if not row["kept"] and "why" not in row:
                row["why"] = self._why(row)
        self.rows = rows
        offsets = {r["weight"]: r.pop("offsets") for r in rows if "offsets" in r}
        self.weights = dequantized(model, offsets)  # weight by weight, before siblings fuse
        self.fused = lighten(model, offsets)
        self.nodes = count_quantized(model)
        if self.exactness is not None:
            self.exactness.pad(model, max_seq_len)
        else:
            pad_single_rows(model, max_seq_len)
        return model

    def _why(self, row: dict) -> str:
        if self.gguf is None:
            return ("recipe: quantization.gguf: requantize" if self.options.gguf == "requantize"
                    else "the source is not a GGUF file")
        return "no GGUF tensor holds exactly these weights"

    def _kind(self, row: dict) -> str:
        if "gguf_kind" in row:
            return row["gguf_kind"]
        if row["head"]:
            return "output head"
        return "other MatMul weights"

    def report(self) -> dict[str, dict]:
        return report_rows(self.rows, self._kind)

    def report_lines(self) -> list[str]:
        lines = []
        for kind, entry in self.report().items():
            what = (f"kept {entry['kept']} of {entry['weights']} as GGUF blocks" if entry["kept"]
                    else f"requantized {entry['weights']}")
            why = f": {'; '.join(entry['why'])}" if entry["why"] and entry["kept"] < entry["weights"] else ""
            lines.append(f"{kind}: {what}, {entry['bits']}-bit{why}")
        return lines

    def summary(self) -> str:
        kept = sum(r["kept"] for r in self.rows)
        fused = f", {len(self.fused)} groups of siblings fused" if self.fused else ""
        return (f"{len(self.rows)} weights in {self.nodes} MatMulNBits ({self.precision}, block {self.spec.block_size}, "
                f"accuracy level {self.spec.accuracy_level}), {kept} kept from GGUF blocks{fused}, one-row calls "
                f"{self._padded()}")

    def _padded(self) -> str:
        return self.exactness.describe() if self.exactness is not None else "padded to two rows"

    def manifest_info(self) -> dict:
        return {"precision": self.precision, "bits": self.spec.bits, "head_bits": self.spec.head_bits,
                "block_size": self.spec.block_size, "symmetric": self.spec.symmetric,
                "accuracy_level": self.spec.accuracy_level, "one_row_calls": self._padded(),
                **({"exactness": self.exactness.record()} if self.exactness is not None else {}),
                "weights": self.report(), "fused": ["+".join(group) for group in self.fused]}

    @property
    def tolerance_key(self) -> str:
        """validate.TOLERANCES' row for this model's graphs."""
        return f"{self.precision}/acc{self.spec.accuracy_level}"


def dequantized_reference(hf_model, quantizer: Quantizer):
    """A copy of ``hf_model`` whose Linear weights that the graph quantized are what its kernel
    computes with, channel by channel (tied heads untied: the graph's embedding stays fp32).
    Returns (model, the quantized graph weights it could not place in full)."""
    import torch

    reference = copy.deepcopy(hf_model)
    placed: dict[str, int] = {}
    for module in reference.modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        weight = module.weight.detach().float().numpy()  # [out, in]
        found = [quantizer.channels.get(key) for key in channel_keys(weight)]
        if any(f is None or f[0] not in quantizer.weights for f in found):
            continue
        new = np.stack([quantizer.weights[name][:, column] for name, column in found])  # [out, in]  # type: ignore[misc]
        module.weight = torch.nn.Parameter(torch.from_numpy(new), requires_grad=False)
        for name, _ in found:  # type: ignore[misc]
            placed[name] = placed.get(name, 0) + 1
    missing = sorted(name for name, w in quantizer.weights.items() if placed.get(name, 0) < w.shape[1])
    return reference.eval(), missing
