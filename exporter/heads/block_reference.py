"""An independent reference forward of DFlash and DSpark heads, for build-time parity.

Written from the published code (z-lab/dflash ``DFlashDraftModel``, vllm-project/speculators
``DFlashDraftModel``/``DSparkDraftModel``, DeepSpec ``Qwen3DSparkModel`` and its Markov heads):
the whole context in one pass, no cache, plain torch on the checkpoint's tensors by their
published names and on config.json as each layout writes it. It shares no code with the graph
(exporter/heads/block.py) nor with the loaders, so a loader that mis-maps a tensor, reads layer
ids in the wrong convention or takes the wrong mask token fails parity.
"""

from __future__ import annotations

import numpy as np
import torch

# layout -> how the published code turns a layer id into an index of transformers' hidden_states
# (z-lab extract_context_feature: id + 1; DeepSpec: -1 is the embeddings, else id + 1;
# speculators/vLLM: the stream entering layer id)
_HIDDEN_INDEX = {
    "z-lab": lambda i: i + 1,
    "deepspec": lambda i: 0 if i == -1 else i + 1,
    "speculators": lambda i: i,
}


def _section(layout: str, config: dict) -> dict:
    return config["transformer_layer_config"] if layout == "speculators" else config


def _value(layout: str, config: dict, key: str, default=None):
    # z-lab keeps its DFlash fields in dflash_config (older files: at the top level)
    if layout == "z-lab":
        return (config.get("dflash_config") or {}).get(key, config.get(key, default))
    return config.get(key, default)


def _layer_ids(layout: str, config: dict) -> list[int]:
    key = "aux_hidden_state_layer_ids" if layout == "speculators" else "target_layer_ids"
    return list(_value(layout, config, key))


