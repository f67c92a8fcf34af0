"""Train an EAGLE-3 head for SmolLM2-135M-Instruct from the target's own generations, in one
timed run (CUDA or CPU), on torch + numpy alone. See README.md beside this file.

1. load the target from the GGUF (our own reader and forward, checked against transformers by
   check_cpu.py); 2. batched generation of responses to the synthesized prompts (greedy and
   temperature sampling, until EOS or MAX_NEW); 3. the draft vocabulary: the DRAFT_VOCAB most
   frequent response tokens (d2t/t2d); 4. one teacher pass over prompt+response: the three taps
   [2, L//2, L-3] and the target's top-TOPK next-token distribution restricted to the draft
   vocabulary; 5. training with training-time test (TTT_STEPS unrolled steps, loss weights
   0.8^j, soft labels, masked to response tokens whose target argmax the head can draft),
   AdamW, warmup + cosine over the time budget; 6. held-out greedy responses scored every
   checkpoint: per-step acceptance and E[L] of a greedy chain of EVAL_D drafts.
Outputs under $OUT: head_main.npz, head_lm.npz (fp16 weights + d2t/t2d), config.json,
eval.json, train_log.txt (to_checkpoint.py turns them into the SafeAILab checkpoint).
"""

from __future__ import annotations

import json
import math
import os
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from head import Eagle3Head  # noqa: E402
from llama import Llama, load_weights  # noqa: E402

T0 = time.time()


def setting(name: str, default, cast=None):
    raw = os.environ.get(name)
    return default if raw in (None, "") else (cast or type(default))(raw)


S = {
    "gguf": setting("GGUF", ".device/model.gguf"), "prompts": setting("PROMPTS", ".device/b/prompts.npz"),
    "out": setting("OUT", "/tmp/eagle3_out"), "device": setting("DEVICE", "cuda" if torch.cuda.is_available() else "cpu"),
    "job_minutes": setting("JOB_MINUTES", 7.5), "gen_minutes": setting("GEN_MINUTES", 2.5),
    "final_reserve_s": setting("FINAL_RESERVE_S", 25.0), "ckpt_seconds": setting("CKPT_SECONDS", 60.0),
    "max_prompts": setting("MAX_PROMPTS", 100000), "max_new": setting("MAX_NEW", 256),
    "gen_batch": setting("GEN_BATCH", 2048), "sample_frac": setting("SAMPLE_FRAC", 2.0),
    "temperature": setting("TEMPERATURE", 0.7), "eos": setting("EOS_IDS", "2"),
    "draft_vocab": setting("DRAFT_VOCAB", 8192), "topk": setting("TOPK", 64),
    "ttt_steps": setting("TTT_STEPS", 5), "eval_d": setting("EVAL_D", 5), "holdout": setting("HOLDOUT", 0.05),
    "teacher_tokens": setting("TEACHER_TOKENS", 32768), "train_tokens": setting("TRAIN_TOKENS", 24576),
    "lr": setting("LR", 1e-3), "warmup": setting("WARMUP", 100), "min_lr_frac": setting("MIN_LR_FRAC", 0.05),
    "train_steps": setting("TRAIN_STEPS", 10**9), "eval_seqs_ckpt": setting("EVAL_SEQS_CKPT", 96),
    "tf32": setting("TF32", 1), "seed": setting("SEED", 0), "lm_init": setting("LM_INIT", "target"), "log_every": setting("LOG_EVERY", 50),
}
OUT = Path(S["out"])
OUT.mkdir(parents=True, exist_ok=True)
LOG = open(OUT / "train_log.txt", "a", buffering=1)


def log(msg: str) -> None:
    line = f"[{time.strftime('%H:%M:%S')} +{time.time() - T0:6.1f}s] {msg}"
    print(line, flush=True)
    LOG.write(line + "\n")


def sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


# -- data -----------------------------------------------------------------------------------


def load_prompts(path: str, limit: int, rng: random.Random) -> list[np.ndarray]:
    d = np.load(path)
    ids, off = d["ids"], d["offsets"]
    prompts = [ids[off[i] : off[i + 1]].astype(np.int64) for i in range(len(off) - 1)]
    rng.shuffle(prompts)
    return prompts[:limit]


