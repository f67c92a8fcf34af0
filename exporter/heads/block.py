"""Block drafters (DFlash, DSpark): the parsed head, its static graph, and its build.

A block drafter keeps a KV cache of the target's *context*: every committed position's tapped
features, projected once (``fc`` then ``hidden_norm``) and turned into keys and values by each
draft layer. One call appends C new context rows to that cache and drafts a whole block after
the anchor (the last committed token, which the target has not seen yet):

    block  = [anchor, mask, mask, ...]              block_size rows at positions start..start+bs-1
    layer  = x + Attn(q = block, kv = [cached context, new context, block])   (not causal)
             then x + MLP(x)                       dense Qwen3/Llama layers, q_norm/k_norm if any
    drafts = lm_head(norm(x))[first:]              first = 1 (DFlash: slot j drafts position start+j)
                                                   first = 0 (sample_from_anchor, DSpark: slot j
                                                   drafts position start+j+1)

The block's own positions are never cached: the next call starts from the context again.

Graph (``BlockGraph``, one per context size C):

  inputs   input_ids          int64 [B, 1]        the anchor
           context_features   float [B, C, F]     the target's aux_hidden_states rows (full width:
                                                  the graph gathers its own tap columns)
           context_valid      int64 [B]           real rows of context_features (the rest is padding)
           cache_length       int64 [B]           context rows already in the cache
           past_key_values.{i}.key|value          [B, n_kv, S_max, hd]
  outputs  logits             float [B, n, V_draft]  n = the drafting slots
           next_tokens        int64 [B, n]        argmax, as target ids (d2t applied)
           present.{i}.key|value  [B, n_kv, C, hd]   K/V of the C context rows (append the valid ones)
           block_hidden       float [B, n, H]     DSpark only: what its Markov and confidence heads read

The Markov and confidence heads of DSpark run in numpy in the runtime (runtime/block_drafter.py)
from ``<name>.block.npz``, with the reduced vocabulary's d2t when a head has one.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from specexport.contract import (
    CACHE_LENGTH,
    CONTEXT_FEATURES,
    CONTEXT_VALID,
    DRAFTER_KINDS,
    INPUT_IDS,
    DrafterEntry,
    KVLayout,
    ModelEntry,
    Role,
    drafter_kind,
    is_present,
    past_names,
)
from specexport.errors import BadInput
from specexport.exporter.archs import LayerWeights
from specexport.exporter.graph_model import _apply_rope, _rms_norm, _rotate_half_matrix
from specexport.exporter.heads.base import HeadContext, tap_columns
from specexport.exporter.onnx_export import export_module
from specexport.exporter.rope import rotary_tables

ACTIVATIONS = {"silu": nn.functional.silu, "swish": nn.functional.silu,
               "gelu_pytorch_tanh": lambda x: nn.functional.gelu(x, approximate="tanh")}
HEADS_FILE = "{name}.block.npz"  # numpy arrays the runtime reads (d2t, Markov and confidence heads)


# -- reading a checkpoint folder -------------------------------------------------------------


@dataclass
class Checkpoint:
    """A head's folder: config.json and every *.safetensors tensor (fp32), by published name."""

    folder: Path
    config: dict
    tensors: dict[str, torch.Tensor]
    files: dict[str, str] = field(default_factory=dict)  # tensor name -> the file holding it

    def where(self, name: str) -> str:
        """The file holding ``name`` (for a missing tensor: the checkpoint's weights files)."""
        if name in self.files:
            return str(self.folder / self.files[name])
        names = sorted(set(self.files.values()))
        return str(self.folder / names[0]) if len(names) == 1 else f"{self.folder}/{{{','.join(names)}}}"

    def has(self, name: str) -> bool:
        return name in self.tensors

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """The tensor ``name`` with exactly ``shape``; a missing or misshapen one is one BadInput line."""
        if name not in self.tensors:
            raise BadInput(f"{self.where(name)}: tensor '{name}' is missing (a {list(shape)} tensor); "
                           "is this the checkpoint the recipe's kind and layout say?")
        tensor = self.tensors[name]
        if tuple(tensor.shape) != tuple(shape):
            raise BadInput(f"{self.where(name)}: tensor '{name}' has shape {list(tensor.shape)}, expected "
                           f"{list(shape)} from config.json")
        return tensor

    def optional(self, name: str, shape: tuple[int, ...]) -> torch.Tensor | None:
        return self.get(name, shape) if name in self.tensors else None

    def bad(self, what: str) -> BadInput:
        return BadInput(f"{self.folder / 'config.json'}: {what}")


