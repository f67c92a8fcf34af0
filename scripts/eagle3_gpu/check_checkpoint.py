"""Check a converted head (to_checkpoint.py's DEST) against the project (HERE, on CPU):
  1. specexport's eagle3 loader load()s it (SafeAILab layout detected, taps [2, 15, 27]);
  2. the project's export module (exporter/heads/chain.ChainGraph: catch-up and step graphs)
     and its independent reference (Eagle3Reference) give the same logits as the training
     job's own head module (head.Eagle3Head, unrolled 2 steps) on a real held-out response
     the job saved (DEST/training.json samples), the target's taps from our GGUF forward;
  3. the greedy chain acceptance of the trained head on that response (a sanity figure).
Usage: .venv/bin/python scripts/eagle3_gpu/check_checkpoint.py DEST [GGUF]   (exit 1 on a mismatch)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
from check_cpu import DEFAULT_GGUF  # noqa: E402
from head import Eagle3Head  # noqa: E402
from llama import Llama, load_weights  # noqa: E402


class StandInTarget(nn.Module):
    """What the loader reads of a target (config + input embedding), without transformers'
    slow GGUF load; the weights are the same GGUF's, through our checked reader."""

    def __init__(self, cfg, embed: torch.Tensor):
        super().__init__()
        from transformers import LlamaConfig

        self.config = LlamaConfig(hidden_size=cfg.hidden, num_hidden_layers=cfg.layers, vocab_size=cfg.vocab,
                                  num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads,
                                  intermediate_size=cfg.inter, max_position_embeddings=cfg.context,
                                  rms_norm_eps=cfg.eps, rope_theta=cfg.rope_theta)
        self.embed = nn.Embedding.from_pretrained(embed)

    def get_input_embeddings(self):
        return self.embed


def ours_from_checkpoint(dest: Path, cfg, embed: torch.Tensor) -> tuple[Eagle3Head, torch.Tensor]:
    from safetensors.torch import load_file

    t = load_file(str(dest / "model.safetensors"))
    draft = torch.arange(len(t["d2t"])) + t["d2t"]
    head = Eagle3Head(cfg.hidden, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.inter, 3, len(draft), cfg.eps,
                      cfg.rope_theta, embed)
    with torch.no_grad():
        for name, p in head.state_names().items():
            p.copy_(t[name].float())
    return head.eval(), draft


def spread(draft_logits: torch.Tensor, draft: torch.Tensor, vocab: int) -> torch.Tensor:
    full = torch.full((*draft_logits.shape[:-1], vocab), float("-inf"))
    full[..., draft] = draft_logits
    return full


def compare(name: str, got: torch.Tensor, want: torch.Tensor) -> bool:
    keep = torch.isfinite(want[0])
    diff = float((got[:, keep] - want[:, keep]).abs().max())
    scale = float(want[:, keep].abs().max())
    agree = float((got.argmax(-1) == want.argmax(-1)).float().mean())
    outside_ok = bool(torch.isneginf(got[:, ~keep]).all())
    ok = diff <= 1e-4 * max(scale, 1.0) and agree == 1.0 and outside_ok
    print(f"{'ok ' if ok else 'BAD'} {name}: max |diff| {diff:.2e} (logit scale {scale:.1f}), argmax {agree:.0%}, "
          f"-inf outside the draft vocabulary: {outside_ok}")
    return ok