def generate_all(model: Llama, prompts, holdout: set[int], rng: random.Random, dev) -> list[dict]:
    """Responses by the target: every prompt greedy, and SAMPLE_FRAC sampled responses per
    training prompt (2.0: two each; 0.5: one for half of them). Held-out batches first (the eval
    needs them); the rest interleaved, cut at the generation deadline."""
    eos = {int(x) for x in str(S["eos"]).split(",")}
    train = [i for i in range(len(prompts)) if i not in holdout]
    whole, part = int(S["sample_frac"]), S["sample_frac"] % 1
    passes = [train] * whole + ([sorted(rng.sample(train, int(len(train) * part)))] if part else [])

    def batches(indices, temperature):
        order = sorted(indices, key=lambda i: len(prompts[i]))
        return [(order[k : k + S["gen_batch"]], temperature) for k in range(0, len(order), S["gen_batch"])]

    rest = batches(train, 0.0) + [b for sampled in passes for b in batches(sampled, S["temperature"])]
    rng.shuffle(rest)
    plan = batches(sorted(holdout), 0.0) + rest
    deadline = T0 + 60 * S["gen_minutes"]
    gen = torch.Generator(device=dev).manual_seed(S["seed"])
    seqs, new_tokens, t_start = [], 0, time.time()
    for n, (indices, temperature) in enumerate(plan):
        if time.time() > deadline and n > 0:
            log(f"generation: deadline, {len(plan) - n} of {len(plan)} batches left out")
            break
        t = time.time()
        responses = model.generate([prompts[i] for i in indices], S["max_new"], temperature, eos, gen,
                                   deadline=deadline, clock=time.time)
        for i, r in zip(indices, responses):
            p = prompts[i]
            seqs.append({"ids": np.concatenate((p, r)).astype(np.int64), "start": len(p), "holdout": i in holdout,
                         "greedy": temperature == 0, "eos": bool(len(r) and int(r[-1]) in eos), "prompt": i})
            new_tokens += len(r)
        sync(dev)
        log(f"generation batch {n + 1}/{len(plan)}: {len(indices)} prompts, T={temperature}, "
            f"{sum(len(r) for r in responses) / len(responses):.0f} new tokens avg, {time.time() - t:.1f}s "
            f"(total {new_tokens} tokens, {new_tokens / (time.time() - t_start):.0f} tok/s)")
    return seqs


def choose_vocab(seqs: list[dict], vocab: int, n: int) -> tuple[np.ndarray, dict]:
    """The n most frequent response tokens of the training sequences (ties: lower id), sorted."""
    counts = np.zeros(vocab, dtype=np.int64)
    for s in seqs:
        if not s["holdout"]:
            np.add.at(counts, s["ids"][s["start"] :], 1)
    order = np.lexsort((np.arange(vocab), -counts))  # by count desc, then id
    total = max(int(counts.sum()), 1)
    coverage = {str(k): round(float(counts[order[:k]].sum()) / total, 5) for k in (4096, 8192, 12288, 16384, 32768)}
    return np.sort(order[:n]), coverage


