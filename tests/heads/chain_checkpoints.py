"""Tiny random chain-head checkpoints in every published layout (EAGLE-3: SafeAILab and
speculators; MTP: DeepSeek-V3/GLM, Qwen3-Next, MiMo, speculators), over a tiny target."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

STD = 0.3  # spread of random matrices: clear logit margins on tiny shapes


def _rand(g: torch.Generator, *shape: int, std: float = STD) -> torch.Tensor:
    return torch.randn(*shape, generator=g) * std


def _norm(g: torch.Generator, n: int) -> torch.Tensor:
    return 1.0 + 0.1 * torch.randn(n, generator=g)


def decoder_layer(g, prefix: str, hidden: int, heads: int, kv: int, hd: int, inter: int, width: int | None = None,
                  qk_norm: bool = False, input_norm: bool = True, bias: bool = False) -> dict[str, torch.Tensor]:
    width = width or hidden
    t = {
        f"{prefix}self_attn.q_proj.weight": _rand(g, heads * hd, width),
        f"{prefix}self_attn.k_proj.weight": _rand(g, kv * hd, width),
        f"{prefix}self_attn.v_proj.weight": _rand(g, kv * hd, width),
        f"{prefix}self_attn.o_proj.weight": _rand(g, hidden, heads * hd),
        f"{prefix}post_attention_layernorm.weight": _norm(g, hidden),
        f"{prefix}mlp.gate_proj.weight": _rand(g, inter, hidden),
        f"{prefix}mlp.up_proj.weight": _rand(g, inter, hidden),
        f"{prefix}mlp.down_proj.weight": _rand(g, hidden, inter),
    }
    if input_norm:
        t[f"{prefix}input_layernorm.weight"] = _norm(g, hidden)
    if bias:  # Qwen2's q/k/v biases
        for proj, rows in (("q", heads * hd), ("k", kv * hd), ("v", kv * hd)):
            t[f"{prefix}self_attn.{proj}_proj.bias"] = _rand(g, rows)
    if qk_norm:
        t[f"{prefix}self_attn.q_norm.weight"] = _norm(g, hd)
        t[f"{prefix}self_attn.k_norm.weight"] = _norm(g, hd)
    return t


def vocab_map(g, vocab: int, draft_vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t [draft] int64, t2d [vocab] bool): a random sorted subset of target ids."""
    chosen = torch.randperm(vocab, generator=g)[:draft_vocab].sort().values
    d2t = chosen - torch.arange(draft_vocab)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[chosen] = True
    return d2t.long(), t2d


def write_eagle3(folder: Path, target_cfg, layout: str = "safeailab", *, seed: int = 1, draft_vocab: int = 96,
                 layer_ids: list[int] | None = None, norm_before_residual: bool = False, with_embed: bool = False,
                 drop: str | None = None, reshape: str | None = None, config_edit: dict | None = None) -> Path:
    """An EAGLE-3 head for ``target_cfg`` (a transformers config). ``drop``/``reshape``: a tensor
    to leave out or truncate (malformed checkpoints); ``config_edit``: keys to set in config.json."""
    g = torch.Generator().manual_seed(seed)
    h, heads, kv = target_cfg.hidden_size, target_cfg.num_attention_heads, target_cfg.num_key_value_heads
    hd = getattr(target_cfg, "head_dim", None) or h // heads
    inter, vocab = target_cfg.intermediate_size, target_cfg.vocab_size
    layer_prefix = "midlayer." if layout == "safeailab" else "layers.0."
    t = decoder_layer(g, layer_prefix, h, heads, kv, hd, inter, width=2 * h)
    t[f"{layer_prefix}hidden_norm.weight"] = _norm(g, h)
    t["fc.weight"] = _rand(g, h, 3 * h, std=STD / 2)
    t["norm.weight"] = _norm(g, h)
    t["lm_head.weight"] = _rand(g, draft_vocab, h)
    t["d2t"], t["t2d"] = vocab_map(g, vocab, draft_vocab)
    if with_embed:
        t["embed_tokens.weight"] = _rand(g, vocab, h)
    layer = {"model_type": "llama", "hidden_size": h, "num_attention_heads": heads, "num_key_value_heads": kv,
             "head_dim": hd, "intermediate_size": inter, "num_hidden_layers": 1, "rms_norm_eps": 1e-6,
             "hidden_act": "silu", "vocab_size": vocab, "max_position_embeddings": 4096, "rope_theta": 10000.0}
    if layout == "safeailab":
        config = {**layer, "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": draft_vocab}
        if layer_ids is not None:
            config["eagle_aux_hidden_state_layer_ids"] = layer_ids
    else:
        config = {"speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"],
                  "transformer_layer_config": layer, "draft_vocab_size": draft_vocab,
                  "norm_before_residual": norm_before_residual, "eagle_aux_hidden_state_layer_ids": layer_ids}
    return _write(folder, t, config, drop, reshape, config_edit)


