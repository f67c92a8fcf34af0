"""The graph we trace: a decoder with a static KV cache passed in and the new K/V passed out.

One module serves every role (prefill, verify, decode, draft): only the number of tokens T
changes. Conventions (design.md, "Graphs"):

  inputs   input_ids                     int64 [B, T]
           cache_length                  int64 [B]      tokens already in the cache
           valid_tokens                  int64 [B]      ort-gqa only: real tokens of each row
           past_key_values.{i}.key|value float [B, n_kv, S_max, head_dim]
           past_state.{j}.conv           float [B, C, K-1]          linear-attention layers only
           past_state.{j}.recurrent      float [B, Hv, dk, dv]
  outputs  logits                        float [B, T, V]
           next_tokens                   int64 [B, T]   argmax of logits (greedy needs no logits)
           present.{i}.key|value         float [B, n_kv, T, head_dim]  K/V of the T new tokens
           present_state.{j}.conv        float [B, T, C, K-1]       the state after each position
           present_state.{j}.recurrent   float [B, T, Hv, dk, dv]
           aux_hidden_states             float [B, T, n_taps·hidden]  only with taps (drafter heads)

i counts the attention layers, j the linear-attention (Gated DeltaNet) layers of a hybrid model
(Qwen3-Next, Qwen3.5), each in model order; a model without linear-attention layers has no
state inputs or outputs. A linear-attention layer reads its state before the T tokens and
returns the state after each of them (``GatedDeltaNet``), so the runtime keeps the one at the
last accepted token; its rows past a short chunk's last real token are never read.

The mask is built in the graph from cache_length: past slot j is visible when j < cache_length
(and inside the sliding window); new token t sees new tokens t' <= t. Slots past the cache
length may hold anything, so padding a short chunk is safe. Attention never concatenates the
cache with the new keys (that would copy the whole cache every step): scores against the past
and against the new tokens are computed apart and joined only after the matmul.

``attention="ort-gqa"`` is the onnxruntime-only variant: each layer's attention is one
com.microsoft GroupQueryAttention node (rotary, mask and the cache append fused, attending
only to the filled part of the cache). Its present.* outputs are the whole cache
[B, n_kv, S_max, hd] with the T new positions written at cache_length: the runtime binds them
to the same buffers as the past inputs, so the cache is updated in place. Being onnxruntime's
own graph, it also uses the fused kernels onnxruntime-genai's builder emits, which
onnxruntime's optimizer does not make from the plain ops (see ``OrtFusions``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from specexport.exporter.archs import DecoderParts, LayerWeights, LinearAttnWeights, MlaWeights, MoeWeights


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Written as a division (not rsqrt) so onnxruntime fuses it into SimplifiedLayerNormalization.
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rotate_half_matrix(rot: int) -> torch.Tensor:
    """R with x @ R == cat(-x[half:], x[:half]): one small MatMul instead of Split/Neg/Concat.
    Each output picks one input times ±1, so the result is exact."""
    half = rot // 2
    r = torch.zeros(rot, rot)
    r[torch.arange(half) + half, torch.arange(half)] = -1.0
    r[torch.arange(half), torch.arange(half) + half] = 1.0
    return r  # [rot, rot]


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotate: torch.Tensor) -> torch.Tensor:
    # x [B, T, heads, head_dim]; cos/sin [B, T, 1, rot] with rot <= head_dim (partial rotary)
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return x * cos + (x @ rotate) * sin
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    return torch.cat((x_rot * cos + (x_rot @ rotate) * sin, x_pass), dim=-1)


def _param(t: torch.Tensor | None) -> nn.Parameter | None:
    return None if t is None else nn.Parameter(t.contiguous(), requires_grad=False)


def _activate(x: torch.Tensor, activation: str) -> torch.Tensor:
    return nn.functional.silu(x) if activation == "silu" else nn.functional.gelu(x, approximate="tanh")


class MoeMlp(nn.Module):
    """Routed experts (archs.MoeWeights: DeepSeek-V3 / GLM-4.5's sigmoid router, Qwen3-Next /
    Qwen3.5-MoE's softmax router), static shapes, exact: router
    scores -> group-limited top-k -> a dense [.., experts] weight, zero off each token's top-k,
    applied to every expert's output. The experts are two plain MatMuls over the stacked weights
    ([hidden, E·2I] and [E·I, hidden]): clean ONNX, int4-quantizable, and right for tiny and
    few-expert models. For large models (256 experts, top-8) this computes E/k times the needed
    work and reads every expert's weights each step; a gather-of-top-k form (Gather the k chosen
    experts' [2I, hidden] / [hidden, I] slices per token, then batched MatMuls) costs k experts'
    work but copies k weight slices per token, and a fused MoE kernel avoids both. One
    implementation, shared by the target graph and the chain heads (MTP)."""

    def __init__(self, w: MoeWeights, activation: str):
        super().__init__()
        experts, inter, hidden = w.gate_w.shape
        self.experts, self.inter, self.activation = experts, inter, activation
        self.top_k, self.n_group, self.topk_group = w.top_k, w.n_group, w.topk_group
        self.norm_topk_prob, self.scaling = w.norm_topk_prob, w.scaling
        if w.scoring not in ("sigmoid", "softmax"):
            raise ValueError(f"MoE scoring must be sigmoid or softmax, not {w.scoring!r}")
        self.scoring = w.scoring
        self.router_w = _param(w.router_w.T)  # [hidden, E]
        # a softmax router has no score bias (archs.softmax_moe_weights: zeros)
        self.score_bias = _param(w.score_bias) if w.scoring == "sigmoid" else None  # [E]
        self.shared_gate = _param(None if w.shared_gate_w is None else w.shared_gate_w.T)  # [hidden, 1]
        gate_up = torch.cat((w.gate_w, w.up_w), dim=1)  # [E, 2I, hidden]: per expert gate rows, then up
        self.gate_up_w = _param(gate_up.reshape(experts * 2 * inter, hidden).T)  # [hidden, E·2I]
        self.down_w = _param(w.down_w.transpose(1, 2).reshape(experts * inter, hidden))  # [E·I, hidden]

    def routing(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, hidden] -> each expert's weight [B, T, E], zero off the token's top-k."""
        batch, tokens, _ = x.shape
        if self.scoring == "softmax":  # Qwen3-Next / Qwen3.5-MoE: over every expert, no bias, no groups
            scores = torch.softmax(x @ self.router_w, dim=-1)  # [B, T, E]
            chosen = scores.topk(self.top_k, dim=-1).indices  # [B, T, k]
            weights = scores.gather(-1, chosen)  # [B, T, k]
            if self.norm_topk_prob:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            if self.scaling != 1.0:
                weights = weights * self.scaling
            return torch.zeros_like(scores).scatter(-1, chosen, weights)  # [B, T, E]
        scores = torch.sigmoid(x @ self.router_w)  # [B, T, E]
        choice = scores + self.score_bias  # the bias steers the choice, not the weights
        if self.topk_group < self.n_group:  # keep the experts of the best topk_group groups
            per_group = self.experts // self.n_group
            grouped = choice.view(batch, tokens, self.n_group, per_group)
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [B, T, G]: each group's best two
            best = group_scores.topk(self.topk_group, dim=-1).indices  # [B, T, topk_group]
            kept = torch.zeros_like(group_scores).scatter(-1, best, 1.0)  # [B, T, G]
            kept = kept.unsqueeze(-1).expand(batch, tokens, self.n_group, per_group).reshape(batch, tokens, -1)
            choice = torch.where(kept > 0, choice, float("-inf"))  # [B, T, E]
        chosen = choice.topk(self.top_k, dim=-1).indices  # [B, T, k]
        weights = scores.gather(-1, chosen)  # [B, T, k]
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        weights = weights * self.scaling
        return torch.zeros_like(scores).scatter(-1, chosen, weights)  # [B, T, E]

    def gate_shared(self, x: torch.Tensor, shared_out: torch.Tensor) -> torch.Tensor:
        """The shared experts' output [B, T, hidden] as the layer adds it: times
        sigmoid(x @ shared_gate) with a shared-expert gate (Qwen3-Next / Qwen3.5-MoE), else as is.
        x: the normed MLP input [B, T, hidden]."""
        if self.shared_gate is None:
            return shared_out
        return shared_out * torch.sigmoid(x @ self.shared_gate)  # gate [B, T, 1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, hidden] (the normed MLP input) -> the routed experts' sum [B, T, hidden]."""
        batch, tokens, _ = x.shape
        weights = self.routing(x)  # [B, T, E]
        gate_up = (x @ self.gate_up_w).view(batch, tokens, self.experts, 2 * self.inter)  # [B, T, E, 2I]
        gate, up = torch.split(gate_up, self.inter, dim=-1)  # [B, T, E, I] ×2
        act = _activate(gate, self.activation) * up * weights.unsqueeze(-1)  # [B, T, E, I]
        return act.reshape(batch, tokens, self.experts * self.inter) @ self.down_w  # [B, T, hidden]


class MlaProjection(nn.Module):
    """DeepSeek's multi-head latent attention up to the per-head Q, K and V (archs.MlaWeights):
    each [B, T, heads, qk], the rotary part first and not yet rotated, V zero-padded to qk. The
    graphs then attend as with any multi-head layer. One implementation, shared by the target
    graph and the chain heads (MTP)."""

    def __init__(self, w: MlaWeights):
        super().__init__()
        self.heads, self.nope, self.rope, self.qk = w.heads, w.nope, w.rope, w.qk
        self.eps = w.latent_eps
        self.in_sizes = (w.q_in, w.kv_lora, w.rope)
        self.in_w = _param(w.in_w.T)  # [hidden, q_in + kv_lora + rope]: one MatMul for both latents
        self.in_b = _param(w.in_b)
        self.q_a_norm = _param(w.q_a_norm)  # [q_lora]
        self.q_b_w = _param(None if w.q_b_w is None else w.q_b_w.T)  # [q_lora, heads·qk]
        self.kv_a_norm = _param(w.kv_a_norm)  # [kv_lora]
        self.kv_b_w = _param(w.kv_b_w.T)  # [kv_lora, heads·(nope+qk)]

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        batch, tokens, _ = x.shape
        h, qk = self.heads, self.qk
        first = x @ self.in_w  # [B, T, q_in + kv_lora + rope]
        if self.in_b is not None:
            first = first + self.in_b
        q, latent, k_pe = torch.split(first, self.in_sizes, dim=-1)
        if self.q_b_w is not None:  # q_lora: q_a_proj -> q_a_layernorm -> q_b_proj
            q = _rms_norm(q, self.q_a_norm, self.eps) @ self.q_b_w  # [B, T, heads·qk]
        q = q.view(batch, tokens, h, qk)  # per head [rope | nope]
        kv = (_rms_norm(latent, self.kv_a_norm, self.eps) @ self.kv_b_w).view(batch, tokens, h, self.nope + qk)
        k_nope, v = torch.split(kv, (self.nope, qk), dim=-1)  # [B, T, heads, nope], [B, T, heads, qk]
        k_pe = k_pe.view(batch, tokens, 1, self.rope).expand(batch, tokens, h, self.rope)  # one for every head
        k = torch.cat((k_pe, k_nope), dim=-1)  # [B, T, heads, qk]
        return q, k, v


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    # transformers' (and FLA's) l2norm of the gated delta rule's q and k
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


class GatedDeltaNet(nn.Module):
    """A linear-attention layer (archs.LinearAttnWeights: Qwen3-Next / Qwen3.5's Gated DeltaNet)
    over T tokens, from the state before them, returning the state after each of them.

    Exactly transformers' math (causal_conv1d_update + torch_recurrent_gated_delta_rule), in
    plain ONNX ops for onnxruntime and TensorRT alike: the four input projections are one MatMul;
    the depthwise causal conv is K shifted multiply-adds over cat(past window, new inputs) (no
    padding), then silu; the recurrence is unrolled over the static T (no Loop/Scan), each step
    a decay, one [1, dk]x[dk, dv] MatMul (what the state predicts for v), the delta and its
    outer product with k; every position's read-out q_t·S_t is one batched MatMul over the
    stacked states afterwards. The per-position states let the runtime keep the state at the
    last accepted token (a rejected draft is undone by selecting, not recomputing)."""

    def __init__(self, w: LinearAttnWeights, out_w: torch.Tensor):
        super().__init__()
        self.k_heads, self.v_heads, self.k_dim, self.v_dim = w.k_heads, w.v_heads, w.k_dim, w.v_dim
        self.kernel, self.channels, self.eps = w.conv_kernel, w.conv_channels, w.norm_eps
        key, value = w.k_heads * w.k_dim, w.v_heads * w.v_dim
        self.in_sizes = (self.channels, value, w.v_heads, w.v_heads)  # mixed qkv, z, b, a
        self.qkv_sizes = (key, key, value)
        self.in_w = _param(torch.cat((w.qkv_w, w.z_w, w.b_w, w.a_w), dim=0).T)  # [hidden, C + Hv·dv + 2·Hv]
        self.conv_w = _param(w.conv_w.T.unsqueeze(-1))  # [K, C, 1]: tap j over every channel
        self.conv_b = _param(None if w.conv_b is None else w.conv_b.unsqueeze(-1))  # [C, 1]
        self.dt_bias = _param(w.dt_bias)  # [Hv]
        self.neg_a = _param(-w.a_log.float().exp())  # [Hv]: g = -exp(A_log)·softplus(a + dt_bias)
        self.norm_w = _param(w.norm_w)  # [dv], as is (the gated norm has no (1 + w) offset)
        self.out_w = _param(out_w.T)  # [Hv·dv, hidden]

    def forward(self, x: torch.Tensor, conv_state: torch.Tensor, recurrent: torch.Tensor):
        """x: the normed layer input [B, T, hidden]; conv_state [B, C, K-1] (the last K-1 conv
        inputs before these tokens); recurrent [B, Hv, dk, dv]. Returns the layer output
        [B, T, hidden], the conv states [B, T, C, K-1] and the recurrent states [B, T, Hv, dk, dv]
        after each of the T positions."""
        batch, tokens, _ = x.shape
        hk, hv, dk, dv, kernel = self.k_heads, self.v_heads, self.k_dim, self.v_dim, self.kernel
        mixed, z, b, a = torch.split(x @ self.in_w, self.in_sizes, dim=-1)  # [B, T, C], [B, T, Hv·dv], [B, T, Hv] ×2

        # causal depthwise conv: output t reads window[t .. t+K-1] (window slot t+K-1 is token t)
        window = torch.cat((conv_state, mixed.transpose(1, 2)), dim=2)  # [B, C, K-1+T]
        conv = window[:, :, 0:tokens] * self.conv_w[0]
        for j in range(1, kernel):
            conv = conv + window[:, :, j : j + tokens] * self.conv_w[j]  # [B, C, T]
        if self.conv_b is not None:
            conv = conv + self.conv_b
        conv = nn.functional.silu(conv).transpose(1, 2)  # [B, T, C]
        # the conv state after position t: the last K-1 inputs up to and including it
        slots = (torch.arange(tokens).view(tokens, 1) + torch.arange(1, kernel).view(1, kernel - 1))  # [T, K-1]
        conv_states = window.index_select(2, slots.reshape(-1)).view(batch, self.channels, tokens, kernel - 1)
        conv_states = conv_states.permute(0, 2, 1, 3)  # [B, T, C, K-1]: one Gather, one Transpose

        q, k, v = torch.split(conv, self.qkv_sizes, dim=-1)
        q = _l2norm(q.reshape(batch, tokens, hk, dk)) / (dk**0.5)  # [B, T, Hk, dk]
        k = _l2norm(k.reshape(batch, tokens, hk, dk))
        v = v.reshape(batch, tokens, hv, dv)  # [B, T, Hv, dv]
        if hv != hk:  # each q/k head serves Hv/Hk consecutive v heads
            q = q.unsqueeze(3).expand(batch, tokens, hk, hv // hk, dk).reshape(batch, tokens, hv, dk)
            k = k.unsqueeze(3).expand(batch, tokens, hk, hv // hk, dk).reshape(batch, tokens, hv, dk)
        beta = torch.sigmoid(b)  # [B, T, Hv]
        decay = torch.exp(self.neg_a * nn.functional.softplus(a + self.dt_bias))  # [B, T, Hv]

        state = recurrent  # [B, Hv, dk, dv]
        states = []
        for t in range(tokens):
            k_t = k[:, t]  # [B, Hv, dk]
            state = state * decay[:, t].view(batch, hv, 1, 1)
            predicted = (k_t.unsqueeze(2) @ state).squeeze(2)  # [B, Hv, dv]: what the state holds for k_t
            delta = (v[:, t] - predicted) * beta[:, t].unsqueeze(-1)  # [B, Hv, dv]
            state = state + k_t.unsqueeze(-1) * delta.unsqueeze(2)  # [B, Hv, dk, dv]
            states.append(state)
        recurrent_states = torch.stack(states, dim=1)  # [B, T, Hv, dk, dv]
        out = (q.unsqueeze(3) @ recurrent_states).squeeze(3)  # [B, T, Hv, dv]

        out = _rms_norm(out, self.norm_w, self.eps) * nn.functional.silu(z.view(batch, tokens, hv, dv))
        return out.reshape(batch, tokens, hv * dv) @ self.out_w, conv_states, recurrent_states


class _Layer(nn.Module):
    def __init__(self, w: LayerWeights, activation: str, fused_mlp: bool = True):
        super().__init__()
        # Linear weights are stored [in, out] so each projection is a plain MatMul with an
        # initializer: what onnxruntime's int4 quantizer and TensorRT both want.
        self.attn_norm = _param(w.attn_norm)
        self.mla = None if w.mla is None else MlaProjection(w.mla)
        self.moe = None if w.moe is None else MoeMlp(w.moe, activation)  # beside the dense (shared) MLP
        # a linear-attention layer (its own projections, out_proj included) instead of attention
        self.linear = None if w.linear is None else GatedDeltaNet(w.linear, w.o_w)
        self.gated = w.out_gate_w is not None  # the attention output times sigmoid(x @ out_gate)
        if w.mla is None and w.linear is None:
            # Q, K and V in one MatMul (and gate with up below): fewer, larger kernels. A gated
            # attention's output gate rides in the same MatMul, after V.
            gate_rows = (w.out_gate_w,) if self.gated else ()
            self.qkv_w = _param(torch.cat((w.q_w, w.k_w, w.v_w, *gate_rows), dim=0).T)  # [hidden, (H+2·n_kv[+H])·hd]
            if w.q_b is not None and self.gated:
                raise ValueError("a gated attention layer with q/k/v biases is not supported")
            self.qkv_b = _param(torch.cat((w.q_b, w.k_b, w.v_b)) if w.q_b is not None else None)
            self.qkv_sizes = (w.q_w.shape[0], w.k_w.shape[0], w.v_w.shape[0], *(g.shape[0] for g in gate_rows))
        if w.linear is None:
            self.o_w, self.o_b = _param(w.o_w.T), _param(w.o_b)
        else:
            self.o_w, self.o_b = None, None
        self.q_norm, self.k_norm = _param(w.q_norm), _param(w.k_norm)
        self.attn_out_norm = _param(w.attn_out_norm)
        self.mlp_norm = _param(w.mlp_norm)
        self.mlp_out_norm = _param(w.mlp_out_norm)
        if fused_mlp:
            self.gate_up_w = _param(torch.cat((w.gate_w, w.up_w), dim=0).T)  # [hidden, 2·intermediate]
        else:
            self.gate_w, self.up_w = _param(w.gate_w.T), _param(w.up_w.T)  # [hidden, intermediate] ×2
        self.fused_mlp = fused_mlp
        self.intermediate = w.gate_w.shape[0]
        self.down_w = _param(w.down_w.T)
        self.sliding_window = w.sliding_window
        self.rope_table = w.rope_table


ATTENTION_KINDS = ("standard", "ort-gqa")
# onnxruntime's GroupQueryAttention (CPU) refuses other head sizes at run time ("head_size shall
# be a multiple of 16"): checked before export, so a recipe gets one line instead
GQA_HEAD_MULTIPLE = 16


def attention_refusal(parts: DecoderParts, attention: str) -> str | None:
    """Why ``parts`` cannot be exported with ``attention`` (None when it can)."""
    if attention == "ort-gqa" and parts.head_dim % GQA_HEAD_MULTIPLE:
        return (f"attention: ort-gqa needs a head size that is a multiple of {GQA_HEAD_MULTIPLE} (onnxruntime's "
                f"GroupQueryAttention); this {parts.model_type} model's is {parts.head_dim}: use attention: standard")
    return None


@dataclass(frozen=True)
class OrtFusions:
    """What the ort-gqa graph writes as onnxruntime's fused kernels (com.microsoft) itself, as
    onnxruntime-genai's builder does: onnxruntime's optimizer fuses our RMSNorm into
    SimplifiedLayerNormalization but never the residual Add into it, and every extra node
    (Split, Add) costs a kernel launch and a buffer. Measured per SmolLM2-135M decode step, 1
    thread, onnxruntime 1.32, 300 interleaved rounds against genai's graph on the same runtime
    (median ms ours / genai, ratio genai÷ours): none 89.9 / 79.4, 0.86; + skip_norm 80.5, 0.98;
    + packed_qkv 78.4, 1.01; + split_mlp 77.8, 1.04."""

    skip_norm: bool = True  # residual Add + RMSNorm -> SkipSimplifiedLayerNormalization
    packed_qkv: bool = True  # the QKV MatMul's output straight into GroupQueryAttention (no Split)
    split_mlp: bool = True  # gate and up as two MatMuls (no Split after one fused MatMul)
    # The output head as a MatMul on its own [hidden, V] copy of the (tied) table, not a Gemm
    # reading the embedding as stored: at 2 threads the Gemm cost 0.85x genai's step, the
    # MatMul 0.97x (150 interleaved steps, same runtime); at 1 thread they tie. Costs one more
    # copy of the table in the weights file.
    matmul_head: bool = True


NO_FUSIONS = OrtFusions(False, False, False, False)
HEAD_WEIGHT = "lm_head_t"  # the MatMul head's initializer (quantize.py keeps it fp32 when asked)


class StaticDecoder(nn.Module):
    def __init__(self, parts: DecoderParts, max_seq_len: int, attention: str = "standard",
                 fusions: OrtFusions | None = None, taps: tuple[int, ...] = (), tree: bool = False):
        """``tree``: a tree verify graph (contract.TREE_*): after cache_length it takes each
        row's offset [B, T] and (standard) the ancestor mask [B, T, T] or (ort-gqa) the
        additive bias [B, 1, T, cache_length + T]; rows sit at cache_length + offset and see
        the cache and the rows the mask allows. ``taps``: hidden states to output as aux_hidden_states, in transformers'
        output_hidden_states indices (i < L: the stream entering layer i; L: after the final norm;
        L counts every layer, linear-attention ones included).

        A model with linear-attention layers (Qwen3-Next, Qwen3.5) takes, after the KV cache of
        its attention layers, each linear layer's state (past_state.{j}.conv [B, C, K-1],
        past_state.{j}.recurrent [B, Hv, dk, dv]) and returns, after the KV presents, the state
        after each of the T positions (present_state.{j}.conv [B, T, C, K-1], .recurrent
        [B, T, Hv, dk, dv]). ``kv_layers`` / ``state_layers`` count the two kinds;
        ``num_layers`` is ``kv_layers`` (the layers with a KV cache: every layer of a model
        without linear-attention layers, as before)."""
        super().__init__()
        if any(not 0 <= i <= len(parts.layers) for i in taps):
            raise ValueError(f"taps {list(taps)} must lie in 0..{len(parts.layers)} (the model's layer count)")
        self.taps = tuple(taps)
        self.tree = tree
        if tree and parts.linear_layers:
            raise ValueError("a tree verify graph needs attention in every layer: a linear-attention layer's "
                             "recurrence runs along one path")
        if attention not in ATTENTION_KINDS:
            raise ValueError(f"attention must be one of {ATTENTION_KINDS}")
        self.attention = attention
        self.takes_valid_tokens = attention == "ort-gqa"  # VALID_TOKENS, after cache_length
        # The standard graph stays plain ONNX (TensorRT, any runtime).
        self.fusions = (fusions or OrtFusions()) if attention == "ort-gqa" else NO_FUSIONS
        self.parts_summary = parts.summary()
        self.max_seq_len = max_seq_len
        self.n_heads = parts.num_attention_heads
        self.n_kv = parts.num_key_value_heads
        self.group = self.n_heads // self.n_kv
        self.head_dim = parts.head_dim
        self.eps = parts.rms_norm_eps
        self.activation = parts.activation
        self.embed_scale = parts.embed_scale
        self.attn_scale = parts.attn_scale
        self.attn_softcap = parts.attn_softcap
        self.final_softcap = parts.final_softcap
        # A tied MatMul head stores the table once, as [hidden, V]: the embedding gathers its
        # columns (a few per step) rather than keeping a second [V, hidden] copy in memory.
        self.embed_from_head = self.fusions.matmul_head and parts.lm_head is None
        self.embed = None if self.embed_from_head else _param(parts.embed)  # [V, hidden]
        self.final_norm = _param(parts.final_norm)
        # A tied head reuses the embedding table: one tensor on disk and in memory.
        self.lm_head = _param(parts.lm_head)
        if self.fusions.matmul_head:
            head = parts.embed if parts.lm_head is None else parts.lm_head
            setattr(self, HEAD_WEIGHT, _param(head.T))  # [hidden, V]
        self.layers = nn.ModuleList(_Layer(w, parts.activation, fused_mlp=not self.fusions.split_mlp)
                                    for w in parts.layers)
        self.kv_layers = len(parts.attention_layers)  # layers with a KV cache (past_key_values.{i})
        self.state_layers = len(parts.linear_layers)  # linear-attention layers (past_state.{j})
        self.state_layout = parts.state_layout()  # None without linear-attention layers
        self.rope_tables = sorted(parts.rope_tables)
        rot = next(iter(parts.rope_tables.values()))[0].shape[-1]
        self.register_buffer("rope_rotate", _rotate_half_matrix(rot), persistent=False)
        for name, (cos, sin) in parts.rope_tables.items():
            self.register_buffer(f"rope_cos_{name}", cos[:max_seq_len].contiguous(), persistent=False)
            self.register_buffer(f"rope_sin_{name}", sin[:max_seq_len].contiguous(), persistent=False)
            if attention == "ort-gqa":  # the op's tables hold one half: transformers' repeat it
                half = cos.shape[-1] // 2
                self.register_buffer(f"rope_cos_half_{name}", cos[:max_seq_len, :half].contiguous(), persistent=False)
                self.register_buffer(f"rope_sin_half_{name}", sin[:max_seq_len, :half].contiguous(), persistent=False)

    @property
    def num_layers(self) -> int:
        """The layers with a KV cache (``kv_layers``): every layer, unless the model has
        linear-attention layers (``state_layers``), which keep a recurrent state instead."""
        return self.kv_layers

    def forward(self, input_ids: torch.Tensor, cache_length: torch.Tensor, *inputs: torch.Tensor):
        # input_ids [B, T]; cache_length [B]; inputs: valid_tokens [B] (ort-gqa), then the past:
        # 2·kv_layers tensors [B, n_kv, S_max, head_dim], then 2·state_layers: conv [B, C, K-1]
        # and recurrent [B, Hv, dk, dv] per linear-attention layer
        tree, inputs = (inputs[:2], inputs[2:]) if self.tree else (None, inputs)  # offsets [B, T], mask or bias
        valid_tokens, past, past_state = self._split_inputs(inputs)
        batch, tokens = input_ids.shape
        offsets, positions, rope_index = self._positions(cache_length, tokens, tree)  # [T] | [B, T], [B, T], [B, T]
        visibility = self._visibility(cache_length, offsets, batch, tokens, tree)  # [S_max], [B, T, S_max], [B, T, T]
        rope = self._rope(rope_index)  # name -> cos, sin [B, T, 1, rot]
        hidden = self._embed(input_ids)  # [B, T, hidden]
        masks = self._masks(positions, offsets, visibility, hidden.dtype)  # window -> [B, 1, 1, T, S_max+T]
        # ort-gqa: seqlens_k [B], total length [], query_seqlens [B] (int32); a tree's position
        # ids [B, T] and bias [B, 1, T, total]
        gqa_lengths = self._gqa_lengths(cache_length, valid_tokens, tokens) if self.attention == "ort-gqa" else None
        if gqa_lengths is not None and tree is not None:
            gqa_lengths = self._gqa_tree(cache_length, positions, tree[1], gqa_lengths)
        hidden, presents, state_presents, tapped = self._decoder_layers(hidden, rope, masks, gqa_lengths, past,
                                                                        past_state)  # hidden [B, T, hidden]
        return self._outputs(hidden, presents, state_presents, tapped)

    def _split_inputs(self, inputs):
        """forward's ``*inputs`` -> (valid_tokens [B] (ort-gqa; None otherwise), the KV cache:
        2·kv_layers tensors [B, n_kv, S_max, hd], the linear-attention state: 2·state_layers
        tensors, conv [B, C, K-1] and recurrent [B, Hv, dk, dv] per layer (empty without))."""
        valid_tokens, past = (inputs[0], inputs[1:]) if self.takes_valid_tokens else (None, inputs)
        past_state = ()
        if self.state_layers:
            past, past_state = past[: 2 * self.kv_layers], past[2 * self.kv_layers :]
        return valid_tokens, past, past_state

    def _positions(self, cache_length, tokens: int, tree=None):
        """cache_length [B] -> the new tokens' offsets [T] (a tree's: [B, T], its depths),
        positions [B, T] and rope table rows [B, T]."""
        offsets = torch.arange(tokens, dtype=torch.int64) if tree is None else tree[0]  # [T] | [B, T]
        positions = cache_length.unsqueeze(1) + offsets  # [B, T]
        # Padding slots of a last, short chunk may run past the table; their outputs are unused.
        rope_index = positions.clamp(max=self.max_seq_len - 1)  # [B, T]
        return offsets, positions, rope_index

    def _visibility(self, cache_length, offsets, batch: int, tokens: int, tree=None):
        """Which keys each new token may see, before any sliding window: (the cache slots
        [S_max], the filled cache slots [B, T, S_max], the new tokens causally, or a tree's
        ancestors [B, T, T])."""
        s_max = self.max_seq_len
        past_slots = torch.arange(s_max, dtype=torch.int64)  # [S_max]
        past_visible = past_slots.view(1, 1, s_max) < cache_length.view(batch, 1, 1)  # [B, 1, S_max]
        past_visible = past_visible.expand(batch, tokens, s_max)  # [B, T, S_max]
        if tree is not None:
            return past_slots, past_visible, tree[1] if self.attention != "ort-gqa" else None
        new_visible = offsets.view(1, tokens) <= offsets.view(tokens, 1)  # [T, T] causal
        new_visible = new_visible.unsqueeze(0).expand(batch, tokens, tokens)  # [B, T, T]
        return past_slots, past_visible, new_visible

    def _rope(self, rope_index):
        """rope_index [B, T] -> name -> (cos, sin) [B, T, 1, rot]: one Gather per table, shared
        by the layers that use it."""
        return {
            name: (
                nn.functional.embedding(rope_index, getattr(self, f"rope_cos_{name}")).unsqueeze(2),
                nn.functional.embedding(rope_index, getattr(self, f"rope_sin_{name}")).unsqueeze(2),
            )
            for name in self.rope_tables
        }  # name -> cos, sin [B, T, 1, rot]

    def _embed(self, input_ids):
        """input_ids [B, T] -> the scaled token embeddings [B, T, hidden]."""
        batch, tokens = input_ids.shape
        if self.embed_from_head:
            table_t = getattr(self, HEAD_WEIGHT)  # [hidden, V]
            hidden = table_t.index_select(1, input_ids.reshape(-1)).T.reshape(batch, tokens, -1)  # [B, T, hidden]
        else:
            hidden = nn.functional.embedding(input_ids, self.embed)  # [B, T, hidden]
        if self.embed_scale != 1.0:
            hidden = hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype)  # [B, T, hidden]
        return hidden

    def _masks(self, positions, offsets, visibility, dtype: torch.dtype):
        """One additive mask [B, 1, 1, T, S_max+T] per distinct window, shared by the layers: 0
        visible, -inf hidden. positions [B, T], offsets [T], visibility: _visibility's."""
        past_slots, past_visible, new_visible = visibility  # [S_max], [B, T, S_max], [B, T, T]
        batch, tokens, s_max = past_visible.shape
        masks: dict[int | None, torch.Tensor] = {}
        if self.attention == "ort-gqa":  # the op masks (and a tree graph is given its bias)
            return masks
        for window in {layer.sliding_window for layer in self.layers if layer.linear is None}:
            mask_past, mask_new = past_visible, new_visible  # [B, T, S_max], [B, T, T]
            if window is not None:
                mask_past = mask_past & (positions.unsqueeze(2) - past_slots.view(1, 1, s_max) < window)
                if offsets.dim() == 1:  # a chain: new rows' distances are their offsets'
                    mask_new = mask_new & (offsets.view(tokens, 1) - offsets.view(1, tokens) < window).unsqueeze(0)
                else:  # a tree: their positions'
                    mask_new = mask_new & (positions.unsqueeze(2) - positions.unsqueeze(1) < window)
            visible = torch.cat((mask_past, mask_new), dim=-1)  # [B, T, S_max+T]
            zero = torch.zeros((), dtype=dtype)  # []
            masks[window] = torch.where(visible, zero, float("-inf")).view(batch, 1, 1, tokens, s_max + tokens)
        return masks

    def _gqa_tree(self, cache_length, positions, mask, lengths):
        """A tree's GroupQueryAttention inputs: seqlens_k as for a chain, the total length as the
        whole cache (S_max: the bias then has static columns; the op still attends to seqlens_k
        + 1 keys, measured equal), position ids [B, T], and the bias [B, 1, T, S_max]: 0 for a
        filled slot and for a row's ancestors (new rows sit at cache_length..+T), -inf else."""
        seqlens_k, _, query_seqlens = lengths
        batch, tokens, _ = mask.shape
        s_max = self.max_seq_len
        rel = torch.arange(s_max, dtype=torch.int64).view(1, s_max) - cache_length.view(batch, 1)  # [B, S_max]
        inside = (rel >= 0) & (rel < tokens)  # [B, S_max] the new rows' slots
        index = rel.clamp(0, tokens - 1).unsqueeze(1).expand(batch, tokens, s_max)  # [B, T, S_max]
        visible = (inside.unsqueeze(1) & torch.gather(mask, 2, index)) | (rel < 0).unsqueeze(1)  # [B, T, S_max]
        bias = torch.where(visible, torch.zeros(()), torch.tensor(float("-inf"))).unsqueeze(1)  # [B, 1, T, S_max]
        total = torch.tensor(s_max, dtype=torch.int32)  # []
        return seqlens_k, total, query_seqlens, positions, bias

    def _gqa_lengths(self, cache_length, valid_tokens, tokens: int):
        """GroupQueryAttention's lengths, int32: seqlens_k [B] (an idle row at length 0 still
        needs >= 0); an upper bound [] of the totals that is at least T (the op's check), as if
        every row's T were real; query_seqlens [B]."""
        total = cache_length + valid_tokens  # [B] filled length after this step
        return ((total - 1).clamp(min=0).to(torch.int32), (cache_length + tokens).max().to(torch.int32),
                valid_tokens.to(torch.int32))

    def _decoder_layers(self, hidden, rope, masks, gqa_lengths, past, past_state):
        """Every layer over the embeddings hidden [B, T, hidden] -> (the stream after the final
        norm [B, T, hidden], the KV presents (2 per attention layer), the linear-attention state
        presents (conv, recurrent per linear layer), hidden_states index -> tapped [B, T, hidden])."""
        presents: list[torch.Tensor] = []
        state_presents: list[torch.Tensor] = []  # per linear-attention layer: conv, recurrent
        tapped: dict[int, torch.Tensor] = {}  # hidden_states index -> [B, T, hidden]
        x = _rms_norm(hidden, self.layers[0].attn_norm, self.eps)  # [B, T, hidden] the first layer's attention input
        for i, layer in enumerate(self.layers):
            if i in self.taps:
                tapped[i] = hidden  # [B, T, hidden] the residual stream entering layer i
            if layer.linear is not None:  # Gated DeltaNet: the state in, the state after each position out
                j = len(state_presents)
                attn_out, conv_states, recurrent_states = layer.linear(x, past_state[j], past_state[j + 1])
                state_presents += [conv_states, recurrent_states]
            else:
                a = len(presents)
                # attn_out [B, T, hidden]; k_new, v_new: the new K/V or updated caches [B, n_kv, *, hd]
                attn_out, k_new, v_new = self._layer_attention(layer, x, rope, masks, gqa_lengths,
                                                               past[a], past[a + 1])
                presents += [k_new, v_new]
            last = i + 1 == len(self.layers)
            next_norm = self.final_norm if last else self.layers[i + 1].attn_norm
            x, hidden = self._residual_mlp(layer, hidden, attn_out, next_norm)  # [B, T, hidden] ×2
        return x, presents, state_presents, tapped

    def _layer_attention(self, layer: _Layer, x, rope, masks, gqa_lengths, past_k, past_v):
        """An attention layer's attention on the normed input x [B, T, hidden] with its RoPE
        table and (standard) its window's mask or (ort-gqa) the op's lengths -> (out
        [B, T, hidden], K and V presents). past_k, past_v [B, n_kv, S_max, hd]."""
        cos, sin = rope[layer.rope_table]  # [B, T, 1, rot]
        if self.attention == "ort-gqa":
            return self._attention_gqa(layer, x, cos, sin, past_k, past_v, gqa_lengths)
        return self._attention(layer, x, cos, sin, past_k, past_v, masks[layer.sliding_window])

    def _residual_mlp(self, layer: _Layer, hidden, attn_out, next_norm):
        """The rest of a layer after its attention: attn_out [B, T, hidden] into the residual
        stream hidden [B, T, hidden], the MLP, its output into the stream -> (the next block's
        input, normed by ``next_norm`` [B, T, hidden], the stream [B, T, hidden])."""
        if layer.attn_out_norm is not None:
            attn_out = _rms_norm(attn_out, layer.attn_out_norm, self.eps)  # [B, T, hidden]
        x, hidden = self._add_norm(hidden, attn_out, layer.mlp_norm)  # [B, T, hidden] ×2
        mlp_out = self._mlp(layer, x)  # [B, T, hidden]
        if layer.mlp_out_norm is not None:
            mlp_out = _rms_norm(mlp_out, layer.mlp_out_norm, self.eps)  # [B, T, hidden]
        return self._add_norm(hidden, mlp_out, next_norm)

    def _outputs(self, hidden, presents, state_presents, tapped):
        """hidden [B, T, hidden] after the final norm -> forward's outputs: logits [B, T, V],
        next_tokens [B, T], the presents, then the state presents, then (taps) aux [B, T,
        n_taps·hidden]."""
        tapped = {**tapped, len(self.layers): hidden}  # hidden_states index -> [B, T, hidden]
        logits = self._logits(hidden)  # [B, T, V]
        next_tokens = logits.argmax(dim=-1)  # [B, T]
        if self.taps:
            aux = torch.cat([tapped[i] for i in self.taps], dim=-1)  # [B, T, n_taps·hidden]
            return (logits, next_tokens, *presents, *state_presents, aux)
        return (logits, next_tokens, *presents, *state_presents)

    def _logits(self, hidden):
        """The output head (softcapped where the model does): hidden [B, T, hidden] -> logits
        [B, T, V]."""
        if self.fusions.matmul_head:
            logits = hidden @ getattr(self, HEAD_WEIGHT)  # [B, T, V]
        else:
            batch, tokens, _ = hidden.shape
            head = self.embed if self.lm_head is None else self.lm_head  # [V, hidden]
            # 2-D linear exports as Gemm(transB=1): the [V, hidden] table is used as stored.
            logits = nn.functional.linear(hidden.reshape(batch * tokens, -1), head)  # [B·T, V]
            logits = logits.reshape(batch, tokens, -1)  # [B, T, V]
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap  # [B, T, V]
        return logits

    def _add_norm(self, hidden, delta, weight):
        """(RMSNorm(hidden + delta) · weight, hidden + delta): the residual stream and the next
        block's input."""
        if not self.fusions.skip_norm:
            hidden = hidden + delta
            return _rms_norm(hidden, weight, self.eps), hidden
        normed, _, _, total = torch.onnx.ops.symbolic_multi_out(
            "com.microsoft::SkipSimplifiedLayerNormalization",
            (hidden, delta, weight),
            dict(epsilon=float(self.eps)),
            dtypes=(hidden.dtype, torch.float32, torch.float32, hidden.dtype),
            shapes=(hidden.shape, (*hidden.shape[:-1], 1), (*hidden.shape[:-1], 1), hidden.shape),
            version=1,
        )  # outputs 1 and 2 (mean, 1/std) are dropped from the node at export (onnx_export)
        return normed, total

    def _attention(self, layer: _Layer, x, cos, sin, past_k, past_v, mask):
        """x: the normed layer input [B, T, hidden]."""
        batch, tokens, _ = x.shape
        hd, n_kv, g = self.head_dim, self.n_kv, self.group
        q, k, v, gate = self._project(layer, x)  # [B, T, H, hd], [B, T, n_kv, hd] ×2, [B, T, H·hd] | None
        if layer.q_norm is not None:
            q = _rms_norm(q, layer.q_norm, self.eps)
            k = _rms_norm(k, layer.k_norm, self.eps)
        q = _apply_rope(q, cos, sin, self.rope_rotate)
        k = _apply_rope(k, cos, sin, self.rope_rotate)
        k_new = k.transpose(1, 2)  # [B, n_kv, T, hd]
        v_new = v.transpose(1, 2)  # [B, n_kv, T, hd]

        # Query heads sharing a KV head are stacked with the tokens: [B, n_kv, G·T, hd], the
        # same G·(1+D) rows the tile rule counts.
        q = q.view(batch, tokens, n_kv, g, hd).permute(0, 2, 3, 1, 4).reshape(batch, n_kv, g * tokens, hd)
        s_past = q @ past_k.transpose(2, 3)  # [B, n_kv, G·T, S_max]
        s_new = q @ k_new.transpose(2, 3)  # [B, n_kv, G·T, T]
        scores = torch.cat((s_past, s_new), dim=-1) * self.attn_scale  # [B, n_kv, G·T, S_max+T]
        if self.attn_softcap is not None:
            scores = torch.tanh(scores / self.attn_softcap) * self.attn_softcap
        scores = scores.view(batch, n_kv, g, tokens, -1) + mask  # mask [B, 1, 1, T, S_max+T]
        probs = torch.softmax(scores, dim=-1).view(batch, n_kv, g * tokens, -1)
        s_max = past_k.shape[2]
        out = probs[..., :s_max] @ past_v + probs[..., s_max:] @ v_new  # [B, n_kv, G·T, hd]
        out = out.view(batch, n_kv, g, tokens, hd).permute(0, 3, 1, 2, 4).reshape(batch, tokens, -1)
        if gate is not None:  # gated attention (Qwen3-Next, Qwen3.5)
            out = out * torch.sigmoid(gate)  # [B, T, H·hd]
        out = out @ layer.o_w  # [B, T, hidden]
        if layer.o_b is not None:
            out = out + layer.o_b
        return out, k_new, v_new

    def _project(self, layer: _Layer, x):
        """The normed input [B, T, hidden] -> q [B, T, H, hd], k and v [B, T, n_kv, hd], before
        RoPE, and a gated attention's output gate [B, T, H·hd] (None without)."""
        if layer.mla is not None:
            return (*layer.mla(x), None)
        batch, tokens, _ = x.shape
        qkv = x @ layer.qkv_w  # [B, T, (H+2·n_kv)·hd] (+ H·hd gate columns)
        if layer.qkv_b is not None:
            qkv = qkv + layer.qkv_b
        q, k, v, *gate = torch.split(qkv, layer.qkv_sizes, dim=-1)  # [B, T, H·hd], [B, T, n_kv·hd] ×2
        hd = self.head_dim
        return (q.view(batch, tokens, self.n_heads, hd), k.view(batch, tokens, self.n_kv, hd),
                v.view(batch, tokens, self.n_kv, hd), gate[0] if gate else None)

    def _attention_gqa(self, layer: _Layer, x, cos, sin, past_k, past_v, lengths):
        """One com.microsoft GroupQueryAttention node; present K/V are the updated caches.
        x: the normed layer input [B, T, hidden]."""
        batch, tokens, _ = x.shape
        hd = self.head_dim
        full_rotary = cos.shape[-1] == hd
        gate = None  # a gated attention's output gate [B, T, H·hd]
        if layer.mla is not None:  # per-head [B, T, H, qk] of its own (MLA rotates part of each head)
            q, k, v = (t.reshape(batch, tokens, -1) for t in layer.mla(x))
        else:
            qkv = x @ layer.qkv_w  # [B, T, (H+2·n_kv)·hd] (+ H·hd gate columns)
            if layer.qkv_b is not None:
                qkv = qkv + layer.qkv_b
            if self.fusions.packed_qkv and layer.q_norm is None and full_rotary and not layer.gated:
                q, k, v = qkv, None, None  # the op splits a packed QKV itself
            elif layer.gated:
                q, k, v, gate = torch.split(qkv, layer.qkv_sizes, dim=-1)
            else:
                q, k, v = torch.split(qkv, layer.qkv_sizes, dim=-1)
        if layer.q_norm is not None or not full_rotary:
            q = q.view(batch, tokens, self.n_heads, hd)
            k = k.view(batch, tokens, self.n_kv, hd)
            if layer.q_norm is not None:  # before RoPE, as transformers does
                q = _rms_norm(q, layer.q_norm, self.eps)
                k = _rms_norm(k, layer.k_norm, self.eps)
            if not full_rotary:  # partial rotary: rotate here, the op's rotary takes whole heads
                q = _apply_rope(q, cos, sin, self.rope_rotate)
                k = _apply_rope(k, cos, sin, self.rope_rotate)
            q = q.reshape(batch, tokens, -1)
            k = k.reshape(batch, tokens, -1)
        attrs = dict(num_heads=self.n_heads, kv_num_heads=self.n_kv, scale=self.attn_scale, do_rotary=int(full_rotary))
        if self.attn_softcap is not None:
            attrs["softcap"] = float(self.attn_softcap)
        if layer.sliding_window is not None:
            attrs["local_window_size"] = int(layer.sliding_window)
        # the op checks its tables even with do_rotary=0 (half width a multiple of 8): none then
        tables = ((getattr(self, f"rope_cos_half_{layer.rope_table}"), getattr(self, f"rope_sin_half_{layer.rope_table}"))
                  if full_rotary else (None, None))
        seqlens_k, total, query_seqlens, *tree = lengths  # tree: position ids [B, T], bias [B, 1, T, total]
        # the op's optional inputs between the rotary tables and query_seqlens: position_ids,
        # attention_bias (a tree's), head_sink, k_scale, v_scale, q_norm_weight, k_norm_weight
        optional = (*(tree or (None, None)), *(None,) * 5)
        out, present_k, present_v = torch.onnx.ops.symbolic_multi_out(
            "com.microsoft::GroupQueryAttention",
            (q, k, v, past_k, past_v, seqlens_k, total, *tables, *optional, query_seqlens),
            attrs,
            dtypes=(x.dtype, past_k.dtype, past_v.dtype),
            shapes=((batch, tokens, self.n_heads * hd), past_k.shape, past_v.shape),
            version=1,
        )
        if gate is not None:  # gated attention (Qwen3-Next, Qwen3.5)
            out = out * torch.sigmoid(gate)  # [B, T, H·hd]
        out = out @ layer.o_w  # [B, T, hidden]
        if layer.o_b is not None:
            out = out + layer.o_b
        return out, present_k, present_v

    def _mlp(self, layer: _Layer, x):
        if layer.fused_mlp:
            gate, up = torch.split(x @ layer.gate_up_w, layer.intermediate, dim=-1)  # [B, T, intermediate] ×2
        else:
            gate, up = x @ layer.gate_w, x @ layer.up_w
        out = (_activate(gate, self.activation) * up) @ layer.down_w  # [B, T, hidden]
        if layer.moe is not None:  # the dense part above is the MoE layer's shared experts
            out = layer.moe.gate_shared(x, out) + layer.moe(x)  # gated by Qwen's shared_expert_gate
        return out