class Data:
    """Flat per-token buffers (on the training device) over all sequences, row N a dummy pad:
    tok [N+1] ids; aux [N+1, 3H] bf16 taps; top_idx [N+1, K] draft ids and top_p [N+1, K] of the
    target's next-token distribution restricted to the draft vocabulary; amax [N+1] the target's
    argmax (full vocabulary); resp [N+1] bool: the NEXT token is a response token; inv [N+1]
    bool: amax is in the draft vocabulary."""

    def __init__(self, model: Llama, seqs: list[dict], draft_ids: np.ndarray, taps, dev):
        self.seqs = seqs
        lengths = np.array([len(s["ids"]) for s in seqs])
        self.offsets = np.concatenate(([0], np.cumsum(lengths)))
        n, k, width = int(self.offsets[-1]), S["topk"], len(taps) * model.cfg.hidden
        self.pad = n
        self.tok = torch.zeros(n + 1, dtype=torch.long, device=dev)
        self.aux = torch.zeros(n + 1, width, dtype=torch.bfloat16, device=dev)
        self.top_idx = torch.zeros(n + 1, k, dtype=torch.int16, device=dev)
        self.top_p = torch.zeros(n + 1, k, dtype=torch.float16, device=dev)
        self.amax = torch.full((n + 1,), -1, dtype=torch.long, device=dev)
        resp = np.zeros(n + 1, dtype=bool)
        for s, o in zip(seqs, self.offsets):
            resp[o + s["start"] - 1 : o + len(s["ids"]) - 1] = True
        self.resp = torch.from_numpy(resp).to(dev)
        draft = torch.from_numpy(draft_ids).to(dev)
        t2d = torch.zeros(model.cfg.vocab, dtype=torch.bool, device=dev)
        t2d[draft] = True
        order = np.argsort(lengths)
        k0, t = 0, time.time()
        while k0 < len(order):  # chunks of similar lengths, at most TEACHER_TOKENS padded tokens
            k1 = k0 + 1
            while k1 < len(order) and (k1 + 1 - k0) * lengths[order[k1]] <= S["teacher_tokens"]:
                k1 += 1
            chunk = order[k0:k1]
            tm = int(lengths[chunk].max())
            ids = torch.zeros(len(chunk), tm, dtype=torch.long)
            for r, i in enumerate(chunk):
                ids[r, : lengths[i]] = torch.from_numpy(seqs[i]["ids"])
            ids = ids.to(dev)
            with torch.no_grad():
                logits, aux = model.full(ids, taps=taps)  # [b, T, V] fp32, [b, T, 3H]
                amax = logits.argmax(-1)  # [b, T]
                restricted = torch.log_softmax(logits.index_select(-1, draft), dim=-1)  # [b, T, V_draft]
                del logits
                top_v, top_i = restricted.topk(k, dim=-1)  # [b, T, K]
                top_p = torch.softmax(top_v, dim=-1)  # renormalized over the kept K
            for r, i in enumerate(chunk):
                o, ln = int(self.offsets[i]), int(lengths[i])
                self.tok[o : o + ln] = ids[r, :ln]
                self.aux[o : o + ln] = aux[r, :ln].to(torch.bfloat16)
                self.top_idx[o : o + ln] = top_i[r, :ln].to(torch.int16)
                self.top_p[o : o + ln] = top_p[r, :ln].to(torch.float16)
                self.amax[o : o + ln] = amax[r, :ln]
            k0 = k1
        self.inv = t2d[self.amax.clamp(min=0)] & (self.amax >= 0)
        sync(dev)
        greedy_match = []
        for s, o in zip(seqs, self.offsets):  # our teacher agrees with the generated greedy tokens?
            if s["greedy"]:
                ln = len(s["ids"])
                greedy_match.append((self.amax[o + s["start"] - 1 : o + ln - 1].cpu().numpy()
                                     == s["ids"][s["start"] :]).mean())
        self.teacher_greedy_agreement = float(np.mean(greedy_match)) if greedy_match else float("nan")
        log(f"teacher pass: {n} tokens in {time.time() - t:.1f}s; aux {self.aux.numel() * 2 / 2**30:.2f} GiB; "
            f"teacher argmax == generated greedy token: {self.teacher_greedy_agreement:.4%}; "
            f"response positions whose argmax is draftable: "
            f"{float(self.inv[self.resp].float().mean()):.4f}")

    def batch(self, members: list[int], extra: int):
        """idx [B, Tm + extra] flat rows (pad: the dummy row), right-padded sequences."""
        tm = max(len(self.seqs[i]["ids"]) for i in members)
        idx = torch.full((len(members), tm + extra), self.pad, dtype=torch.long)
        for r, i in enumerate(members):
            o, ln = int(self.offsets[i]), len(self.seqs[i]["ids"])
            idx[r, :ln] = torch.arange(o, o + ln)
        return idx.to(self.tok.device), tm


