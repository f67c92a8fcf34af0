"""A GGUF file's quantized blocks, where MatMulNBits represents them exactly.

MatMulNBits dequantizes a block of 32 weights as ``scale · (code − zero_point)`` with integer
codes and (on the fast CPU kernels) integer zero points. Three GGUF block types map exactly:

- Q4_0: ``d · (q − 8)``, q in 0..15: 4-bit codes, zero point 8.
- Q8_0: ``d · q``, q in −127..127: 8-bit codes ``q + 128``, zero point 128.
- Q4_1: ``d · q + m``, q in 0..15: 4-bit codes at zero point 0, and the offset ``m`` of each
  block carried beside the kernel: x·w = Σ_blocks d·(x_b·q_b) + Σ_blocks m·sum(x_b), the second
  sum a small fp32 MatMul over the input's block sums (quantize.py). The build stores the codes
  at the default zero point 8 with offsets m + 8d instead (``Blocks.centered``): the same
  weights, on the kernel's faster no-zero-point path. MatMulNBits also takes float zero points,
  which would carry m/d in the kernel itself, but its CPU kernels then run 6–20× slower per
  call (measured on this project's 2-core machine).

Everything else is requantized from the dequantized weights, and ``WHY_NOT`` says why (K-quants
use 256-weight super-blocks with 6-bit sub-block scales).

A graph's weight is matched to its GGUF tensor by value: transformers dequantizes the same
blocks with gguf's own ``dequantize`` (bit for bit what ``dequantized`` here computes), and
may permute rows (Llama's q/k projections), which keeps each row's blocks whole, so every row
of the graph's weight is found by its bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

BLOCK = 32  # weights per block of Q4_0 and Q8_0
# type name -> (bits, zero point, bytes per block)
EXACT = {"Q4_0": (4, 8, 2 + BLOCK // 2), "Q8_0": (8, 128, 2 + BLOCK), "Q4_1": (4, 0, 4 + BLOCK // 2)}
OFFSET_TYPES = ("Q4_1",)
DEFAULT_ZERO_POINT = {4: 8, 8: 128}  # MatMulNBits' zero point where a node has no zero-point input  # d · q + m: a float offset per block beside the codes
WHY_NOT = {
    "Q5_0": "5-bit codes: the build makes 4- and 8-bit MatMulNBits only",
    "Q5_1": "5-bit codes: the build makes 4- and 8-bit MatMulNBits only",
    "F32": "float weights",
    "F16": "float weights",
    "BF16": "float weights",
}
K_QUANT = "256-weight super-blocks with 6-bit sub-block scales: no MatMulNBits layout"


@dataclass
class Blocks:
    """One GGUF tensor's blocks in MatMulNBits' terms: ``codes`` [rows, cols] unsigned, ``scales``
    [rows, cols / 32]; a weight is scales · (codes − zero_point) + offsets. Rows are output channels."""

    name: str  # the GGUF tensor's name (blk.3.attn_q.weight)
    type: str  # Q4_0 | Q8_0 | Q4_1
    bits: int
    zero_point: int
    codes: np.ndarray  # [rows, cols] uint8
    scales: np.ndarray  # [rows, cols // 32] float32
    offsets: np.ndarray | None = None  # [rows, cols // 32] float32 (Q4_1's m), else None

    def dequantized(self) -> np.ndarray:
        """[rows, cols] float32, as gguf's dequantize computes it (d · q + m for Q4_1)."""
        rows, cols = self.codes.shape
        blocks = self.codes.reshape(rows, cols // BLOCK, BLOCK).astype(np.float32) - np.float32(self.zero_point)
        values = blocks * self.scales[:, :, None]
        if self.offsets is not None:
            values = values + self.offsets[:, :, None]
        return values.reshape(rows, cols)

    def centered(self) -> Blocks:
        """Q4_1's blocks at MatMulNBits' default 4-bit zero point: d·(q − 8) + (m + 8d), the same
        weights (each is one rounding of the same sum), on the kernel's no-zero-point path (a lone
        [576, 3072] call, AVX512-VNNI: 14 against 24 us; in SmolLM2's graph a few percent at
        most), and the int8 activations' rounding no longer multiplied by the code offset 8d. Only where every m + 8d is exact in fp32; else self."""
        if self.offsets is None or self.bits != 4 or self.zero_point != 0:
            return self
        shifted = self.offsets + np.float32(8) * self.scales  # [rows, cols / 32] fp32
        exact = shifted.astype(np.float64) == self.offsets.astype(np.float64) + 8.0 * self.scales.astype(np.float64)
        if not exact.all():
            return self
        return Blocks(self.name, self.type, self.bits, DEFAULT_ZERO_POINT[4], self.codes, self.scales, shifted)


def tensor_kind(name: str) -> str:
    """``blk.3.attn_q.weight`` -> ``attn_q``; ``token_embd.weight`` -> ``token_embd``."""
    parts = name.split(".")
    return parts[2] if parts[0] == "blk" and len(parts) > 3 else parts[0]


def why_requantized(type_name: str) -> str:
    return WHY_NOT.get(type_name, K_QUANT if type_name.endswith("_K") else f"{type_name}: no exact MatMulNBits layout")


def parse_blocks(raw: np.ndarray, type_name: str, rows: int, cols: int
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Raw GGUF bytes [rows, bytes per row] of a Q4_0, Q4_1 or Q8_0 tensor -> (codes [rows, cols]
    uint8 unsigned, scales [rows, cols / 32] float32, Q4_1's offsets [rows, cols / 32] or None)."""
    bits, zero, size = EXACT[type_name]
    blocks = np.ascontiguousarray(raw).reshape(rows, cols // BLOCK, size)  # [rows, nb, bytes]
    scales = blocks[:, :, :2].copy().view(np.float16)[:, :, 0].astype(np.float32)  # [rows, nb]
    offsets = None
    header = 2
    if type_name in OFFSET_TYPES:
        offsets = blocks[:, :, 2:4].copy().view(np.float16)[:, :, 0].astype(np.float32)  # [rows, nb]
        header = 4
    body = blocks[:, :, header:]
    if bits == 8:
        codes = (body.view(np.int8).astype(np.int16) + zero).astype(np.uint8)  # [rows, nb, 32]
    else:  # byte j: q[j] in the low nibble, q[j + 16] in the high one
        codes = np.concatenate([body & 0x0F, body >> 4], axis=-1)  # [rows, nb, 32]
    return codes.reshape(rows, cols), scales, offsets


@dataclass
class GgufTensor:
    """A 2-D GGUF tensor: its blocks where MatMulNBits keeps them exactly, else None (requantized)."""

    name: str
    type: str
    blocks: Blocks | None
    shape: tuple[int, int]  # [rows, cols]: output channels, inputs


def read_tensors(path: Path) -> tuple[list[GgufTensor], list[np.ndarray]]:
    """Every 2-D tensor of ``path`` (the MatMul weights and the embedding), and each one's values
    [rows, cols] float32 as gguf's dequantize gives them (what transformers loads)."""
    import gguf
    from gguf.quants import dequantize

    reader = gguf.GGUFReader(str(path))
    tensors, values = [], []
    for tensor in reader.tensors:
        if len(tensor.shape) != 2:
            continue  # norms and biases: not MatMul weights
        type_name = tensor.tensor_type.name
        cols, rows = (int(x) for x in tensor.shape)  # GGUF lists the fastest dimension first
        blocks = None
        if type_name in EXACT and cols % BLOCK == 0:
            codes, scales, offsets = parse_blocks(np.asarray(tensor.data), type_name, rows, cols)
            bits, zero, _ = EXACT[type_name]
            blocks = Blocks(tensor.name, type_name, bits, zero, codes, scales, offsets)
            values.append(blocks.dequantized())
        else:
            values.append(np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(rows, cols))
        tensors.append(GgufTensor(tensor.name, type_name, blocks, (rows, cols)))
    return tensors, values


class RowIndex:
    """Every row of a GGUF file's 2-D tensors by its bytes: finds a graph weight's tensor, rows
    permuted or not."""

    def __init__(self, tensors: list[GgufTensor], values: list[np.ndarray]):
        self.tensors = tensors
        self._rows: dict[bytes, tuple[int, int]] = {}
        for t, array in enumerate(values):
            for r, row in enumerate(array):
                self._rows.setdefault(row.tobytes(), (t, r))

    @classmethod
    def of_file(cls, path: Path) -> RowIndex:
        return cls(*read_tensors(path))

    def find(self, weight: np.ndarray) -> Match | None:
        """``weight`` [out, in] float32 -> where each of its rows is in the file (a graph may fuse
        several tensors into one weight: q, k and v), or None when some row is in none."""
        found = [self._rows.get(np.ascontiguousarray(row, dtype=np.float32).tobytes()) for row in weight]
        if not found or any(f is None for f in found):
            return None
        order: list[int] = []
        for t, _ in found:  # type: ignore[misc]
            if t not in order:
                order.append(t)
        if any(self.tensors[t].shape[1] != weight.shape[1] for t in order):
            return None
        return Match([self.tensors[t] for t in order], [(order.index(t), r) for t, r in found])  # type: ignore[misc]


@dataclass
class Match:
    """A graph weight's rows in a GGUF file: the tensors they come from (in order), and for each
    row (its tensor's index in ``tensors``, its row there)."""

    tensors: list[GgufTensor]
    rows: list[tuple[int, int]]

    @property
    def name(self) -> str:
        return "+".join(t.name for t in self.tensors)

    @property
    def kind(self) -> str:
        types = "/".join(sorted({t.type for t in self.tensors}))
        return f"{'+'.join(tensor_kind(t.name) for t in self.tensors)} ({types})"

    def blocks(self) -> Blocks | None:
        """The rows' blocks gathered in the graph's order, when every tensor is exact at one bit
        width; else None."""
        exact = [t.blocks for t in self.tensors]
        if any(b is None for b in exact) or len({t.type for t in self.tensors}) != 1:
            return None
        first = exact[0]
        assert first is not None
        codes = np.stack([exact[t].codes[r] for t, r in self.rows])  # type: ignore[union-attr]  # [out, in]
        scales = np.stack([exact[t].scales[r] for t, r in self.rows])  # type: ignore[union-attr]  # [out, nb]
        offsets = (np.stack([exact[t].offsets[r] for t, r in self.rows])  # type: ignore[union-attr,index]
                   if first.offsets is not None else None)  # [out, nb]
        return Blocks(self.name, first.type, first.bits, first.zero_point, codes, scales, offsets)

    def why_not(self) -> str:
        inexact = sorted({t.type for t in self.tensors if t.blocks is None})
        if inexact:
            return "; ".join(why_requantized(t) for t in inexact)
        return "its tensors are of different GGUF types"
