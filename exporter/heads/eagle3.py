"""EAGLE-3 heads: the SafeAILab and the speculators layouts.

The math (SafeAILab EAGLE ``cnets.py``, vLLM ``llama_eagle3.py``, speculators ``eagle3``):
g = fc(concat of three target hidden states) [H]; the first layer's attention reads
concat(input_layernorm(embed(token)), hidden_norm(g)) [2H], its residual is g (or
hidden_norm(g) with ``norm_before_residual``); logits = lm_head(norm(stream)) over the draft
vocabulary, target id = i + d2t[i]. The next step's features are the stream BEFORE the final
norm (vLLM's ``hidden_prenorm``, SafeAILab's ``out_hidden``), fed without fc. The embedding is
the target's unless the checkpoint has its own (``embed_tokens.weight``).

Tapped layers: vLLM/speculators ids i mean the stream entering layer i (transformers'
``hidden_states[i]``, our convention too); SafeAILab's modified target collects the stream
before layers 2, L//2 and L-3, the default when a config names none.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from specexport.errors import BadInput
from specexport.exporter.heads.chain import (
    ChainHead,
    ChainLayer,
    ChainSpec,
    Eagle3Stem,
    TargetStates,
    Tensors,
    config_int,
    read_config,
    read_published,
    safetensors_files,
)
from specexport.exporter.rope import rotary_tables

# layout -> where its tensors live (the decoder layer i's prefix, and the head's own tensors)
LAYOUTS = {
    "safeailab": {"layer": "midlayer.", "fc": "fc.weight", "norm": "norm.weight", "lm_head": "lm_head.weight",
                  "d2t": "d2t", "t2d": "t2d", "embed": "embed_tokens.weight", "fc_norm": "input_norm.weight"},
    "speculators": {"layer": "layers.{i}.", "fc": "fc.weight", "norm": "norm.weight", "lm_head": "lm_head.weight",
                    "d2t": "d2t", "t2d": "t2d", "embed": "embed_tokens.weight", "fc_norm": "input_norm.weight"},
}
# inside a decoder layer: our field -> the checkpoint's name
LAYER_NAMES = {
    "attn_norm": "input_layernorm.weight", "hidden_norm": "hidden_norm.weight",
    "q_w": "self_attn.q_proj.weight", "k_w": "self_attn.k_proj.weight", "v_w": "self_attn.v_proj.weight",
    "o_w": "self_attn.o_proj.weight", "q_b": "self_attn.q_proj.bias", "k_b": "self_attn.k_proj.bias",
    "v_b": "self_attn.v_proj.bias", "q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight",
    "mlp_norm": "post_attention_layernorm.weight", "gate_w": "mlp.gate_proj.weight",
    "up_w": "mlp.up_proj.weight", "down_w": "mlp.down_proj.weight",
}
# checkpoint layer id -> transformers' hidden_states index (both layouts: the stream entering layer i)
CONVENTIONS = {"safeailab": lambda i: i, "speculators": lambda i: i}
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


def default_taps(num_layers: int) -> list[int]:
    return [2, num_layers // 2, num_layers - 3]


def detect_layout(config: dict, tensors: Tensors) -> str:
    if config.get("speculators_model_type") == "eagle3":
        return "speculators"
    if "draft_vocab_size" in config and any(n.startswith("midlayer.") for n in tensors.names()):
        return "safeailab"
    raise BadInput(f"{tensors.origin}: {tensors.where} is neither a SafeAILab EAGLE-3 checkpoint (config.json with "
                   "draft_vocab_size, midlayer.* tensors) nor a speculators one (speculators_model_type: eagle3)")


def layer_config(config: dict, layout: str, origin: str) -> dict:
    if layout == "speculators":
        inner = config.get("transformer_layer_config")
        if not isinstance(inner, dict):
            raise BadInput(f"{origin}: config.json: 'transformer_layer_config' must be an object (the decoder layer's config)")
        return inner
    return config


def transformers_parts(model_type: str):
    """(DecoderLayer class, RotaryEmbedding class, config class) of a transformers family."""
    from transformers import AutoConfig

    try:
        module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
        config_class = type(AutoConfig.for_model(model_type))
    except (ImportError, ValueError):
        raise BadInput(f"EAGLE-3 decoder layer of model_type '{model_type}' is not supported (llama, qwen3)") from None
    prefix = next(n[: -len("DecoderLayer")] for n in dir(module) if n.endswith("DecoderLayer") and not n.startswith("_"))
    return getattr(module, prefix + "DecoderLayer"), getattr(module, prefix + "RotaryEmbedding"), config_class


def hf_config(fields: dict, origin: str):
    model_type = fields.get("model_type", "llama")
    _, _, config_class = transformers_parts(model_type)
    keep = {k: v for k, v in fields.items() if k not in ("architectures", "auto_map", "transformers_version")}
    try:
        cfg = config_class(**keep)
    except (TypeError, ValueError) as err:
        raise BadInput(f"{origin}: config.json: not a valid {model_type} layer config: {err}") from None
    cfg._attn_implementation = "eager"
    return cfg


def rope_table(cfg, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    _, rotary_class, _ = transformers_parts(cfg.model_type)
    return rotary_tables(rotary_class(cfg), positions)  # [S, rot] each


@dataclass(frozen=True)
class _Shape:
    """The head's sizes, read from its config (``where`` names the part of config.json they came from)."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    inter: int
    n_layers: int
    act: str
    eps: float
    where: str