def _write(folder: Path, t: dict, config: dict, drop, reshape, config_edit, name: str = "model.safetensors") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    if drop:
        del t[drop]
    if reshape:
        t[reshape] = t[reshape][..., :-1].contiguous()
    config.update(config_edit or {})
    save_file({k: v.contiguous() for k, v in t.items()}, str(folder / name))
    (folder / "config.json").write_text(json.dumps(config))
    return folder


MTP_LAYOUTS = ("deepseek", "qwen3-next", "mimo", "speculators")


def mtp_tensors(target_cfg, layout: str, seed: int = 2, fused_experts: bool = False) -> tuple[dict[str, torch.Tensor], str]:
    """(tensors, the decoder layer's prefix) of an MTP module in ``layout`` for ``target_cfg``."""
    g = torch.Generator().manual_seed(seed)
    h, heads, kv = target_cfg.hidden_size, target_cfg.num_attention_heads, target_cfg.num_key_value_heads
    hd = getattr(target_cfg, "head_dim", None) or h // heads
    inter, vocab, n = getattr(target_cfg, "intermediate_size", None), target_cfg.vocab_size, target_cfg.num_hidden_layers
    qk = target_cfg.model_type == "qwen3"
    if layout == "deepseek":
        p = f"model.layers.{n}."
        t = {p + "enorm.weight": _norm(g, h), p + "hnorm.weight": _norm(g, h), p + "eh_proj.weight": _rand(g, h, 2 * h),
             p + "shared_head.norm.weight": _norm(g, h), p + "shared_head.head.weight": _rand(g, vocab, h)}
        layer = p
    elif layout == "qwen3-next":  # Qwen3NextRMSNorm weights sit near 0 (applied as 1 + w)
        p = "mtp."
        t = {p + "fc.weight": _rand(g, h, 2 * h), p + "pre_fc_norm_embedding.weight": _norm(g, h) - 1,
             p + "pre_fc_norm_hidden.weight": _norm(g, h) - 1, p + "norm.weight": _norm(g, h) - 1}
        layer = p + "layers.0."
    else:
        p = "model.mtp_layers.0." if layout == "mimo" else "mtp_layers.0."
        t = {p + "token_layernorm.weight": _norm(g, h), p + "hidden_layernorm.weight": _norm(g, h),
             p + "input_proj.weight": _rand(g, h, 2 * h), p + "final_layernorm.weight": _norm(g, h)}
        layer = p
    if target_cfg.model_type in GATED:  # Qwen3-Next / Qwen3.5: a gated full-attention layer
        t.update(gated_layer(g, layer, target_cfg, fused_experts))
        return t, layer
    bias = target_cfg.model_type == "qwen2" or bool(getattr(target_cfg, "attention_bias", False))
    t.update(decoder_layer(g, layer, h, heads, kv, hd, inter, qk_norm=qk, bias=bias))
    if hasattr(target_cfg, "n_routed_experts"):  # DeepSeek-V3 / GLM-4.5: the MTP layer is an MoE layer
        t = {k: v for k, v in t.items() if not k.startswith(layer + "mlp.")}
        t.update(moe_mlp(g, layer, target_cfg))
    if hasattr(target_cfg, "kv_lora_rank"):  # DeepSeek-V3: and its attention MLA
        t = {k: v for k, v in t.items() if not k.startswith(layer + "self_attn.")}
        t.update(mla_attention(g, layer, target_cfg))
    return t, layer


# targets whose MTP layer has gated attention (q_proj per head [q | gate]) and 1 + w norms
GATED = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")


