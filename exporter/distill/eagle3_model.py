"""The EAGLE-3 head being trained, in the SafeAILab layout and math that
``exporter/heads/eagle3.py`` loads (one decoder layer, the target's embedding):

    g = fc(concat of the taps)                                    [H]
    x = concat(input_layernorm(embed(token)), hidden_norm(g))      [2H]
    s = g + o_proj(attention(x));  s = s + mlp(post_attention_layernorm(s))
    logits = lm_head(norm(s)) over the draft vocabulary (target id = i + d2t[i])

and the next step is fed ``s`` (the stream before the final norm) in place of g.

Training-time test (the unrolled chain the runtime runs): step j feeds row p the token
x_{p+1+j} and the head's own stream of step j-1 at row p, at rope position p+j. Its query sees
the step-0 keys of rows <= p (the catch-up rows, fed the target's features) and the keys of
steps 1..j at row p (its own earlier drafts), as the runtime's step graph does for a chain
anchored at p. The rope table is transformers' own for the head's config, the one the loader
builds its graphs with.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def head_config(target_cfg, taps: tuple[int, ...], draft_vocab: int) -> dict:
    """The checkpoint's config.json (SafeAILab EAGLE-3, a llama decoder layer of the target's
    sizes), naming its taps so the loader needs no recipe override."""
    hidden = target_cfg.hidden_size
    heads = target_cfg.num_attention_heads
    rope = dict(getattr(target_cfg, "rope_parameters", None) or {})
    theta = rope.pop("rope_theta", None) or getattr(target_cfg, "rope_theta", None) or 10000.0
    scaling = rope if rope.get("rope_type", "default") != "default" else None
    return {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": hidden, "intermediate_size": target_cfg.intermediate_size,
        "num_attention_heads": heads, "num_key_value_heads": getattr(target_cfg, "num_key_value_heads", None) or heads,
        "head_dim": getattr(target_cfg, "head_dim", None) or hidden // heads, "num_hidden_layers": 1,
        "rms_norm_eps": float(getattr(target_cfg, "rms_norm_eps", 1e-6)), "rope_theta": float(theta),
        "rope_scaling": scaling, "max_position_embeddings": target_cfg.max_position_embeddings,
        "vocab_size": target_cfg.vocab_size, "draft_vocab_size": int(draft_vocab), "target_hidden_size": hidden,
        "tie_word_embeddings": False, "eagle_aux_hidden_state_layer_ids": list(taps), "torch_dtype": "float16",
    }


def rope_tables(config: dict, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [positions, head_dim] from transformers' rotary class for ``config``."""
    from specexport.exporter.heads.eagle3 import hf_config, rope_table

    return rope_table(hf_config(config, "distill"), positions)


class Norm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(size)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight.to(x.dtype)


