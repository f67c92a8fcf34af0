"""DFlash training and held-out scoring over the teacher's rows (teacher.py, batches of
eagle3_train.py).

Blocks: each step draws up to ``anchors`` random anchor positions a per sequence among the
response's committed tokens (a >= the response's start, and a+1 still in the sequence): the
block is [token a, mask × (B-1)], its context the taps of rows < a, as the runtime drafts after
committing token a. Slot k (1..B-1) drafts position a+k; its target is the teacher's row a+k-1
(the target's distribution of token a+k given the real prefix), restricted to the draft
vocabulary's top K as for EAGLE-3.

Loss: soft cross-entropy per slot, weighted w_k = exp(-(k-1)/gamma) (earlier slots weigh more:
a late draft only counts once every earlier one was accepted), averaged over the slots whose
position is a response token and whose target argmax is in the draft vocabulary.

Held-out score: every anchor of the target's own greedy held-out responses whose first D
slots lie in the response; a greedy block draft at slot k is accepted when it equals the
target's argmax at row a+k-1. Along the target's own greedy response that is exactly the
runtime's rule (the context is the committed tokens, which are the target's argmax chain).
Per position: P(draft k accepted | drafts < k were); E[L] = 1 + E[accepted drafts], at the
plan's D (or the block's B-1 drafts when fewer).

DSpark (dspark_train.py) reuses all of it through ``loss_fn`` and a ``Tally``: its anchor slot
drafts too (slot k = 0..B-1 drafts a+k+1 from row a+k: ``slot_rows`` covers both).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import torch

from specexport.exporter.distill.data import Sequences
from specexport.exporter.distill.dflash_model import DFlashDraft
from specexport.exporter.distill.eagle3_train import Batch, assemble, autocast, held_out_summary, make_batches
from specexport.exporter.distill.teacher import Teacher


def default_gamma(block_size: int) -> float:
    """The DFlash paper's decay per block size (16: 7, 10: 5, 8: 4), else about half the drafts."""
    return {16: 7.0, 10: 5.0, 8: 4.0}.get(block_size, max(1.0, (block_size - 1) / 2))


def anchor_ok(batch: Batch) -> torch.Tensor:
    """[B, W] bool: position a may anchor a block (a >= the response's start, a+1 in the sequence)."""
    ok = batch.resp.clone()
    ok[:, 1:] &= batch.resp[:, :-1]  # resp[a-1]: a-1 >= start-1
    ok[:, 0] = False
    return ok


