"""The DFlash head being trained, in the speculators layout and the math of the build's
reference forward (``exporter/heads/block_reference.py``), batched over many blocks at once:

    ctx    = hidden_norm(fc(concat of the taps))           one row per context position j
    block  = [embed(anchor), embed(mask) × (B-1)]          positions a .. a+B-1
    layer  = x + o_proj(Attn(q = block, kv = [ctx rows j < a, the block's own rows]))   not causal
             then x + mlp(post_attention_layernorm(x))      keys of ctx rows: k_proj(ctx) (no input
                                                            norm), q_norm/k_norm on every row
    drafts = lm_head(norm(x))[1:]                           slot k drafts position a+k

Taps are the stream entering layer i (transformers' ``hidden_states[i]``, the speculators and
project convention: the teacher's ``aux`` columns as they are). The embedding, the mask
token's embedding and ``lm_head`` (the target's output rows of the draft vocabulary) are the
target's, frozen; ``lm_head`` is still written so the loader reads a reduced vocabulary.
The rope table is transformers' Qwen3 rotary for ``transformer_layer_config`` (the
reference's and the loader's).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specexport.exporter.distill.eagle3_model import Norm  # the same RMSNorm as the EAGLE-3 head


def default_taps(n_layers: int, count: int = 5) -> list[int]:
    """Up to ``count`` target layers spread from the second to the last (the stream entering each)."""
    n = max(1, min(count, n_layers - 1))
    if n == 1:
        return [max(0, n_layers - 1)]
    return sorted({round(1 + i * (n_layers - 2) / (n - 1)) for i in range(n)})


def head_config(target_cfg, taps: tuple[int, ...], draft_vocab: int, block_size: int, layers: int,
                mask_token_id: int) -> dict:
    """config.json in the speculators DFlash layout: a Qwen3 decoder config of the target's
    attention shape, the taps (aux_hidden_state_layer_ids), block size and mask token."""
    hidden = target_cfg.hidden_size
    heads = target_cfg.num_attention_heads
    rope = dict(getattr(target_cfg, "rope_parameters", None) or {})
    theta = rope.pop("rope_theta", None) or getattr(target_cfg, "rope_theta", None) or 10000.0
    fields = {
        "model_type": "qwen3", "hidden_size": hidden, "num_hidden_layers": int(layers),
        "num_attention_heads": heads, "num_key_value_heads": getattr(target_cfg, "num_key_value_heads", None) or heads,
        "head_dim": getattr(target_cfg, "head_dim", None) or hidden // heads,
        "intermediate_size": target_cfg.intermediate_size, "rms_norm_eps": float(getattr(target_cfg, "rms_norm_eps", 1e-6)),
        "rope_theta": float(theta), "hidden_act": "silu", "attention_bias": False, "vocab_size": target_cfg.vocab_size,
        "max_position_embeddings": target_cfg.max_position_embeddings,
    }
    if rope.get("rope_type", "default") != "default":
        fields["rope_scaling"] = rope
    return {
        "speculators_model_type": "dflash", "architectures": ["DFlashSpeculator"],
        "transformer_layer_config": fields, "draft_vocab_size": int(draft_vocab), "block_size": int(block_size),
        "aux_hidden_state_layer_ids": list(taps), "mask_token_id": int(mask_token_id),
        "target_hidden_size": hidden, "sample_from_anchor": False, "torch_dtype": "float16",
    }


def rope_tables(config: dict, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [positions, head_dim]: transformers' Qwen3 rotary, as the reference builds it."""
    from transformers import AutoConfig
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    section = config["transformer_layer_config"]
    fields = {k: v for k, v in section.items() if k not in ("architectures", "auto_map", "model_type")}
    rotary = Qwen3RotaryEmbedding(AutoConfig.for_model("qwen3", **fields))
    with torch.no_grad():
        cos, sin = rotary(torch.zeros(1), torch.arange(positions).unsqueeze(0))
    return cos[0].float(), sin[0].float()




def _linear(n_in: int, n_out: int, std: float) -> nn.Linear:
    layer = nn.Linear(n_in, n_out, bias=False)
    nn.init.normal_(layer.weight, std=std)
    return layer


def _rotate(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, h: int, heads: int, kv_heads: int, hd: int, eps: float, std: float):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, hd
        self.q_proj, self.k_proj = _linear(h, heads * hd, std), _linear(h, kv_heads * hd, std)
        self.v_proj, self.o_proj = _linear(h, kv_heads * hd, std), _linear(heads * hd, h, std)
        self.q_norm, self.k_norm = Norm(hd, eps), Norm(hd, eps)


class MLP(nn.Module):
    def __init__(self, h: int, inter: int, std: float):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = _linear(h, inter, std), _linear(h, inter, std), _linear(inter, h, std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, h: int, heads: int, kv_heads: int, hd: int, inter: int, eps: float, std: float):
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = Norm(h, eps), Norm(h, eps)
        self.self_attn = Attention(h, heads, kv_heads, hd, eps, std)
        self.mlp = MLP(h, inter, std)


