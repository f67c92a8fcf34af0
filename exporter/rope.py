"""RoPE cos/sin tables from transformers' own rotary module, evaluated reproducibly.

The module defines the table (every RoPE type: scaled, YaRN, per layer type), but torch's
float32 cos is not reproducible from process to process: in some processes (4 of 40, measured
2026-12-04 on the project's VM, torch 2.x, the tiny llama's [160, 16] table) rows 80 onwards came
out 1.5e-4 off, where transformers' own forward (the build's reference) had them right, and the
build's validation failed 1 build in about 12. So where the module computes the standard
formula, cos/sin(position · inv_freq) · attention_scaling over (freqs, freqs), the table is that
formula in float64 from the module's own frequencies, rounded once to float32; a module that
computes anything else (its output more than ``FORMULA_TOLERANCE`` away) keeps its own output.
"""

from __future__ import annotations

import torch

FORMULA_TOLERANCE = 1e-3  # far above float32 cos error (~1e-6), far below any other formula's difference


def rotary_tables(rotary, positions: int, layer_type: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [positions, rot] float32 of ``rotary`` (a transformers rotary module; ``layer_type``
    for a module with a table per layer type) at positions 0 .. positions - 1."""
    ids = torch.arange(positions).unsqueeze(0)  # [1, S]
    probe = torch.zeros(1, dtype=torch.float32)
    cos, sin = rotary(probe, ids) if layer_type is None else rotary(probe, ids, layer_type)  # [1, S, rot]
    cos, sin = cos[0].float(), sin[0].float()
    prefix = f"{layer_type}_" if layer_type is not None else ""
    inv_freq = getattr(rotary, f"{prefix}inv_freq", None)  # [rot / 2], as the forward just used it
    scaling = getattr(rotary, f"{prefix}attention_scaling", None)
    if not isinstance(inv_freq, torch.Tensor) or scaling is None:
        return cos, sin
    angles = torch.arange(positions, dtype=torch.float64)[:, None] * inv_freq.double()[None]  # [S, rot / 2]
    emb = torch.cat((angles, angles), dim=-1)  # [S, rot]
    exact_cos, exact_sin = (emb.cos() * float(scaling)).float(), (emb.sin() * float(scaling)).float()
    if exact_cos.shape != cos.shape or not (torch.allclose(exact_cos, cos, rtol=0, atol=FORMULA_TOLERANCE)
                                            and torch.allclose(exact_sin, sin, rtol=0, atol=FORMULA_TOLERANCE)):
        return cos, sin  # another formula: the module's own
    return exact_cos, exact_sin
