"""Supported architectures: read a transformers decoder into one uniform description.

Each entry of ``ARCHITECTURES`` knows how one family names and arranges its weights. The
result, ``DecoderParts``, is what ``graph_model.StaticDecoder`` is built from, so adding an
architecture means writing one small reader here, not a new graph.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch

from specexport.contract import StateLayout
from specexport.errors import BadInput
from specexport.exporter.rope import rotary_tables


@dataclass
class LayerWeights:
    """One decoder layer. Linear weights keep the transformers layout [out, in]."""

    attn_norm: torch.Tensor  # [hidden]
    o_w: torch.Tensor  # [hidden, heads*head_dim]
    mlp_norm: torch.Tensor  # [hidden]
    # the dense MLP; in an MoE layer its shared experts (added to the routed experts' output)
    gate_w: torch.Tensor  # [intermediate, hidden]
    up_w: torch.Tensor  # [intermediate, hidden]
    down_w: torch.Tensor  # [hidden, intermediate]
    # the Q/K/V projections; None in an MLA layer, whose projections ``mla`` holds
    q_w: torch.Tensor | None = None  # [heads*head_dim, hidden]
    k_w: torch.Tensor | None = None  # [kv_heads*head_dim, hidden]
    v_w: torch.Tensor | None = None  # [kv_heads*head_dim, hidden]
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
    moe: MoeWeights | None = None  # routed experts (DeepSeek-V3 / GLM-4.5 MoE layers)
    mla: MlaWeights | None = None  # multi-head latent attention (DeepSeek-V3)
    # gated attention (Qwen3-Next, Qwen3.5): the attention output is multiplied by
    # sigmoid(x_normed @ out_gate_w.T) before o_proj; q_proj's per-head gate rows, q_w keeps the query rows
    out_gate_w: torch.Tensor | None = None  # [heads*head_dim, hidden]
    # a linear-attention layer (Gated DeltaNet: Qwen3-Next, Qwen3.5): q_w/k_w/v_w are None, o_w is
    # out_proj's weight [hidden, Hv*dv] and the layer keeps a recurrent state instead of a KV cache
    linear: LinearAttnWeights | None = None


@dataclass
class MoeWeights:
    """Routed experts. ``scoring="sigmoid"`` (DeepSeek-V3 / GLM-4.5): a sigmoid router whose choice
    (not whose weights) adds ``score_bias``, top-k among the best ``topk_group`` of ``n_group``
    expert groups, the chosen scores normalised (``norm_topk_prob``) and scaled.
    ``scoring="softmax"`` (Qwen3-Next / Qwen3.5-MoE): a softmax over every expert, top-k, the
    chosen probabilities renormalised (``norm_topk_prob``); no bias (zeros), no groups, scaling 1.
    ``shared_gate_w``: the shared expert's output (the layer's dense part) is multiplied by
    sigmoid(x @ shared_gate_w.T) (Qwen's shared_expert_gate). Per expert, transformers' layout."""

    router_w: torch.Tensor  # [experts, hidden]
    score_bias: torch.Tensor  # [experts] e_score_correction_bias
    gate_w: torch.Tensor  # [experts, moe_intermediate, hidden]
    up_w: torch.Tensor  # [experts, moe_intermediate, hidden]
    down_w: torch.Tensor  # [experts, hidden, moe_intermediate]
    top_k: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    scaling: float  # routed_scaling_factor
    scoring: str = "sigmoid"  # "sigmoid" | "softmax"
    shared_gate_w: torch.Tensor | None = None  # [1, hidden]


@dataclass
class MlaWeights:
    """DeepSeek's multi-head latent attention, rearranged (``mla_weights``) so the graph attends
    as plain multi-head attention over per-head K and V of the qk width (nope + rope): each head's
    Q and K put the rotary part first (de-interleaved, so the graph's rotate-half RoPE applies to
    the first ``rope`` dims), V and the output projection are zero-padded from v_head_dim to the
    qk width (exact: the padded columns are zeros and meet zero weights)."""

    in_w: torch.Tensor  # [q_in + kv_lora + rope, hidden]: q_a_proj (or q_proj), kv_a_proj_with_mqa
    in_b: torch.Tensor | None  # [q_in + kv_lora + rope] (attention_bias)
    q_a_norm: torch.Tensor | None  # [q_lora]; None: no q_lora, in_w's first rows are Q itself
    q_b_w: torch.Tensor | None  # [heads*qk, q_lora] (q_b_proj; per head [rope | nope])
    kv_a_norm: torch.Tensor  # [kv_lora]
    kv_b_w: torch.Tensor  # [heads*(nope + qk), kv_lora]: per head k_nope, then V padded to qk
    heads: int
    q_in: int  # q_lora, or heads*qk without q_lora
    kv_lora: int
    rope: int
    nope: int
    v_dim: int  # v_head_dim before the padding
    latent_eps: float  # q_a_layernorm / kv_a_layernorm epsilon

    @property
    def qk(self) -> int:
        return self.nope + self.rope


@dataclass
class LinearAttnWeights:
    """A Gated DeltaNet layer (Qwen3-Next, Qwen3.5), transformers' layout [out, in]. ``qkv_w``'s
    output rows are in the order transformers' ``mixed_qkv`` has after its cat: every q head, every
    k head, every v head (Qwen3-Next's interleaved in_proj_qkvz / in_proj_ba are un-interleaved per
    k-head group as its ``fix_query_key_value_ordering`` does). The layer: a causal depthwise conv
    (``conv_w``, ``conv_kernel`` taps, then ``activation``) over those C channels, l2-normed q and k,
    g = -exp(a_log)·softplus(x·a_w + dt_bias), beta = sigmoid(x·b_w), the gated delta rule over a
    [v_heads, k_dim, v_dim] state (k heads repeated to the v heads), an RMSNorm of each head's output
    (weight ``norm_w`` as is, no offset) times silu(x·z_w), then out_proj (LayerWeights.o_w)."""

    qkv_w: torch.Tensor  # [2*Hk*dk + Hv*dv, hidden]
    z_w: torch.Tensor  # [Hv*dv, hidden]
    b_w: torch.Tensor  # [Hv, hidden]
    a_w: torch.Tensor  # [Hv, hidden]
    conv_w: torch.Tensor  # [C, K]
    conv_b: torch.Tensor | None  # [C]
    dt_bias: torch.Tensor  # [Hv]
    a_log: torch.Tensor  # [Hv]
    norm_w: torch.Tensor  # [dv]
    k_heads: int
    v_heads: int
    k_dim: int
    v_dim: int
    conv_kernel: int
    activation: str  # of the conv: "silu"
    norm_eps: float

    @property
    def conv_channels(self) -> int:
        return 2 * self.k_heads * self.k_dim + self.v_heads * self.v_dim


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

    @property
    def attention_layers(self) -> list[int]:
        """Indices of the layers that attend (and keep a KV cache), in model order."""
        return [i for i, layer in enumerate(self.layers) if layer.linear is None]

    @property
    def linear_layers(self) -> list[int]:
        """Indices of the linear-attention layers (a recurrent state, no KV cache), in model order."""
        return [i for i, layer in enumerate(self.layers) if layer.linear is not None]

    def state_layout(self) -> StateLayout | None:
        """The recurrent state of the linear-attention layers (one layout shared by all of them:
        conv window [C, K-1], state [Hv, dk, dv]); None for a model without such layers."""
        layouts = {StateLayout(len(self.linear_layers), w.conv_channels, w.conv_kernel, w.v_heads, w.k_dim, w.v_dim)
                   for w in (layer.linear for layer in self.layers) if w is not None}
        if len(layouts) > 1:
            raise BadInput(f"{self.model_type}: the linear-attention layers' state sizes differ "
                           f"({', '.join(str(s.to_json()) for s in layouts)}); one state layout per model is supported")
        return layouts.pop() if layouts else None

    def summary(self) -> dict:
        summary = {
            "model_type": self.model_type,
            "hidden_size": self.hidden_size,
            "num_layers": len(self.layers),
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "tied_embeddings": self.lm_head is None,
        }
        if self.linear_layers:
            summary["layer_types"] = ["full_attention" if layer.linear is None else "linear_attention"
                                      for layer in self.layers]
        return summary


@dataclass(frozen=True)
class ArchTraits:
    norm_offset: float = 0.0  # Gemma norms scale by (1 + w)
    fused_qkv: bool = False  # Phi-3: one qkv_proj, one gate_up_proj
    mla: bool = False  # DeepSeek-V3: multi-head latent attention (MlaWeights)
    # Qwen3-Next / Qwen3.5: q_proj holds per head [q | gate]; the output is gated (LayerWeights.out_gate_w)
    gated_attention: bool = False
    # MoE layers (mlp.experts, mlp.gate, mlp.shared_experts) are read wherever a layer has them;
    # linear-attention layers (layer.linear_attn: Gated DeltaNet) wherever a layer has one


ARCHITECTURES: dict[str, ArchTraits] = {
    "llama": ArchTraits(),
    "mistral": ArchTraits(),
    "qwen2": ArchTraits(),
    "qwen3": ArchTraits(),
    "gemma": ArchTraits(norm_offset=1.0),
    "gemma2": ArchTraits(norm_offset=1.0),
    "gemma3_text": ArchTraits(norm_offset=1.0),
    "phi3": ArchTraits(fused_qkv=True),
    "glm4_moe": ArchTraits(),  # GQA, partial rotary, MoE after first_k_dense_replace layers
    "deepseek_v3": ArchTraits(mla=True),
    # hybrid: Gated DeltaNet linear-attention layers and gated full-attention layers, (1 + w) norms,
    # partial rotary; softmax-routed MoE with a gated shared expert (qwen3_next, qwen3_5_moe_text)
    "qwen3_next": ArchTraits(norm_offset=1.0, gated_attention=True),
    "qwen3_5_text": ArchTraits(norm_offset=1.0, gated_attention=True),
    "qwen3_5_moe_text": ArchTraits(norm_offset=1.0, gated_attention=True),
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
    layer_types = sorted(set(getattr(model.config, "layer_types", None) or []))
    if "layer_type" in inspect.signature(rotary.forward).parameters and layer_types:
        return {layer_type: rotary_tables(rotary, max_positions, layer_type) for layer_type in layer_types}
    return {"default": rotary_tables(rotary, max_positions)}


def _t(x: torch.Tensor | None) -> torch.Tensor | None:
    return None if x is None else x.detach().float().clone()


def _norm(module, offset: float) -> torch.Tensor:
    return module.weight.detach().float() + offset


def moe_weights(config, router_w: torch.Tensor, score_bias: torch.Tensor, gate_w: torch.Tensor,
                up_w: torch.Tensor, down_w: torch.Tensor) -> MoeWeights:
    """The routed experts with the routing settings of a DeepSeek-V3 / GLM-4.5 ``config``."""
    return MoeWeights(router_w=router_w, score_bias=score_bias, gate_w=gate_w, up_w=up_w, down_w=down_w,
                      top_k=int(config.num_experts_per_tok), n_group=int(config.n_group or 1),
                      topk_group=int(config.topk_group or 1), norm_topk_prob=bool(config.norm_topk_prob),
                      scaling=float(config.routed_scaling_factor))


def softmax_moe_weights(top_k: int, norm_topk_prob: bool, router_w: torch.Tensor, gate_w: torch.Tensor,
                        up_w: torch.Tensor, down_w: torch.Tensor,
                        shared_gate_w: torch.Tensor | None = None) -> MoeWeights:
    """Qwen3-Next / Qwen3.5-MoE routed experts: a softmax over every expert, top-k, renormalised
    when ``norm_topk_prob``; no score bias (zeros), no groups, no scaling."""
    return MoeWeights(router_w=router_w, score_bias=torch.zeros(router_w.shape[0]), gate_w=gate_w, up_w=up_w,
                      down_w=down_w, top_k=int(top_k), n_group=1, topk_group=1, norm_topk_prob=bool(norm_topk_prob),
                      scaling=1.0, scoring="softmax", shared_gate_w=shared_gate_w)


def _read_moe(config, mlp) -> MoeWeights:
    """transformers 5 stacks the experts: gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I]."""
    gate_w, up_w = mlp.experts.gate_up_proj.detach().float().chunk(2, dim=1)  # [E, I, H] ×2
    down_w = _t(mlp.experts.down_proj)
    if hasattr(mlp, "shared_expert_gate"):  # Qwen3-Next / Qwen3.5-MoE: softmax router, gated shared expert
        # Qwen3-Next's router renormalises when norm_topk_prob; Qwen3.5-MoE's always does
        return softmax_moe_weights(mlp.gate.top_k, getattr(mlp.gate, "norm_topk_prob", True), _t(mlp.gate.weight),
                                   gate_w.clone(), up_w.clone(), down_w, _t(mlp.shared_expert_gate.weight))
    return moe_weights(config, _t(mlp.gate.weight), _t(mlp.gate.e_score_correction_bias), gate_w.clone(),
                       up_w.clone(), down_w)


def _deinterleave(rope: int) -> torch.Tensor:
    """DeepSeek rotates pairs (x0, x1), (x2, x3), ...; taking the evens then the odds makes it
    the rotate-half RoPE (transformers' apply_rotary_pos_emb_interleave says the same)."""
    return torch.cat((torch.arange(0, rope, 2), torch.arange(1, rope, 2)))  # [rope]


def _rope_first(w: torch.Tensor, heads: int, nope: int, rope: int, interleaved: bool) -> torch.Tensor:
    """Rows [heads·(nope+rope), in] of per-head [nope | rope] reordered to [rope | nope]."""
    per_head = w.reshape(heads, nope + rope, -1)
    rope_rows = per_head[:, nope:][:, _deinterleave(rope)] if interleaved else per_head[:, nope:]
    return torch.cat((rope_rows, per_head[:, :nope]), dim=1).reshape(w.shape)


def mla_weights(config, get, has, eps: float, origin: str) -> tuple[MlaWeights, torch.Tensor]:
    """(MlaWeights, the output projection padded to [hidden, heads·qk]) from DeepSeek's published
    tensors: ``get(name, shape)`` / ``has(name)`` by their names under ``self_attn.``.

    The graph caches each head's expanded K and V (num_kv_heads = num_heads, V zero-padded to
    the qk width): the simplest exact form. The memory-efficient form caches the compressed
    latent (kv_lora + rope per token, shared by the heads) and absorbs kv_b_proj into the query
    and output projections."""
    heads, hidden = config.num_attention_heads, config.hidden_size
    nope, rope, v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
    kv_lora, q_lora, qk = config.kv_lora_rank, config.q_lora_rank, nope + rope
    interleaved = bool(getattr(config, "rope_interleave", False))
    if v_dim > qk:
        raise BadInput(f"{origin}: v_head_dim ({v_dim}) above the qk head dim ({qk}) is not supported")
    if q_lora:
        q_first = get("q_a_proj.weight", (q_lora, hidden))
        q_b = _rope_first(get("q_b_proj.weight", (heads * qk, q_lora)), heads, nope, rope, interleaved)
    else:
        q_first = _rope_first(get("q_proj.weight", (heads * qk, hidden)), heads, nope, rope, interleaved)
        q_b = None
    kv_a = get("kv_a_proj_with_mqa.weight", (kv_lora + rope, hidden))
    order = torch.cat((torch.arange(kv_lora), kv_lora + (_deinterleave(rope) if interleaved else torch.arange(rope))))
    in_b = None
    if has("kv_a_proj_with_mqa.bias"):  # attention_bias: q_a_proj and kv_a_proj_with_mqa (and o_proj)
        q_bias = get("q_a_proj.bias", (q_lora,)) if q_lora else torch.zeros(heads * qk)
        in_b = torch.cat((q_bias, get("kv_a_proj_with_mqa.bias", (kv_lora + rope,))[order]))
    kv_b = get("kv_b_proj.weight", (heads * (nope + v_dim), kv_lora)).reshape(heads, nope + v_dim, kv_lora)
    v_padded = torch.cat((kv_b[:, nope:], torch.zeros(heads, qk - v_dim, kv_lora)), dim=1)  # [heads, qk, kv_lora]
    kv_b_w = torch.cat((kv_b[:, :nope], v_padded), dim=1)  # [heads, nope+qk, kv_lora]
    o_w = get("o_proj.weight", (hidden, heads * v_dim)).reshape(hidden, heads, v_dim)
    o_w = torch.cat((o_w, torch.zeros(hidden, heads, qk - v_dim)), dim=2).reshape(hidden, heads * qk)  # zero rows meet V's zeros
    mla = MlaWeights(
        in_w=torch.cat((q_first, kv_a[order])), in_b=in_b,
        q_a_norm=get("q_a_layernorm.weight", (q_lora,)) if q_lora else None, q_b_w=q_b,
        kv_a_norm=get("kv_a_layernorm.weight", (kv_lora,)), kv_b_w=kv_b_w.reshape(heads * (nope + qk), kv_lora),
        heads=heads, q_in=q_lora or heads * qk, kv_lora=kv_lora, rope=rope, nope=nope, v_dim=v_dim,
        latent_eps=eps,
    )
    return mla, o_w


def _read_mla(config, attn, origin: str) -> tuple[MlaWeights, torch.Tensor]:
    params = {name: p.detach().float() for name, p in attn.named_parameters()}
    return mla_weights(config, lambda name, _shape: params[name], params.__contains__,
                       float(attn.kv_a_layernorm.variance_epsilon), origin)


def _read_linear(config, lin, origin: str) -> dict:
    """A Gated DeltaNet layer (``layer.linear_attn``), as LayerWeights fields: ``linear``, ``o_w``."""
    hk, hv, dk, dv = lin.num_k_heads, lin.num_v_heads, lin.head_k_dim, lin.head_v_dim
    hidden = config.hidden_size
    if hv % hk:
        raise BadInput(f"{origin}: linear_num_value_heads ({hv}) must be a multiple of linear_num_key_heads ({hk})")
    if _ACTIVATIONS.get(lin.activation) != "silu":
        raise BadInput(f"{origin}: a linear-attention conv activation '{lin.activation}' is not supported (silu)")
    if hasattr(lin, "in_proj_qkvz"):  # Qwen3-Next: per k-head group [q | k | v | z] and [b | a]
        r = hv // hk
        qkvz = lin.in_proj_qkvz.weight.detach().float().reshape(hk, 2 * dk + 2 * r * dv, hidden)
        q, k, v, z = torch.split(qkvz, (dk, dk, r * dv, r * dv), dim=1)
        ba = lin.in_proj_ba.weight.detach().float().reshape(hk, 2 * r, hidden)
        b, a = torch.split(ba, (r, r), dim=1)
        qkv_w = torch.cat((q.reshape(hk * dk, hidden), k.reshape(hk * dk, hidden), v.reshape(hv * dv, hidden)))
        z_w, b_w, a_w = z.reshape(hv * dv, hidden), b.reshape(hv, hidden), a.reshape(hv, hidden)
    else:  # Qwen3.5: in_proj_qkv already in mixed_qkv's order, z, b and a apart
        qkv_w, z_w = _t(lin.in_proj_qkv.weight), _t(lin.in_proj_z.weight)
        b_w, a_w = _t(lin.in_proj_b.weight), _t(lin.in_proj_a.weight)
    if any(getattr(getattr(lin, name), "bias", None) is not None
           for name in ("in_proj_qkvz", "in_proj_ba", "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
           if hasattr(lin, name)):
        raise BadInput(f"{origin}: biases on a linear-attention layer's projections are not supported")
    conv = lin.conv1d
    linear = LinearAttnWeights(
        qkv_w=qkv_w.contiguous().clone(), z_w=z_w.contiguous().clone(), b_w=b_w.contiguous().clone(),
        a_w=a_w.contiguous().clone(), conv_w=conv.weight.detach().float().reshape(conv.weight.shape[0], -1).clone(),
        conv_b=_t(conv.bias), dt_bias=_t(lin.dt_bias), a_log=_t(lin.A_log), norm_w=_t(lin.norm.weight),  # plain w
        k_heads=hk, v_heads=hv, k_dim=dk, v_dim=dv, conv_kernel=int(lin.conv_kernel_size),
        activation="silu", norm_eps=float(lin.norm.variance_epsilon),
    )
    if tuple(linear.conv_w.shape) != (linear.conv_channels, linear.conv_kernel):
        raise BadInput(f"{origin}: linear-attention conv1d weight {tuple(conv.weight.shape)} is not depthwise over "
                       f"{linear.conv_channels} channels")
    return dict(linear=linear, o_w=_t(lin.out_proj.weight))


def split_query_gate(q_proj: torch.Tensor, heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-Next / Qwen3.5 gated attention's q_proj [heads·2·hd, in], per head [q | gate] ->
    the query rows and the output gate's rows, each [heads·hd, in]."""
    per_head = q_proj.reshape(heads, 2, head_dim, q_proj.shape[1])  # [heads, (q | gate), hd, in]
    return (per_head[:, 0].reshape(heads * head_dim, -1).clone(), per_head[:, 1].reshape(heads * head_dim, -1).clone())


def attention_scale(model, head_dim: int) -> float:
    """The attention layers' shared scaling, from the first layer that attends (a hybrid model's
    first layers may be linear attention; with none, head_dim^-0.5)."""
    first = next((layer.self_attn for layer in model.model.layers if hasattr(layer, "self_attn")), None)
    return float(first.scaling) if first is not None else float(head_dim) ** -0.5


def _read_gated_attention(attn, heads: int, head_dim: int, origin: str) -> dict:
    """Qwen3-Next / Qwen3.5 gated attention: q_proj's rows are per head [q | gate]."""
    if attn.q_proj.bias is not None:
        raise BadInput(f"{origin}: gated attention with attention_bias is not supported")
    qg = attn.q_proj.weight.detach().float()
    if qg.shape[0] != heads * 2 * head_dim:
        raise BadInput(f"{origin}: q_proj has {qg.shape[0]} rows; gated attention wants heads·2·head_dim "
                       f"({heads * 2 * head_dim})")
    q_w, out_gate_w = split_query_gate(qg, heads, head_dim)
    return dict(q_w=q_w, out_gate_w=out_gate_w,
                k_w=_t(attn.k_proj.weight), v_w=_t(attn.v_proj.weight),
                k_b=_t(attn.k_proj.bias), v_b=_t(attn.v_proj.bias),
                o_w=_t(attn.o_proj.weight), o_b=_t(attn.o_proj.bias))


def _read_attention(traits: ArchTraits, config, attn, q_size: int, kv_size: int, origin: str) -> dict:
    """A layer's attention projections, as LayerWeights fields."""
    if traits.gated_attention:
        return _read_gated_attention(attn, config.num_attention_heads, q_size // config.num_attention_heads, origin)
    if traits.mla:
        mla, o_w = _read_mla(config, attn, origin)
        return dict(mla=mla, o_w=o_w, o_b=_t(attn.o_proj.bias))
    if traits.fused_qkv:  # Phi-3: one qkv_proj, no biases
        qkv = attn.qkv_proj.weight.detach().float()
        q_w, k_w, v_w = qkv[:q_size], qkv[q_size : q_size + kv_size], qkv[q_size + kv_size :]
        return dict(q_w=_t(q_w), k_w=_t(k_w), v_w=_t(v_w), o_w=_t(attn.o_proj.weight), o_b=_t(attn.o_proj.bias))
    return dict(q_w=_t(attn.q_proj.weight), k_w=_t(attn.k_proj.weight), v_w=_t(attn.v_proj.weight),
                q_b=_t(attn.q_proj.bias), k_b=_t(attn.k_proj.bias), v_b=_t(attn.v_proj.bias),
                o_w=_t(attn.o_proj.weight), o_b=_t(attn.o_proj.bias))


def _read_mlp(traits: ArchTraits, config, mlp) -> dict:
    """A layer's MLP, as LayerWeights fields: the dense MLP, or an MoE layer's routed experts and
    its shared experts as the dense part."""
    moe = _read_moe(config, mlp) if hasattr(mlp, "experts") else None
    # the shared experts: DeepSeek / GLM's shared_experts, Qwen's (gated) shared_expert
    dense = (mlp.shared_experts if hasattr(mlp, "shared_experts") else mlp.shared_expert) if moe is not None else mlp
    if traits.fused_qkv:  # Phi-3: one gate_up_proj
        gate_w, up_w = dense.gate_up_proj.weight.chunk(2, dim=0)
    else:
        gate_w, up_w = dense.gate_proj.weight, dense.up_proj.weight
    return dict(gate_w=_t(gate_w), up_w=_t(up_w), down_w=_t(dense.down_proj.weight), moe=moe)


def read_decoder(model, max_positions: int, origin: str) -> DecoderParts:
    """Read a transformers *ForCausalLM into DecoderParts (fp32 copies of every weight)."""
    config = model.config
    traits = check_supported(config.model_type, origin)
    off = traits.norm_offset
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    if traits.mla:  # the graph caches every head's expanded K and V at the qk width (mla_weights)
        kv_heads, head_dim = heads, config.qk_nope_head_dim + config.qk_rope_head_dim
    act_name = getattr(config, "hidden_activation", None) or config.hidden_act
    if act_name not in _ACTIVATIONS:
        raise BadInput(f"{origin}: activation '{act_name}' is not supported ({', '.join(_ACTIVATIONS)})")

    layer_types = getattr(config, "layer_types", None)
    rope_tables = _rope_tables(model, max_positions)
    layers: list[LayerWeights] = []
    for i, layer in enumerate(model.model.layers):
        attn = getattr(layer, "self_attn", None)
        sandwich = hasattr(layer, "pre_feedforward_layernorm")
        if attn is None:  # a linear-attention layer (Gated DeltaNet)
            mixer = _read_linear(config, layer.linear_attn, origin)
        else:
            mixer = _read_attention(traits, config, attn, heads * head_dim, kv_heads * head_dim, origin)
        layers.append(
            LayerWeights(
                attn_norm=_norm(layer.input_layernorm, off),
                **mixer,
                q_norm=_norm(attn.q_norm, off) if attn is not None and hasattr(attn, "q_norm") else None,
                k_norm=_norm(attn.k_norm, off) if attn is not None and hasattr(attn, "k_norm") else None,
                attn_out_norm=_norm(layer.post_attention_layernorm, off) if sandwich else None,
                mlp_norm=_norm(layer.pre_feedforward_layernorm if sandwich else layer.post_attention_layernorm, off),
                mlp_out_norm=_norm(layer.post_feedforward_layernorm, off) if sandwich else None,
                **_read_mlp(traits, config, layer.mlp),
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
        attn_scale=attention_scale(model, head_dim),
        attn_softcap=getattr(config, "attn_logit_softcapping", None),
        final_softcap=getattr(config, "final_logit_softcapping", None),
        embed=_t(embed_module.weight),
        final_norm=_norm(model.model.norm, off),
        lm_head=None if tied else _t(lm_head),
        layers=layers,
        rope_tables=rope_tables,
    )