def gated_layer(g, prefix: str, cfg, fused_experts: bool = False) -> dict[str, torch.Tensor]:
    """A Qwen3-Next / Qwen3.5 full-attention layer by its published names: q_proj's rows per head
    [q | gate], q/k norms, norms near 0 (applied as 1 + w); a softmax-routed MoE with a gated
    shared expert where the config has experts (per-expert names, or ``fused_experts``: the
    stacked [E, 2I, H] / [E, H, I] tensors), else a dense MLP."""
    h, heads, kv = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads
    hd = cfg.head_dim
    a = f"{prefix}self_attn."
    t = {f"{prefix}input_layernorm.weight": _norm(g, h) - 1, f"{prefix}post_attention_layernorm.weight": _norm(g, h) - 1,
         a + "q_proj.weight": _rand(g, heads * 2 * hd, h), a + "k_proj.weight": _rand(g, kv * hd, h),
         a + "v_proj.weight": _rand(g, kv * hd, h), a + "o_proj.weight": _rand(g, h, heads * hd),
         a + "q_norm.weight": _norm(g, hd) - 1, a + "k_norm.weight": _norm(g, hd) - 1}
    experts = getattr(cfg, "num_experts", 0) or 0
    if not experts:
        inter = cfg.intermediate_size
        t.update({f"{prefix}mlp.gate_proj.weight": _rand(g, inter, h), f"{prefix}mlp.up_proj.weight": _rand(g, inter, h),
                  f"{prefix}mlp.down_proj.weight": _rand(g, h, inter)})
        return t
    inter, shared = cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    m = f"{prefix}mlp."
    t[m + "gate.weight"] = _rand(g, experts, h, std=0.15)  # router logits of a unit or so
    gate, up, down = _rand(g, experts, inter, h), _rand(g, experts, inter, h), _rand(g, experts, h, inter)
    if fused_experts:
        t[m + "experts.gate_up_proj"] = torch.cat((gate, up), dim=1)
        t[m + "experts.down_proj"] = down
    else:
        for e in range(experts):
            t[m + f"experts.{e}.gate_proj.weight"] = gate[e]
            t[m + f"experts.{e}.up_proj.weight"] = up[e]
            t[m + f"experts.{e}.down_proj.weight"] = down[e]
    t.update({m + "shared_expert.gate_proj.weight": _rand(g, shared, h), m + "shared_expert.up_proj.weight": _rand(g, shared, h),
              m + "shared_expert.down_proj.weight": _rand(g, h, shared),
              m + "shared_expert_gate.weight": _rand(g, 1, h, std=0.15)})  # sigmoid of a unit or so
    return t


def moe_mlp(g, prefix: str, cfg) -> dict[str, torch.Tensor]:
    """A DeepSeek-V3 / GLM-4.5 MoE MLP by its published names: router, score-correction bias,
    per-expert projections, shared experts."""
    h, experts, inter = cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size
    shared = inter * cfg.n_shared_experts
    t = {f"{prefix}mlp.gate.weight": _rand(g, experts, h, std=0.15),  # router logits of a unit or so
         f"{prefix}mlp.gate.e_score_correction_bias": _rand(g, experts, std=0.1)}
    for e in range(experts):
        t[f"{prefix}mlp.experts.{e}.gate_proj.weight"] = _rand(g, inter, h)
        t[f"{prefix}mlp.experts.{e}.up_proj.weight"] = _rand(g, inter, h)
        t[f"{prefix}mlp.experts.{e}.down_proj.weight"] = _rand(g, h, inter)
    t[f"{prefix}mlp.shared_experts.gate_proj.weight"] = _rand(g, shared, h)
    t[f"{prefix}mlp.shared_experts.up_proj.weight"] = _rand(g, shared, h)
    t[f"{prefix}mlp.shared_experts.down_proj.weight"] = _rand(g, h, shared)
    return t


