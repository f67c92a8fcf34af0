"""Supported architectures: read a transformers decoder into one uniform description.

Each entry of ``ARCHITECTURES`` knows how one family names and arranges its weights. The
result, ``DecoderParts``, is what ``graph_model.StaticDecoder`` is built from, so adding an
architecture means writing one small reader here, not a new graph.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch

from specexport.errors import BadInput


@dataclass
class LayerWeights:
    """One decoder layer. Linear weights keep the transformers layout [out, in]."""

    attn_norm: torch.Tensor  # [hidden]
    q_w: torch.Tensor  # [heads*head_dim, hidden]
    k_w: torch.Tensor  # [kv_heads*head_dim, hidden]
    v_w: torch.Tensor  # [kv_heads*head_dim, hidden]
    o_w: torch.Tensor  # [hidden, heads*head_dim]
    mlp_norm: torch.Tensor  # [hidden]
    gate_w: torch.Tensor  # [intermediate, hidden]
    up_w: torch.Tensor  # [intermediate, hidden]
    down_w: torch.Tensor  # [hidden, intermediate]
    q_b: torch.Tensor | None = None
    k_b: torch.Tensor | None = None
    v_b: torch.Tensor | None = None
    o_b: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None  # [head_dim] (Qwen3, Gemma3)
    k_norm: torch.Tensor | None = None
    attn_out_norm: torch.Tensor | None = None  # sandwich norms (Gemma2/3)
    mlp_out_norm: torch.Tensor | None = None
    sliding_window: int | None = None  # keys further back than this are masked
    rope_table: str = "default"  # which cos/sin table this layer uses


@dataclass
class DecoderParts:
    model_type: str
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    activation: str  # "silu" | "gelu_tanh"
    embed_scale: float
    attn_scale: float
    attn_softcap: float | None
    final_softcap: float | None
    embed: torch.Tensor  # [vocab, hidden]
    final_norm: torch.Tensor  # [hidden]
    lm_head: torch.Tensor | None  # [vocab, hidden]; None when tied to the embedding
    layers: list[LayerWeights]
    # name -> (cos, sin), each [max_positions, rotary_dim]; computed by the model's own
    # rotary module so every RoPE variant (llama3, yarn, longrope, ...) matches exactly.
    rope_tables: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def summary(self) -> dict:
        return {
            "model_type": self.model_type,
            "hidden_size": self.hidden_size,
            "num_layers": len(self.layers),
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "tied_embeddings": self.lm_head is None,
        }


@dataclass(frozen=True)
class ArchTraits:
    norm_offset: float = 0.0  # Gemma norms scale by (1 + w)
    fused_qkv: bool = False  # Phi-3: one qkv_proj, one gate_up_proj


ARCHITECTURES: dict[str, ArchTraits] = {
    "llama": ArchTraits(),
    "mistral": ArchTraits(),
    "qwen2": ArchTraits(),
    "qwen3": ArchTraits(),
    "gemma": ArchTraits(norm_offset=1.0),
    "gemma2": ArchTraits(norm_offset=1.0),
    "gemma3_text": ArchTraits(norm_offset=1.0),
    "phi3": ArchTraits(fused_qkv=True),
}

_ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",
    "gelu": "gelu_tanh",  # Gemma's legacy name for the tanh approximation
}


def supported_list() -> str:
    return ", ".join(sorted(ARCHITECTURES))


def check_supported(model_type: str, origin: str) -> ArchTraits:
    traits = ARCHITECTURES.get(model_type)
    if traits is None:
        raise BadInput(
            f"{origin}: architecture '{model_type}' is not supported; supported: {supported_list()}"
        )
    return traits


def _layer_window(config, index: int) -> int | None:
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return window if layer_types[index] == "sliding_attention" else None
    return window


def _rope_tables(model, max_positions: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    rotary = model.model.rotary_emb
    positions = torch.arange(max_positions).unsqueeze(0)  # [1, S]
    probe = torch.zeros(1, dtype=torch.float32)
    layer_types = sorted(set(getattr(model.config, "layer_types", None) or []))
    if "layer_type" in inspect.signature(rotary.forward).parameters and layer_types:
        tables = {}
        for layer_type in layer_types:
            cos, sin = rotary(probe, positions, layer_type)
            tables[layer_type] = (cos[0].float(), sin[0].float())
        return tables
    cos, sin = rotary(probe, positions)
    return {"default": (cos[0].float(), sin[0].float())}


def _t(x: torch.Tensor | None) -> torch.Tensor | None:
    return None if x is None else x.detach().float().clone()


def _norm(module, offset: float) -> torch.Tensor:
    return module.weight.detach().float() + offset


def read_decoder(model, max_positions: int, origin: str) -> DecoderParts:
    """Read a transformers *ForCausalLM into DecoderParts (fp32 copies of every weight)."""
    config = model.config
    traits = check_supported(config.model_type, origin)
    off = traits.norm_offset
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    act_name = getattr(config, "hidden_activation", None) or config.hidden_act
    if act_name not in _ACTIVATIONS:
        raise BadInput(f"{origin}: activation '{act_name}' is not supported ({', '.join(_ACTIVATIONS)})")

    layer_types = getattr(config, "layer_types", None)
    rope_tables = _rope_tables(model, max_positions)
    layers: list[LayerWeights] = []
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        q_size, kv_size = heads * head_dim, kv_heads * head_dim
        if traits.fused_qkv:
            qkv = attn.qkv_proj.weight.detach().float()
            q_w, k_w, v_w = qkv[:q_size], qkv[q_size : q_size + kv_size], qkv[q_size + kv_size :]
            gate_up = mlp.gate_up_proj.weight.detach().float()
            gate_w, up_w = gate_up.chunk(2, dim=0)
            q_b = k_b = v_b = None
        else:
            q_w, k_w, v_w = (attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight)
            q_b, k_b, v_b = attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias
            gate_w, up_w = mlp.gate_proj.weight, mlp.up_proj.weight
        sandwich = hasattr(layer, "pre_feedforward_layernorm")
        layers.append(
            LayerWeights(
                attn_norm=_norm(layer.input_layernorm, off),
                q_w=_t(q_w), k_w=_t(k_w), v_w=_t(v_w), o_w=_t(attn.o_proj.weight),
                q_b=_t(q_b), k_b=_t(k_b), v_b=_t(v_b), o_b=_t(attn.o_proj.bias),
                q_norm=_norm(attn.q_norm, off) if hasattr(attn, "q_norm") else None,
                k_norm=_norm(attn.k_norm, off) if hasattr(attn, "k_norm") else None,
                attn_out_norm=_norm(layer.post_attention_layernorm, off) if sandwich else None,
                mlp_norm=_norm(layer.pre_feedforward_layernorm if sandwich else layer.post_attention_layernorm, off),
                mlp_out_norm=_norm(layer.post_feedforward_layernorm, off) if sandwich else None,
                gate_w=_t(gate_w), up_w=_t(up_w), down_w=_t(mlp.down_proj.weight),
                sliding_window=_layer_window(config, i),
                rope_table=layer_types[i] if layer_types and layer_types[i] in rope_tables else "default",
            )
        )

    embed_module = model.model.embed_tokens
    embed_scale = float(getattr(embed_module, "scalar_embed_scale", 1.0))
    lm_head = model.lm_head.weight
    tied = lm_head.data_ptr() == embed_module.weight.data_ptr()
    return DecoderParts(
        model_type=config.model_type,
        hidden_size=config.hidden_size,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=embed_module.weight.shape[0],
        rms_norm_eps=float(config.rms_norm_eps),
        activation=_ACTIVATIONS[act_name],
        embed_scale=embed_scale,
        attn_scale=float(model.model.layers[0].self_attn.scaling),
        attn_softcap=getattr(config, "attn_logit_softcapping", None),
        final_softcap=getattr(config, "final_logit_softcapping", None),
        embed=_t(embed_module.weight),
        final_norm=_norm(model.model.norm, off),
        lm_head=None if tied else _t(lm_head),
        layers=layers,
        rope_tables=rope_tables,
    )