class DFlashDraft(nn.Module):
    """The trainable head; parameter names are the checkpoint's (``checkpoint_names``)."""

    def __init__(self, config: dict, embed: torch.Tensor, lm_head: torch.Tensor,
                 rope: tuple[torch.Tensor, torch.Tensor]):
        super().__init__()
        c = config["transformer_layer_config"]
        h, heads, kv = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
        hd, eps, std = c["head_dim"], c["rms_norm_eps"], 0.02
        n_taps = len(config["aux_hidden_state_layer_ids"])
        self.block, self.heads, self.kv_heads, self.hd = config["block_size"], heads, kv, hd
        self.first = 0 if config.get("sample_from_anchor") else 1  # DSpark: the anchor slot drafts too
        self.drafts = self.block - self.first  # drafting slots per block
        self.fc = _linear(n_taps * config["target_hidden_size"], h, std)
        self.hidden_norm, self.norm = Norm(h, eps), Norm(h, eps)
        self.layers = nn.ModuleList(Layer(h, heads, kv, hd, c["intermediate_size"], eps, std)
                                    for _ in range(c["num_hidden_layers"]))
        self.lm_head = nn.Linear(h, lm_head.shape[0], bias=False)
        with torch.no_grad():
            self.lm_head.weight.copy_(lm_head)
        self.lm_head.weight.requires_grad_(False)  # the target's rows, frozen
        self.register_buffer("embed", embed.detach().float(), persistent=False)  # [V_t, H] frozen
        self.register_buffer("mask_embedding", embed[int(config["mask_token_id"])].detach().float().clone(),
                             persistent=False)  # [H]
        self.register_buffer("rope_cos", rope[0], persistent=False)  # [S, hd]
        self.register_buffer("rope_sin", rope[1], persistent=False)

    def checkpoint_names(self) -> dict[str, nn.Parameter]:
        """Checkpoint tensor name -> parameter (lm_head included, though frozen)."""
        return dict(self.named_parameters())

    def trainable(self) -> list[nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]

    def draft_logits(self, hidden: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """hidden [..., S, H] of the drafting slots -> logits [..., S, V_d]; ``prev`` [..., S] (the
        token before each drafted one) is for heads that read it (DSpark's Markov head)."""
        return self.lm_head(hidden)

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # x [..., T, heads, hd]; positions broadcastable to [..., T]
        cos, sin = self.rope_cos[positions].unsqueeze(-2), self.rope_sin[positions].unsqueeze(-2)
        return x * cos + _rotate(x) * sin

    def forward(self, tok: torch.Tensor, aux: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """tok [b, W] ids, aux [b, W, n·H_t] the taps of every row, anchors [b, N] positions
        (each >= 1: rows j < anchor are its context) -> hidden [b, N, drafts, H] of the drafting
        slots (norm applied; ``draft_logits`` of it gives the draft logits)."""
        b, w = tok.shape
        n, bs, heads, kv, hd = anchors.shape[1], self.block, self.heads, self.kv_heads, self.hd
        group = heads // kv
        ctx = self.hidden_norm(self.fc(aux.to(self.fc.weight.dtype)))  # [b, W, H]
        anchor = self.embed[tok.gather(1, anchors)]  # [b, N, H]
        x = torch.cat((anchor.unsqueeze(2), self.mask_embedding.expand(b, n, bs - 1, -1)), dim=2)  # [b, N, B, H]
        block_pos = anchors.unsqueeze(-1) + torch.arange(bs, device=tok.device)  # [b, N, B]
        ctx_pos = torch.arange(w, device=tok.device)  # [W]
        hidden_ctx = ctx_pos.view(1, 1, w) >= anchors.unsqueeze(-1)  # [b, N, W]: rows the block must not see
        ctx_mask = torch.zeros(b, n, w, device=tok.device).masked_fill(hidden_ctx, float("-inf"))
        ctx_mask = ctx_mask.view(b, 1, n, 1, w)
        scale = hd ** -0.5
        for layer in self.layers:
            att = layer.self_attn
            h = layer.input_layernorm(x)
            q = att.q_norm(att.q_proj(h).view(b, n, bs, heads, hd))
            k = att.k_norm(att.k_proj(h).view(b, n, bs, kv, hd))
            v = att.v_proj(h).view(b, n, bs, kv, hd)
            k_c = att.k_norm(att.k_proj(ctx).view(b, w, kv, hd))
            v_c = att.v_proj(ctx).view(b, w, kv, hd)
            q, k = self._rope(q, block_pos), self._rope(k, block_pos)
            k_c = self._rope(k_c, ctx_pos)
            if group > 1:
                k, v = k.repeat_interleave(group, dim=-2), v.repeat_interleave(group, dim=-2)
                k_c, v_c = k_c.repeat_interleave(group, dim=-2), v_c.repeat_interleave(group, dim=-2)
            s_c = torch.einsum("bnqhd,bkhd->bhnqk", q, k_c) * scale + ctx_mask  # [b, heads, N, B, W]
            s_s = torch.einsum("bnqhd,bnkhd->bhnqk", q, k) * scale  # [b, heads, N, B, B]
            probs = torch.softmax(torch.cat((s_c, s_s), dim=-1).float(), dim=-1).to(q.dtype)
            out = (torch.einsum("bhnqk,bkhd->bnqhd", probs[..., :w], v_c)
                   + torch.einsum("bhnqk,bnkhd->bnqhd", probs[..., w:], v))  # [b, N, B, heads, hd]
            x = x + att.o_proj(out.reshape(b, n, bs, heads * hd))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.norm(x)[:, :, self.first :]