def read_checkpoint(folder: Path, origin: str) -> Checkpoint:
    from safetensors import safe_open

    if not folder.is_dir():
        raise BadInput(f"{origin}.path: {folder} is not a folder (config.json + *.safetensors)")
    config_path = folder / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except FileNotFoundError:
        raise BadInput(f"{origin}.path: {folder} has no config.json") from None
    except (OSError, ValueError) as err:
        raise BadInput(f"{config_path}: not valid JSON ({err})") from None
    if not isinstance(config, dict):
        raise BadInput(f"{config_path}: expected a JSON object")
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise BadInput(f"{origin}.path: {folder} has no *.safetensors weights (specexport loads safetensors only)")
    tensors: dict[str, torch.Tensor] = {}
    where: dict[str, str] = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as handle:
                for name in handle.keys():
                    tensor = handle.get_tensor(name)
                    tensors[name] = tensor.float() if tensor.is_floating_point() else tensor
                    where[name] = path.name
        except Exception as err:  # safetensors raises its own error types for a corrupt header
            raise BadInput(f"{path}: cannot read safetensors ({err})") from None
    return Checkpoint(folder, config, tensors, where)


def config_int(ckpt: Checkpoint, config: dict, key: str, default: Any = None, low: int = 0) -> int:
    """An integer field of config.json (``config`` may be a nested section of it)."""
    value = config.get(key, default)
    if value is None:
        raise ckpt.bad(f"'{key}' is missing")
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ckpt.bad(f"'{key}' must be an integer >= {low} (got {value!r})")
    return value


# -- the parsed head -------------------------------------------------------------------------


