"""EAGLE-3 training and held-out scoring over the teacher's rows.

Loss (per unrolled step j, weight 0.8^j): soft cross-entropy of the head's draft-vocabulary
distribution against the target's restricted top-K distribution, over positions whose next
token is a response token and whose target argmax is in the draft vocabulary.

Held-out score: the same loss, and greedy chains of D drafts from every anchor of the target's
own greedy held-out responses. Along such a response the token fed at step j is the target's
argmax, so while every earlier draft was accepted the unrolled chain is exactly what the
runtime drafts: a draft is accepted when it equals the target's argmax. Per position: the
chance that draft j is accepted given drafts < j were; E[L] = 1 + E[accepted drafts].
"""

from __future__ import annotations

import math
import random
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from specexport.exporter.distill.data import Sequences
from specexport.exporter.distill.eagle3_model import Eagle3Draft
from specexport.exporter.distill.teacher import Teacher

DECAY = 0.8  # loss weight of unrolled step j: DECAY**j


@dataclass
class Batch:
    """One batch of right-padded sequences, W = T_max + steps + 1 columns (pad columns: resp False)."""

    tok: torch.Tensor  # [B, W] token ids
    aux: torch.Tensor  # [B, W, n·H] the target's taps
    top_idx: torch.Tensor  # [B, W, K] draft ids of the target's next-token top K
    top_p: torch.Tensor  # [B, W, K] their renormalised probabilities
    amax: torch.Tensor  # [B, W] the target's argmax (target ids; -1 on pad)
    resp: torch.Tensor  # [B, W] bool: the NEXT token is a response token
    greedy: torch.Tensor  # [B] bool: the target's own greedy response
    rows: int  # R = T_max - 1 anchor rows


def make_batches(members: list[int], lengths: list[int], budget: int, rng: random.Random) -> list[list[int]]:
    """Members in batches of similar lengths under a padded-token budget, in random order."""
    members = members[:]
    rng.shuffle(members)
    out: list[list[int]] = []
    group = 64 * max(1, budget // 64)
    for g in range(0, len(members), group):
        cur: list[int] = []
        for i in sorted(members[g : g + group], key=lambda i: lengths[i]):
            if cur and (len(cur) + 1) * lengths[i] > budget:  # sorted: lengths[i] is the longest
                out.append(cur)
                cur = []
            cur.append(i)
        if cur:
            out.append(cur)
    rng.shuffle(out)
    return out


def assemble(teacher: Teacher, seqs: Sequences, members: list[int], steps: int, device: torch.device) -> Batch:
    rows = teacher.rows(seqs, members)
    tm = max(len(seqs.ids[i]) for i in members)
    b, w = len(members), tm + steps + 1
    width, k = rows[0]["aux"].shape[1], rows[0]["top_idx"].shape[1]
    tok = torch.zeros(b, w, dtype=torch.long)
    aux = torch.zeros(b, w, width, dtype=rows[0]["aux"].dtype)
    top_idx = torch.zeros(b, w, k, dtype=torch.long)
    top_p = torch.zeros(b, w, k)
    amax = torch.full((b, w), -1, dtype=torch.long)
    resp = torch.zeros(b, w, dtype=torch.bool)
    for r, (i, row) in enumerate(zip(members, rows)):
        n = len(seqs.ids[i])
        tok[r, :n] = torch.from_numpy(seqs.ids[i])
        aux[r, :n], top_idx[r, :n], top_p[r, :n], amax[r, :n] = row["aux"], row["top_idx"], row["top_p"], row["amax"]
        resp[r, seqs.start[i] - 1 : n - 1] = True
    greedy = torch.tensor([seqs.greedy[i] for i in members])
    move = lambda t: t.to(device, non_blocking=True)  # noqa: E731
    return Batch(move(tok), move(aux), move(top_idx), move(top_p), move(amax), move(resp), move(greedy), tm - 1)


def _unroll(head: Eagle3Draft, batch: Batch, steps: int) -> list[torch.Tensor]:
    r = batch.rows
    return head.unroll(batch.tok[:, 1 : r + steps], batch.aux[:, :r], steps)  # steps of [B, R, H]


def batch_loss(head: Eagle3Draft, batch: Batch, steps: int, draft_of: torch.Tensor,
               outs: list[torch.Tensor] | None = None) -> tuple[torch.Tensor, list[float]]:
    """(the weighted soft cross-entropy, top-1 agreement per step) of one batch."""
    outs = outs if outs is not None else _unroll(head, batch, steps)
    r = batch.rows
    total = torch.zeros((), device=batch.tok.device)
    accs = []
    for j in range(steps):
        cols = slice(1 + j, 1 + j + r)  # the teacher's row for the token row p predicts at step j
        amax = batch.amax[:, cols]  # [B, R]
        mask = batch.resp[:, cols] & (draft_of[amax.clamp(min=0)] >= 0) & (amax >= 0)  # [B, R]
        if not bool(mask.any()):
            continue
        logp = torch.log_softmax(head.lm_head(outs[j][mask]).float(), dim=-1)  # [n, V_draft]
        picked = logp.gather(1, batch.top_idx[:, cols][mask])  # [n, K]
        total = total + DECAY**j * -(batch.top_p[:, cols][mask] * picked).sum(-1).mean()
        with torch.no_grad():
            accs.append(float((logp.argmax(-1) == draft_of[amax[mask]]).float().mean()))
    return total, accs


def autocast(device: torch.device):
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()


def train_step(head: Eagle3Draft, opt: torch.optim.Optimizer, batch: Batch, steps: int, draft_of: torch.Tensor,
               lr: float, device: torch.device) -> float:
    """One optimizer step (AdamW at ``lr``, gradients clipped to norm 0.5); returns the loss."""
    for group in opt.param_groups:
        group["lr"] = lr
    with autocast(device):
        loss, _ = batch_loss(head, batch, steps, draft_of)
    opt.zero_grad(set_to_none=True)
    if loss.requires_grad:  # a batch without a trainable position has nothing to learn from
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 0.5)
        opt.step()
    return float(loss.detach())