def sample_anchors(batch: Batch, n: int, gen: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to ``n`` random valid anchors per row: ([B, N] positions, [B, N] valid)."""
    ok = anchor_ok(batch)[:, : batch.rows + 1]
    n = max(1, min(n, ok.shape[1]))
    noise = torch.rand(ok.shape, generator=gen).to(ok.device)
    keys = noise.masked_fill(~ok, -1.0)
    picked = keys.topk(n, dim=1).indices  # [B, N]
    valid = ok.gather(1, picked)
    return picked.masked_fill(~valid, 1), valid


def slot_rows(anchors: torch.Tensor, drafts: int) -> torch.Tensor:
    """[B, N, drafts] the teacher rows of the drafting slots: a+i for slot i (DFlash's slot k = i+1
    drafts a+k, predicted by row a+k-1; DSpark's slot k = i drafts a+k+1, row a+k)."""
    return anchors.unsqueeze(-1) + torch.arange(drafts, device=anchors.device)


def _rows(t: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """t [B, W, ...] gathered at rows [B, N, S] -> [B, N, S, ...]."""
    b = torch.arange(t.shape[0], device=t.device).view(-1, 1, 1)
    return t[b, rows]


@dataclass
class Scored:
    """One batch of blocks through the head and the loss."""

    loss: torch.Tensor  # the weighted soft cross-entropy (DSpark: plus the confidence BCE)
    logits: torch.Tensor  # [B, N, S, V_d] draft logits
    rows: torch.Tensor  # [B, N, S] teacher rows of the slots
    mask: torch.Tensor  # [B, N, S] slots the loss counts


def soft_ce(batch: Batch, logits: torch.Tensor, rows: torch.Tensor, valid: torch.Tensor, draft_of: torch.Tensor,
            gamma: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(the weighted soft cross-entropy, [B, N, S] the slots it counts)."""
    amax = _rows(batch.amax, rows)  # [B, N, S]
    mask = valid.unsqueeze(-1) & _rows(batch.resp, rows) & (amax >= 0) & (draft_of[amax.clamp(min=0)] >= 0)
    k = torch.arange(rows.shape[-1], device=logits.device, dtype=torch.float32)
    weight = torch.exp(-k / gamma).view(1, 1, -1) * mask  # [B, N, S]
    logp = torch.log_softmax(logits, dim=-1)
    ce = -(_rows(batch.top_p, rows) * logp.gather(-1, _rows(batch.top_idx, rows))).sum(-1)  # [B, N, S]
    return (ce * weight).sum() / weight.sum().clamp(min=1e-6), mask


def block_loss(head: DFlashDraft, batch: Batch, anchors: torch.Tensor, valid: torch.Tensor, draft_of: torch.Tensor,
               gamma: float) -> Scored:
    hidden = head(batch.tok, batch.aux, anchors)  # [B, N, S, H]
    rows = slot_rows(anchors, head.drafts)
    logits = head.draft_logits(hidden, _rows(batch.tok, rows)).float()  # tok[row]: the token before the draft
    loss, mask = soft_ce(batch, logits, rows, valid, draft_of, gamma)
    return Scored(loss, logits, rows, mask)


LossFn = Callable[[DFlashDraft, Batch, torch.Tensor, torch.Tensor, torch.Tensor, float], Scored]


def train_step(head: DFlashDraft, opt: torch.optim.Optimizer, batch: Batch, anchors: int, draft_of: torch.Tensor,
               gamma: float, lr: float, device: torch.device, gen: torch.Generator | None = None,
               loss_fn: LossFn = block_loss) -> float:
    """One optimizer step (AdamW at ``lr``, gradients clipped to norm 0.5); returns the loss."""
    for group in opt.param_groups:
        group["lr"] = lr
    where, valid = sample_anchors(batch, anchors, gen)
    if not bool(valid.any()):
        return 0.0
    with autocast(device):
        loss = loss_fn(head, batch, where, valid, draft_of, gamma).loss
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(head.trainable(), 0.5)
    opt.step()
    return float(loss.detach())


class Tally:
    """Extra held-out figures of a head kind: ``add`` per scored chunk, ``summary`` at the end."""

    def add(self, scored: Scored, full: torch.Tensor, dd: int) -> None:
        pass

    def summary(self) -> dict:
        return {}


@torch.no_grad()
def evaluate(head: DFlashDraft, teacher: Teacher, seqs: Sequences, members: list[int], d: int, anchors: int,
             draft_ids: torch.Tensor, draft_of: torch.Tensor, gamma: float, budget: int, device: torch.device,
             loss_fn: LossFn = block_loss, tally: Tally | None = None) -> dict:
    """The held-out loss (every anchor) and the acceptance of greedy block drafts (module doc)."""
    was_training = head.training
    head.eval()
    tally = tally or Tally()
    bs = head.block
    dd = max(1, min(d, head.drafts))
    loss_sum, weight_sum, hits, agree = 0.0, 0, [], []
    lengths = [len(x) for x in seqs.ids]
    for members_b in make_batches(members, lengths, budget, random.Random(0)):
        batch = assemble(teacher, seqs, members_b, bs, device)
        ok = anchor_ok(batch)
        positions = torch.arange(1, batch.rows + 1, device=device)
        for lo in range(0, len(positions), anchors):
            where = positions[lo : lo + anchors].unsqueeze(0).expand(len(members_b), -1).contiguous()  # [B, N]
            valid = ok.gather(1, where)
            if not bool(valid.any()):
                continue
            with autocast(device):
                scored = loss_fn(head, batch, where, valid, draft_of, gamma)
            n_valid = int(valid.sum())
            loss_sum += float(scored.loss) * n_valid
            weight_sum += n_valid
            pred = draft_ids[scored.logits[..., :dd, :].argmax(-1)]  # [B, N, dd] target ids
            rows = scored.rows[..., :dd]
            full = valid & _rows(batch.resp, rows).all(-1) & batch.greedy[:, None]  # [B, N]
            hits.append((pred == _rows(batch.amax, rows))[full].cpu())
            tally.add(scored, full, dd)
        follows = batch.resp[:, : batch.rows] & batch.greedy[:, None]
        agree.append((batch.amax[:, : batch.rows] == batch.tok[:, 1 : batch.rows + 1])[follows].cpu())
    head.train(was_training)
    result: dict = {"loss": round(loss_sum / max(weight_sum, 1), 5), "D": d, "block_size": bs}
    return held_out_summary(result, hits, agree, dd) | tally.summary()


def mask_token(seqs: Sequences, vocab: int, special: list[int]) -> int:
    """The mask token: the highest id no sequence uses and that is not a special token
    (the vocabulary's tail holds reserved tokens; its embedding is the target's, frozen)."""
    used = torch.zeros(vocab, dtype=torch.bool)
    for ids in seqs.ids:
        used[torch.from_numpy(ids)] = True
    for s in special:
        if 0 <= s < vocab:
            used[s] = True
    free = (~used).nonzero().flatten()
    return int(free[-1]) if len(free) else vocab - 1