@dataclass
class DenseConfig:
    """The draft layers' shape (a Qwen3/Llama decoder config)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    activation: str
    attention_bias: bool
    rope: Callable[[int], tuple[torch.Tensor, torch.Tensor]]  # positions -> cos, sin [S, rot]


def dense_config(ckpt: Checkpoint, section: dict) -> DenseConfig:
    """Read a transformers decoder config (the top level, or speculators' transformer_layer_config)."""
    hidden = config_int(ckpt, section, "hidden_size", low=1)
    heads = config_int(ckpt, section, "num_attention_heads", low=1)
    kv_heads = config_int(ckpt, section, "num_key_value_heads", heads, low=1)
    if heads % kv_heads:
        raise ckpt.bad(f"num_attention_heads ({heads}) is not a multiple of num_key_value_heads ({kv_heads})")
    head_dim = section.get("head_dim") or hidden // heads
    activation = section.get("hidden_act", "silu")
    if activation not in ACTIVATIONS:
        raise ckpt.bad(f"hidden_act '{activation}' is not supported ({', '.join(ACTIVATIONS)})")
    if any(t != "full_attention" for t in section.get("layer_types") or []):
        raise ckpt.bad("sliding-window draft layers (layer_types) are not supported; every layer must be full_attention")
    eps = section.get("rms_norm_eps", 1e-6)
    if not isinstance(eps, (int, float)) or eps <= 0:
        raise ckpt.bad(f"'rms_norm_eps' must be a positive number (got {eps!r})")
    return DenseConfig(hidden, config_int(ckpt, section, "num_hidden_layers", low=1), heads, kv_heads, int(head_dim),
                       config_int(ckpt, section, "intermediate_size", low=1), float(eps), activation,
                       bool(section.get("attention_bias", False)), rope_tables(ckpt, section))


def rope_tables(ckpt: Checkpoint, section: dict) -> Callable[[int], tuple[torch.Tensor, torch.Tensor]]:
    """cos/sin tables of the draft's RoPE, from transformers' own rotary module (every RoPE type)."""
    from transformers import AutoConfig
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    fields = {k: v for k, v in section.items() if k not in ("architectures", "auto_map", "model_type")}
    try:
        config = AutoConfig.for_model("qwen3", **fields)
        rotary = Qwen3RotaryEmbedding(config)
    except (TypeError, ValueError, KeyError) as err:
        raise ckpt.bad(f"cannot build the draft layers' rotary embedding ({err})") from None

    def tables(length: int) -> tuple[torch.Tensor, torch.Tensor]:
        return rotary_tables(rotary, length)  # [S, rot] each

    return tables


def read_layers(ckpt: Checkpoint, dense: DenseConfig, prefix: str = "layers") -> list[LayerWeights]:
    """The draft's decoder layers, by their published names (the same in every layout)."""
    h, q, kv, inter, hd = dense.hidden, dense.heads * dense.head_dim, dense.kv_heads * dense.head_dim, \
        dense.intermediate, dense.head_dim
    layers = []
    for i in range(dense.layers):
        p = f"{prefix}.{i}"
        bias = dense.attention_bias
        has_qk_norm = ckpt.has(f"{p}.self_attn.q_norm.weight")
        layers.append(LayerWeights(
            attn_norm=ckpt.get(f"{p}.input_layernorm.weight", (h,)),
            q_w=ckpt.get(f"{p}.self_attn.q_proj.weight", (q, h)),
            k_w=ckpt.get(f"{p}.self_attn.k_proj.weight", (kv, h)),
            v_w=ckpt.get(f"{p}.self_attn.v_proj.weight", (kv, h)),
            o_w=ckpt.get(f"{p}.self_attn.o_proj.weight", (h, q)),
            q_b=ckpt.get(f"{p}.self_attn.q_proj.bias", (q,)) if bias else None,
            k_b=ckpt.get(f"{p}.self_attn.k_proj.bias", (kv,)) if bias else None,
            v_b=ckpt.get(f"{p}.self_attn.v_proj.bias", (kv,)) if bias else None,
            q_norm=ckpt.get(f"{p}.self_attn.q_norm.weight", (hd,)) if has_qk_norm else None,
            k_norm=ckpt.get(f"{p}.self_attn.k_norm.weight", (hd,)) if has_qk_norm else None,
            mlp_norm=ckpt.get(f"{p}.post_attention_layernorm.weight", (h,)),
            gate_w=ckpt.get(f"{p}.mlp.gate_proj.weight", (inter, h)),
            up_w=ckpt.get(f"{p}.mlp.up_proj.weight", (inter, h)),
            down_w=ckpt.get(f"{p}.mlp.down_proj.weight", (h, inter)),
        ))
    return layers


@dataclass
class BlockSpec:
    """Everything a block head's graph and runtime need, read from a checkpoint by a loader
    (exporter/heads/dflash.py, dspark.py)."""

    kind: str  # dflash | dspark
    layout: str  # which published layout it was read from
    ckpt: Checkpoint
    dense: DenseConfig
    taps: tuple[int, ...]  # the target's hidden states it reads (our convention), in fc's order
    block_size: int
    from_anchor: bool  # sample_from_anchor: the anchor slot drafts too
    layers: list[LayerWeights]
    fc: torch.Tensor  # [H, n_taps·H_target]
    hidden_norm: torch.Tensor  # [H]
    final_norm: torch.Tensor  # [H]
    embed: torch.Tensor  # [V_target, H]: the anchor's embedding (the target's, or the checkpoint's own)
    mask_embedding: torch.Tensor  # [H]: every slot after the anchor
    lm_head: torch.Tensor  # [V_draft, H]
    d2t: np.ndarray | None = None  # [V_draft] int64 target ids of a reduced draft vocabulary
    mask_token_id: int | None = None
    # numpy arrays for the runtime's heads (DSpark's Markov and confidence heads), by npz key
    head_arrays: dict[str, np.ndarray] = field(default_factory=dict)
    params: dict = field(default_factory=dict)  # extra DrafterEntry params (markov type, ...)

    @property
    def drafts(self) -> int:
        """Drafting slots per block."""
        return self.block_size if self.from_anchor else self.block_size - 1


# -- the graph -------------------------------------------------------------------------------


def _p(t: torch.Tensor | None) -> nn.Parameter | None:
    return None if t is None else nn.Parameter(t.detach().float().contiguous(), requires_grad=False)


class _BlockLayer(nn.Module):
    def __init__(self, w: LayerWeights):
        super().__init__()
        # [in, out] MatMuls; the block rows need Q, K and V (one MatMul), context rows K and V
        self.attn_norm, self.mlp_norm = _p(w.attn_norm), _p(w.mlp_norm)
        self.qkv_w = _p(torch.cat((w.q_w, w.k_w, w.v_w)).T)  # [H, (heads+2·n_kv)·hd]
        self.qkv_b = _p(torch.cat((w.q_b, w.k_b, w.v_b))) if w.q_b is not None else None
        self.kv_w = _p(torch.cat((w.k_w, w.v_w)).T)  # [H, 2·n_kv·hd]
        self.kv_b = _p(torch.cat((w.k_b, w.v_b))) if w.k_b is not None else None
        self.sizes = (w.q_w.shape[0], w.k_w.shape[0], w.v_w.shape[0])
        self.o_w = _p(w.o_w.T)  # [heads·hd, H]
        self.q_norm, self.k_norm = _p(w.q_norm), _p(w.k_norm)
        self.gate_up_w = _p(torch.cat((w.gate_w, w.up_w)).T)  # [H, 2·intermediate]
        self.intermediate = w.gate_w.shape[0]
        self.down_w = _p(w.down_w.T)  # [intermediate, H]


class BlockGraph(nn.Module):
    """One block-drafter call: append C context rows to the cache, draft one block (module doc)."""

    def __init__(self, spec: BlockSpec, columns: list[int], max_seq_len: int):
        super().__init__()
        d = spec.dense
        self.heads, self.n_kv, self.hd, self.eps = d.heads, d.kv_heads, d.head_dim, d.eps
        self.group = d.heads // d.kv_heads
        self.scale = d.head_dim ** -0.5
        self.act = ACTIVATIONS[d.activation]
        self.block, self.first = spec.block_size, spec.block_size - spec.drafts
        self.max_seq_len = max_seq_len
        self.with_hidden = DRAFTER_KINDS[drafter_kind(spec.kind)].block_hidden  # DSpark's heads read BLOCK_HIDDEN
        self.register_buffer("columns", torch.tensor(columns, dtype=torch.int64), persistent=False)  # [n_taps·H_t]
        self.fc_w = _p(spec.fc.T)  # [n_taps·H_t, H]
        self.hidden_norm, self.final_norm = _p(spec.hidden_norm), _p(spec.final_norm)
        # one table when the head's embedding and output head are the same tensor (a tied target)
        self.embed = _p(spec.embed)  # [V_t, H]
        self.lm_head = self.embed if spec.lm_head is spec.embed else _p(spec.lm_head)  # [V_d, H]
        self.mask_embedding = _p(spec.mask_embedding.view(1, 1, -1))  # [1, 1, H]
        d2t = spec.d2t if spec.d2t is not None else np.arange(spec.lm_head.shape[0])
        self.register_buffer("d2t", torch.from_numpy(np.asarray(d2t, dtype=np.int64)), persistent=False)  # [V_d]
        self.map_ids = spec.d2t is not None
        self.layers = nn.ModuleList(_BlockLayer(w) for w in spec.layers)
        # positions reach the block's end past the last cache slot
        cos, sin = d.rope(max_seq_len + spec.block_size)
        self.register_buffer("rope_cos", cos, persistent=False)  # [S_max+bs, rot]
        self.register_buffer("rope_sin", sin, persistent=False)
        self.register_buffer("rope_rotate", _rotate_half_matrix(cos.shape[-1]), persistent=False)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        index = positions.clamp(max=self.rope_cos.shape[0] - 1)  # [B, T]
        cos = nn.functional.embedding(index, self.rope_cos).unsqueeze(2)  # [B, T, 1, rot]
        sin = nn.functional.embedding(index, self.rope_sin).unsqueeze(2)
        return cos, sin

    def forward(self, input_ids, context_features, context_valid, cache_length, *past):
        # input_ids [B, 1]; context_features [B, C, F]; context_valid [B]; cache_length [B]
        batch, rows = context_features.shape[:2]
        bs, s_max = self.block, self.max_seq_len
        ctx = context_features.index_select(2, self.columns) @ self.fc_w  # [B, C, H]
        ctx = _rms_norm(ctx, self.hidden_norm, self.eps)
        ctx_offsets = torch.arange(rows, dtype=torch.int64)  # [C]
        ctx_pos = cache_length.unsqueeze(1) + ctx_offsets  # [B, C]
        start = cache_length + context_valid  # [B] the anchor's position
        block_pos = start.unsqueeze(1) + torch.arange(bs, dtype=torch.int64)  # [B, bs]
        ctx_rope, block_rope = self._rope(ctx_pos), self._rope(block_pos)

        anchor = nn.functional.embedding(input_ids, self.embed)  # [B, 1, H]
        x = torch.cat((anchor, self.mask_embedding.expand(batch, bs - 1, -1)), dim=1)  # [B, bs, H]

        # 0 where visible, -inf where hidden: cached slots below cache_length, new rows below
        # context_valid, every block row (the block attends to itself both ways)
        slots = torch.arange(s_max, dtype=torch.int64)
        past_ok = slots.view(1, s_max) < cache_length.view(batch, 1)  # [B, S_max]
        new_ok = ctx_offsets.view(1, rows) < context_valid.view(batch, 1)  # [B, C]
        block_ok = torch.ones(batch, bs, dtype=torch.bool)  # [B, bs]
        visible = torch.cat((past_ok, new_ok, block_ok), dim=1)  # [B, S_max+C+bs]
        mask = torch.where(visible, torch.zeros((), dtype=x.dtype), float("-inf")).view(batch, 1, 1, 1, -1)

        presents = []
        for i, layer in enumerate(self.layers):
            h = _rms_norm(x, layer.attn_norm, self.eps)  # [B, bs, H]
            out, k_ctx, v_ctx = self._attention(layer, h, ctx, block_rope, ctx_rope, past[2 * i], past[2 * i + 1], mask)
            presents += [k_ctx, v_ctx]
            x = x + out
            h = _rms_norm(x, layer.mlp_norm, self.eps)
            gate, up = torch.split(h @ layer.gate_up_w, layer.intermediate, dim=-1)  # [B, bs, I] ×2
            x = x + (self.act(gate) * up) @ layer.down_w  # [B, bs, H]

        hidden = _rms_norm(x, self.final_norm, self.eps)[:, self.first:]  # [B, n, H]
        n = bs - self.first
        logits = nn.functional.linear(hidden.reshape(batch * n, -1), self.lm_head).view(batch, n, -1)  # [B, n, V_d]
        next_tokens = logits.argmax(dim=-1)  # [B, n]
        if self.map_ids:
            next_tokens = self.d2t.index_select(0, next_tokens.reshape(-1)).view(batch, n)  # [B, n] target ids
        outputs = (logits, next_tokens, *presents)
        return (*outputs, hidden) if self.with_hidden else outputs

    def _heads(self, x, heads):  # [B, T, heads·hd] -> [B, T, heads, hd]
        return x.view(x.shape[0], x.shape[1], heads, self.hd)

    def _attention(self, layer, h, ctx, block_rope, ctx_rope, past_k, past_v, mask):
        batch, bs, _ = h.shape
        rows = ctx.shape[1]
        g, n_kv, hd = self.group, self.n_kv, self.hd
        qkv = h @ layer.qkv_w  # [B, bs, (heads+2·n_kv)·hd]
        kv = ctx @ layer.kv_w  # [B, C, 2·n_kv·hd]
        if layer.qkv_b is not None:
            qkv, kv = qkv + layer.qkv_b, kv + layer.kv_b
        q, k, v = torch.split(qkv, layer.sizes, dim=-1)
        k_c, v_c = torch.split(kv, layer.sizes[1:], dim=-1)
        q, k, v = self._heads(q, self.heads), self._heads(k, n_kv), self._heads(v, n_kv)  # [B, bs, *, hd]
        k_c, v_c = self._heads(k_c, n_kv), self._heads(v_c, n_kv)  # [B, C, n_kv, hd]
        if layer.q_norm is not None:
            q = _rms_norm(q, layer.q_norm, self.eps)
            k = _rms_norm(k, layer.k_norm, self.eps)
            k_c = _rms_norm(k_c, layer.k_norm, self.eps)
        q = _apply_rope(q, *block_rope, self.rope_rotate)
        k = _apply_rope(k, *block_rope, self.rope_rotate).transpose(1, 2)  # [B, n_kv, bs, hd]
        k_c = _apply_rope(k_c, *ctx_rope, self.rope_rotate).transpose(1, 2)  # [B, n_kv, C, hd]
        v, v_c = v.transpose(1, 2), v_c.transpose(1, 2)
        # query heads sharing a KV head stacked with the block rows: [B, n_kv, G·bs, hd]
        q = q.view(batch, bs, n_kv, g, hd).permute(0, 2, 3, 1, 4).reshape(batch, n_kv, g * bs, hd)
        scores = torch.cat((q @ past_k.transpose(2, 3), q @ k_c.transpose(2, 3), q @ k.transpose(2, 3)), dim=-1)
        scores = scores.view(batch, n_kv, g, bs, -1) * self.scale + mask  # [B, n_kv, G, bs, S_max+C+bs]
        probs = torch.softmax(scores, dim=-1).view(batch, n_kv, g * bs, -1)
        s_max = past_k.shape[2]
        out = probs[..., :s_max] @ past_v + probs[..., s_max:s_max + rows] @ v_c + probs[..., s_max + rows:] @ v
        out = out.view(batch, n_kv, g, bs, hd).permute(0, 3, 1, 2, 4).reshape(batch, bs, -1)  # [B, bs, heads·hd]
        return out @ layer.o_w, k_c, v_c


def graph_io(spec: BlockSpec) -> tuple[list[str], list[str]]:
    """A block head's graph inputs and outputs (its kind's signature in contract.DRAFTER_KINDS)."""
    signature = DRAFTER_KINDS[drafter_kind(spec.kind)]
    return signature.graph_inputs(len(spec.layers)), signature.graph_outputs(len(spec.layers))


def example_inputs(graph: BlockGraph, spec: BlockSpec, batch: int, rows: int, width: int) -> tuple[torch.Tensor, ...]:
    kv = (batch, spec.dense.kv_heads, graph.max_seq_len, spec.dense.head_dim)
    return (torch.zeros(batch, 1, dtype=torch.int64), torch.zeros(batch, rows, width),
            torch.ones(batch, dtype=torch.int64), torch.zeros(batch, dtype=torch.int64),
            *[torch.zeros(kv) for _ in range(2 * len(spec.layers))])


def batch_dims(num_layers: int) -> dict:
    """torch.export's dynamic shapes of a block graph whose batch is symbolic (every input's
    axis 0; DYNAMIC, as the chain graphs')."""
    rows = {0: torch.export.Dim.DYNAMIC}
    # keyed by forward's argument names (input_ids, context_features, context_valid, cache_length, *past)
    return {INPUT_IDS: rows, CONTEXT_FEATURES: rows, CONTEXT_VALID: rows, CACHE_LENGTH: rows,
            "past": tuple(rows for _ in range(2 * num_layers))}


def block_rows(batch: int, rows: int, room: int, width: int, vocab: int,
               rng: np.random.Generator) -> tuple[list[dict[str, np.ndarray]], list[int]]:
    """The batch-1 feeds of each row of a batched block graph's check (validate.row_plan over
    ``room`` cache positions: spread cache lengths, C, C-1, ... context rows, the last row
    idle), with random anchors and target features. Returns (rows, context rows of each)."""
    from specexport.exporter.validate import row_plan

    feeds, valid = [], []
    for length, count in row_plan(batch, rows, room):
        features = np.zeros((1, rows, width), dtype=np.float32)  # [1, C, F]
        features[0, :count] = rng.standard_normal((count, width))
        feeds.append({INPUT_IDS: rng.integers(3, vocab, size=(1, 1)), CONTEXT_FEATURES: features,
                      CONTEXT_VALID: np.array([count], dtype=np.int64), CACHE_LENGTH: np.array([length], dtype=np.int64)})
        valid.append(count)
    return feeds, valid


def validate_block_batched(ctx: HeadContext, spec: BlockSpec, names: dict[int, str],
                           batched: dict[str, tuple[int, int]], width: int) -> None:
    """Each batched block graph row by row against the batch-1 graph of its C
    (validate.check_batched_rows): rows at spread cache lengths with C, C-1, ... context rows
    and an idle row, over a random cache and random target features (the batch-1 graph itself
    was checked against the reference). Presents agree over each row's context rows, the
    block's outputs (logits, next tokens, block_hidden) whole."""
    from specexport.exporter.validate import check_batched_rows
    from specexport.runtime.engine import EngineOptions, SharedGraphs
    from specexport.runtime.ort_engine import OrtEngine

    if not batched:
        return
    options, shared = EngineOptions(threads=ctx.threads), SharedGraphs()
    rng = np.random.default_rng(0)
    n_layers = len(spec.layers)
    kv = (1, spec.dense.kv_heads, ctx.max_seq_len, spec.dense.head_dim)
    past = {name: rng.standard_normal(kv).astype(np.float32) for name in past_names(n_layers)}  # [1, n_kv, S_max, hd]
    _, outputs = graph_io(spec)
    block = tuple(name for name in outputs if not is_present(name))
    with ctx.step("validate", f"{ctx.name} batched block graphs") as s:
        for name, (batch, rows) in batched.items():
            engine = OrtEngine(name, ctx.tmp / f"{names[rows]}.onnx", *ctx.builder.specs[name], options, shared)
            single = OrtEngine(names[rows], ctx.tmp / f"{names[rows]}.onnx", *ctx.builder.specs[names[rows]], options,
                               shared)
            feeds, valid = block_rows(batch, rows, ctx.max_seq_len - spec.block_size, width, spec.embed.shape[0], rng)
            parity, worst = check_batched_rows(name, engine, single, past, feeds, valid, list(outputs),
                                               lambda got, want, _: (got, want, None), whole=block)
            ctx.record_parity(name, {**parity.to_dict(), "max_rel_output_diff": worst,
                                     "rows": [[int(f[CACHE_LENGTH][0]), v] for f, v in zip(feeds, valid)]},
                              reference="the batch-1 graph, row by row")
        s.detail = f"{len(batched)} graphs, ragged rows and an idle row against batch 1"


# -- the LoadedHead --------------------------------------------------------------------------


class BlockHead:
    """A loaded DFlash/DSpark head: LoadedHead for the builder (exporter/heads/base.py)."""

    def __init__(self, spec: BlockSpec, target, origin: str):
        self.spec = spec
        self.target = target
        self.origin = origin
        self.taps = spec.taps

    def context_sizes(self, ctx: HeadContext) -> list[int]:
        """C = 1+D (a round's committed rows) and the prefill chunk (the prompt)."""
        return sorted({ctx.plan.tokens_per_verify, ctx.prefill_chunk})

    def build(self, ctx: HeadContext) -> None:
        from specexport.exporter.heads.block_validate import validate_block_head

        spec = self.spec
        hidden_t = self.target.config.hidden_size
        width = len(ctx.target_taps) * hidden_t
        graph = BlockGraph(spec, tap_columns(ctx.target_taps, spec.taps, hidden_t), ctx.max_seq_len).eval()
        inputs, outputs = graph_io(spec)
        store = ctx.weights()
        names: dict[int, str] = {}
        batched: dict[str, tuple[int, int]] = {}  # batched engine name -> (batch, C)
        try:
            for rows in self.context_sizes(ctx):
                # a round's graph (C = 1+D) with a symbolic batch when the recipe batches: the
                # batched loop's block calls at every batch size share its file
                symbolic = bool(ctx.batches) and rows == ctx.plan.tokens_per_verify
                with ctx.step("export", f"{ctx.name} block C={rows}") as s:
                    example = example_inputs(graph, spec, 2 if symbolic else ctx.batch, rows, width)
                    proto = export_module(graph, example, inputs, outputs, ctx.opset,
                                          batch_dims(len(spec.layers)) if symbolic else None)
                    names[rows], path = ctx.save_graph(proto, Role.BLOCK, rows, store)
                    s.detail = f"{spec.kind} ({spec.layout}), block {spec.block_size}, {len(spec.layers)} layers"
                if symbolic:
                    batched.update(ctx.save_batched(proto, path, {rows: Role.BLOCK}, store))
        finally:
            store.close()
        if spec.head_arrays or spec.d2t is not None:
            arrays = dict(spec.head_arrays)
            if spec.d2t is not None:
                arrays["d2t"] = np.asarray(spec.d2t, dtype=np.int64)
            np.savez(ctx.tmp / HEADS_FILE.format(name=ctx.name), **arrays)
        kv = KVLayout(len(spec.layers), spec.dense.kv_heads, spec.dense.head_dim, ctx.max_seq_len, "float32")
        ctx.add_model(ModelEntry(ctx.name, spec.kind, kv, int(spec.lm_head.shape[0]), f"{ctx.name}.weights", "standard", {
            "layout": spec.layout, "hidden_size": spec.dense.hidden, "num_layers": len(spec.layers),
            "block_size": spec.block_size, "drafts": spec.drafts, "reads_taps": list(spec.taps),
        }))
        validate_block_head(self, ctx, names)
        validate_block_batched(ctx, spec, names, batched, width)

    def drafter_entry(self, name: str) -> DrafterEntry:
        spec = self.spec
        has_file = bool(spec.head_arrays) or spec.d2t is not None
        return DrafterEntry(name, spec.kind, name, {
            "block_size": spec.block_size, "drafts": spec.drafts, "from_anchor": spec.from_anchor,
            "heads_file": HEADS_FILE.format(name=name) if has_file else None, **spec.params,
        })


# -- what a layout's config says, and the spec every layout shares ----------------------------


@dataclass
class LayoutFacts:
    """A checkpoint's config in its own layout's words, before our conventions apply."""

    section: dict  # the draft layers' decoder fields
    layer_ids: list[int]  # target layers, in the layout's convention
    to_tap: Callable[[int], int]  # layer id -> transformers' hidden_states index (our convention)
    block_size: int
    mask_token_id: int | None
    from_anchor: bool
    draft_vocab: int | None = None  # a reduced draft vocabulary's size (speculators), else None


def layer_ids(ckpt: Checkpoint, raw: Any, key: str, override: list[int] | None) -> list[int]:
    ids = override if override is not None else raw
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ckpt.bad(f"'{key}' must be a non-empty list of layer ids (got {ids!r})")
    return ids


def speculators_facts(ckpt: Checkpoint, kind: str, override: list[int] | None) -> LayoutFacts:
    """vllm-project/speculators' DFlash/DSpark config: transformer_layer_config,
    aux_hidden_state_layer_ids (vLLM convention: the stream entering layer i), draft_vocab_size."""
    config = ckpt.config
    section = config.get("transformer_layer_config")
    if not isinstance(section, dict):
        raise ckpt.bad("'transformer_layer_config' is missing (speculators layout)")
    ids = layer_ids(ckpt, config.get("aux_hidden_state_layer_ids"), "aux_hidden_state_layer_ids", override)
    return LayoutFacts(section, ids, lambda i: i, config_int(ckpt, config, "block_size", low=2),
                       config.get("mask_token_id"),
                       bool(config.get("sample_from_anchor", kind == "dspark")),
                       config.get("draft_vocab_size"))


def detect_layout(ckpt: Checkpoint, kind: str, wanted: str, detectors: dict[str, Callable[[dict], bool]]) -> str:
    """The recipe's layout, or the first whose detector recognises config.json."""
    if wanted != "auto":
        return wanted
    for layout, recognises in detectors.items():
        if recognises(ckpt.config):
            return layout
    raise ckpt.bad(f"cannot tell which {kind} layout this is ({', '.join(detectors)}); set the drafter's layout")


def read_block(ckpt: Checkpoint, kind: str, layout: str, facts: LayoutFacts, target) -> BlockSpec:
    """The parts every DFlash-family layout shares: dense layers, fc + hidden_norm over the taps,
    the anchor's embedding, the mask embedding and the output head."""
    dense = dense_config(ckpt, facts.section)
    config_t = target.config
    n_target = int(config_t.num_hidden_layers)
    hidden_t = int(config_t.hidden_size)
    taps = tuple(facts.to_tap(i) for i in facts.layer_ids)
    for layer_id, tap in zip(facts.layer_ids, taps):
        if not 0 <= tap < n_target:
            raise ckpt.bad(f"target layer id {layer_id} is outside the target's {n_target} layers in this layout's "
                           "convention (the last layer's output is not tapped: transformers norms it)")
    if len(set(taps)) != len(taps):
        raise ckpt.bad(f"target layer ids {facts.layer_ids} repeat a layer")
    h = dense.hidden
    embed_t = target.model.get_input_embeddings().weight.detach().float()  # [V_t, H_t]
    head_t = target.model.get_output_embeddings().weight.detach().float()
    vocab = embed_t.shape[0]
    if ckpt.has("embed_tokens.weight"):
        embed = ckpt.get("embed_tokens.weight", (vocab, h))
    elif h != hidden_t:
        raise ckpt.bad(f"the draft's hidden_size {h} differs from the target's {hidden_t} and the checkpoint has no "
                       "embed_tokens.weight: the target's embedding cannot feed it")
    else:
        embed = embed_t
    draft_vocab = facts.draft_vocab or vocab
    if not isinstance(draft_vocab, int) or not 0 < draft_vocab <= vocab:
        raise ckpt.bad(f"'draft_vocab_size' must be an integer in 1..{vocab} (got {facts.draft_vocab!r})")
    if ckpt.has("lm_head.weight") or draft_vocab < vocab:
        lm_head = ckpt.get("lm_head.weight", (draft_vocab, h))
    elif h != hidden_t:
        raise ckpt.bad(f"the draft's hidden_size {h} differs from the target's {hidden_t} and the checkpoint has no "
                       "lm_head.weight")
    else:
        tied = target.model.get_output_embeddings().weight.data_ptr() == target.model.get_input_embeddings().weight.data_ptr()
        lm_head = embed if tied and embed is embed_t else head_t
    d2t = None
    if draft_vocab < vocab:
        offsets = ckpt.get("d2t", (draft_vocab,)).to(torch.int64).numpy()
        d2t = np.arange(draft_vocab, dtype=np.int64) + offsets  # target id = i + d2t[i]
        if d2t.min() < 0 or d2t.max() >= vocab:
            raise BadInput(f"{ckpt.where('d2t')}: tensor 'd2t' maps draft ids outside the target's vocabulary of {vocab}")
    if ckpt.has("mask_embedding"):
        mask_embedding = ckpt.tensors["mask_embedding"]
        if mask_embedding.numel() != h:
            raise BadInput(f"{ckpt.where('mask_embedding')}: tensor 'mask_embedding' has shape "
                           f"{list(mask_embedding.shape)}, expected [{h}]")
        mask_embedding = mask_embedding.reshape(h)
    else:
        mask = facts.mask_token_id
        if isinstance(mask, bool) or not isinstance(mask, int):
            raise ckpt.bad(f"'mask_token_id' is missing or not an integer (got {mask!r}) and there is no mask_embedding")
        if not 0 <= mask < vocab:
            raise ckpt.bad(f"mask_token_id {mask} is outside the target's vocabulary of {vocab} tokens")
        mask_embedding = embed[mask]
    return BlockSpec(
        kind=kind, layout=layout, ckpt=ckpt, dense=dense, taps=taps, block_size=facts.block_size,
        from_anchor=facts.from_anchor, layers=read_layers(ckpt, dense),
        fc=ckpt.get("fc.weight", (h, len(taps) * hidden_t)), hidden_norm=ckpt.get("hidden_norm.weight", (h,)),
        final_norm=ckpt.get("norm.weight", (h,)), embed=embed, mask_embedding=mask_embedding, lm_head=lm_head,
        d2t=d2t, mask_token_id=facts.mask_token_id,
    )
