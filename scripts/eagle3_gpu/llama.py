"""SmolLM2 (Llama) in plain torch, from a GGUF file: a full-sequence forward that also returns
tapped hidden states, and batched generation with a KV cache over left-padded prompts.

Taps follow specexport's convention (transformers' output_hidden_states indices): tap i < L is
the residual stream ENTERING layer i (i = 0: the embeddings), tap L the final-normed output.
llama.cpp stores q/k rows permuted for its interleaved rope; `reverse_permute` undoes that the
way transformers' GGUF loader does, so the HF rotate-half rope applies.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from gguf_read import GgufFile


@dataclass
class Config:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    inter: int
    vocab: int
    eps: float
    rope_theta: float
    context: int

    @classmethod
    def from_gguf(cls, meta: dict) -> Config:
        arch = meta["general.architecture"]
        if arch != "llama":
            raise ValueError(f"GGUF architecture '{arch}' is not llama")
        g = lambda key: meta[f"llama.{key}"]  # noqa: E731
        hidden, heads = int(g("embedding_length")), int(g("attention.head_count"))
        return cls(layers=int(g("block_count")), hidden=hidden, heads=heads,
                   kv_heads=int(g("attention.head_count_kv")),
                   head_dim=int(meta.get("llama.rope.dimension_count", hidden // heads)),
                   inter=int(g("feed_forward_length")), vocab=int(meta.get("llama.vocab_size", 0)),
                   eps=float(g("attention.layer_norm_rms_epsilon")),
                   rope_theta=float(meta.get("llama.rope.freq_base", 10000.0)),
                   context=int(g("context_length")))


def reverse_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row order (pairs interleaved per head) back to the HF order."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def load_weights(path: str, device, dtype=torch.float32) -> tuple[Config, dict[str, torch.Tensor]]:
    f = GgufFile(path)
    cfg = Config.from_gguf(f.metadata)
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(device=device, dtype=dtype)  # noqa: E731
    w = {"embed": t(f.get("token_embd.weight")), "norm": t(f.get("output_norm.weight"))}  # [V, H], [H]
    cfg.vocab = cfg.vocab or w["embed"].shape[0]
    if "output.weight" in f.tensors:  # untied head (SmolLM2 ties it to the embedding)
        w["head"] = t(f.get("output.weight"))
    for i in range(cfg.layers):
        p = f"blk.{i}."
        q = reverse_permute(f.get(p + "attn_q.weight"), cfg.heads)  # [heads·hd, H]
        k = reverse_permute(f.get(p + "attn_k.weight"), cfg.kv_heads)  # [kv·hd, H]
        v = f.get(p + "attn_v.weight")
        w[f"{i}.qkv"] = t(np.concatenate((q, k, v)).T)  # [H, (heads+2kv)·hd]
        w[f"{i}.o"] = t(f.get(p + "attn_output.weight").T)  # [heads·hd, H]
        w[f"{i}.gate_up"] = t(np.concatenate((f.get(p + "ffn_gate.weight"), f.get(p + "ffn_up.weight"))).T)  # [H, 2I]
        w[f"{i}.down"] = t(f.get(p + "ffn_down.weight").T)  # [I, H]
        w[f"{i}.attn_norm"] = t(f.get(p + "attn_norm.weight"))
        w[f"{i}.mlp_norm"] = t(f.get(p + "ffn_norm.weight"))
    del f
    return cfg, w


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float):
    """positions [B, T] -> cos, sin [B, 1, T, hd] (HF layout: the two halves share frequencies)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    freqs = positions.float().unsqueeze(-1) * inv  # [B, T, hd/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [B, T, hd]
    return emb.cos().unsqueeze(1), emb.sin().unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def grouped_attention(q, k, v, mask, kv_heads: int) -> torch.Tensor:
    """q [B, heads, T, hd], k/v [B, kv, S, hd], mask [B, 1, T, S] bool -> [B, heads, T, hd].
    Query heads h use key head h // (heads/kv) (HF's repeat_kv), without copying k and v."""
    b, heads, t, hd = q.shape
    rep = heads // kv_heads
    scores = (q.reshape(b, kv_heads, rep * t, hd) @ k.transpose(2, 3)) * hd**-0.5  # [B, kv, rep·T, S]
    scores = scores.view(b, kv_heads, rep, t, -1).masked_fill(~mask.unsqueeze(2), float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(v.dtype).view(b, kv_heads, rep * t, -1)
    return (probs @ v).view(b, heads, t, hd)


class Llama:
    def __init__(self, cfg: Config, weights: dict[str, torch.Tensor]):
        self.cfg, self.w = cfg, weights
        self.head = weights.get("head", weights["embed"])  # [V, H]

    def forward(self, ids, positions, mask, cache=None, slots=None, taps=(), logits_rows=None):
        """ids [B, T]; positions [B, T] rope positions; mask [B, 1, T, S] bool (True = visible)
        over the keys (the cache's first S slots when cache is given, else the T new rows);
        cache: list of (k, v) [B, kv, S_max, hd] written at `slots` (a slice). Returns
        (logits [B, T', V] fp32 for rows `logits_rows` (all by default), taps [B, T, n·H])."""
        c, w = self.cfg, self.w
        b, t = ids.shape
        x = F.embedding(ids, w["embed"])  # [B, T, H]
        cos, sin = rope_cos_sin(positions, c.head_dim, c.rope_theta)
        taps = list(taps)
        caught = {}
        for i in range(c.layers):
            if i in taps:
                caught[i] = x
            h = rms_norm(x, w[f"{i}.attn_norm"], c.eps)
            q, k, v = torch.split(h @ w[f"{i}.qkv"], [c.heads * c.head_dim, c.kv_heads * c.head_dim,
                                                      c.kv_heads * c.head_dim], dim=-1)
            q = apply_rope(q.view(b, t, c.heads, c.head_dim).transpose(1, 2), cos, sin)  # [B, heads, T, hd]
            k = apply_rope(k.view(b, t, c.kv_heads, c.head_dim).transpose(1, 2), cos, sin)  # [B, kv, T, hd]
            v = v.view(b, t, c.kv_heads, c.head_dim).transpose(1, 2)
            if cache is not None:
                ck, cv = cache[i]
                ck[:, :, slots] = k
                cv[:, :, slots] = v
                k, v = ck[:, :, : mask.shape[-1]], cv[:, :, : mask.shape[-1]]
            a = grouped_attention(q, k, v, mask, c.kv_heads)  # [B, heads, T, hd]
            x = x + a.transpose(1, 2).reshape(b, t, -1) @ w[f"{i}.o"]
            gate, up = (rms_norm(x, w[f"{i}.mlp_norm"], c.eps) @ w[f"{i}.gate_up"]).chunk(2, dim=-1)
            x = x + (F.silu(gate) * up) @ w[f"{i}.down"]  # [B, T, H]
        out = rms_norm(x, w["norm"], c.eps)
        if c.layers in taps:
            caught[c.layers] = out
        rows = out if logits_rows is None else out[:, logits_rows]
        logits = (rows @ self.head.T).float()  # [B, T', V]
        aux = torch.cat([caught[i] for i in taps], dim=-1) if taps else None  # [B, T, n·H]
        return logits, aux

    def full(self, ids: torch.Tensor, taps=()):
        """Right-padded sequences, no cache: (logits [B, T, V], taps [B, T, n·H])."""
        b, t = ids.shape
        positions = torch.arange(t, device=ids.device).expand(b, t)
        mask = torch.ones(t, t, dtype=torch.bool, device=ids.device).tril().expand(b, 1, t, t)
        return self.forward(ids, positions, mask, taps=taps)

    @torch.no_grad()
    def generate(self, prompts: list[np.ndarray], max_new: int, temperature: float, eos: set[int],
                 generator: torch.Generator | None = None, deadline=None, clock=None) -> list[np.ndarray]:
        """Batched generation over left-padded prompts. Returns each response's tokens (the
        EOS included when it came). ``deadline``: stop early (responses cut) when clock() passes it."""
        c, dev = self.cfg, self.w["embed"].device
        b, p = len(prompts), max(len(x) for x in prompts)
        s_max = p + max_new
        pad = torch.tensor([p - len(x) for x in prompts], device=dev)  # [B]
        ids = torch.zeros(b, p, dtype=torch.long, device=dev)
        for r, x in enumerate(prompts):
            ids[r, p - len(x):] = torch.from_numpy(np.asarray(x, dtype=np.int64))
        dtype = self.w["embed"].dtype
        cache = [(torch.zeros(b, c.kv_heads, s_max, c.head_dim, device=dev, dtype=dtype),
                  torch.zeros(b, c.kv_heads, s_max, c.head_dim, device=dev, dtype=dtype)) for _ in range(c.layers)]
        slot = torch.arange(s_max, device=dev)  # [S_max]
        key_ok = slot.view(1, -1) >= pad.view(-1, 1)  # [B, S_max] the padding is never a key
        causal = slot[:p].view(-1, 1) >= slot[:p].view(1, -1)  # [P, P]
        mask = (key_ok[:, None, :p] & causal) | torch.eye(p, dtype=torch.bool, device=dev)  # pad rows see themselves
        positions = (slot[:p].view(1, -1) - pad.view(-1, 1)).clamp(min=0)  # [B, P]
        logits, _ = self.forward(ids, positions, mask[:, None], cache, slice(0, p), logits_rows=slice(p - 1, p))
        out = torch.zeros(b, max_new, dtype=torch.long, device=dev)
        done = torch.zeros(b, dtype=torch.bool, device=dev)
        eos_t = torch.tensor(sorted(eos), device=dev)
        n = 0
        for n in range(max_new):
            last = logits[:, -1]  # [B, V]
            if temperature > 0:
                probs = torch.softmax(last / temperature, dim=-1)
                nxt = torch.multinomial(probs, 1, generator=generator)[:, 0]
            else:
                nxt = last.argmax(-1)
            nxt = torch.where(done, eos_t[0], nxt)
            out[:, n] = nxt
            done |= torch.isin(nxt, eos_t)
            if n + 1 == max_new or bool(done.all()) or (deadline is not None and clock() > deadline):
                break
            at = p + n  # the slot of the token just drawn
            visible = key_ok[:, None, None, : at + 1]  # [B, 1, 1, S]
            pos = (at - pad).view(-1, 1)  # [B, 1]
            logits, _ = self.forward(nxt.view(-1, 1), pos, visible, cache, slice(at, at + 1))
        out = out[:, : n + 1].cpu().numpy()
        responses = []
        for row in out:
            hits = np.flatnonzero(np.isin(row, list(eos)))
            responses.append(row[: hits[0] + 1] if len(hits) else row)
        return responses
