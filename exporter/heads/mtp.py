"""MTP heads: DeepSeek-V3/GLM, Qwen3-Next/Qwen3.5, MiMo and speculators layouts.

Each predicts the token after next from (embedding of the next token, the target's last hidden
state), through a projection of the two normed vectors and one decoder layer of the target's
kind; chained for k > 1 by reusing the layer on its own output hidden. Per family (vLLM's
``deepseek_mtp.py``, ``qwen3_next_mtp.py``, ``mimo_mtp.py``, speculators ``mtp``):

- deepseek (also GLM-4.5's ``glm4_moe_mtp.py``): ``model.layers.{N}.{enorm, hnorm, eh_proj,
  shared_head.norm, shared_head.head}`` + the layer under ``model.layers.{N}.``; concat
  [enorm(e), hnorm(h)]; the target hidden is its final-normed output (DeepseekV2Model returns
  ``norm(hidden, residual)``: tap L); the next step reads the layer output before
  shared_head.norm; vLLM zeroes the embedding at position 0.
- qwen3-next: ``mtp.{fc, pre_fc_norm_embedding, pre_fc_norm_hidden, layers.0.*, norm}``; concat
  [e, h]; its norms are Qwen3NextRMSNorm (weight applied as 1 + w); target hidden final-normed
  (tap L); the next step reads ``mtp.norm``'s output (what the MTP model returns); the target's
  lm_head; no position-0 mask.
- mimo: ``model.mtp_layers.{i}.{token_layernorm, hidden_layernorm, input_proj,
  final_layernorm}`` + the layer; concat [HIDDEN, embedding]; the target hidden is BEFORE its
  final norm (vLLM's MiMoModel returns ``hidden + residual`` and norms in compute_logits), which
  the graph reconstructs from tap L exactly (chain.MtpStem.target_scale); the next step reads
  final_layernorm's output; the target's lm_head; position-0 mask.
- speculators ``mtp``: ``mtp_layers.0.{hidden_layernorm, token_layernorm, input_proj,
  final_layernorm}`` + the layer; concat [e, h]; tap L (its target_layer_ids =
  [num_hidden_layers]); next step reads final_layernorm's output; the target's lm_head.

The decoder layer inside is read as a layer of the target's own kind (its norms, q/k norms,
biases, fused phi3 names). Over a DeepSeek-V3 or GLM-4.5 target (``MTP_TARGETS``) the MTP
layer is what those checkpoints publish: an MoE layer (router, score-correction bias,
``mlp.experts.{e}.*``, shared experts as the dense MLP; archs.moe_weights) with GQA attention
(GLM) or MLA (DeepSeek; archs.mla_weights), computed by the target graph's own MoeMlp and
MlaProjection; the reference loads the same tensors into transformers' own decoder layer
(experts stacked as transformers 5 holds them).

Over a Qwen3-Next, Qwen3.5 or Qwen3.5-MoE target (``GATED_TARGETS``; vLLM's
``qwen3_next_mtp.py`` / ``qwen3_5_mtp.py``: ``mtp.*`` names, the layer a full-attention
decoder layer of the target's kind) the layer has gated attention: q_proj's rows are per head
[q | gate], the attention output times sigmoid(gate) before o_proj (ChainLayer.out_gate_w);
q/k norms; partial rotary; every norm 1 + w. Its MLP is, for Qwen3-Next and Qwen3.5-MoE, a
softmax-routed MoE (``mlp.gate``, ``mlp.experts.{e}.*`` or the fused
``mlp.experts.{gate_up,down}_proj``, the shared expert as the dense MLP, times
sigmoid(``mlp.shared_expert_gate``)), computed by the target graph's MoeMlp; a dense MLP for
Qwen3.5. An MoE or MLA layer over a dense target, a linear-attention MTP layer, and an MTP
layer of a Qwen3-Next/Qwen3.5 checkpoint over another target are refused in one line.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from specexport.errors import BadInput
from specexport.exporter.archs import (
    ARCHITECTURES,
    _rope_tables,
    attention_scale,
    mla_weights,
    moe_weights,
    softmax_moe_weights,
    split_query_gate,
)
from specexport.exporter.heads.chain import (
    ChainHead,
    ChainLayer,
    ChainSpec,
    MtpStem,
    TargetStates,
    Tensors,
    read_config,
    read_published,
    safetensors_files,
)


@dataclass(frozen=True)
class MtpLayout:
    prefix: str  # the MTP module's tensors (and its decoder layer's), {n}: the layer index
    embed_norm: str
    hidden_norm: str
    proj: str
    out_norm: str
    layer: str  # the decoder layer's prefix under the module's
    head: str | None = None  # its own output head; None: the target's lm_head
    embed: str | None = None  # its own embedding, when present; else the target's
    hidden_first: bool = False
    mask_position0: bool = False
    norm_offset: float = 0.0  # Qwen3NextRMSNorm: 1 + w
    normed_hidden_out: bool = True
    target_before_norm: bool = False  # MiMo


LAYOUTS = {
    "deepseek": MtpLayout("model.layers.{n}.", "enorm.weight", "hnorm.weight", "eh_proj.weight",
                          "shared_head.norm.weight", "", head="shared_head.head.weight", embed="embed_tokens.weight",
                          mask_position0=True, normed_hidden_out=False),
    "qwen3-next": MtpLayout("mtp.", "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight", "fc.weight",
                            "norm.weight", "layers.0.", norm_offset=1.0),
    "mimo": MtpLayout("model.mtp_layers.{n}.", "token_layernorm.weight", "hidden_layernorm.weight", "input_proj.weight",
                      "final_layernorm.weight", "", hidden_first=True, mask_position0=True, target_before_norm=True),
    "speculators": MtpLayout("mtp_layers.{n}.", "token_layernorm.weight", "hidden_layernorm.weight",
                             "input_proj.weight", "final_layernorm.weight", ""),
}
# the decoder layer's tensors: our field -> name (phi3's fused names are split below)
LAYER_NAMES = {
    "attn_norm": "input_layernorm.weight", "q_w": "self_attn.q_proj.weight", "k_w": "self_attn.k_proj.weight",
    "v_w": "self_attn.v_proj.weight", "o_w": "self_attn.o_proj.weight", "q_b": "self_attn.q_proj.bias",
    "k_b": "self_attn.k_proj.bias", "v_b": "self_attn.v_proj.bias", "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight", "mlp_norm": "post_attention_layernorm.weight",
    "gate_w": "mlp.gate_proj.weight", "up_w": "mlp.up_proj.weight", "down_w": "mlp.down_proj.weight",
}
# an MoE layer (DeepSeek-V3 / GLM-4.5): our MoeWeights field -> name ({e}: the expert), and its
# shared experts, read as the layer's dense MLP
EXPERT_NAMES = {"router_w": "mlp.gate.weight", "score_bias": "mlp.gate.e_score_correction_bias",
                "gate_w": "mlp.experts.{e}.gate_proj.weight", "up_w": "mlp.experts.{e}.up_proj.weight",
                "down_w": "mlp.experts.{e}.down_proj.weight"}
SHARED_NAMES = {"gate_w": "mlp.shared_experts.gate_proj.weight", "up_w": "mlp.shared_experts.up_proj.weight",
                "down_w": "mlp.shared_experts.down_proj.weight"}
# a Qwen3-Next / Qwen3.5-MoE layer's softmax-routed MoE: the router and routed experts by
# EXPERT_NAMES' names (no score-correction bias), or fused as transformers 5 and some Qwen3.5
# checkpoints store them (FUSED_EXPERT_NAMES: [E, 2I, H] gate rows then up, [E, H, I]); one
# shared expert (the dense MLP) and its gate [1, H]
FUSED_EXPERT_NAMES = {"gate_up_w": "mlp.experts.gate_up_proj", "down_w": "mlp.experts.down_proj"}
QWEN_SHARED_NAMES = {"gate_w": "mlp.shared_expert.gate_proj.weight", "up_w": "mlp.shared_expert.up_proj.weight",
                     "down_w": "mlp.shared_expert.down_proj.weight"}
SHARED_GATE_NAME = "mlp.shared_expert_gate.weight"
# tensor-name pieces of layers beyond a dense one: (what it is, the layer kind that reads it;
# None: none does)
UNREACHABLE = {
    "mlp.experts.": ("a mixture-of-experts MLP", "moe"), "mlp.gate.weight": ("a mixture-of-experts router", "moe"),
    "self_attn.q_a_proj": ("multi-head latent attention (MLA)", "mla"),
    "self_attn.kv_a_proj": ("multi-head latent attention (MLA)", "mla"),
    "linear_attn.": ("linear attention", None),
    "mlp.shared_expert.": ("a Qwen3-Next mixture-of-experts MLP", "qwen-moe"),
    "mlp.shared_expert_gate": ("a Qwen3-Next mixture-of-experts MLP", "qwen-moe"),
}
# target model_type -> the layer kinds beyond dense its MTP layer may be (archs.ARCHITECTURES reads
# the same kinds in the target; its gated_attention trait: the Qwen3-Next / Qwen3.5 gated layer)
MTP_TARGETS = {"llama": (), "mistral": (), "qwen2": (), "qwen3": (), "phi3": (), "glm4_moe": ("moe",),
               "deepseek_v3": ("moe", "mla"), "qwen3_next": ("moe", "qwen-moe"), "qwen3_5_text": (),
               "qwen3_5_moe_text": ("moe", "qwen-moe")}
GATED_TARGETS = tuple(t for t in MTP_TARGETS if ARCHITECTURES[t].gated_attention)
# config.json model types of checkpoints whose MTP layer is a gated Qwen3-Next / Qwen3.5 layer
# (the multimodal Qwen3.5 wrappers name the text model's kind in text_config)
GATED_CHECKPOINTS = ("qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")


def _target_folder(spec, target, base: Path, origin: str) -> Path:
    if spec.path is not None:
        return spec.path if spec.path.is_absolute() else base / spec.path
    # transformers records the directory a model came from
    where = getattr(target.model, "name_or_path", "") or getattr(target.model.config, "_name_or_path", "")
    if not where or not (Path(where) / "config.json").is_file():
        raise BadInput(f"{origin}: an mtp drafter without 'path' reads the target's own checkpoint, which needs a "
                       "transformers directory target (source: hf); give the MTP weights' folder as 'path'")
    return Path(where)


def detect_layout(config: dict, tensors: Tensors) -> tuple[str, int]:
    """(layout, the MTP layer index in the checkpoint's names)."""
    names = tensors.names()
    if config.get("speculators_model_type") == "mtp":
        return "speculators", 0
    if "mtp.fc.weight" in names:
        return "qwen3-next", 0
    found = sorted(int(m.group(1)) for n in names if (m := re.fullmatch(r"model\.mtp_layers\.(\d+)\.input_proj\.weight", n)))
    if found:
        return "mimo", found[0]
    found = sorted(int(m.group(1)) for n in names if (m := re.fullmatch(r"model\.layers\.(\d+)\.eh_proj\.weight", n)))
    if found:
        return "deepseek", found[0]
    raise BadInput(f"{tensors.origin}: no MTP weights found in {tensors.where} (looked for model.layers.N.eh_proj, "
                   "mtp.fc, model.mtp_layers.N.input_proj, and speculators_model_type: mtp in config.json)")


def load(spec, target, base: Path, origin: str) -> ChainHead:
    folder = _target_folder(spec, target, base, origin)
    files = safetensors_files(folder, origin)
    config = read_config(folder, origin) if (folder / "config.json").is_file() else {}
    t_cfg = target.model.config
    if t_cfg.model_type not in MTP_TARGETS:
        raise BadInput(f"{origin}: MTP heads are exported over {', '.join(MTP_TARGETS)} targets; "
                       f"this target is '{t_cfg.model_type}'")
    reachable = MTP_TARGETS[t_cfg.model_type]
    gated = ARCHITECTURES[t_cfg.model_type].gated_attention
    model_type = config.get("model_type") or (config.get("transformer_layer_config") or {}).get("model_type")
    if model_type == "deepseek_v2":
        raise BadInput(f"{origin}: the MTP layer of a 'deepseek_v2' model (softmax-routed, group-limited MoE) is out "
                       "of reach: specexport exports dense, DeepSeek-V3/GLM-4.5 and Qwen3-Next/Qwen3.5 MTP layers")
    if model_type in GATED_CHECKPOINTS and not gated:
        raise BadInput(f"{origin}: the MTP layer of a '{model_type}' model (gated attention, 1 + w norms) is a layer "
                       f"of a {'/'.join(GATED_TARGETS)} target; this target is '{t_cfg.model_type}'")
    tensors = Tensors(files, origin, lambda n: "mtp" in n or "eh_proj" in n or "enorm" in n or "hnorm" in n
                      or "shared_head" in n or re.match(r"model\.layers\.\d+\.", n) is not None or n.startswith("mtp_layers."))
    if spec.layout == "auto":
        layout, n = detect_layout(config, tensors)
    else:
        layout, n = spec.layout, (t_cfg.num_hidden_layers if spec.layout == "deepseek" else 0)
    lay = LAYOUTS[layout]
    prefix = lay.prefix.format(n=n)
    layer_prefix = prefix + lay.layer
    for name in tensors.names():
        if name.startswith(layer_prefix):
            for piece, (why, kind) in UNREACHABLE.items():
                if piece in name and kind not in reachable:
                    raise BadInput(f"{origin}: the MTP layer has {why} (tensor '{name}'), which a "
                                   f"'{t_cfg.model_type}' target's MTP layer cannot be")
    if spec.layer_ids is not None:
        raise BadInput(f"{origin}.layer_ids: an MTP head reads the target's last hidden state; layer_ids does not apply")

    hidden, heads = t_cfg.hidden_size, t_cfg.num_attention_heads
    kv_heads = getattr(t_cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(t_cfg, "head_dim", None) or hidden // heads
    if ARCHITECTURES[t_cfg.model_type].mla:  # per-head K/V at the qk width, as the target graph (archs.mla_weights)
        kv_heads, head_dim = heads, t_cfg.qk_nope_head_dim + t_cfg.qk_rope_head_dim
    inter = getattr(t_cfg, "intermediate_size", None)  # Qwen3.5-MoE has no dense MLP
    eps = float(t_cfg.rms_norm_eps)
    embed = target.model.get_input_embeddings().weight.detach().float()
    vocab = embed.shape[0]
    if lay.embed and tensors.has(prefix + lay.embed):
        embed = tensors.get(prefix + lay.embed, (vocab, hidden))
    head = tensors.get(prefix + lay.head, (vocab, hidden)) if lay.head and tensors.has(prefix + lay.head) \
        else target.model.get_output_embeddings().weight.detach().float()
    if gated:
        layer = read_gated_layer(tensors, layer_prefix, t_cfg, hidden, heads, kv_heads, head_dim, origin)
    elif tensors.has(layer_prefix + EXPERT_NAMES["router_w"]):
        layer = read_moe_layer(tensors, layer_prefix, target, origin)
    else:
        layer = read_layer(tensors, layer_prefix, t_cfg, hidden, heads, kv_heads, head_dim, inter)

    def norm(name: str) -> torch.Tensor:
        return tensors.get(prefix + name, (hidden,)) + lay.norm_offset

    hidden_norm = norm(lay.hidden_norm)
    target_scale = None
    if lay.target_before_norm:
        final = target.model.model.norm.weight.detach().float() + ARCHITECTURES[t_cfg.model_type].norm_offset
        if bool((final.abs() < 1e-6).any()):
            raise BadInput(f"{origin}: the target's final norm has zero weights; the MiMo head's pre-norm hidden "
                           "cannot be recovered from the tapped output")
        target_scale = (hidden_norm.double() / final.double()).float()
    stem = MtpStem(proj=tensors.get(prefix + lay.proj, (hidden, 2 * hidden)), embed_norm=norm(lay.embed_norm),
                   hidden_norm=hidden_norm, hidden_first=lay.hidden_first, mask_position0=lay.mask_position0,
                   target_scale=target_scale)
    act = getattr(t_cfg, "hidden_act", "silu")
    spec_out = ChainSpec(
        kind="mtp", hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=head_dim, eps=eps,
        activation="silu" if act in ("silu", "swish") else "gelu_tanh",
        attn_scale=attention_scale(target.model, head_dim), embed=embed, stem=stem, layers=[layer],
        out_norm=norm(lay.out_norm), lm_head=head, hidden_out_normed=lay.normed_hidden_out,
        rope=_rope_tables(target.model, t_cfg.max_position_embeddings)["default"], target_vocab=vocab,
        taps=(t_cfg.num_hidden_layers,), target_hidden=hidden, info={"layout": layout},
    )
    return ChainHead(spec_out, MtpReference(layout, prefix, files, target, origin), {"layout": layout})


def read_attention(tensors: Tensors, prefix: str, t_cfg, hidden, heads, kv_heads, head_dim) -> dict:
    """A GQA layer's attention and norms, as ChainLayer fields."""
    off = ARCHITECTURES[t_cfg.model_type].norm_offset
    q, kv = heads * head_dim, kv_heads * head_dim

    def get(field: str, shape):
        return tensors.get(prefix + LAYER_NAMES[field], shape)

    def maybe(field: str, shape):
        return get(field, shape) if tensors.has(prefix + LAYER_NAMES[field]) else None

    if ARCHITECTURES[t_cfg.model_type].fused_qkv:  # phi3: qkv_proj
        qkv = tensors.get(prefix + "self_attn.qkv_proj.weight", (q + 2 * kv, hidden))
        q_w, k_w, v_w = qkv[:q], qkv[q : q + kv], qkv[q + kv :]
    else:
        q_w, k_w, v_w = get("q_w", (q, hidden)), get("k_w", (kv, hidden)), get("v_w", (kv, hidden))
    has_qk_norm = t_cfg.model_type == "qwen3" or bool(getattr(t_cfg, "use_qk_norm", False))
    return dict(
        attn_norm=get("attn_norm", (hidden,)) + off, q_w=q_w, k_w=k_w, v_w=v_w, o_w=get("o_w", (hidden, q)),
        q_b=maybe("q_b", (q,)), k_b=maybe("k_b", (kv,)), v_b=maybe("v_b", (kv,)),
        q_norm=get("q_norm", (head_dim,)) + off if has_qk_norm else None,
        k_norm=get("k_norm", (head_dim,)) + off if has_qk_norm else None,
        mlp_norm=get("mlp_norm", (hidden,)) + off,
    )


def read_layer(tensors: Tensors, prefix: str, t_cfg, hidden, heads, kv_heads, head_dim, inter) -> ChainLayer:
    """A dense layer of the target's kind."""
    attention = read_attention(tensors, prefix, t_cfg, hidden, heads, kv_heads, head_dim)
    if ARCHITECTURES[t_cfg.model_type].fused_qkv:  # phi3: gate_up_proj
        gate_up = tensors.get(prefix + "mlp.gate_up_proj.weight", (2 * inter, hidden))
        gate_w, up_w = gate_up[:inter], gate_up[inter:]
    else:
        gate_w = tensors.get(prefix + LAYER_NAMES["gate_w"], (inter, hidden))
        up_w = tensors.get(prefix + LAYER_NAMES["up_w"], (inter, hidden))
    return ChainLayer(**attention, gate_w=gate_w, up_w=up_w,
                      down_w=tensors.get(prefix + LAYER_NAMES["down_w"], (hidden, inter)))


def read_moe_layer(tensors: Tensors, prefix: str, target, origin: str) -> ChainLayer:
    """A DeepSeek-V3 / GLM-4.5 MTP layer: routed experts by their published names (EXPERT_NAMES),
    the shared experts as the dense MLP, and MLA or GQA attention as the target's own layers."""
    t_cfg = target.model.config
    hidden, experts, inter = t_cfg.hidden_size, t_cfg.n_routed_experts, t_cfg.moe_intermediate_size
    shared = inter * t_cfg.n_shared_experts

    def expert(field: str, shape) -> torch.Tensor:  # [E, *shape]
        return torch.stack([tensors.get(prefix + EXPERT_NAMES[field].format(e=e), shape) for e in range(experts)])

    moe = moe_weights(t_cfg, tensors.get(prefix + EXPERT_NAMES["router_w"], (experts, hidden)),
                      tensors.get(prefix + EXPERT_NAMES["score_bias"], (experts,)), expert("gate_w", (inter, hidden)),
                      expert("up_w", (inter, hidden)), expert("down_w", (hidden, inter)))
    dense = {field: tensors.get(prefix + name, (hidden, shared) if field == "down_w" else (shared, hidden))
             for field, name in SHARED_NAMES.items()}
    if not ARCHITECTURES[t_cfg.model_type].mla:
        heads = t_cfg.num_attention_heads
        kv_heads = getattr(t_cfg, "num_key_value_heads", None) or heads
        head_dim = getattr(t_cfg, "head_dim", None) or hidden // heads
        return ChainLayer(**read_attention(tensors, prefix, t_cfg, hidden, heads, kv_heads, head_dim), **dense, moe=moe)
    attn_prefix = prefix + "self_attn."
    if tensors.has(attn_prefix + "o_proj.bias"):
        raise BadInput(f"{origin}: the MTP layer's MLA has an o_proj bias (attention_bias), which the head graph lacks")
    eps = float(target.model.model.layers[0].self_attn.kv_a_layernorm.variance_epsilon)
    mla, o_w = mla_weights(t_cfg, lambda name, shape: tensors.get(attn_prefix + name, shape),
                           lambda name: tensors.has(attn_prefix + name), eps, origin)
    norms = {field: tensors.get(prefix + LAYER_NAMES[field], (hidden,)) for field in ("attn_norm", "mlp_norm")}
    return ChainLayer(**norms, **dense, o_w=o_w, mla=mla, moe=moe)


def read_gated_layer(tensors: Tensors, prefix: str, t_cfg, hidden, heads, kv_heads, head_dim, origin: str) -> ChainLayer:
    """A Qwen3-Next / Qwen3.5 full-attention MTP layer: q_proj's rows per head [q | gate] split
    into Q and the output gate, q/k norms, every norm 1 + w (the target's norm_offset); the
    softmax MoE with its gated shared expert where the layer has a router, else the dense MLP."""
    off = ARCHITECTURES[t_cfg.model_type].norm_offset
    q, kv = heads * head_dim, kv_heads * head_dim

    def get(field: str, shape):
        return tensors.get(prefix + LAYER_NAMES[field], shape)

    for field in ("q_b", "k_b", "v_b"):
        if tensors.has(prefix + LAYER_NAMES[field]):
            raise BadInput(f"{origin}: the MTP layer's gated attention has a bias ('{prefix + LAYER_NAMES[field]}', "
                           "attention_bias), which the head graph lacks")
    q_w, out_gate_w = split_query_gate(get("q_w", (2 * q, hidden)), heads, head_dim)
    attention = dict(
        attn_norm=get("attn_norm", (hidden,)) + off, q_w=q_w,
        out_gate_w=out_gate_w, k_w=get("k_w", (kv, hidden)), v_w=get("v_w", (kv, hidden)),
        o_w=get("o_w", (hidden, q)), q_norm=get("q_norm", (head_dim,)) + off, k_norm=get("k_norm", (head_dim,)) + off,
        mlp_norm=get("mlp_norm", (hidden,)) + off,
    )
    if not tensors.has(prefix + EXPERT_NAMES["router_w"]):
        inter = t_cfg.intermediate_size
        dense = {field: get(field, (hidden, inter) if field == "down_w" else (inter, hidden))
                 for field in ("gate_w", "up_w", "down_w")}
        return ChainLayer(**attention, **dense)
    experts, inter = t_cfg.num_experts, t_cfg.moe_intermediate_size
    shared = t_cfg.shared_expert_intermediate_size
    if tensors.has(prefix + FUSED_EXPERT_NAMES["gate_up_w"]):  # [E, 2I, H]: each expert's gate rows, then up
        gate_w, up_w = tensors.get(prefix + FUSED_EXPERT_NAMES["gate_up_w"], (experts, 2 * inter, hidden)).split(inter, 1)
        down_w = tensors.get(prefix + FUSED_EXPERT_NAMES["down_w"], (experts, hidden, inter))
    else:
        def expert(field: str, shape) -> torch.Tensor:  # [E, *shape]
            return torch.stack([tensors.get(prefix + EXPERT_NAMES[field].format(e=e), shape) for e in range(experts)])

        gate_w, up_w = expert("gate_w", (inter, hidden)), expert("up_w", (inter, hidden))
        down_w = expert("down_w", (hidden, inter))
    # transformers' Qwen3.5-MoE router always renormalises the top-k (its config has no norm_topk_prob)
    renorm = True if t_cfg.model_type == "qwen3_5_moe_text" else bool(t_cfg.norm_topk_prob)
    moe = softmax_moe_weights(t_cfg.num_experts_per_tok, renorm,
                              tensors.get(prefix + EXPERT_NAMES["router_w"], (experts, hidden)),
                              gate_w.contiguous(), up_w.contiguous(), down_w,
                              tensors.get(prefix + SHARED_GATE_NAME, (1, hidden)))
    dense = {field: tensors.get(prefix + name, (hidden, shared) if field == "down_w" else (shared, hidden))
             for field, name in QWEN_SHARED_NAMES.items()}
    return ChainLayer(**attention, **dense, moe=moe)


def _stacked_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with a published MoE layer's per-expert tensors (mlp.experts.{e}.{gate,up,down}_proj)
    stacked as transformers 5 holds them: mlp.experts.gate_up_proj [E, 2I, H] (each expert's gate
    rows, then up), mlp.experts.down_proj [E, H, I]."""
    pattern = re.compile(r"mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")
    found: dict[str, dict[int, torch.Tensor]] = {"gate": {}, "up": {}, "down": {}}
    out = {}
    for name, value in state.items():
        if m := pattern.fullmatch(name):
            found[m.group(2)][int(m.group(1))] = value
        else:
            out[name] = value
    if found["gate"]:
        order = sorted(found["gate"])
        out["mlp.experts.gate_up_proj"] = torch.stack([torch.cat((found["gate"][e], found["up"][e])) for e in order])
        out["mlp.experts.down_proj"] = torch.stack([found["down"][e] for e in order])
    return out


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


class MtpReference:
    """Each family's MTP forward as vLLM writes it, over the target's own transformers decoder
    layer class loaded from the checkpoint's published names."""

    # layout -> (module prefix, embed norm, hidden norm, projection, output norm, hidden first,
    #            zero embedding at position 0, norm as 1 + w, own head, next hidden normed, pre-norm target)
    PUBLISHED = {
        "deepseek": ("model.layers.{n}.", "enorm", "hnorm", "eh_proj", "shared_head.norm", False, True, 0.0,
                     "shared_head.head", False, False),
        "qwen3-next": ("mtp.", "pre_fc_norm_embedding", "pre_fc_norm_hidden", "fc", "norm", False, False, 1.0, None,
                       True, False),
        "mimo": ("model.mtp_layers.{n}.", "token_layernorm", "hidden_layernorm", "input_proj", "final_layernorm", True,
                 True, 0.0, None, True, True),
        "speculators": ("mtp_layers.{n}.", "token_layernorm", "hidden_layernorm", "input_proj", "final_layernorm",
                        False, False, 0.0, None, True, False),
    }
    MODULE_NAMES = ("enorm", "hnorm", "eh_proj", "shared_head", "embed_tokens", "pre_fc_norm_embedding",
                    "pre_fc_norm_hidden", "fc.", "norm.weight", "token_layernorm", "hidden_layernorm", "input_proj",
                    "final_layernorm")

    def __init__(self, layout: str, prefix: str, files, target, origin: str):
        self.name = f"mtp reference ({layout}, vLLM math, transformers layer)"
        (_, self.e_norm, self.h_norm, self.proj, self.o_norm, self.hidden_first, self.mask0, self.offset, own_head,
         self.normed_out, self.pre_norm) = self.PUBLISHED[layout]
        t = {n[len(prefix):]: v for n, v in read_published(files).items() if n.startswith(prefix)}
        layer_prefix = "layers.0." if layout == "qwen3-next" else ""
        model = target.model
        if model.config.model_type in GATED_TARGETS:
            # vLLM builds the MTP layer as the target's decoder layer of type full_attention at
            # index 0 (its prefix mtp.layers.0): an MoE layer where layer 0 would be one
            # (mlp_only_layers, decoder_sparse_step)
            config = copy.deepcopy(model.config)
            config.layer_types = ["full_attention"] * len(config.layer_types)
            self.layer = type(model.model.layers[0])(config, layer_idx=0)
        else:
            # the target's last layer index: an MoE layer where the target's deep layers are (DeepSeek-V3
            # and GLM-4.5 build a dense MLP below first_k_dense_replace)
            self.layer = type(model.model.layers[0])(model.config, layer_idx=len(model.model.layers) - 1)
        state = {k[len(layer_prefix):]: v for k, v in t.items()
                 if k.startswith(layer_prefix) and not any(k.startswith(m) for m in self.MODULE_NAMES)}
        try:
            self.layer.load_state_dict(_stacked_experts(state), strict=True)
        except RuntimeError as err:  # the checkpoint's layer is not the kind the target's config builds
            found = " ".join(str(err).split())
            raise BadInput(f"{origin}: the MTP layer's tensors do not fit a {type(self.layer).__name__} of the "
                           f"target's config: {found[:300]}") from None
        self.layer.eval()
        self.t, self.eps = t, float(model.config.rms_norm_eps)
        self.rotary = model.model.rotary_emb
        self.embed = t.get("embed_tokens.weight", model.get_input_embeddings().weight.detach().float())
        self.head = t[own_head + ".weight"] if own_head and own_head + ".weight" in t else \
            model.get_output_embeddings().weight.detach().float()

    def _norm(self, x, name):
        return _rms(x, self.t[name + ".weight"] + self.offset, self.eps)

    def run(self, tokens: torch.Tensor, states: TargetStates, own_last: torch.Tensor | None):
        n = len(tokens)
        prev = (states.before_final_norm if self.pre_norm else states.hidden_states[-1])[:n]  # [n, H]
        if own_last is not None:  # [H], or [r, H]: the last r rows (a chain's step rows)
            own = own_last.reshape(-1, prev.shape[-1])
            prev = torch.cat((prev[: n - len(own)], own))
        e = self.embed[tokens].clone()  # [n, H]
        if self.mask0:
            e[0] = 0.0  # row 0 sits at position 0
        e, h = self._norm(e, self.e_norm), self._norm(prev, self.h_norm)
        x = torch.cat((h, e) if self.hidden_first else (e, h), dim=-1) @ self.t[self.proj + ".weight"].T  # [n, H]
        pos_ids = torch.arange(n)[None]
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        out = self.layer(x[None], attention_mask=mask, position_ids=pos_ids,
                         position_embeddings=self.rotary(x[None], pos_ids))
        out = (out[0] if isinstance(out, tuple) else out)[0]  # [n, H]
        normed = self._norm(out, self.o_norm)
        return normed @ self.head.T, (normed if self.normed_out else out)
