"""RoPE tables (exporter/rope.py): transformers' rotary module defines them, the standard formula
is evaluated in float64 (torch's float32 cos came out 1.5e-4 off past row 80 in some processes,
failing about one tiny build in twelve), and a module with another formula keeps its own."""

from __future__ import annotations

import torch

from specexport.exporter.recipe import TinySource
from specexport.exporter.rope import rotary_tables
from specexport.exporter.tiny import tiny_model


def llama_rotary():
    model, _ = tiny_model(TinySource(source="tiny", arch="llama"))
    return model.model.rotary_emb


def exact(rotary, positions: int) -> torch.Tensor:
    angles = torch.arange(positions, dtype=torch.float64)[:, None] * rotary.inv_freq.double()[None]
    return torch.cat((angles, angles), -1).cos().float()  # [S, rot]


def test_tables_are_the_formula_rounded_once():
    rotary = llama_rotary()
    cos, sin = rotary_tables(rotary, 160)
    module_cos, _ = rotary(torch.zeros(1), torch.arange(160)[None])
    assert torch.equal(cos, exact(rotary, 160))
    assert (cos - module_cos[0]).abs().max() < 1e-5  # the module's own float32 evaluation, where it is right
    assert sin.shape == cos.shape == (160, rotary.inv_freq.numel() * 2)


class Off(torch.nn.Module):
    """A module whose float32 cos is off past row 80, as torch's was in some processes."""

    def __init__(self, rotary):
        super().__init__()
        self.inner, self.inv_freq, self.attention_scaling = rotary, rotary.inv_freq, rotary.attention_scaling

    def forward(self, x, position_ids):
        cos, sin = self.inner(x, position_ids)
        return torch.cat((cos[:, :80], cos[:, 80:] + 1.5e-4), dim=1), sin


class Interleaved(Off):
    """Another formula: the angles interleaved (cos(f0), cos(f0), cos(f1), ...), not (freqs, freqs)."""

    def forward(self, x, position_ids):
        angles = position_ids[0, :, None].float() * self.inv_freq[None]  # [S, rot / 2]
        emb = angles.repeat_interleave(2, dim=-1)[None]  # [1, S, rot]
        return emb.cos(), emb.sin()


def test_a_slightly_wrong_evaluation_is_replaced_and_another_formula_kept():
    rotary = llama_rotary()
    cos, _ = rotary_tables(Off(rotary), 160)
    assert torch.equal(cos, exact(rotary, 160))
    other = Interleaved(rotary)
    cos, sin = rotary_tables(other, 160)
    want_cos, want_sin = other(torch.zeros(1), torch.arange(160)[None])
    assert torch.equal(cos, want_cos[0]) and torch.equal(sin, want_sin[0])