def make_batches(members: list[int], lengths: dict[int, int], budget: int, rng: random.Random) -> list[list[int]]:
    """Batches of similar lengths under a padded-token budget, in random order."""
    members = members[:]
    rng.shuffle(members)
    out = []
    group = max(budget // 64, 1) * 64
    for g in range(0, len(members), group):
        part = sorted(members[g : g + group], key=lambda i: lengths[i])
        cur: list[int] = []
        for i in part:
            if cur and (len(cur) + 1) * lengths[i] > budget:  # sorted: lengths[i] is the longest
                out.append(cur)
                cur = []
            cur.append(i)
        if cur:
            out.append(cur)
    rng.shuffle(out)
    return out


# -- training -------------------------------------------------------------------------------


def unroll_batch(head: Eagle3Head, data: Data, members: list[int], steps: int, train: bool):
    """Returns (idx [B, Tm+steps+1], R, per step: (target rows t_j [B, R], normed rows or all))."""
    idx, tm = data.batch(members, steps + 1)
    r = tm - 1  # rows p = 0..Tm-2 (row p is fed x_{p+1})
    tokens = data.tok[idx[:, 1 : r + steps]]  # [B, R+steps-1]: column c holds x_{c+1}
    aux = data.aux[idx[:, :r]]  # [B, R, 3H]
    targets = [idx[:, 1 + j : 1 + j + r] for j in range(steps)]  # [B, R] flat row of the teacher
    rows = [data.resp[t] & data.inv[t] for t in targets] if train else None
    outs = head.unroll(tokens, aux, steps, want_rows=rows)
    return targets, rows, outs


def train_loss(head, data, members, steps, draft_of):
    targets, rows, outs = unroll_batch(head, data, members, steps, train=True)
    losses, accs = [], []
    for j in range(steps):
        t = targets[j][rows[j]]  # [n_j]
        if len(t) == 0:
            continue
        logp = torch.log_softmax(head.lm_head(outs[j]).float(), dim=-1)  # [n_j, V_draft]
        picked = logp.gather(1, data.top_idx[t].long())  # [n_j, K]
        losses.append((0.8**j) * -(data.top_p[t].float() * picked).sum(-1).mean())
        with torch.no_grad():
            accs.append(float((logp.argmax(-1) == draft_of[data.amax[t]]).float().mean()))
    return sum(losses), accs


@torch.no_grad()
def evaluate(head, data, members, d, draft_ids_t, dev, amp) -> dict:
    """Greedy chains of d drafts at every anchor of the held-out greedy responses: per-step
    acceptance (top-1 == the target's argmax), and E[L] = 1 + E[accepted drafts]."""
    head.eval()
    hits = []  # [anchors, d] bool
    lengths = {i: len(data.seqs[i]["ids"]) for i in members}
    for batch in make_batches(members, lengths, S["train_tokens"], random.Random(0)):
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=amp):
            targets, _, outs = unroll_batch(head, data, batch, d, train=False)
            preds = [draft_ids_t[head.lm_head(o).argmax(-1)] for o in outs]  # d of [B, R] target ids
        valid = torch.stack([data.resp[t] for t in targets]).all(0)  # [B, R] all d targets are response tokens
        correct = torch.stack([p == data.amax[t] for p, t in zip(preds, targets)], dim=-1)  # [B, R, d]
        hits.append(correct[valid].cpu())
    head.train()
    h = torch.cat(hits).float() if hits else torch.zeros(0, d)
    if len(h) == 0:
        return {"anchors": 0}
    chain = h.cumprod(dim=1)  # [anchors, d] all drafts up to j accepted
    p_chain = chain.mean(0)
    cond = [float(p_chain[0])] + [float(p_chain[j] / p_chain[j - 1]) if p_chain[j - 1] > 0 else 0.0
                                  for j in range(1, d)]
    return {"anchors": len(h), "top1_per_step": [round(float(x), 4) for x in h.mean(0)],
            "chain_accept_per_step": [round(x, 4) for x in cond], "E_L": round(1 + float(chain.sum(1).mean()), 4),
            "D": d}