@torch.no_grad()
def evaluate(head: Eagle3Draft, teacher: Teacher, seqs: Sequences, members: list[int], steps: int, d: int,
             draft_ids: torch.Tensor, draft_of: torch.Tensor, budget: int, device: torch.device) -> dict:
    """The held-out loss, and the acceptance of greedy chains of ``d`` drafts (see the module)."""
    was_training = head.training
    head.eval()
    losses, hits, agree = [], [], []
    lengths = [len(x) for x in seqs.ids]
    for members_b in make_batches(members, lengths, budget, random.Random(0)):
        batch = assemble(teacher, seqs, members_b, max(steps, d), device)
        with autocast(device):
            outs = _unroll(head, batch, max(steps, d))
            loss, _ = batch_loss(head, batch, steps, draft_of, outs)
            r = batch.rows
            cols = [slice(1 + j, 1 + j + r) for j in range(d)]
            preds = [draft_ids[head.lm_head(outs[j]).argmax(-1)] for j in range(d)]  # d of [B, R] target ids
        losses.append(float(loss) * len(members_b))
        valid = torch.stack([batch.resp[:, c] for c in cols]).all(0) & batch.greedy[:, None]  # [B, R]
        correct = torch.stack([p == batch.amax[:, c] for p, c in zip(preds, cols)], dim=-1)  # [B, R, d]
        hits.append(correct[valid].cpu())
        follows = batch.resp[:, :r] & batch.greedy[:, None]  # the target's argmax is the next token?
        agree.append((batch.amax[:, :r] == batch.tok[:, 1 : r + 1])[follows].cpu())
    head.train(was_training)
    result: dict = {"loss": round(sum(losses) / max(len(members), 1), 5), "D": d}
    return held_out_summary(result, hits, agree, d)


def learning_rate(base: float, step: int, warmup: int, frac: float, floor: float = 0.05) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine from ``base`` to ``floor``·base as the
    run's progress ``frac`` goes 0 -> 1."""
    frac = min(max(frac, 0.0), 1.0)
    return base * min(1.0, (step + 1) / max(warmup, 1)) * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * frac)))


def held_out_summary(result: dict, hits: list, agree: list, d: int) -> dict:
    """Add to ``result`` what the held-out drafts say: per-position acceptance, top-1, the E[L]
    they imply, and how often the target's argmax is the response's next token. ``hits``:
    [anchors, d] booleans per batch (draft j equals the target's argmax), ``agree``: booleans."""
    h = torch.cat(hits).float() if hits else torch.zeros(0, d)
    result["anchors"] = len(h)
    if len(h):
        chain = h.cumprod(dim=1).mean(0)  # [d] P(drafts 1..j all accepted)
        per_position = [float(chain[0])] + [float(chain[j] / chain[j - 1]) if chain[j - 1] > 0 else 0.0
                                            for j in range(1, d)]
        result.update(acceptance=[round(x, 4) for x in per_position], top1=[round(float(x), 4) for x in h.mean(0)],
                      expected_length=round(1 + float(chain.sum()), 4))
    else:
        result.update(acceptance=None, top1=None, expected_length=None)
    a = torch.cat(agree) if agree else torch.zeros(0, dtype=torch.bool)
    result["teacher_agreement"] = round(float(a.float().mean()), 4) if len(a) else None
    return result
