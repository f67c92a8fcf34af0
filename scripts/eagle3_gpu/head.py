"""The EAGLE-3 head being trained, in the SafeAILab layout and math (the one specexport's
exporter/heads/eagle3.py loads): g = fc(concat of the three taps) [H]; the layer's attention
reads concat(input_layernorm(embed(token)), hidden_norm(g)) [2H] with residual g; logits =
lm_head(norm(stream)) over the draft vocabulary; the next step's features are the stream
before the final norm.

Training-time test (SafeAILab traineagle3): step j of an unrolled chain feeds row p the token
x_{p+1+j} and the head's own stream of step j-1 at row p, at rope position p+j (the cache slot
the runtime gives it). Its query sees the step-0 keys of rows <= p (the catch-up rows the
target's features fill) and the keys of steps 1..j at row p (its own earlier drafts), which is
the attention the runtime's step graph computes for a chain anchored at p.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from llama import apply_rope, rope_cos_sin
from torch import nn


class Norm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(size)), eps

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight.to(x.dtype)


def linear(n_in: int, n_out: int, std: float = 0.02) -> nn.Linear:
    layer = nn.Linear(n_in, n_out, bias=False)
    nn.init.normal_(layer.weight, std=std)
    return layer


class Eagle3Head(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, inter: int, n_taps: int,
                 draft_vocab: int, eps: float, rope_theta: float, embed: torch.Tensor):
        super().__init__()
        self.hidden, self.heads, self.kv_heads, self.head_dim = hidden, heads, kv_heads, head_dim
        self.rope_theta = rope_theta
        self.register_buffer("embed", embed, persistent=False)  # [V, H] the target's, frozen
        self.fc = linear(n_taps * hidden, hidden)
        self.input_layernorm, self.hidden_norm = Norm(hidden, eps), Norm(hidden, eps)
        self.q_proj = linear(2 * hidden, heads * head_dim)
        self.k_proj = linear(2 * hidden, kv_heads * head_dim)
        self.v_proj = linear(2 * hidden, kv_heads * head_dim)
        self.o_proj = linear(heads * head_dim, hidden, std=0.02 / math.sqrt(2))
        self.post_attention_layernorm = Norm(hidden, eps)
        self.gate_proj, self.up_proj = linear(hidden, inter), linear(hidden, inter)
        self.down_proj = linear(inter, hidden, std=0.02 / math.sqrt(2))
        self.norm = Norm(hidden, eps)
        self.lm_head = linear(hidden, draft_vocab)

    def state_names(self) -> dict[str, nn.Parameter]:
        """Parameters under their SafeAILab checkpoint names."""
        mid = ("input_layernorm", "hidden_norm", "post_attention_layernorm")
        names = {"fc.weight": self.fc.weight, "norm.weight": self.norm.weight, "lm_head.weight": self.lm_head.weight}
        for n in mid:
            names[f"midlayer.{n}.weight"] = getattr(self, n).weight
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
            names[f"midlayer.self_attn.{n}.weight"] = getattr(self, n).weight
        for n in ("gate_proj", "up_proj", "down_proj"):
            names[f"midlayer.mlp.{n}.weight"] = getattr(self, n).weight
        return names

    def unroll(self, tokens: torch.Tensor, aux: torch.Tensor, steps: int, want_rows=None):
        """tokens [B, R + steps - 1]: column c holds x_{c+1} (the token row c is fed at step 0);
        aux [B, R, n·H] the target's taps of rows 0..R-1. Returns, per step j, the final-normed
        stream [B, R, H] (or its rows ``want_rows[j]`` (a bool mask [B, R]) as [n_j, H])."""
        b, r, _ = aux.shape
        g = self.fc(aux.to(self.fc.weight.dtype))  # [B, R, H] (bf16 storage; autocast picks the compute type)
        keys, values, outs = [], [], []
        base = torch.arange(r, device=aux.device).expand(b, r)  # [B, R]
        causal = torch.ones(r, r, dtype=torch.bool, device=aux.device).tril()  # [R, R]
        rep = self.heads // self.kv_heads
        for j in range(steps):
            emb = F.embedding(tokens[:, j : j + r], self.embed).to(g.dtype)  # [B, R, H]
            x = torch.cat((self.input_layernorm(emb), self.hidden_norm(g)), dim=-1)  # [B, R, 2H]
            cos, sin = rope_cos_sin(base + j, self.head_dim, self.rope_theta)
            q = apply_rope(self.q_proj(x).view(b, r, self.heads, self.head_dim).transpose(1, 2), cos, sin)
            k = apply_rope(self.k_proj(x).view(b, r, self.kv_heads, self.head_dim).transpose(1, 2), cos, sin)
            v = self.v_proj(x).view(b, r, self.kv_heads, self.head_dim).transpose(1, 2)  # [B, kv, R, hd]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)  # [B, heads, R, hd]
            keys.append(k)
            values.append(v)
            scale = self.head_dim**-0.5
            q = q.to(k.dtype)
            s0 = (q @ keys[0].transpose(2, 3)) * scale  # [B, heads, R, R]
            s0 = s0.masked_fill(~causal, float("-inf"))
            diag = [(q * kk).sum(-1, keepdim=True) * scale for kk in keys[1:]]  # j of [B, heads, R, 1]
            probs = torch.softmax(torch.cat([s0, *diag], dim=-1).float(), dim=-1).to(v.dtype)
            a = probs[..., :r] @ values[0]  # [B, heads, R, hd]
            for i, vv in enumerate(values[1:]):
                a = a + probs[..., r + i : r + i + 1] * vv
            stream = g + self.o_proj(a.transpose(1, 2).reshape(b, r, -1))  # [B, R, H]
            h = self.post_attention_layernorm(stream)
            stream = stream + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))
            normed = self.norm(stream)
            outs.append(normed if want_rows is None else normed[want_rows[j]])
            g = stream  # the next step's features: the stream before the final norm
        return outs