def _linear(n_in: int, n_out: int, std: float) -> nn.Linear:
    layer = nn.Linear(n_in, n_out, bias=False)
    nn.init.normal_(layer.weight, std=std)
    return layer


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rope: x [B, heads, R, hd], cos/sin [R, hd]."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class Eagle3Draft(nn.Module):
    def __init__(self, config: dict, n_taps: int, embed: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]):
        super().__init__()
        h, eps = config["hidden_size"], config["rms_norm_eps"]
        self.heads, self.kv_heads, self.head_dim = (config["num_attention_heads"], config["num_key_value_heads"],
                                                    config["head_dim"])
        inter, t_hidden = config["intermediate_size"], config["target_hidden_size"]
        self.register_buffer("embed", embed, persistent=False)  # [V, H] the target's, frozen, not saved
        self.register_buffer("cos", rope[0], persistent=False)  # [S, hd]
        self.register_buffer("sin", rope[1], persistent=False)
        std = 0.02
        self.fc = _linear(n_taps * t_hidden, h, std)
        self.input_layernorm, self.hidden_norm = Norm(h, eps), Norm(h, eps)
        self.q_proj = _linear(2 * h, self.heads * self.head_dim, std)
        self.k_proj = _linear(2 * h, self.kv_heads * self.head_dim, std)
        self.v_proj = _linear(2 * h, self.kv_heads * self.head_dim, std)
        self.o_proj = _linear(self.heads * self.head_dim, h, std / math.sqrt(2))
        self.post_attention_layernorm = Norm(h, eps)
        self.gate_proj, self.up_proj = _linear(h, inter, std), _linear(h, inter, std)
        self.down_proj = _linear(inter, h, std / math.sqrt(2))
        self.norm = Norm(h, eps)
        self.lm_head = _linear(h, config["draft_vocab_size"], std)

    def checkpoint_names(self) -> dict[str, nn.Parameter]:
        """Every parameter under its SafeAILab checkpoint name."""
        names = {"fc.weight": self.fc.weight, "norm.weight": self.norm.weight, "lm_head.weight": self.lm_head.weight}
        for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
            names[f"midlayer.{n}.weight"] = getattr(self, n).weight
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
            names[f"midlayer.self_attn.{n}.weight"] = getattr(self, n).weight
        for n in ("gate_proj", "up_proj", "down_proj"):
            names[f"midlayer.mlp.{n}.weight"] = getattr(self, n).weight
        return names

    def unroll(self, tokens: torch.Tensor, aux: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """tokens [B, R + steps - 1] (column c holds x_{c+1}, the token row c is fed at step 0);
        aux [B, R, n·H] the target's taps of rows 0..R-1. Returns, per step j, the final-normed
        stream [B, R, H] (row p predicts x_{p+2+j})."""
        b, r, _ = aux.shape
        g = self.fc(aux.to(self.fc.weight.dtype))  # [B, R, H]
        causal = torch.ones(r, r, dtype=torch.bool, device=aux.device).tril()  # [R, R]
        rep, scale = self.heads // self.kv_heads, self.head_dim**-0.5
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        outs = []
        for j in range(steps):
            emb = F.embedding(tokens[:, j : j + r], self.embed).to(g.dtype)  # [B, R, H]
            x = torch.cat((self.input_layernorm(emb), self.hidden_norm(g)), dim=-1)  # [B, R, 2H]
            cos, sin = self.cos[j : j + r], self.sin[j : j + r]  # [R, hd]: row p at position p + j
            q = _rotate(self.q_proj(x).view(b, r, self.heads, self.head_dim).transpose(1, 2), cos, sin)
            k = _rotate(self.k_proj(x).view(b, r, self.kv_heads, self.head_dim).transpose(1, 2), cos, sin)
            v = self.v_proj(x).view(b, r, self.kv_heads, self.head_dim).transpose(1, 2)  # [B, kv, R, hd]
            keys.append(k.repeat_interleave(rep, dim=1))  # [B, heads, R, hd]
            values.append(v.repeat_interleave(rep, dim=1))
            q = q.to(keys[0].dtype)
            s0 = (q @ keys[0].transpose(2, 3)) * scale  # [B, heads, R, R] the catch-up rows <= p
            s0 = s0.masked_fill(~causal, float("-inf"))
            own = [(q * kk).sum(-1, keepdim=True) * scale for kk in keys[1:]]  # j of [B, heads, R, 1]
            probs = torch.softmax(torch.cat([s0, *own], dim=-1).float(), dim=-1).to(values[0].dtype)
            a = probs[..., :r] @ values[0]  # [B, heads, R, hd]
            for i, vv in enumerate(values[1:]):
                a = a + probs[..., r + i : r + i + 1] * vv
            stream = g + self.o_proj(a.transpose(1, 2).reshape(b, r, -1))  # [B, R, H]
            h = self.post_attention_layernorm(stream)
            stream = stream + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))
            outs.append(self.norm(stream))
            g = stream  # the next step's features: the stream before the final norm
        return outs