def mla_attention(g, prefix: str, cfg) -> dict[str, torch.Tensor]:
    """DeepSeek-V3's multi-head latent attention by its published names (q_lora when the config has it)."""
    h, heads, kv_lora, rope = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    qk, v = cfg.qk_nope_head_dim + rope, cfg.v_head_dim
    a = f"{prefix}self_attn."
    t = {a + "kv_a_proj_with_mqa.weight": _rand(g, kv_lora + rope, h), a + "kv_a_layernorm.weight": _norm(g, kv_lora),
         a + "kv_b_proj.weight": _rand(g, heads * (cfg.qk_nope_head_dim + v), kv_lora),
         a + "o_proj.weight": _rand(g, h, heads * v)}
    if cfg.q_lora_rank:
        t.update({a + "q_a_proj.weight": _rand(g, cfg.q_lora_rank, h), a + "q_a_layernorm.weight": _norm(g, cfg.q_lora_rank),
                  a + "q_b_proj.weight": _rand(g, heads * qk, cfg.q_lora_rank)})
    else:
        t[a + "q_proj.weight"] = _rand(g, heads * qk, h)
    return t


def write_mtp_target(folder: Path, arch: str, layouts: str | tuple[str, ...], *, seed: int = 0,
                     drop: str | None = None, reshape: str | None = None, num_layers: int = 2,
                     fused_experts: bool = False, **fields) -> Path:
    """A tiny transformers target directory whose own safetensors also hold MTP modules (one per
    layout: their names do not collide). ``fused_experts``: a Qwen MoE MTP layer's experts as
    the stacked tensors."""
    from safetensors.torch import load_file

    from tests.exporter.hf_dirs import save_tiny_hf

    save_tiny_hf(folder, arch, seed=seed, num_layers=num_layers, **fields)
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(folder)
    weights = load_file(str(folder / "model.safetensors"))
    for i, layout in enumerate((layouts,) if isinstance(layouts, str) else layouts):
        weights.update(mtp_tensors(cfg, layout, seed=2 + i, fused_experts=fused_experts)[0])
    if drop:
        del weights[drop]
    if reshape:
        weights[reshape] = weights[reshape][..., :-1].contiguous()
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def write_mtp_speculators(folder: Path, target_cfg, *, drop=None, reshape=None, config_edit=None) -> Path:
    t, _ = mtp_tensors(target_cfg, "speculators")
    config = {"speculators_model_type": "mtp", "architectures": ["MTPDraftModel"],
              "transformer_layer_config": target_cfg.to_dict(), "num_speculative_steps": 3}
    return _write(folder, t, config, drop, reshape, config_edit)


# -- heads that agree with their target by construction (acceptance floors) -----------------


# rotary pairs (i, i + 32) of a 64-wide head turn by 10000^(-i/32) per position: from i = 20 on,
# by at most 0.15 rad over the 48 cache slots of the head tests
SLOW_ROTARY = [*range(20, 32), *range(52, 64)]
KEY_DIMS = len(SLOW_ROTARY)  # the bigram target's embedding columns a copy EAGLE-3 head matches tokens by
SELF_MATCH_SCORE = 200.0  # a copy EAGLE-3 row's attention score on rows of its own token


def write_bigram_target(folder: Path, seed: int = 0) -> Path:
    """A one-layer qwen2 target (untied lm_head) whose next token depends on the current token
    only: its attention's output projection is zero. Each embedding row has rms 1, so that a
    head's RMS-normed embedding is the target's own layer input, and norm sqrt(KEY_DIMS) in its
    first KEY_DIMS columns (random directions: two tokens' cosine there is far below 1). The
    copy heads below compute its next-token logits exactly."""
    from safetensors.torch import load_file

    from tests.exporter.hf_dirs import save_tiny_hf

    save_tiny_hf(folder, "qwen2", seed=seed, num_layers=1)
    weights = load_file(str(folder / "model.safetensors"))
    weights["model.layers.0.self_attn.o_proj.weight"].zero_()
    embed = weights["model.embed_tokens.weight"]  # [V, H]
    keys, rest = embed[:, :KEY_DIMS], embed[:, KEY_DIMS:]
    weights["model.embed_tokens.weight"] = torch.cat((keys / keys.norm(dim=-1, keepdim=True) * KEY_DIMS**0.5,
                                                      rest / rest.norm(dim=-1, keepdim=True) * rest.shape[1]**0.5), 1)
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def _target_layer(weights: dict, prefix: str) -> dict[str, torch.Tensor]:
    """The bigram target's decoder layer 0 (attention, norms, MLP) under ``prefix``."""
    return {prefix + k[len("model.layers.0."):]: v.clone() for k, v in weights.items() if k.startswith("model.layers.0.")}


