"""DFlash (z-lab/dflash): a block drafter over the target's hidden states, from its checkpoint.

Layouts (detected from config.json, or the recipe's ``layout``):

- ``z-lab``: a Qwen3 config at the top level plus ``block_size`` and
  ``dflash_config: {target_layer_ids, mask_token_id}`` (older files: at the top level). Layer
  ids mean the OUTPUT of layer i: transformers' hidden_states[i + 1]. No embedding or output
  head: the target's serve. Slot 0 is the anchor; slots 1..block_size-1 draft.
- ``speculators`` (vllm-project/speculators, ``speculators_model_type: dflash``):
  ``transformer_layer_config``, ``aux_hidden_state_layer_ids`` (the stream entering layer i:
  hidden_states[i]), ``mask_token_id``, ``block_size``, ``sample_from_anchor`` (default false),
  and with ``draft_vocab_size`` below the target's a reduced ``lm_head.weight`` and ``d2t``
  (target id = i + d2t[i]).

Weights (both): ``layers.{i}.*`` (dense Qwen3/Llama layers, q_norm/k_norm when present),
``fc.weight`` [H, n_taps·H_target], ``hidden_norm.weight``, ``norm.weight``; optionally
``mask_embedding`` [H] in place of the mask token's embedding. The graph and its math:
exporter/heads/block.py.
"""

from __future__ import annotations

from pathlib import Path

from specexport.exporter.heads.block import (
    BlockHead,
    Checkpoint,
    LayoutFacts,
    config_int,
    detect_layout,
    layer_ids,
    read_block,
    read_checkpoint,
    speculators_facts,
)

# dflash_config fields of newer z-lab models that change the math; refused rather than ignored
_UNSUPPORTED = {"input_embedding_scale": 1.0, "output_multiplier": 1.0, "final_logit_softcapping": None,
                "conv_kernel_size": None, "selector_rank": None}


def zlab_facts(ckpt: Checkpoint, override: list[int] | None) -> LayoutFacts:
    config = ckpt.config
    extra = config.get("dflash_config") or {}
    if not isinstance(extra, dict):
        raise ckpt.bad("'dflash_config' must be an object")

    def value(key, default=None):
        return extra.get(key, config.get(key, default))

    for key, neutral in _UNSUPPORTED.items():
        if value(key, neutral) not in (neutral, 0):
            raise ckpt.bad(f"'{key}' = {value(key)!r} is not supported (DFlash2-style heads are not exportable yet)")
    ids = layer_ids(ckpt, value("target_layer_ids"), "dflash_config.target_layer_ids", override)
    return LayoutFacts(config, ids, lambda i: i + 1, config_int(ckpt, {"block_size": value("block_size")}, "block_size",
                                                                low=2),
                       value("mask_token_id"), from_anchor=False)


# layout -> (recognises config.json, reads its facts); auto detection tries them in order
LAYOUTS = {
    "speculators": (lambda c: c.get("speculators_model_type") == "dflash",
                    lambda ckpt, override: speculators_facts(ckpt, "dflash", override)),
    "z-lab": (lambda c: "dflash_config" in c or "DFlashDraftModel" in (c.get("architectures") or []), zlab_facts),
}


def load(spec, target, base: Path, origin: str) -> BlockHead:
    folder = spec.path if spec.path.is_absolute() else base / spec.path
    ckpt = read_checkpoint(folder, origin)
    if ckpt.config.get("speculators_model_type") not in (None, "dflash"):
        raise ckpt.bad(f"speculators_model_type is '{ckpt.config['speculators_model_type']}', not dflash "
                       "(use the matching drafter kind)")
    layout = detect_layout(ckpt, "dflash", spec.layout, {name: recognise for name, (recognise, _) in LAYOUTS.items()})
    facts = LAYOUTS[layout][1](ckpt, spec.layer_ids)
    return BlockHead(read_block(ckpt, "dflash", layout, facts, target), target, origin)