def _read_shape(fields: dict, layout: str, origin: str) -> _Shape:
    """The decoder layers' sizes and activation, checked."""
    where = "config.json" + (": transformer_layer_config" if layout == "speculators" else "")
    hidden = config_int(fields, "hidden_size", origin, where)
    heads = config_int(fields, "num_attention_heads", origin, where)
    kv_heads = fields.get("num_key_value_heads") or heads
    head_dim = fields.get("head_dim") or hidden // heads
    inter = config_int(fields, "intermediate_size", origin, where)
    n_layers = config_int(fields, "num_hidden_layers", origin, where) if layout == "speculators" else 1
    act = fields.get("hidden_act", "silu")
    if act not in ACTIVATIONS:
        raise BadInput(f"{origin}: {where}: hidden_act '{act}' is not supported ({', '.join(ACTIVATIONS)})")
    return _Shape(hidden, heads, kv_heads, head_dim, inter, n_layers, act, float(fields.get("rms_norm_eps", 1e-6)),
                  where)


def _read_taps(spec, config: dict, layout: str, t_layers: int, origin: str) -> tuple[int, ...]:
    """The target layers read (the recipe's ids, else the config's, else EAGLE-3's default), as
    transformers' hidden_states indices."""
    ids = spec.layer_ids if spec.layer_ids is not None else config.get("eagle_aux_hidden_state_layer_ids")
    ids = default_taps(t_layers) if ids is None else ids
    if not isinstance(ids, list) or len(ids) != 3 or not all(isinstance(i, int) and 0 <= i < t_layers for i in ids):
        raise BadInput(f"{origin}: EAGLE-3 layer ids {ids!r} must be three target layers in 0..{t_layers - 1}")
    return tuple(CONVENTIONS[layout](i) for i in ids)


def _read_layer(tensors: Tensors, prefix: str, shape: _Shape, first: bool,
                origin: str) -> tuple[ChainLayer, tuple[torch.Tensor, torch.Tensor] | None]:
    """Decoder layer ``prefix``'s weights; the first layer reads [embedding, features] (2H wide)
    and also returns its two input norms (input_layernorm, hidden_norm) for the stem."""
    hidden, head_dim = shape.hidden, shape.head_dim
    width = 2 * hidden if first else hidden

    def get(field: str, dims):
        return tensors.get(prefix + LAYER_NAMES[field], dims)

    def maybe(field: str, dims):
        return get(field, dims) if tensors.has(prefix + LAYER_NAMES[field]) else None

    q, kv, inter = shape.heads * head_dim, shape.kv_heads * head_dim, shape.inter
    w = ChainLayer(
        attn_norm=None if first else get("attn_norm", (hidden,)),
        q_w=get("q_w", (q, width)), k_w=get("k_w", (kv, width)), v_w=get("v_w", (kv, width)),
        o_w=get("o_w", (hidden, q)), q_b=maybe("q_b", (q,)), k_b=maybe("k_b", (kv,)), v_b=maybe("v_b", (kv,)),
        q_norm=maybe("q_norm", (head_dim,)), k_norm=maybe("k_norm", (head_dim,)),
        mlp_norm=get("mlp_norm", (hidden,)), gate_w=get("gate_w", (inter, hidden)),
        up_w=get("up_w", (inter, hidden)), down_w=get("down_w", (hidden, inter)),
    )
    if (w.q_b is None) != (w.k_b is None) or (w.q_norm is None) != (w.k_norm is None):
        raise BadInput(f"{origin}: {prefix}self_attn: q and k must both have (or both lack) biases and norms")
    return w, (get("attn_norm", (hidden,)), get("hidden_norm", (hidden,))) if first else None


