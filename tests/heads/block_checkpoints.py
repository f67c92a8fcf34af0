"""Tiny random DFlash/DSpark checkpoints in every published layout, over a tiny target.

Each writer makes a folder (config.json + model.safetensors) with the tensor names and config
fields the published code saves: z-lab DFlash, speculators DFlash, DeepSpec DSpark and
speculators DSpark. The draft layers are dense Qwen3 layers (q_norm/k_norm); scales keep the
activations of order one, so argmax margins are clear.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from tests.heads.common import SHAPES

# The tiny target every head test builds over (a recipe `target:` and the model it makes).
TARGET = {"source": "tiny", "arch": "qwen3", "seed": 3, "num_layers": 4}


def tiny_target():
    """The transformers model of TARGET (for checkpoint shapes and the DeepSpec head copies)."""
    from specexport.exporter.recipe import TinySource
    from specexport.exporter.tiny import tiny_model

    model, _ = tiny_model(TinySource(**TARGET))
    return model


def _linear(gen, out: int, inp: int, gain: float = 1.0) -> torch.Tensor:
    return torch.randn(out, inp, generator=gen) * gain / inp**0.5


def _norm(gen, size: int) -> torch.Tensor:
    return 1.0 + 0.1 * torch.randn(size, generator=gen)


def decoder_fields(target, layers: int, intermediate: int = 96) -> dict:
    """The draft layers' Qwen3 config fields (the target's attention shape)."""
    t = target.config
    return {"model_type": "qwen3", "hidden_size": t.hidden_size, "num_hidden_layers": layers,
            "num_attention_heads": t.num_attention_heads, "num_key_value_heads": t.num_key_value_heads,
            "head_dim": t.head_dim, "intermediate_size": intermediate, "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0, "hidden_act": "silu", "attention_bias": False, "vocab_size": t.vocab_size,
            "max_position_embeddings": 4096}


def dense_tensors(gen, fields: dict, n_taps: int, target_hidden: int) -> dict[str, torch.Tensor]:
    """layers.*, fc, hidden_norm, norm: what every layout shares."""
    h, hd = fields["hidden_size"], fields["head_dim"]
    q, kv, inter = fields["num_attention_heads"] * hd, fields["num_key_value_heads"] * hd, fields["intermediate_size"]
    out = {"fc.weight": _linear(gen, h, n_taps * target_hidden), "hidden_norm.weight": _norm(gen, h),
           "norm.weight": _norm(gen, h)}
    for i in range(fields["num_hidden_layers"]):
        p = f"layers.{i}."
        out.update({
            p + "input_layernorm.weight": _norm(gen, h), p + "post_attention_layernorm.weight": _norm(gen, h),
            p + "self_attn.q_proj.weight": _linear(gen, q, h, 2.0), p + "self_attn.k_proj.weight": _linear(gen, kv, h, 2.0),
            p + "self_attn.v_proj.weight": _linear(gen, kv, h), p + "self_attn.o_proj.weight": _linear(gen, h, q),
            p + "self_attn.q_norm.weight": _norm(gen, hd), p + "self_attn.k_norm.weight": _norm(gen, hd),
            p + "mlp.gate_proj.weight": _linear(gen, inter, h), p + "mlp.up_proj.weight": _linear(gen, inter, h),
            p + "mlp.down_proj.weight": _linear(gen, h, inter),
        })
    return out


def _write(folder: Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    return folder


def write_zlab_dflash(folder: Path, target, *, layer_ids=(0, 2), block_size: int = 6, mask_token_id: int = 5,
                      layers: int = 1, seed: int = 0, mask_embedding: bool = False) -> Path:
    """z-lab: Qwen3 fields at the top level, dflash_config {target_layer_ids (output of layer i),
    mask_token_id}; no embedding or lm_head (the target's)."""
    gen = torch.Generator().manual_seed(seed)
    fields = decoder_fields(target, layers)
    config = {**fields, "architectures": ["DFlashDraftModel"], "block_size": block_size,
              "num_target_layers": target.config.num_hidden_layers,
              "dflash_config": {"target_layer_ids": list(layer_ids), "mask_token_id": mask_token_id}}
    tensors = dense_tensors(gen, fields, len(layer_ids), target.config.hidden_size)
    if mask_embedding:
        tensors["mask_embedding"] = torch.randn(fields["hidden_size"], generator=gen) * 0.5
    return _write(folder, config, tensors)


def _speculators(kind: str, target, fields: dict, layer_ids, block_size: int, mask_token_id: int,
                 draft_vocab: int | None, extra: dict) -> dict:
    return {"speculators_model_type": kind, "architectures": [f"{kind.upper()}Speculator"],
            "transformer_layer_config": fields, "draft_vocab_size": draft_vocab or target.config.vocab_size,
            "block_size": block_size, "aux_hidden_state_layer_ids": list(layer_ids), "mask_token_id": mask_token_id,
            "target_hidden_size": target.config.hidden_size, **extra}


def _reduced_head(gen, target, draft_vocab: int) -> dict[str, torch.Tensor]:
    """A reduced vocabulary: the draft ids map to every other target id from 3 on (d2t offsets)."""
    ids = torch.arange(draft_vocab) * 2 + 3  # target ids, ascending
    return {"lm_head.weight": _linear(gen, draft_vocab, target.config.hidden_size, 8.0),
            "d2t": ids - torch.arange(draft_vocab), "t2d": torch.zeros(target.config.vocab_size, dtype=torch.bool)}


def write_speculators_dflash(folder: Path, target, *, layer_ids=(1, 3), block_size: int = 5, mask_token_id: int = 7,
                             layers: int = 2, seed: int = 1, draft_vocab: int | None = None) -> Path:
    """speculators: transformer_layer_config, aux_hidden_state_layer_ids (the stream entering
    layer i); a reduced vocabulary brings lm_head + d2t."""
    gen = torch.Generator().manual_seed(seed)
    fields = decoder_fields(target, layers)
    tensors = dense_tensors(gen, fields, len(layer_ids), target.config.hidden_size)
    if draft_vocab:
        tensors.update(_reduced_head(gen, target, draft_vocab))
    config = _speculators("dflash", target, fields, layer_ids, block_size, mask_token_id, draft_vocab,
                          {"sample_from_anchor": False})
    return _write(folder, config, tensors)


def _markov_tensors(gen, hidden: int, vocab: int, draft_vocab: int, rank: int, kind: str, confidence: bool,
                    with_markov: bool) -> dict[str, torch.Tensor]:
    out = {}
    if rank:
        out["markov_head.markov_w1.weight"] = torch.randn(vocab, rank, generator=gen)
        out["markov_head.markov_w2.weight"] = _linear(gen, draft_vocab, rank, 3.0)
        if kind == "gated":
            out["markov_head.gate_proj.weight"] = _linear(gen, rank, hidden + rank)
            out["markov_head.gate_proj.bias"] = 0.1 * torch.randn(rank, generator=gen)
        if kind == "rnn":
            out["markov_head.joint_proj.weight"] = _linear(gen, 3 * rank, 2 * rank + hidden)
            out["markov_head.joint_proj.bias"] = 0.1 * torch.randn(3 * rank, generator=gen)
    if confidence:
        out["confidence_head.proj.weight"] = _linear(gen, 1, hidden + (rank if with_markov else 0))
        out["confidence_head.proj.bias"] = torch.tensor([1.5])
    return out


def write_deepspec_dspark(folder: Path, target, *, layer_ids=(-1, 1, 2), block_size: int = 5, mask_token_id: int = 9,
                          layers: int = 1, seed: int = 2, markov_rank: int = 8, markov_head_type: str = "vanilla",
                          confidence: bool = True, with_markov: bool = True) -> Path:
    """DeepSpec: the target's Qwen3 config copied with the DSpark fields; target_layer_ids in
    DeepSpec's convention (-1: embeddings, i: output of layer i); its own embed_tokens and
    lm_head (copies of the target's, as DeepSpec initialises them)."""
    gen = torch.Generator().manual_seed(seed)
    fields = decoder_fields(target, layers)
    config = {**fields, "architectures": ["Qwen3DSparkModel"], "block_size": block_size,
              "num_target_layers": target.config.num_hidden_layers, "mask_token_id": mask_token_id,
              "target_layer_ids": list(layer_ids), "num_anchors": 512, "tie_word_embeddings": False,
              "markov_rank": markov_rank, "markov_head_type": markov_head_type,
              "enable_confidence_head": confidence, "confidence_head_with_markov": with_markov}
    tensors = dense_tensors(gen, fields, len(layer_ids), target.config.hidden_size)
    tensors["embed_tokens.weight"] = target.get_input_embeddings().weight.detach().clone()
    tensors["lm_head.weight"] = target.get_output_embeddings().weight.detach().clone()
    vocab = target.config.vocab_size
    tensors.update(_markov_tensors(gen, fields["hidden_size"], vocab, vocab, markov_rank, markov_head_type,
                                   confidence, with_markov))
    return _write(folder, config, tensors)


def write_speculators_dspark(folder: Path, target, *, layer_ids=(0, 3), block_size: int = 4, mask_token_id: int = 11,
                             layers: int = 1, seed: int = 4, markov_rank: int = 6, markov_head_type: str = "rnn",
                             confidence: bool = True, with_markov: bool = False, draft_vocab: int | None = 100) -> Path:
    """speculators DSpark: the speculators DFlash fields plus markov_rank/markov_head_type and the
    confidence head; W1 over the target vocabulary, W2 over the draft one."""
    gen = torch.Generator().manual_seed(seed)
    fields = decoder_fields(target, layers)
    tensors = dense_tensors(gen, fields, len(layer_ids), target.config.hidden_size)
    if draft_vocab:
        tensors.update(_reduced_head(gen, target, draft_vocab))
    tensors.update(_markov_tensors(gen, fields["hidden_size"], target.config.vocab_size,
                                   draft_vocab or target.config.vocab_size, markov_rank, markov_head_type,
                                   confidence, with_markov))
    config = _speculators("dspark", target, fields, layer_ids, block_size, mask_token_id, draft_vocab, {
        "sample_from_anchor": True, "markov_rank": markov_rank, "markov_head_type": markov_head_type,
        "enable_confidence_head": confidence, "confidence_head_with_markov": with_markov})
    return _write(folder, config, tensors)


# -- builds ----------------------------------------------------------------------------------

PROMPTS = ["The lighthouse keeper", "def merge(a, b):\n    return", "1, 2, 3, 4,", "x"]


def recipe(*drafters: dict, max_draft: int = 3) -> dict:
    return {"name": "heads", "target": TARGET, "drafters": list(drafters), "shapes": SHAPES,
            "draft": {"tile": 128, "max_draft": max_draft}}


def build(raw: dict, base: Path, out: Path) -> Path:
    """A whole engine directory (target + heads), as `specexport build` makes it."""
    from specexport.exporter.builder import build_recipe
    from specexport.exporter.recipe import parse_recipe
    from specexport.progress import Reporter

    build_recipe(parse_recipe(raw, "recipe"), base, out, False, Reporter(quiet=True))
    return out


def drafts_by_reference(pipe, drafter: str, prompt: str, new_tokens: int = 12) -> list[tuple]:
    """Greedy decode with the head, recording every proposal: [(the committed context it was
    drafted after, the drafts, the depth asked for, the confidence products or None)]."""
    chosen = pipe.drafter(drafter)
    seen = []
    propose = chosen.propose

    def spy(rows, budget):  # one slot: generate's
        drafts = propose(rows, budget)
        ks = budget.depths
        if ks[0] > 0:
            products = getattr(chosen.slots[0], "last_confidence", None) if hasattr(chosen, "slots") else None
            seen.append((np.array(rows[0].context), np.array(drafts[0].tokens), ks[0],
                         None if products is None else np.array(products)))
        return drafts

    chosen.propose = spy
    try:
        pipe.generate(prompt, drafter=drafter, max_new_tokens=new_tokens, adaptive=False)
    finally:
        del chosen.propose
    return seen
