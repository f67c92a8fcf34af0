"""DSpark (deepseek-ai/DeepSpec): DFlash's parallel block plus a light serial Markov head and a
confidence head, from its checkpoint.

The block is DFlash's (exporter/heads/block.py) with ``sample_from_anchor``: the anchor slot
drafts too, so slot k drafts the token at anchor position + k + 1 and a block of B drafts B
tokens. After the block graph, in numpy (runtime/block_drafter.py ``BlockHeads``), slot by slot
with prev_0 = the anchor, prev_k = the token drafted at slot k-1 (target ids), h_k the block's
final-normed hidden state at slot k and e_k = W1[prev_k] (rank r, ``markov_head.markov_w1``
[V_target, r]; ``markov_w2`` [V_draft, r]):

    vanilla  logits_k = lm_head(h_k) + W2 e_k
    gated    logits_k = lm_head(h_k) + W2 (sigmoid(gate_proj([h_k; e_k])) * e_k)
    rnn      (a, c, o) = joint_proj([s; e_k; h_k]);  s <- sig(a) s + (1 - sig(a)) tanh(c)  (s_0 = 0)
             logits_k = lm_head(h_k) + W2 tanh(o)
    conf_k   = sigmoid(confidence_head.proj([h_k; e_k]))   ([h_k] without confidence_head_with_markov)

The draft at slot k is drawn from logits_k (greedy: its argmax), and prod_{j<=k} conf_j
predicts that drafts 0..k are all accepted (DeepSpec's calibration target): with the recipe's
``confidence_threshold`` the draft stops where the product falls below it.

Layouts: ``deepspec`` (a Qwen3 config at the top level with ``target_layer_ids`` in DeepSpec's
convention: -1 the embeddings, i the output of layer i = hidden_states[i + 1];
``mask_token_id``, ``block_size``, ``markov_rank``, ``markov_head_type``,
``enable_confidence_head``, ``confidence_head_with_markov``; its own ``embed_tokens`` and
``lm_head``) and ``speculators`` (``speculators_model_type: dspark``, the speculators DFlash
fields plus the Markov and confidence ones; ``sample_from_anchor`` defaults to true).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from specexport.exporter.heads.block import (
    BlockHead,
    BlockSpec,
    Checkpoint,
    LayoutFacts,
    config_int,
    detect_layout,
    layer_ids,
    read_block,
    read_checkpoint,
    speculators_facts,
)

MARKOV_KINDS = ("vanilla", "gated", "rnn")


def deepspec_facts(ckpt: Checkpoint, override: list[int] | None) -> LayoutFacts:
    config = ckpt.config
    ids = layer_ids(ckpt, config.get("target_layer_ids"), "target_layer_ids", override)
    return LayoutFacts(config, ids, lambda i: 0 if i == -1 else i + 1, config_int(ckpt, config, "block_size", low=1),
                       config.get("mask_token_id"), from_anchor=True)


LAYOUTS = {
    "speculators": (lambda c: c.get("speculators_model_type") == "dspark",
                    lambda ckpt, override: speculators_facts(ckpt, "dspark", override)),
    "deepspec": (lambda c: "markov_rank" in c and "target_layer_ids" in c
                 or any("DSpark" in a for a in c.get("architectures") or []), deepspec_facts),
}


def read_heads(spec: BlockSpec) -> None:
    """The Markov and confidence heads' arrays (numpy, for the runtime) and their params."""
    ckpt, config = spec.ckpt, spec.ckpt.config
    h, vocab, draft_vocab = spec.dense.hidden, spec.embed.shape[0], spec.lm_head.shape[0]
    rank = config_int(ckpt, config, "markov_rank", 0)
    arrays: dict[str, np.ndarray] = {}
    markov = None
    if rank:
        markov = str(config.get("markov_head_type", "vanilla")).lower()
        if markov not in MARKOV_KINDS:
            raise ckpt.bad(f"markov_head_type '{markov}' is not one of {', '.join(MARKOV_KINDS)}")
        arrays["markov_w1"] = ckpt.get("markov_head.markov_w1.weight", (vocab, rank))
        arrays["markov_w2"] = ckpt.get("markov_head.markov_w2.weight", (draft_vocab, rank))
        if markov == "gated":
            arrays["markov_gate_w"] = ckpt.get("markov_head.gate_proj.weight", (rank, h + rank))
            arrays["markov_gate_b"] = ckpt.get("markov_head.gate_proj.bias", (rank,))
        if markov == "rnn":
            arrays["markov_joint_w"] = ckpt.get("markov_head.joint_proj.weight", (3 * rank, 2 * rank + h))
            arrays["markov_joint_b"] = ckpt.get("markov_head.joint_proj.bias", (3 * rank,))
    with_markov = bool(config.get("confidence_head_with_markov", False))
    if config.get("enable_confidence_head", False):
        if with_markov and not rank:
            raise ckpt.bad("confidence_head_with_markov needs a Markov head (markov_rank > 0)")
        arrays["confidence_w"] = ckpt.get("confidence_head.proj.weight", (1, h + (rank if with_markov else 0)))[0]
        arrays["confidence_b"] = ckpt.get("confidence_head.proj.bias", (1,))
    spec.head_arrays = {k: np.ascontiguousarray(v.float().numpy()) for k, v in arrays.items()}
    spec.params.update(markov=markov, confidence_with_markov=with_markov)


def load(spec, target, base: Path, origin: str) -> BlockHead:
    folder = spec.path if spec.path.is_absolute() else base / spec.path
    ckpt = read_checkpoint(folder, origin)
    if ckpt.config.get("speculators_model_type") not in (None, "dspark"):
        raise ckpt.bad(f"speculators_model_type is '{ckpt.config['speculators_model_type']}', not dspark "
                       "(use the matching drafter kind)")
    layout = detect_layout(ckpt, "dspark", spec.layout, {name: recognise for name, (recognise, _) in LAYOUTS.items()})
    facts = LAYOUTS[layout][1](ckpt, spec.layer_ids)
    block = read_block(ckpt, "dspark", layout, facts, target)
    read_heads(block)
    block.params["confidence_threshold"] = spec.confidence_threshold
    return BlockHead(block, target, origin)