def _read_layers(tensors: Tensors, names: dict, config: dict, shape: _Shape,
                 t_hidden: int, origin: str) -> tuple[Eagle3Stem, list[ChainLayer]]:
    """The stem (fc over the taps, the first layer's two input norms) and the decoder layers."""
    first, norms = _read_layer(tensors, names["layer"].format(i=0), shape, True, origin)
    layers = [first] + [_read_layer(tensors, names["layer"].format(i=i), shape, False, origin)[0]
                        for i in range(1, shape.n_layers)]
    fc_norm = tensors.get(names["fc_norm"], (3 * t_hidden,)) if config.get("norm_before_fc") else None
    stem = Eagle3Stem(fc=tensors.get(names["fc"], (shape.hidden, 3 * t_hidden)), input_norm=norms[0],
                      hidden_norm=norms[1], norm_before_residual=bool(config.get("norm_before_residual", False)),
                      fc_norm=fc_norm)
    return stem, layers


def _read_vocab_map(tensors: Tensors, names: dict, draft_vocab: int, t_vocab: int, origin: str) -> torch.Tensor | None:
    """d2t (target id = i + d2t[i]; None when the head drafts the whole target vocabulary),
    checked against t2d when the checkpoint has one."""
    d2t = None
    if tensors.has(names["d2t"]) or draft_vocab != t_vocab:
        d2t = tensors.get(names["d2t"], (draft_vocab,), dtype="int")
        mapped = torch.arange(draft_vocab) + d2t
        if int(mapped.min()) < 0 or int(mapped.max()) >= t_vocab or len(torch.unique(mapped)) != draft_vocab:
            raise BadInput(f"{origin}: tensor '{names['d2t']}' maps draft ids outside the target vocabulary of "
                           f"{t_vocab} or twice onto one id (target id = i + d2t[i])")
    if tensors.has(names["t2d"]):
        t2d = tensors.get(names["t2d"], (t_vocab,), dtype="any")
        if int(t2d.bool().sum()) != draft_vocab:
            raise BadInput(f"{origin}: tensor '{names['t2d']}' marks {int(t2d.bool().sum())} target ids, "
                           f"expected draft_vocab_size {draft_vocab}")
    return d2t


def load(spec, target, base: Path, origin: str) -> ChainHead:
    """An EAGLE-3 checkpoint (either layout) for ``target``: its weights checked against the
    config and the target, as the chain graphs' spec, with the independent reference beside it."""
    folder = spec.path if spec.path.is_absolute() else base / spec.path
    files = safetensors_files(folder, origin)
    config = read_config(folder, origin)
    tensors = Tensors(files, origin)
    layout = detect_layout(config, tensors) if spec.layout == "auto" else spec.layout
    names = LAYOUTS[layout]
    fields = layer_config(config, layout, origin)
    shape = _read_shape(fields, layout, origin)
    hidden = shape.hidden
    t_cfg = target.model.config
    t_hidden, t_layers = t_cfg.hidden_size, t_cfg.num_hidden_layers
    target_embed = target.model.get_input_embeddings().weight.detach().float()
    t_vocab = target_embed.shape[0]
    f_hidden = config.get("target_hidden_size") or fields.get("target_hidden_size") or hidden
    if f_hidden != t_hidden:
        raise BadInput(f"{origin}: config.json: target_hidden_size {f_hidden} differs from the target's hidden size {t_hidden}")
    draft_vocab = config_int(config, "draft_vocab_size", origin) if "draft_vocab_size" in config else t_vocab
    taps = _read_taps(spec, config, layout, t_layers, origin)
    stem, layers = _read_layers(tensors, names, config, shape, t_hidden, origin)
    embed = tensors.get(names["embed"], (t_vocab, hidden)) if tensors.has(names["embed"]) else target_embed
    if embed.shape[1] != hidden:
        raise BadInput(f"{origin}: the head has no embed_tokens.weight and its hidden size {hidden} differs from the target's {t_hidden}")
    d2t = _read_vocab_map(tensors, names, draft_vocab, t_vocab, origin)
    cfg = hf_config(fields, origin)
    spec_out = ChainSpec(
        kind="eagle3", hidden=hidden, heads=shape.heads, kv_heads=shape.kv_heads, head_dim=shape.head_dim,
        eps=shape.eps, activation=ACTIVATIONS[shape.act], attn_scale=shape.head_dim**-0.5, embed=embed, stem=stem,
        layers=layers, out_norm=tensors.get(names["norm"], (hidden,)),
        lm_head=tensors.get(names["lm_head"], (draft_vocab, hidden)), hidden_out_normed=False,
        rope=rope_table(cfg, target.model.config.max_position_embeddings), target_vocab=t_vocab, taps=taps,
        target_hidden=t_hidden, d2t=d2t, info={"layout": layout},
    )
    return ChainHead(spec_out, Eagle3Reference(folder, files, config, target, origin), {"layout": layout})


