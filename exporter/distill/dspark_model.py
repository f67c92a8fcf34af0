"""The DSpark head being trained: the DFlash block (dflash_model.py) with ``sample_from_anchor``
(the anchor slot drafts too: slot k drafts position a+k+1, a block of B drafts B tokens), plus
DeepSpec's two light heads, in the speculators ``dspark`` layout and the math of the build's
reference (``block_reference.reference_markov``, runtime/block_drafter.py ``BlockHeads``):

    e_k      = W1[prev_k]                         markov_head.markov_w1 [V_target, r]
    logits_k = lm_head(h_k) + W2 e_k              markov_head.markov_w2 [V_draft, r] (vanilla)
    conf_k   = sigmoid(proj([h_k; e_k]))          confidence_head.proj [1, H + r] + bias
                                                  (confidence_head_with_markov: true)

prev_0 is the anchor and prev_k the token at slot k-1 (the runtime: its own draft; training:
the sequence's token, teacher forcing). h_k is the block's final-normed hidden state.
"""

from __future__ import annotations

import torch
from torch import nn

from specexport.exporter.distill import dflash_model
from specexport.exporter.distill.dflash_model import DFlashDraft

MARKOV_KIND = "vanilla"  # the Markov head trained here (the loader also reads gated and rnn)


def head_config(target_cfg, taps: tuple[int, ...], draft_vocab: int, block_size: int, layers: int,
                mask_token_id: int, markov_rank: int) -> dict:
    """config.json in the speculators DSpark layout: the DFlash fields plus the two heads'."""
    config = dflash_model.head_config(target_cfg, taps, draft_vocab, block_size, layers, mask_token_id)
    config.update({
        "speculators_model_type": "dspark", "architectures": ["DSparkSpeculator"], "sample_from_anchor": True,
        "markov_rank": int(markov_rank), "markov_head_type": MARKOV_KIND, "enable_confidence_head": True,
        "confidence_head_with_markov": True,
    })
    return config


class MarkovHead(nn.Module):
    def __init__(self, vocab: int, draft_vocab: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab, rank)  # weight [V_t, r]: N(0, 1)
        self.markov_w2 = nn.Linear(rank, draft_vocab, bias=False)  # weight [V_d, r]
        nn.init.zeros_(self.markov_w2.weight)  # untrained, the head drafts as the parallel block alone


class ConfidenceHead(nn.Module):
    def __init__(self, features: int):
        super().__init__()
        self.proj = nn.Linear(features, 1)  # weight [1, H + r], bias [1]
        nn.init.zeros_(self.proj.weight)  # untrained: 0.5 everywhere
        nn.init.zeros_(self.proj.bias)


class DSparkDraft(DFlashDraft):
    """The trainable DSpark head; parameter names are the checkpoint's (``checkpoint_names``)."""

    def __init__(self, config: dict, embed: torch.Tensor, lm_head: torch.Tensor,
                 rope: tuple[torch.Tensor, torch.Tensor]):
        super().__init__(config, embed, lm_head, rope)
        rank, hidden = int(config["markov_rank"]), config["transformer_layer_config"]["hidden_size"]
        self.markov_head = MarkovHead(embed.shape[0], lm_head.shape[0], rank)
        self.confidence_head = ConfidenceHead(hidden + rank)

    def draft_logits(self, hidden: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """hidden [..., S, H], prev [..., S] target ids -> logits [..., S, V_d] (vanilla Markov bias)."""
        m = self.markov_head
        return self.lm_head(hidden) + m.markov_w2(m.markov_w1(prev))

    def confidence_logit(self, hidden: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """hidden [..., S, H], prev [..., S] -> [..., S] logit of conf_k (sigmoid of it: conf_k)."""
        feats = torch.cat((hidden, self.markov_head.markov_w1(prev).to(hidden.dtype)), dim=-1)  # [..., S, H + r]
        return self.confidence_head.proj(feats).squeeze(-1)