def main() -> int:
    from specexport.exporter.heads.chain import ChainGraph, TargetStates
    from specexport.exporter.heads.eagle3 import load
    from specexport.exporter.recipe import Eagle3Drafter

    dest = Path(sys.argv[1]).resolve()
    gguf = Path(sys.argv[2]) if len(sys.argv) > 2 else DEFAULT_GGUF
    cfg, w = load_weights(str(gguf), "cpu")
    target = SimpleNamespace(model=StandInTarget(cfg, w["embed"]), tokenizer=None, origin="target")
    head = load(Eagle3Drafter(kind="eagle3", path=dest), target, dest.parent, "drafters.0")
    spec = head.spec
    print(f"loaded: layout {spec.info}, taps {spec.taps}, draft vocabulary {spec.lm_head.shape[0]}, "
          f"hidden {spec.hidden}, heads {spec.heads}/{spec.kv_heads}")
    ok = spec.taps == (2, 15, 27)

    sample = json.loads((dest / "training.json").read_text())["samples"][0]
    ids = torch.tensor(sample["ids"][:96])  # [S] prompt + the target's greedy response
    every = tuple(range(cfg.layers + 1))
    with torch.no_grad():
        logits_t, hidden = Llama(cfg, w).full(ids[None], taps=every)  # [1, S, V], [1, S, 31·H]
    states = hidden[0].split(cfg.hidden, dim=-1)  # 31 of [S, H]
    states = TargetStates(hidden_states=tuple(states), before_final_norm=states[-1])
    taps = spec.taps
    aux = torch.cat([states.hidden_states[i] for i in taps], dim=-1)  # [S, 3H]
    n = len(ids) - 1  # rows p = 0..n-1: token x_{p+1}, features of position p
    s_max = 128

    ours, draft = ours_from_checkpoint(dest, cfg, w["embed"])
    with torch.no_grad():
        outs = ours.unroll(ids[None, 1:], aux[None, : n - 1], 2)  # rows 0..n-2, steps 0 and 1
        ours0 = spread(ours.lm_head(outs[0])[0], draft, cfg.vocab)  # [n-1, V]
        ours1 = spread(ours.lm_head(outs[1])[0], draft, cfg.vocab)  # row p: step 1 of the chain at p
        ref0, ref_hidden = head.reference.run(ids[1:], states, None)  # [n, V], [n, H]

        zeros = [torch.zeros(1, spec.kv_heads, s_max, spec.head_dim) for _ in range(2)]
        catchup = ChainGraph(spec, taps, s_max, step=False).eval()
        g_logits, _, k_new, v_new, hidden_out = catchup(ids[None, 1:], aux[None, :n], torch.tensor([0]), *zeros)
        ok &= compare("catch-up graph vs the loader's reference", g_logits[0], ref0)
        ok &= compare("training module (step 0) vs the loader's reference", ours0, ref0[: n - 1])
        step = ChainGraph(spec, taps, s_max, step=True).eval()
        for p in (5, n // 2, n - 2):
            past_k, past_v = zeros[0].clone(), zeros[1].clone()
            past_k[:, :, : p + 1], past_v[:, :, : p + 1] = k_new[:, :, : p + 1], v_new[:, :, : p + 1]
            s_logits, *_ = step(ids[None, p + 2 : p + 3], hidden_out[:, p : p + 1], torch.tensor([p + 1]), past_k, past_v)
            ref1, _ = head.reference.run(ids[1 : p + 3], states, ref_hidden[p])
            ok &= compare(f"step graph at slot {p + 1} vs the reference", s_logits[0], ref1[-1:])
            ok &= compare(f"training module (step 1, row {p}) vs the reference", ours1[p : p + 1], ref1[-1:])

        # greedy chains of 5 over the response (the job's eval, on one text)
        start, d = sample["start"], 5
        rows = n - d
        outs = ours.unroll(ids[None, 1:], aux[None, :rows], d)
        amax = logits_t[0].argmax(-1)  # [S] the target's next token at each position
        hits = torch.stack([draft[ours.lm_head(o)[0].argmax(-1)] == amax[1 + j : 1 + j + rows]
                            for j, o in enumerate(outs)], dim=-1)[start - 1 :]  # [anchors, d]
        chain = hits.float().cumprod(1)
        print(f"greedy chains on this response ({len(hits)} anchors): per-step top-1 "
              f"{[round(float(x), 3) for x in hits.float().mean(0)]}, E[L] at D=5 {1 + float(chain.sum(1).mean()):.2f}")
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
