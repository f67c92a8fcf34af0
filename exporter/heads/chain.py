"""Chain heads (EAGLE-3, MTP): one static-shape torch module, its export and its validation.

A chain head drafts one token per call from (token, features) rows. Row p pairs token x_{p+1}
with the features of position p and predicts x_{p+2} (the EAGLE convention), at cache slot p.
Catch-up graphs take the target's full ``aux_hidden_states`` width as ``draft_features`` and
gather their own tap columns; the step graph takes the head's own hidden [B, 1, H]. A stem per
kind turns (embedding, features) into the first layer's input; the layers, the output norm and
the head are shared. Draft-vocabulary logits are scattered into the target vocabulary (-inf
elsewhere) so the runtime's sampling code works on target ids unchanged.

Validation runs every graph through the runtime's ModelRunner against a reference forward that
each kind's module writes from the published code (full sequence, no cache, transformers'
own attention and MLP modules), sharing nothing with the graph module here.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
from torch import nn

from specexport.backends import TENSORRT
from specexport.contract import (
    CACHE_LENGTH,
    DRAFT_FEATURES,
    DRAFTER_KINDS,
    HIDDEN_OUT,
    INPUT_IDS,
    LOGITS,
    NEXT_TOKENS,
    DrafterEntry,
    DrafterKind,
    KVLayout,
    ModelEntry,
    Role,
    drafter_kind,
    engine_name,
    present_names,
)
from specexport.errors import BadInput
from specexport.exporter.archs import MlaWeights, MoeWeights
from specexport.exporter.fill import check_fill
from specexport.exporter.graph_model import MlaProjection, MoeMlp, _apply_rope, _rms_norm, _rotate_half_matrix
from specexport.exporter.heads.base import HeadContext, tap_columns
from specexport.exporter.onnx_export import export_module
from specexport.exporter.validate import Parity, cache_lengths, check_batched_rows, row_plan
from specexport.runtime.runner import PAD_ID

# -- reading checkpoints --------------------------------------------------------------------


def read_config(folder: Path, origin: str) -> dict:
    path = folder / "config.json"
    if not path.is_file():
        raise BadInput(f"{origin}: {path} not found; a head checkpoint needs its config.json")
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise BadInput(f"{origin}: cannot read {path}: {err}") from None
    if not isinstance(config, dict):
        raise BadInput(f"{origin}: {path} must hold a JSON object")
    return config


def safetensors_files(folder: Path, origin: str) -> list[Path]:
    if not folder.is_dir():
        raise BadInput(f"{origin}.path: {folder} is not a folder; give the checkpoint's folder")
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        found = ", ".join(sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt")))
        raise BadInput(f"{origin}.path: {folder} has no *.safetensors weights ({found or 'no weights'}); "
                       "specexport loads safetensors only: convert with safetensors.torch.save_file")
    return files


class Tensors:
    """A checkpoint's tensors by name (safetensors only), each read on demand; errors name the
    file and the tensor."""

    def __init__(self, files: list[Path], origin: str, prefix_filter: Callable[[str], bool] = lambda _: True):
        from safetensors import safe_open

        self.origin = origin
        self._where: dict[str, Path] = {}
        for path in files:
            try:
                with safe_open(str(path), framework="pt") as f:
                    for key in f.keys():
                        if prefix_filter(key):
                            self._where[key] = path
            except Exception as err:  # noqa: BLE001 - any unreadable file is one line
                raise BadInput(f"{origin}: cannot read {path}: {err}") from None
        self.where = files[0].parent if files else Path(".")

    def names(self) -> list[str]:
        return sorted(self._where)

    def has(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str, shape: tuple[int, ...] | None = None, dtype: str = "float") -> torch.Tensor:
        from safetensors import safe_open

        if name not in self._where:
            raise BadInput(f"{self.origin}: tensor '{name}' is missing from {self.where} "
                           "(a malformed or incomplete checkpoint)")
        path = self._where[name]
        with safe_open(str(path), framework="pt") as f:
            t = f.get_tensor(name)
        if shape is not None and tuple(t.shape) != tuple(shape):
            raise BadInput(f"{self.origin}: tensor '{name}' in {path.name} has shape {list(t.shape)}, "
                           f"expected {list(shape)}")
        if dtype == "any":
            return t
        if dtype == "float":
            if not t.is_floating_point():
                raise BadInput(f"{self.origin}: tensor '{name}' in {path.name} has dtype {t.dtype}, expected a float")
            return t.float()
        if t.is_floating_point() or t.dtype == torch.bool:
            raise BadInput(f"{self.origin}: tensor '{name}' in {path.name} has dtype {t.dtype}, expected integers")
        return t.long()


def config_int(config: dict, key: str, origin: str, file: str = "config.json") -> int:
    value = config.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise BadInput(f"{origin}: {file}: '{key}' must be a positive integer (got {value!r})")
    return value


# -- the graph ------------------------------------------------------------------------------


@dataclass
class ChainLayer:
    """One decoder layer, transformers layout [out, in]. ``attn_norm`` None: EAGLE-3's first
    layer, whose inputs are normed before the concatenation."""

    attn_norm: torch.Tensor | None
    o_w: torch.Tensor
    mlp_norm: torch.Tensor
    gate_w: torch.Tensor  # the dense MLP; an MoE layer's shared experts
    up_w: torch.Tensor
    down_w: torch.Tensor
    q_w: torch.Tensor | None = None  # None in an MLA layer (``mla`` holds its projections)
    k_w: torch.Tensor | None = None
    v_w: torch.Tensor | None = None
    q_b: torch.Tensor | None = None
    k_b: torch.Tensor | None = None
    v_b: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    moe: MoeWeights | None = None  # routed experts beside the dense MLP (DeepSeek-V3 / GLM-4.5 / Qwen3-Next MTP layers)
    mla: MlaWeights | None = None  # DeepSeek-V3's multi-head latent attention
    # [heads·hd, in] Qwen3-Next / Qwen3.5 gated attention: the attention output (before o_proj)
    # times sigmoid(x @ out_gate_w.T); the gate rows of q_proj's per-head [q | gate]
    out_gate_w: torch.Tensor | None = None


@dataclass
class Eagle3Stem:
    fc: torch.Tensor  # [H, n_taps·H_target]
    input_norm: torch.Tensor  # [H] the token embedding's norm
    hidden_norm: torch.Tensor  # [H]
    norm_before_residual: bool
    fc_norm: torch.Tensor | None = None  # [n_taps·H_target] speculators' norm_before_fc


@dataclass
class MtpStem:
    proj: torch.Tensor  # [H, 2H]
    embed_norm: torch.Tensor  # [H]
    hidden_norm: torch.Tensor  # [H]
    hidden_first: bool  # MiMo concatenates [hidden, embedding]
    mask_position0: bool  # vLLM's DeepSeek/MiMo MTP zero the embedding at position 0
    # MiMo reads the target's pre-final-norm hidden; the graph gets the final-normed one (tap L):
    # hidden_norm(pre) = post · (w_hidden / w_final) exactly (same eps), folded into one vector
    target_scale: torch.Tensor | None = None  # [H]


@dataclass
class ChainSpec:
    kind: str
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    activation: str  # silu | gelu_tanh
    attn_scale: float
    embed: torch.Tensor  # [V_target, H]
    stem: Eagle3Stem | MtpStem
    layers: list[ChainLayer]
    out_norm: torch.Tensor  # [H] before the head
    lm_head: torch.Tensor  # [V_draft, H]
    hidden_out_normed: bool  # the next step's features: out_norm's output (True) or the stream before it
    rope: tuple[torch.Tensor, torch.Tensor]  # cos, sin [S_table, rot]
    target_vocab: int
    taps: tuple[int, ...]  # target hidden states read, transformers indices, in the head's order
    target_hidden: int
    d2t: torch.Tensor | None = None  # [V_draft] int64: target id = i + d2t[i]
    info: dict = field(default_factory=dict)


def _p(t: torch.Tensor | None) -> nn.Parameter | None:
    return None if t is None else nn.Parameter(t.contiguous().float(), requires_grad=False)


class ChainGraph(nn.Module):
    """forward(input_ids [B,T], draft_features [B,T,F], cache_length [B], *past) ->
    (logits [B,T,V], next_tokens [B,T], *presents [B,n_kv,T,hd], hidden_out [B,T,H]).
    ``step``: features are the head's own hidden; otherwise the target's aux_hidden_states."""

    def __init__(self, spec: ChainSpec, target_taps: tuple[int, ...], max_seq_len: int, step: bool):
        super().__init__()
        self.spec, self.step, self.s_max = spec, step, max_seq_len
        self.n_heads, self.n_kv, self.hd = spec.heads, spec.kv_heads, spec.head_dim
        self.group = spec.heads // spec.kv_heads
        self.embed = _p(spec.embed)  # [V, H]
        cols = tap_columns(target_taps, spec.taps, spec.target_hidden)
        self.register_buffer("columns", torch.tensor(cols, dtype=torch.int64), persistent=False)
        stem = spec.stem
        if isinstance(stem, Eagle3Stem):
            self.fc_t = _p(stem.fc.T)  # [F_taps, H]
            self.fc_norm = _p(stem.fc_norm)
            self.e_norm, self.h_norm = _p(stem.input_norm), _p(stem.hidden_norm)
        else:
            self.proj_t = _p(stem.proj.T)  # [2H, H]
            self.e_norm, self.h_norm = _p(stem.embed_norm), _p(stem.hidden_norm)
            self.target_scale = _p(stem.target_scale)
        self.layers = nn.ModuleList()
        for w in spec.layers:
            m = nn.Module()
            m.attn_norm, m.q_norm, m.k_norm = _p(w.attn_norm), _p(w.q_norm), _p(w.k_norm)
            m.mla = None if w.mla is None else MlaProjection(w.mla)  # the target graph's own
            if w.mla is None:
                # one MatMul for Q, K, V and (gated attention) the output gate: [in, (2·H_q+2·n_kv)·hd]
                gate_rows = () if w.out_gate_w is None else (w.out_gate_w,)
                m.qkv_w = _p(torch.cat((w.q_w, w.k_w, w.v_w, *gate_rows)).T)  # [in, (H_q+2·n_kv)·hd (+H_q·hd)]
                gate_b = () if w.out_gate_w is None else (torch.zeros(w.out_gate_w.shape[0]),)
                m.qkv_b = _p(torch.cat((w.q_b, w.k_b, w.v_b, *gate_b))) if w.q_b is not None else None
                m.sizes = (w.q_w.shape[0], w.k_w.shape[0], w.v_w.shape[0], *(g.shape[0] for g in gate_rows))
            elif w.out_gate_w is not None:
                raise BadInput("an MLA layer with an attention output gate is not a published layout")
            m.gated = w.out_gate_w is not None
            m.o_w, m.mlp_norm = _p(w.o_w.T), _p(w.mlp_norm)  # [H_q, H], [H]
            m.gate_up_w = _p(torch.cat((w.gate_w, w.up_w)).T)  # [H, 2·I]
            m.inter = w.gate_w.shape[0]
            m.down_w = _p(w.down_w.T)  # [I, H]
            m.moe = None if w.moe is None else MoeMlp(w.moe, spec.activation)  # the target graph's own
            self.layers.append(m)
        self.out_norm = _p(spec.out_norm)
        self.head_t = _p(spec.lm_head.T)  # [H, V_draft]
        v_draft = spec.lm_head.shape[0]
        self.target_vocab, self.v_draft = spec.target_vocab, v_draft
        if spec.d2t is not None:
            # draft column -> its target id; the other target ids stay -inf
            self.register_buffer("target_ids", torch.arange(v_draft) + spec.d2t, persistent=False)  # [V_draft]
            self.register_buffer("d2t", spec.d2t.clone(), persistent=False)
        else:
            self.target_ids = None
        cos, sin = spec.rope
        self.register_buffer("cos", cos[:max_seq_len].float().contiguous(), persistent=False)
        self.register_buffer("sin", sin[:max_seq_len].float().contiguous(), persistent=False)
        self.register_buffer("rotate", _rotate_half_matrix(cos.shape[-1]), persistent=False)

    def forward(self, input_ids, features, cache_length, *past):
        batch, tokens = input_ids.shape
        offsets = torch.arange(tokens, dtype=torch.int64)  # [T]
        positions = cache_length.unsqueeze(1) + offsets  # [B, T]
        slots = torch.arange(self.s_max, dtype=torch.int64)
        past_visible = (slots.view(1, 1, -1) < cache_length.view(batch, 1, 1)).expand(batch, tokens, self.s_max)
        new_visible = (offsets.view(1, tokens) <= offsets.view(tokens, 1)).unsqueeze(0).expand(batch, tokens, tokens)
        return self.decode(input_ids, features, positions, torch.cat((past_visible, new_visible), dim=-1), past)

    def decode(self, input_ids, features, positions, visible, past):
        """The rows ``input_ids`` [B, T] with ``features`` at ``positions`` [B, T], row t seeing
        the cache slots and new rows that ``visible`` [B, T, S_max+T] allows."""
        spec = self.spec
        batch, tokens = input_ids.shape
        rope_at = positions.clamp(max=self.s_max - 1)  # padding rows may run past the table
        cos = nn.functional.embedding(rope_at, self.cos).unsqueeze(2)  # [B, T, 1, rot]
        sin = nn.functional.embedding(rope_at, self.sin).unsqueeze(2)
        mask = torch.where(visible, torch.zeros(()), float("-inf")).view(batch, 1, 1, tokens, self.s_max + tokens)

        emb = nn.functional.embedding(input_ids, self.embed)  # [B, T, H]
        if not self.step:
            features = features.index_select(2, self.columns)  # [B, T, n_taps·H_target]
        stream, x = self._stem(emb, features, positions)

        presents = []
        for layer in self.layers:
            if x is None:
                x = _rms_norm(stream, layer.attn_norm, spec.eps)
            attn, k_new, v_new = self._attention(layer, x, cos, sin, past[len(presents)], past[len(presents) + 1], mask)
            presents += [k_new, v_new]
            stream = stream + attn
            mlp_in = _rms_norm(stream, layer.mlp_norm, spec.eps)  # [B, T, H]
            gate, up = torch.split(mlp_in @ layer.gate_up_w, layer.inter, dim=-1)
            act = nn.functional.silu(gate) if spec.activation == "silu" else nn.functional.gelu(gate, approximate="tanh")
            dense = (act * up) @ layer.down_w  # [B, T, H]
            if layer.moe is not None:  # the dense MLP above is the MoE layer's shared experts (Qwen3-Next: gated)
                dense = layer.moe.gate_shared(mlp_in, dense) + layer.moe(mlp_in)
            stream = stream + dense
            x = None
        normed = _rms_norm(stream, self.out_norm, spec.eps)  # [B, T, H]
        draft_logits = normed @ self.head_t  # [B, T, V_draft]
        best = draft_logits.argmax(dim=-1)  # [B, T]
        if self.target_ids is None:
            logits, next_tokens = draft_logits, best
        else:
            # scattered into -inf, not gathered from the draft columns: every call runs this,
            # greedy ones too (onnxruntime runs the outputs nobody fetches), and a Gather over the
            # target vocabulary copies its 49152 floats one by one, where ScatterElements writes
            # the head's 8192 into a filled tensor (SmolLM2's EAGLE-3 step, 2 AVX2 cores: 0.33 ms
            # of 1.9 saved at int8, 0.38 of 2.7 at fp32; the same outputs bit for bit)
            ids = self.target_ids.expand(batch, tokens, self.v_draft)  # [B, T, V_draft]
            logits = torch.full((batch, tokens, self.target_vocab), float("-inf"), dtype=draft_logits.dtype).scatter(
                2, ids, draft_logits)  # [B, T, V_target]
            next_tokens = best + self.d2t.index_select(0, best.reshape(-1)).reshape(batch, tokens)
        hidden_out = normed if spec.hidden_out_normed else stream
        return (logits, next_tokens, *presents, hidden_out)

    def _stem(self, emb, features, positions):
        """(residual stream, first attention input or None when the first layer norms it)."""
        stem, eps = self.spec.stem, self.spec.eps
        if isinstance(stem, Eagle3Stem):
            g = features  # [B, T, H]: the head's own hidden at a step
            if not self.step:
                if self.fc_norm is not None:
                    g = _rms_norm(g, self.fc_norm, eps)
                g = g @ self.fc_t  # [B, T, H]
            h = _rms_norm(g, self.h_norm, eps)
            x = torch.cat((_rms_norm(emb, self.e_norm, eps), h), dim=-1)  # [B, T, 2H]
            return (h if stem.norm_before_residual else g), x
        if stem.mask_position0:
            emb = emb * (positions != 0).unsqueeze(-1).to(emb.dtype)
        e = _rms_norm(emb, self.e_norm, eps)
        if not self.step and self.target_scale is not None:
            h = features * self.target_scale
        else:
            h = _rms_norm(features, self.h_norm, eps)
        joined = torch.cat((h, e) if stem.hidden_first else (e, h), dim=-1)  # [B, T, 2H]
        return joined @ self.proj_t, None

    def _attention(self, layer, x, cos, sin, past_k, past_v, mask):
        batch, tokens, _ = x.shape
        hd, n_kv, g = self.hd, self.n_kv, self.group
        if layer.mla is not None:  # per-head [B, T, H, qk], the rotary part first (graph_model.MlaProjection)
            q, k, v = layer.mla(x)
        else:
            qkv = x @ layer.qkv_w
            if layer.qkv_b is not None:
                qkv = qkv + layer.qkv_b
            q, k, v, *out_gate = torch.split(qkv, layer.sizes, dim=-1)
            q = q.view(batch, tokens, self.n_heads, hd)
            k = k.view(batch, tokens, n_kv, hd)
            v = v.view(batch, tokens, n_kv, hd)
        if layer.q_norm is not None:
            q, k = _rms_norm(q, layer.q_norm, self.spec.eps), _rms_norm(k, layer.k_norm, self.spec.eps)
        q, k = _apply_rope(q, cos, sin, self.rotate), _apply_rope(k, cos, sin, self.rotate)
        k_new, v_new = k.transpose(1, 2), v.transpose(1, 2)  # [B, n_kv, T, hd]
        q = q.view(batch, tokens, n_kv, g, hd).permute(0, 2, 3, 1, 4).reshape(batch, n_kv, g * tokens, hd)
        scores = torch.cat((q @ past_k.transpose(2, 3), q @ k_new.transpose(2, 3)), dim=-1) * self.spec.attn_scale
        # sizes spelled out (not -1): torch.export cannot prove the inferred size of a graph with
        # a symbolic token count
        width = self.s_max + tokens  # past slots, then the new tokens
        scores = scores.view(batch, n_kv, g, tokens, width) + mask  # [B, n_kv, G, T, S_max+T]
        probs = torch.softmax(scores, dim=-1).view(batch, n_kv, g * tokens, width)
        p_past, p_new = torch.split(probs, (self.s_max, tokens), dim=-1)  # [B, n_kv, G·T, S_max], [.., T]
        out = p_past @ past_v + p_new @ v_new  # [B, n_kv, G·T, hd]
        out = out.view(batch, n_kv, g, tokens, hd).permute(0, 3, 1, 2, 4).reshape(batch, tokens, -1)
        if layer.gated:  # Qwen3-Next / Qwen3.5: [B, T, H_q·hd] times sigmoid of the gate, per head and dim
            out = out * torch.sigmoid(out_gate[0])
        return out @ layer.o_w, k_new, v_new


def graph_io(num_layers: int, kind: str = DrafterKind.EAGLE3) -> tuple[list[str], list[str]]:
    """A chain head's graph inputs and outputs (its kind's signature in contract.DRAFTER_KINDS)."""
    signature = DRAFTER_KINDS[drafter_kind(kind)]
    return signature.graph_inputs(num_layers), signature.graph_outputs(num_layers)


def export_chain(graph: ChainGraph, batch: int | None, tokens: int | None, width: int, opset: int):
    """One static graph of ``tokens`` rows, or with ``tokens=None`` one graph whose row count
    is symbolic (traced at 4 rows): the catch-up sizes share it, and its weights in memory.
    ``batch=None``: the batch is symbolic too (traced at 2 rows; the batched loop's head graphs
    at every batch size share the file)."""
    spec = graph.spec
    rows = 4 if tokens is None else tokens
    b = 2 if batch is None else batch
    example = (torch.zeros(b, rows, dtype=torch.int64), torch.zeros(b, rows, width),
               torch.zeros(b, dtype=torch.int64),
               *[torch.zeros(b, spec.kv_heads, graph.s_max, spec.head_dim) for _ in range(2 * len(spec.layers))])
    if tokens is not None and batch is not None:
        return export_module(graph, example, *graph_io(len(spec.layers), spec.kind), opset)
    # DYNAMIC (not a named range): the mask's guards (min(S+T, T·(S+T)) == S+T) hold for
    # every T >= 1, but torch.export cannot prove them and would refuse a named range
    t = {1: torch.export.Dim.DYNAMIC} if tokens is None else {}
    rows_dim = {0: torch.export.Dim.DYNAMIC} if batch is None else {}
    # keyed by forward's argument names (input_ids, features, cache_length, *past)
    dims = {INPUT_IDS: {**rows_dim, **t} or None, "features": {**rows_dim, **t} or None,
            CACHE_LENGTH: rows_dim or None, "past": tuple(rows_dim or None for _ in range(2 * len(spec.layers)))}
    return export_module(graph, example, *graph_io(len(spec.layers), spec.kind), opset, dims)


# -- the reference side ---------------------------------------------------------------------


def read_published(files) -> dict[str, torch.Tensor]:
    """Every tensor of the files as stored (floats as fp32): the reference reads the checkpoint
    itself, not through the loader."""
    from safetensors.torch import load_file

    out = {}
    for path in files:
        out.update({k: (v.float() if v.is_floating_point() else v) for k, v in load_file(str(path)).items()})
    return out


class Reference(Protocol):
    """What a kind's module gives validation: a full-sequence forward written from the published
    code. ``run(tokens [n], states, own_last)``: rows p = 0..n-1 (token tokens[p], the target's
    features of position p from ``states``), the last row fed ``own_last`` (the head's own hidden
    of the row before) instead when given; ``own_last`` [r, H]: the last r rows so fed, each the
    hidden of the row before (a chain's step rows). Returns (logits [n, V_target], hidden [n, H])."""

    name: str

    def run(self, tokens: torch.Tensor, states: TargetStates, own_last: torch.Tensor | None):
        """(logits [n, V_target], hidden [n, H])."""


@dataclass
class TargetStates:
    """The target's hidden states on the reference text, as transformers computes them."""

    hidden_states: tuple[torch.Tensor, ...]  # L+1 of [S, H] (output_hidden_states)
    before_final_norm: torch.Tensor  # [S, H] the last layer's output, before the final norm


def target_states(ctx: HeadContext, ids: np.ndarray) -> TargetStates:
    model = ctx.target.model
    caught: dict[str, torch.Tensor] = {}

    def hook(_module, _inputs, output):
        caught["out"] = output[0] if isinstance(output, tuple) else output

    handle = model.model.layers[-1].register_forward_hook(hook)
    try:
        with torch.no_grad():
            out = model(torch.from_numpy(ids).unsqueeze(0), use_cache=False, output_hidden_states=True)
    finally:
        handle.remove()
    return TargetStates(tuple(h[0].float() for h in out.hidden_states), caught["out"][0].float())


# -- build: export, validate, register ------------------------------------------------------


def round_catchup_sizes(ctx: HeadContext) -> dict[int, Role]:
    """The catch-up entries of a round: after an accept of n drafts the head catches up 1+n
    rows, so one entry per size 2..1+D (one row runs the 2-row entry: size 1 is the step's
    name), each an entry of the one catch-up file; with only 1+D, every round caught up 1+D
    rows whatever it accepted. As the target's verify sizes: for ort-gqa recipes (onnxruntime
    only); standard ones may go to TensorRT, which compiles a plan per entry: 1+D alone."""
    largest = ctx.plan.tokens_per_verify
    if ctx.recipe.attention != "ort-gqa":
        return {largest: Role.CATCHUP}
    return dict.fromkeys(range(2, max(largest, 2) + 1), Role.CATCHUP)


def catchup_sizes(ctx: HeadContext) -> dict[int, Role]:
    sizes = round_catchup_sizes(ctx)
    sizes.setdefault(ctx.prefill_chunk, Role.PREFILL)
    return sizes


@dataclass
class ChainHead:
    """A loaded chain head (LoadedHead): its spec and its reference forward."""

    spec: ChainSpec
    reference: Reference
    params: dict = field(default_factory=dict)

    @property
    def taps(self) -> tuple[int, ...]:
        return self.spec.taps

    def drafter_entry(self, name: str) -> DrafterEntry:
        return DrafterEntry(name, self.spec.kind, name, dict(self.params))

    def build(self, ctx: HeadContext) -> None:
        spec = self.spec
        width = len(ctx.target_taps) * spec.target_hidden
        graphs: dict[str, tuple[int, bool]] = {}  # engine name -> (tokens, step?)
        # the catch-up graph's fill copy (exporter/fill.py; ort-gqa recipes, onnxruntime only):
        # engine name -> (tokens, path)
        fills: dict[str, tuple[int, Path]] | None = {} if fill_built(ctx) else None
        batched: dict[str, tuple[int, int, bool]] = {}  # batched engine name -> (batch, tokens, step?)
        paths = {}
        store = ctx.weights()
        # with batch sizes above 1 the batch is symbolic too: the batched loop's catch-up (2..1+D)
        # and step graphs at each batch size are entries over the same two files
        batch = None if ctx.batches else ctx.batch
        try:
            # the catch-up sizes (2..1+D, the prefill chunk): one graph, its row count symbolic;
            # the step (one row, the head's own hidden as features): a graph of its own
            for step, sizes in ((False, catchup_sizes(ctx)), (True, {1: Role.STEP})):
                module = ChainGraph(spec, ctx.target_taps, ctx.max_seq_len, step).eval()
                label = f"{ctx.name} step t1" if step else f"{ctx.name} catch-up (every size)"
                with ctx.step("export", label) as s:
                    proto = export_chain(module, batch, 1 if step else None, spec.hidden if step else width,
                                         ctx.opset)
                    s.detail = f"{len(proto.graph.node)} nodes"
                stem = engine_name(ctx.name, Role.STEP, ctx.batch, 1) if step else f"{ctx.name}.catchup"
                saved = ctx.save_shared_graph(proto, stem, sizes, store, fills=None if step else fills)
                for tokens, (name, path) in zip(sizes, saved.items()):
                    graphs[name], paths[name] = (tokens, step), path
                rounds = {1: Role.STEP} if step else round_catchup_sizes(ctx)
                for name, (b, tokens) in ctx.save_batched(proto, next(iter(saved.values())), rounds, store).items():
                    batched[name], paths[name] = (b, tokens, step), next(iter(saved.values()))
            tree = None
            if ctx.recipe.draft.tree.max_nodes:  # EAGLE-2's level-by-level expansion (chain_tree.py)
                from specexport.exporter.heads.chain_tree import build_chain_tree

                rows = ctx.recipe.draft.tree.top_k
                tree = (*build_chain_tree(ctx, spec, store, rows), rows)
        finally:
            store.close()
        kv = KVLayout(len(spec.layers), spec.kv_heads, spec.head_dim, ctx.max_seq_len, "float32")
        info = {"hidden_size": spec.hidden, "feature_width": width, "taps": list(spec.taps),
                "draft_vocab_size": int(spec.lm_head.shape[0]), **spec.info}
        ctx.add_model(ModelEntry(ctx.name, spec.kind, kv, spec.target_vocab, f"{ctx.name}.weights", "standard", info))
        validate_chain(ctx, self.reference, spec, graphs, paths, width, batched, tree, fills)


def fill_built(ctx: HeadContext) -> bool:
    """Does the head get a fill graph: its catch-up sizes entries of one symbolic graph for
    onnxruntime (ort-gqa recipes, as ``round_catchup_sizes``), no TensorRT plans to compile?"""
    return ctx.recipe.attention == "ort-gqa" and TENSORRT not in ctx.recipe.backends


def validate_chain(ctx: HeadContext, reference: Reference, spec: ChainSpec, graphs: dict[str, tuple[int, bool]],
                   paths: dict, width: int, batched: dict[str, tuple[int, int, bool]] | None = None,
                   tree: tuple[str, Path, dict[str, int], int] | None = None,
                   fills: dict[str, tuple[int, Path]] | None = None) -> None:
    """Every graph against the reference on real text, at several cache lengths, through the
    runtime's ModelRunner (the cache filled by the catch-up graphs, chunk by chunk); then each
    batched graph row by row against the batch-1 graph (``validate_chain_batched``); then the
    tree step (``tree``: its engine name, path, batched entries and rows;
    chain_tree.validate_chain_tree); then the fill graph's cache against the catch-up graph's
    (``fills``: engine name -> (tokens, path); exporter/fill.py)."""
    from specexport.runtime.engine import EngineOptions, SharedGraphs
    from specexport.runtime.kv_cache import KVCache
    from specexport.runtime.ort_engine import OrtEngine
    from specexport.runtime.runner import ModelRunner

    s_max = ctx.max_seq_len
    with ctx.step("validate", f"{ctx.name} reference") as s:
        ids = ctx.reference_ids(s_max)  # [S]
        states = target_states(ctx, ids)
        aux = torch.cat([states.hidden_states[i] for i in ctx.target_taps], dim=-1).numpy()  # [S, F]
        tokens = torch.from_numpy(ids[1:])  # row p: token x_{p+1}
        with torch.no_grad():
            ref_logits, ref_hidden = reference.run(tokens, states, None)  # [S-1, V], [S-1, H]
        s.detail = f"{reference.name}, {len(tokens)} rows"
    options = EngineOptions(threads=ctx.threads)
    shared = SharedGraphs()  # the catch-up sizes run on one session, as at run time
    engines = {name: OrtEngine(name, paths[name], *ctx.builder.specs[name], options, shared) for name in graphs}
    cache = KVCache(len(spec.layers), 1, spec.kv_heads, s_max, spec.head_dim)
    catchup = [n for n, (_, step) in graphs.items() if not step]
    fills = fills or {}
    fill_engines = [OrtEngine(n, path, *ctx.builder.specs[n], options, shared) for n, (_, path) in fills.items()]
    roles = {**dict.fromkeys(catchup, Role.CATCHUP), **dict.fromkeys(fills, Role.FILL)}  # CATCHUP: any decoding role
    runner = ModelRunner(ctx.name, [engines[n] for n in catchup] + fill_engines, cache,
                         {**{n: graphs[n][0] for n in catchup}, **{n: t for n, (t, _) in fills.items()}},
                         roles=roles)
    with ctx.step("validate", f"{ctx.name} graphs") as s:
        rows = len(tokens)
        runner.forward(ids[1:].tolist(), inputs={DRAFT_FEATURES: aux[:rows]})
        worst = 1.0
        for name, (count, step) in graphs.items():
            parity = Parity()
            tested = []
            for length in cache_lengths(s_max, count):
                if length + count > rows or (step and length == 0):
                    continue
                cache.length = length
                feeds = dict(cache.view())
                feeds[INPUT_IDS] = ids[None, length + 1 : length + 1 + count]  # [1, T]
                feeds[CACHE_LENGTH] = np.array([length], dtype=np.int64)
                if step:  # the head's own hidden of the row before, from the reference
                    feeds[DRAFT_FEATURES] = ref_hidden[None, length - 1 : length].numpy()
                    with torch.no_grad():
                        want, _ = reference.run(tokens[: length + 1], states, ref_hidden[length - 1])
                    want = want[-1:].numpy()
                else:
                    feeds[DRAFT_FEATURES] = aux[None, length : length + count]
                    want = ref_logits[length : length + count].numpy()
                out = engines[name].run(feeds, [LOGITS, NEXT_TOKENS])
                parity.add(*_draftable(out[LOGITS][0], want, out[NEXT_TOKENS][0]))
                tested.append(length)
            figures = {**parity.to_dict(), "cache_lengths": tested}
            worst = min(worst, figures["argmax_agreement"])
            ctx.record_parity(name, figures, reference=reference.name)
        s.detail = f"{len(graphs)} graphs, argmax agreement {worst:.1%}"
    if batched:
        singles = {(tokens, step): engines[n] for n, (tokens, step) in graphs.items()}
        with ctx.step("validate", f"{ctx.name} batched graphs") as s:
            for name, (batch, count, step) in batched.items():
                engine = OrtEngine(name, paths[name], *ctx.builder.specs[name], options, shared)
                rows, valid = batched_rows(batch, count, step, s_max, ids, aux, ref_hidden.numpy())
                parity, worst_rel = check_batched_rows(name, engine, singles[(count, step)], cache.view(), rows, valid,
                                                       [LOGITS, NEXT_TOKENS, HIDDEN_OUT, *present_names(len(spec.layers))],
                                                       _draftable)
                ctx.record_parity(name, {**parity.to_dict(), "max_rel_output_diff": worst_rel,
                                         "rows": [[int(r[CACHE_LENGTH][0]), v] for r, v in zip(rows, valid)]},
                                  reference="the batch-1 graph, row by row")
            s.detail = f"{len(batched)} graphs, ragged rows and an idle row against batch 1"
    if fills:  # the fill graph's cache against the catch-up graph's, bit for bit
        with ctx.step("validate", f"{ctx.name} fill graph") as s:
            # the cache holds every row of the text (filled above): kept as it is for the tree's check
            kept, kept_length = {name: array.copy() for name, array in cache.view().items()}, cache.length
            length = len(tokens) // 2
            figures = check_fill(runner, ids[1:], {DRAFT_FEATURES: aux[: len(tokens)]}, (0, length // 2, length))
            for name, array in cache.view().items():
                array[...] = kept[name]
            cache.length = kept_length
            for name in fills:
                ctx.builder.record_fill(name, figures)
            s.detail = f"{len(fills)} sizes, cache = the catch-up graph's bit for bit"
        ctx.time_fill(runner)
    if tree is not None:  # last: it writes the cache past the rows it keeps
        from specexport.exporter.heads.chain_tree import validate_chain_tree

        validate_chain_tree(ctx, reference, *tree, cache)
    # every graph timed in the builder's one schedule (one size per graph: catch-up sizes are
    # 2..1+D and the prefill chunk, the step 1; a chunk of 1 leaves the step untimed)
    timed = {graphs[n][0]: engines[n] for n in graphs if not graphs[n][1]}
    for n in graphs:
        if graphs[n][1] and 1 not in timed:
            timed[1] = engines[n]
    ctx.time_with(ModelRunner(ctx.name, list(timed.values()), cache, {e.name: t for t, e in timed.items()}))


def batched_rows(batch: int, tokens: int, step: bool, s_max: int, ids: np.ndarray, aux: np.ndarray,
                 hidden: np.ndarray) -> tuple[list[dict[str, np.ndarray]], list[int]]:
    """The batch-1 feeds of each row of a batched head graph's check (validate.row_plan: spread
    cache lengths, T, T-1, ... valid rows right-padded, the last row idle) on the reference
    text: row p pairs token ids[p+1] with the target's features aux[p] (catch-up) or the head's
    own hidden of the row before (step). Returns (rows, valid counts)."""
    rows, valid = [], []
    for length, count in row_plan(batch, tokens, s_max - 1):
        length = max(length, 1) if step else length  # a step reads the hidden of the row before
        input_ids = np.full((1, tokens), PAD_ID, dtype=np.int64)  # [1, T]
        input_ids[0, :count] = ids[length + 1 : length + 1 + count]
        source = hidden[length - 1 : length] if step else aux[length : length + count]  # [count, F]
        features = np.zeros((1, tokens, source.shape[-1]), dtype=np.float32)  # [1, T, F]
        features[0, :count] = source[:count]
        rows.append({INPUT_IDS: input_ids, DRAFT_FEATURES: features,
                     CACHE_LENGTH: np.array([length], dtype=np.int64)})
        valid.append(count)
    return rows, valid


def _draftable(got: np.ndarray, want: np.ndarray, next_tokens: np.ndarray):
    """The figures over the ids the head can draft (finite in the reference; the rest must be
    -inf in the graph too, else the comparison is made to fail with NaN): (got, want, next
    tokens as column indices)."""
    columns = np.flatnonzero(np.isfinite(want[0]))  # [V_draft] ascending target ids
    got_kept = got[:, columns].astype(np.float64)
    if not np.isneginf(np.delete(got, columns, axis=1)).all():
        got_kept = got_kept + np.nan
    at = np.minimum(np.searchsorted(columns, next_tokens), len(columns) - 1)
    picked = np.where(columns[at] == next_tokens, at, -1)  # -1: a token outside the draft vocabulary
    return got_kept, want[:, columns].astype(np.float64), picked