class Eagle3Reference:
    """EAGLE-3 written from the published code over transformers' own decoder layer (its q/k/v
    widened to 2H as speculators does), reading the checkpoint by its published names."""

    name = "eagle3 reference (SafeAILab/vLLM/speculators math, transformers layer)"

    def __init__(self, folder: Path, files, config: dict, target, origin: str):
        speculators = config.get("speculators_model_type") == "eagle3"
        fields = config["transformer_layer_config"] if speculators else config
        t = read_published(files)
        cfg = hf_config(fields, origin)
        layer_class, rotary_class, _ = transformers_parts(cfg.model_type)
        hidden, n_layers = cfg.hidden_size, (cfg.num_hidden_layers if speculators else 1)
        self.layers = nn.ModuleList()
        for i in range(n_layers):
            layer = layer_class(cfg, layer_idx=i)
            prefix = f"layers.{i}." if speculators else "midlayer."
            if i == 0:  # the first layer reads [embedding, hidden]: 2H wide projections
                attn = layer.self_attn
                for proj in ("q_proj", "k_proj", "v_proj"):
                    old = getattr(attn, proj)
                    setattr(attn, proj, nn.Linear(2 * hidden, old.out_features, bias=old.bias is not None))
                layer.hidden_norm = type(layer.input_layernorm)(hidden, eps=cfg.rms_norm_eps)
            state = {k[len(prefix):]: v for k, v in t.items() if k.startswith(prefix)}
            layer.load_state_dict(state, strict=True)
            self.layers.append(layer.eval())
        self.rotary = rotary_class(cfg)
        self.fc = t["fc.weight"]
        self.fc_norm = t.get("input_norm.weight") if config.get("norm_before_fc") else None
        self.norm_before_residual = bool(config.get("norm_before_residual", False))
        self.norm = type(self.layers[0].input_layernorm)(hidden, eps=cfg.rms_norm_eps)
        self.norm.weight.data = t["norm.weight"]
        self.lm_head = t["lm_head.weight"]
        self.embed = t.get("embed_tokens.weight", target.model.get_input_embeddings().weight.detach().float())
        self.vocab = target.model.get_input_embeddings().weight.shape[0]
        d2t = t.get("d2t")
        self.targets = torch.arange(len(self.lm_head)) + (d2t.long() if d2t is not None else 0)
        n = target.model.config.num_hidden_layers
        ids = config.get("eagle_aux_hidden_state_layer_ids") or [2, n // 2, n - 3]
        self.ids = list(ids)  # vLLM/speculators: hidden_states[i], the stream entering layer i

    def run(self, tokens: torch.Tensor, states: TargetStates, own_last: torch.Tensor | None):
        n = len(tokens)
        aux = torch.cat([states.hidden_states[i][:n] for i in self.ids], dim=-1)  # [n, 3H]
        if self.fc_norm is not None:
            aux = aux * torch.rsqrt(aux.pow(2).mean(-1, keepdim=True) + self.norm.variance_epsilon) * self.fc_norm
        g = aux @ self.fc.T  # [n, H]
        if own_last is not None:  # [H], or [r, H]: the last r rows (a chain's step rows)
            own = own_last.reshape(-1, g.shape[-1])
            g = torch.cat((g[: n - len(own)], own))
        first = self.layers[0]
        residual, h = g, first.hidden_norm(g)
        if self.norm_before_residual:
            residual = h
        x = torch.cat((first.input_layernorm(self.embed[tokens]), h), dim=-1)[None]  # [1, n, 2H]
        pos = self.rotary(x, torch.arange(n)[None])
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        attn, _ = first.self_attn(hidden_states=x, position_embeddings=pos, attention_mask=mask)
        s = residual[None] + attn
        s = s + first.mlp(first.post_attention_layernorm(s))
        for layer in self.layers[1:]:
            out = layer(s, attention_mask=mask, position_embeddings=pos, position_ids=torch.arange(n)[None])
            s = out[0] if isinstance(out, tuple) else out
        s = s[0]  # [n, H]
        draft = self.norm(s) @ self.lm_head.T  # [n, V_draft]
        full = torch.full((n, self.vocab), float("-inf"))
        full[:, self.targets] = draft
        return full, s