def add_copy_mimo(target: Path) -> Path:
    """A MiMo MTP module in the bigram target's safetensors that is the target's own layer:
    input_proj takes the normed embedding back to the embedding (rms 1: a factor sqrt(1 + eps))
    and drops the hidden, the final norm is the target's; each row computes the target's
    next-token logits of its token."""
    from safetensors.torch import load_file

    weights = load_file(str(target / "model.safetensors"))
    eps = json.loads((target / "config.json").read_text())["rms_norm_eps"]
    h = weights["model.norm.weight"].shape[0]
    p = "model.mtp_layers.0."
    weights.update({p + "token_layernorm.weight": torch.ones(h), p + "hidden_layernorm.weight": torch.ones(h),
                    # [H, 2H]: MiMo concatenates [hidden, embedding]
                    p + "input_proj.weight": torch.cat((torch.zeros(h, h), torch.eye(h) * (1 + eps) ** 0.5), dim=1),
                    p + "final_layernorm.weight": weights["model.norm.weight"].clone(), **_target_layer(weights, p)})
    save_file(weights, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target


def write_copy_eagle3(folder: Path, target: Path) -> Path:
    """An EAGLE-3 head (speculators layout) that is the bigram target's own layer. Its hidden
    path is off: hidden_norm 0 with norm_before_residual, so the features are never read and
    the residual starts at 0. One attention head of width H finds the rows of its own token:
    q = k, the embedding's first KEY_DIMS columns scaled, on the slowest rotary dimensions (the
    rotation barely turns them), so a row scores SELF_MATCH_SCORE on rows of its own token and
    tens less on any other; v and o copy that embedding into the stream. The MLP, final norm and
    lm_head are the target's: each row computes the target's next-token logits of its token."""
    from safetensors.torch import load_file

    cfg = json.loads((target / "config.json").read_text())
    weights = load_file(str(target / "model.safetensors"))
    h, eps = cfg["hidden_size"], cfg["rms_norm_eps"]
    qk = torch.zeros(h, 2 * h)  # [hd = H, 2H]: reads the normed embedding half of [embedding, hidden]
    # score = |q|^2 / sqrt(hd) = scale^2 · KEY_DIMS / sqrt(H) on a row's own token
    qk[SLOW_ROTARY, :KEY_DIMS] = torch.eye(KEY_DIMS) * (SELF_MATCH_SCORE * h**0.5 / KEY_DIMS) ** 0.5
    copy = torch.cat((torch.eye(h), torch.zeros(h, h)), dim=1)  # [H, 2H]
    p = "layers.0."
    t = {p + "self_attn.q_proj.weight": qk, p + "self_attn.k_proj.weight": qk.clone(),
         p + "self_attn.v_proj.weight": copy, p + "self_attn.o_proj.weight": torch.eye(h) * (1 + eps) ** 0.5,
         p + "input_layernorm.weight": torch.ones(h), p + "hidden_norm.weight": torch.zeros(h),
         p + "post_attention_layernorm.weight": weights["model.layers.0.post_attention_layernorm.weight"],
         **{p + f"mlp.{m}_proj.weight": weights[f"model.layers.0.mlp.{m}_proj.weight"] for m in ("gate", "up", "down")},
         "fc.weight": torch.zeros(h, 3 * h), "norm.weight": weights["model.norm.weight"],
         "lm_head.weight": weights["lm_head.weight"]}
    layer = {"model_type": "llama", "hidden_size": h, "num_attention_heads": 1, "num_key_value_heads": 1,
             "head_dim": h, "intermediate_size": cfg["intermediate_size"], "num_hidden_layers": 1, "rms_norm_eps": eps,
             "hidden_act": "silu", "vocab_size": cfg["vocab_size"], "max_position_embeddings": 4096,
             "rope_theta": 10000.0}
    config = {"speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"],
              "transformer_layer_config": layer, "draft_vocab_size": cfg["vocab_size"],
              "norm_before_residual": True, "eagle_aux_hidden_state_layer_ids": [0, 0, 0]}
    return _write(folder, t, config, None, None, None)
