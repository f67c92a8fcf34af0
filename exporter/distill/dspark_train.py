"""DSpark training and held-out scoring: DFlash's (dflash_train.py: anchors, the position-decayed
soft cross-entropy, block acceptance) with the anchor slot drafting (slot k = 0..B-1 drafts
position a+k+1 from the teacher's row a+k), the vanilla Markov head and the confidence head.

Markov head, teacher forcing: slot k's prev is the sequence's token at row a+k (prev_0 = the
anchor), the token the teacher's row a+k is conditioned on. Along a greedy response an accepted
draft is that very token, so while the drafts before slot k were accepted this is what the
runtime computes from its own drafts, and the held-out acceptance is the runtime's.

Confidence: DeepSpec's calibration target is that the running product conf_0 ... conf_k predicts
"drafts 0..k all accepted". We train the factors: conf_k by binary cross-entropy toward "slot
k's argmax is the teacher's argmax", only over blocks whose slots < k were right (and whose
tokens there are the teacher's argmax, so slot k's forced prev is the accepted draft), i.e.
conf_k -> P(slot k right | slots < k right), whose product over slots is P(slots 0..k right).
The confidence head reads detached features: its loss fits the readout, not the drafter.

Held-out: DFlash's figures, the loss including the confidence BCE, and ``confidence``: the mean
conf_k over the greedy held-out slots the runtime reaches (slots < k right) that were right and
that were wrong, and their BCE.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specexport.exporter.distill import dflash_train
from specexport.exporter.distill.dflash_train import Scored, Tally, _rows, slot_rows, soft_ce
from specexport.exporter.distill.dspark_model import DSparkDraft
from specexport.exporter.distill.eagle3_train import Batch


@dataclass
class DSparkScored(Scored):
    conf: torch.Tensor  # [B, N, S] conf_k (probabilities)
    right: torch.Tensor  # [B, N, S] bool: slot k's argmax is the teacher's argmax
    reached: torch.Tensor  # [B, N, S] bool: slots < k right (the slots the confidence loss counts)


def _reached(right: torch.Tensor, forced: torch.Tensor, counted: torch.Tensor) -> torch.Tensor:
    """[B, N, S] bool: every slot before k right and its token the teacher's argmax (exclusive prefix)."""
    ok = (right & forced).float()
    before = torch.cat((torch.ones_like(ok[..., :1]), ok[..., :-1].cumprod(-1)), dim=-1)
    return before.bool() & counted


def block_loss(head: DSparkDraft, batch: Batch, anchors: torch.Tensor, valid: torch.Tensor, draft_of: torch.Tensor,
               gamma: float) -> DSparkScored:
    """The drafts' soft cross-entropy (Markov bias included) plus the confidence BCE (module doc)."""
    hidden = head(batch.tok, batch.aux, anchors)  # [B, N, S, H]
    rows = slot_rows(anchors, head.drafts)  # [B, N, S]
    prev = _rows(batch.tok, rows)  # [B, N, S] teacher forcing: the sequence's token before each draft
    logits = head.draft_logits(hidden, prev).float()  # [B, N, S, V_d]
    ce, mask = soft_ce(batch, logits, rows, valid, draft_of, gamma)
    amax = _rows(batch.amax, rows)  # [B, N, S] target ids
    wanted = draft_of[amax.clamp(min=0)]  # -1: the target's argmax is outside the draft vocabulary
    counted = valid.unsqueeze(-1) & _rows(batch.resp, rows) & (amax >= 0)  # a draft the runtime could make
    right = (logits.argmax(-1) == wanted) & (wanted >= 0) & counted
    reached = _reached(right, _rows(batch.tok, rows + 1) == amax, counted)
    logit = head.confidence_logit(hidden.detach(), prev).float()  # [B, N, S]
    bce = (F.binary_cross_entropy_with_logits(logit[reached], right[reached].float()) if bool(reached.any())
           else logit.sum() * 0.0)
    return DSparkScored(ce + bce, logits, rows, mask, torch.sigmoid(logit), right, reached)


class ConfidenceTally(Tally):
    """conf_k of the held-out greedy slots the runtime reaches, split by whether slot k was right."""

    def __init__(self):
        self.conf: list[torch.Tensor] = []
        self.right: list[torch.Tensor] = []

    def add(self, scored: DSparkScored, full: torch.Tensor, dd: int) -> None:
        keep = scored.reached[..., :dd] & full.unsqueeze(-1)  # [B, N, dd]
        self.conf.append(scored.conf[..., :dd][keep].float().cpu())
        self.right.append(scored.right[..., :dd][keep].cpu())

    def summary(self) -> dict:
        conf = torch.cat(self.conf) if self.conf else torch.zeros(0)
        right = torch.cat(self.right) if self.right else torch.zeros(0, dtype=torch.bool)
        mean = lambda t: round(float(t.mean()), 4) if len(t) else None  # noqa: E731
        bce = F.binary_cross_entropy(conf.clamp(1e-6, 1 - 1e-6), right.float()) if len(conf) else None
        return {"confidence": {"right": mean(conf[right]), "wrong": mean(conf[~right]), "slots": len(conf),
                               "bce": round(float(bce), 5) if bce is not None else None}}


def train_step(*args, **kwargs) -> float:
    """dflash_train.train_step with the DSpark loss."""
    return dflash_train.train_step(*args, **kwargs, loss_fn=block_loss)


def evaluate(*args, **kwargs) -> dict:
    """dflash_train.evaluate with the DSpark loss and the confidence figures."""
    return dflash_train.evaluate(*args, **kwargs, loss_fn=block_loss, tally=ConfidenceTally())