def save(head: Eagle3Head, draft_ids: np.ndarray, vocab: int, cfg, taps, report: dict) -> None:
    """fp16 weights under SafeAILab names, split in two files (each returned file ≤ 16 MiB),
    written whole or not at all."""
    names = {k: v.detach().float().cpu().numpy().astype(np.float16) for k, v in head.state_names().items()}
    d2t = draft_ids - np.arange(len(draft_ids))  # target id = i + d2t[i]
    t2d = np.zeros(vocab, dtype=bool)
    t2d[draft_ids] = True
    lm = {"lm_head.weight": names.pop("lm_head.weight"), "d2t": d2t.astype(np.int64), "t2d": t2d}
    for fname, arrays in (("head_main.npz", names), ("head_lm.npz", lm)):
        tmp = OUT / (fname + ".part")
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)
        os.replace(tmp, OUT / fname)
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": cfg.hidden, "intermediate_size": cfg.inter, "num_attention_heads": cfg.heads,
        "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim, "num_hidden_layers": 1,
        "rms_norm_eps": cfg.eps, "rope_theta": cfg.rope_theta, "rope_scaling": None,
        "max_position_embeddings": cfg.context, "vocab_size": vocab, "draft_vocab_size": len(draft_ids),
        "target_hidden_size": cfg.hidden, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
        "pad_token_id": 2, "torch_dtype": "float16",
    }
    (OUT / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    tmp = OUT / "eval.json.part"
    tmp.write_text(json.dumps({**report, "taps": list(taps), "settings": S}, indent=1) + "\n")
    os.replace(tmp, OUT / "eval.json")


def main() -> None:
    dev = torch.device(S["device"])
    amp = dev.type == "cuda"
    torch.backends.cuda.matmul.allow_tf32 = bool(S["tf32"])
    torch.backends.cudnn.allow_tf32 = bool(S["tf32"])
    torch.manual_seed(S["seed"])
    rng = random.Random(S["seed"])
    end = T0 + 60 * S["job_minutes"]
    log(f"settings: {json.dumps(S)}")
    log(f"torch {torch.__version__}, python {sys.version.split()[0]}, device {dev}"
        + (f" ({torch.cuda.get_device_name(dev)})" if dev.type == "cuda" else ""))

    cfg, w = load_weights(S["gguf"], dev)
    model = Llama(cfg, w)
    taps = (2, cfg.layers // 2, cfg.layers - 3)  # EAGLE-3's default, the stream entering each layer
    log(f"target loaded: {cfg}; taps {taps}")

    prompts = load_prompts(S["prompts"], S["max_prompts"], rng)
    holdout = set(rng.sample(range(len(prompts)), max(2, int(len(prompts) * S["holdout"]))))
    seqs = generate_all(model, prompts, holdout, rng, dev)
    resp = [len(s["ids"]) - s["start"] for s in seqs]
    stats = {"sequences": len(seqs), "prompts": len(prompts), "holdout_prompts": len(holdout),
             "greedy": sum(s["greedy"] for s in seqs), "response_tokens": int(sum(resp)),
             "total_tokens": int(sum(len(s["ids"]) for s in seqs)), "mean_response": round(float(np.mean(resp)), 1),
             "eos_share": round(float(np.mean([s["eos"] for s in seqs])), 3),
             "generation_s": round(time.time() - T0, 1)}
    log(f"data: {stats}")

    draft_ids, coverage = choose_vocab(seqs, cfg.vocab, S["draft_vocab"])
    log(f"draft vocabulary {len(draft_ids)}; response-token coverage by top-k: {coverage}")
    data = Data(model, seqs, draft_ids, taps, dev)
    embed = w["embed"].detach().clone()
    del model, w
    if dev.type == "cuda":
        torch.cuda.empty_cache()

    head = Eagle3Head(cfg.hidden, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.inter, len(taps), len(draft_ids),
                      cfg.eps, cfg.rope_theta, embed).to(dev)
    draft_ids_t = torch.from_numpy(draft_ids).to(dev)
    if S["lm_init"] == "target":  # lm_head starts from the target's tied head rows (norm at 1:
        with torch.no_grad():     # the target's final-norm gains would make the first logits ~2x)
            head.lm_head.weight.copy_(embed[draft_ids_t])
    draft_of = torch.full((cfg.vocab,), -1, dtype=torch.long, device=dev)
    draft_of[draft_ids_t] = torch.arange(len(draft_ids), device=dev)
    params = [p for p in head.parameters() if p.requires_grad]
    log(f"head: {sum(p.numel() for p in params) / 1e6:.2f}M trainable parameters "
        f"({sum(p.numel() for p in params) * 2 / 1e6:.1f} MB fp16)")
    opt = torch.optim.AdamW(params, lr=S["lr"], betas=(0.9, 0.95), weight_decay=0.0)

    train_members = [i for i, s in enumerate(seqs) if not s["holdout"]]
    eval_members = [i for i, s in enumerate(seqs) if s["holdout"] and s["greedy"]]
    eval_small = eval_members[: S["eval_seqs_ckpt"]]
    lengths = {i: len(s["ids"]) for i, s in enumerate(seqs)}
    report = {"data": stats, "coverage": coverage, "teacher_greedy_agreement": data.teacher_greedy_agreement,
              "curve": [], "samples": [{"ids": seqs[i]["ids"].tolist(), "start": seqs[i]["start"]}
                                       for i in eval_members[:3]]}  # real text for check_checkpoint.py
    t_train = time.time()
    train_end = end - S["final_reserve_s"]
    budget = max(train_end - t_train, 1.0)
    log(f"training: {len(train_members)} sequences, {len(eval_members)} held-out greedy; "
        f"{budget:.0f}s budget; {S['ttt_steps']} unrolled steps")
    first = evaluate(head, data, eval_small, S["eval_d"], draft_ids_t, dev, amp)
    report["curve"].append({"minutes": 0.0, "step": 0, **first})
    log(f"untrained eval: {first}")

    step, epoch, next_ckpt, done = 0, 0, time.time() + S["ckpt_seconds"], False
    run_loss, run_acc = [], []
    while not done:
        epoch += 1
        for members in make_batches(train_members, lengths, S["train_tokens"], rng):
            now = time.time()
            frac = min(max((now - t_train) / budget, step / S["train_steps"]), 1.0)
            if frac >= 1.0:
                done = True
                break
            lr = S["lr"] * min(1.0, (step + 1) / S["warmup"]) * (
                S["min_lr_frac"] + (1 - S["min_lr_frac"]) * 0.5 * (1 + math.cos(math.pi * frac)))
            for g in opt.param_groups:
                g["lr"] = lr
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=amp):
                loss, accs = train_loss(head, data, members, S["ttt_steps"], draft_of)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 0.5)
            opt.step()
            step += 1
            run_loss.append(float(loss.detach()))
            run_acc.append(accs)
            if step % S["log_every"] == 0 or step <= 3:
                acc = np.mean([a for a in run_acc if len(a) == len(run_acc[-1])], axis=0)
                log(f"step {step} epoch {epoch} lr {lr:.2e} loss {np.mean(run_loss):.4f} "
                    f"top1/step {np.round(acc, 3).tolist()}")
                run_loss, run_acc = [], []
            if time.time() > next_ckpt:
                ev = evaluate(head, data, eval_small, S["eval_d"], draft_ids_t, dev, amp)
                report["curve"].append({"minutes": round((time.time() - t_train) / 60, 2), "step": step, **ev})
                save(head, draft_ids, cfg.vocab, cfg, taps, {**report, "steps": step, "final": None})
                log(f"checkpoint at step {step}: held-out E[L] {ev.get('E_L')} per-step {ev.get('chain_accept_per_step')}")
                next_ckpt = time.time() + S["ckpt_seconds"]
    final = evaluate(head, data, eval_members, S["eval_d"], draft_ids_t, dev, amp)
    report["curve"].append({"minutes": round((time.time() - t_train) / 60, 2), "step": step,
                            **evaluate(head, data, eval_small, S["eval_d"], draft_ids_t, dev, amp)})
    report.update(steps=step, epochs=epoch, train_seconds=round(time.time() - t_train, 1), final=final,
                  wall_seconds=round(time.time() - T0, 1))
    save(head, draft_ids, cfg.vocab, cfg, taps, report)
    log(f"final held-out eval ({len(eval_members)} greedy responses): {final}")
    log(f"done: {step} steps, {epoch} epochs, wall {time.time() - T0:.0f}s; files in {OUT}")


if __name__ == "__main__":
    main()