def _from_anchor(layout: str, config: dict) -> bool:
    if layout == "z-lab":
        return False
    if layout == "deepspec":
        return True
    return bool(config.get("sample_from_anchor", config.get("speculators_model_type") == "dspark"))


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rotate(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@torch.no_grad()
def reference_block(layout: str, config: dict, tensors: dict[str, torch.Tensor], target_model,
                    hidden_states: tuple[np.ndarray, ...], ids: np.ndarray, start: int) -> tuple[np.ndarray, np.ndarray]:
    """The head's drafting logits and final-normed hidden states for the block anchored at
    ``start`` (ids[start] is the anchor; positions < start are the context): ([n, V_draft], [n, H])."""
    from transformers import AutoConfig
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    section = _section(layout, config)
    eps = float(section.get("rms_norm_eps", 1e-6))
    heads = int(section["num_attention_heads"])
    kv_heads = int(section.get("num_key_value_heads", heads))
    head_dim = int(section.get("head_dim") or section["hidden_size"] // heads)
    block = int(_value(layout, config, "block_size"))
    w = {k: v.float() for k, v in tensors.items()}

    features = torch.cat([torch.from_numpy(hidden_states[_HIDDEN_INDEX[layout](i)]) for i in _layer_ids(layout, config)],
                         dim=-1)[:start]  # [start, n·H_t]
    target_hidden = _rms(features @ w["fc.weight"].T, w["hidden_norm.weight"], eps)  # [start, H]

    embed = w.get("embed_tokens.weight", target_model.get_input_embeddings().weight.detach().float())
    if "mask_embedding" in w:
        mask = w["mask_embedding"].reshape(-1)
    else:
        mask = embed[int(_value(layout, config, "mask_token_id"))]
    noise = torch.cat((embed[int(ids[start])].unsqueeze(0), mask.unsqueeze(0).expand(block - 1, -1)))  # [bs, H]

    fields = {k: v for k, v in section.items() if k not in ("architectures", "auto_map", "model_type")}
    rotary = Qwen3RotaryEmbedding(AutoConfig.for_model("qwen3", **fields))
    cos, sin = rotary(noise.unsqueeze(0), torch.arange(start + block).unsqueeze(0))  # [1, start+bs, hd]
    cos, sin = cos[0], sin[0]

    x = noise
    for i in range(int(section["num_hidden_layers"])):
        p = f"layers.{i}."

        def linear(h, name, p=p):
            out = h @ w[p + name + ".weight"].T
            return out + w[p + name + ".bias"] if p + name + ".bias" in w else out

        h = _rms(x, w[p + "input_layernorm.weight"], eps)
        q = linear(h, "self_attn.q_proj").view(block, heads, head_dim)
        k = torch.cat((linear(target_hidden, "self_attn.k_proj"), linear(h, "self_attn.k_proj"))).view(-1, kv_heads, head_dim)
        v = torch.cat((linear(target_hidden, "self_attn.v_proj"), linear(h, "self_attn.v_proj"))).view(-1, kv_heads, head_dim)
        if p + "self_attn.q_norm.weight" in w:
            q = _rms(q, w[p + "self_attn.q_norm.weight"], eps)
            k = _rms(k, w[p + "self_attn.k_norm.weight"], eps)
        q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # [heads, T, hd]
        q = q * cos[-block:] + _rotate(q) * sin[-block:]
        k = k * cos + _rotate(k) * sin
        k = k.repeat_interleave(heads // kv_heads, dim=0)
        v = v.repeat_interleave(heads // kv_heads, dim=0)
        attn = torch.softmax(q @ k.transpose(1, 2) * head_dim ** -0.5, dim=-1) @ v  # not causal: no mask
        x = x + linear(attn.transpose(0, 1).reshape(block, -1), "self_attn.o_proj")
        h = _rms(x, w[p + "post_attention_layernorm.weight"], eps)
        gate, up = linear(h, "mlp.gate_proj"), linear(h, "mlp.up_proj")
        x = x + linear(torch.nn.functional.silu(gate) * up, "mlp.down_proj")

    hidden = _rms(x, w["norm.weight"], eps)[0 if _from_anchor(layout, config) else 1:]  # [n, H]
    lm_head = w.get("lm_head.weight")
    if lm_head is None:
        lm_head = target_model.get_output_embeddings().weight.detach().float()
    return (hidden @ lm_head.T).numpy(), hidden.numpy()


def reference_markov(config: dict, tensors: dict[str, torch.Tensor], base_logits: np.ndarray, hidden: np.ndarray,
                     anchor: int, d2t: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """DSpark's serial greedy refinement (DeepSpec markov_head.sample_block_tokens, speculators
    MarkovHead.block_bias) and its confidence head: (corrected logits [n, V_draft], draft target
    ids [n], confidence probabilities [n] or None)."""
    w = {k: v.float() for k, v in tensors.items()}
    rank = int(config.get("markov_rank", 0))
    kind = str(config.get("markov_head_type", "vanilla")).lower()
    logits_out, tokens, confidence = [], [], []
    prev, state = int(anchor), torch.zeros(rank)
    for k in range(base_logits.shape[0]):
        h = torch.from_numpy(hidden[k])
        logits = torch.from_numpy(base_logits[k]).clone()
        emb = w["markov_head.markov_w1.weight"][prev] if rank else None
        if rank and kind == "vanilla":
            logits += w["markov_head.markov_w2.weight"] @ emb
        elif rank and kind == "gated":
            gate = torch.sigmoid(torch.nn.functional.linear(torch.cat((h, emb)), w["markov_head.gate_proj.weight"],
                                                            w["markov_head.gate_proj.bias"]))
            logits += w["markov_head.markov_w2.weight"] @ (gate * emb)
        elif rank:  # rnn
            z = torch.nn.functional.linear(torch.cat((state, emb, h)), w["markov_head.joint_proj.weight"],
                                           w["markov_head.joint_proj.bias"])
            g, cand, out = z.chunk(3)
            state = torch.sigmoid(g) * state + (1 - torch.sigmoid(g)) * torch.tanh(cand)
            logits += w["markov_head.markov_w2.weight"] @ torch.tanh(out)
        if "confidence_head.proj.weight" in w:
            feats = torch.cat((h, emb)) if config.get("confidence_head_with_markov") else h
            confidence.append(float(torch.sigmoid(feats @ w["confidence_head.proj.weight"][0]
                                                  + w["confidence_head.proj.bias"][0])))
        choice = int(logits.argmax())
        prev = int(d2t[choice]) if d2t is not None else choice
        logits_out.append(logits.numpy())
        tokens.append(prev)
    conf = np.array(confidence) if confidence else None
    return np.stack(logits_out), np.array(tokens, dtype=np.int64), conf
