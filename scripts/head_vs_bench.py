"""Where an EAGLE-3 head falls short on the bench's prompts: teacher-forced E[L] per category.

The target (the recipe's, in torch) answers each bench prompt greedily (``--max-new`` tokens, as
the bench does; or the responses come from ``--responses FILE``, a JSON list of token-id lists,
e.g. the runtime's ``generate --json`` output, so both read the same text), then each head drafts
greedy chains of D from every anchor of those responses: the acceptance the distill run scores
on its held-out split, here on the bench's prompts. Also prints, per category, the share of
response tokens outside each head's draft vocabulary (a sure rejection wherever one comes).

Note: this averages over every anchor; the decode loop starts rounds only after a rejection,
where drafting is harder, so its E[L] runs up to ~10% lower on the same text.

Usage: .venv/bin/python scripts/head_vs_bench.py HEAD [HEAD ...] [--recipe R] [--prompts F]
       [--responses FILE] [--max-new 96] [--draft 5]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np
import torch

from specexport.exporter.distill import checkpoint
from specexport.exporter.distill.command import load_weights
from specexport.exporter.distill.data import Sequences, generate, prompt_ids, read_jsonl
from specexport.exporter.distill.eagle3_model import Eagle3Draft, rope_tables
from specexport.exporter.distill.eagle3_train import evaluate
from specexport.exporter.distill.teacher import Teacher
from specexport.exporter.heads.eagle3 import default_taps
from specexport.exporter.recipe import load_recipe
from specexport.exporter.sources import load_source

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("heads", nargs="+", type=Path)
    ap.add_argument("--recipe", type=Path, default=ROOT / "recipes/smollm2-135m.yaml")
    ap.add_argument("--prompts", type=Path, default=ROOT / "bench/prompts/dev.jsonl")
    ap.add_argument("--responses", type=Path, default=None)
    ap.add_argument("--max-new", type=int, default=96)
    ap.add_argument("--draft", type=int, default=5)
    args = ap.parse_args()

    recipe, base = load_recipe(args.recipe)
    target = load_source(recipe.target, base, "target")
    cfg, cpu = target.model.config, torch.device("cpu")
    items = read_jsonl(args.prompts, "--prompts")
    categories = [item.get("category", "all") for _, item in items]
    prompts = prompt_ids(target.tokenizer, items, args.prompts)
    if args.responses is not None:
        answers = [np.array(a, dtype=np.int64) for a in json.loads(args.responses.read_text())]
    else:
        eos = target.model.generation_config.eos_token_id
        eos = eos if isinstance(eos, list) else [eos]
        answers = generate(target.model, prompts, max_new=args.max_new, batch=1, temperature=0.0, eos_ids=eos,
                           pad_id=eos[0], seed=0, device=cpu)
    seqs = Sequences()
    for prompt, answer in zip(prompts, answers):
        seqs.add(np.concatenate((prompt, answer)), len(prompt), True, True)
    embed = target.model.get_input_embeddings().weight.detach().float()  # [V, H]
    names = sorted(set(categories))
    print(f"{'head':40s} " + " ".join(f"{c:>14s}" for c in names) + f" {'all':>7s}")
    for folder in args.heads:
        head_ckpt = checkpoint.read_head(folder)
        taps = tuple(head_ckpt.taps or default_taps(cfg.num_hidden_layers))
        head = Eagle3Draft(head_ckpt.config, len(taps), embed, rope_tables(head_ckpt.config, 4096)).eval()
        load_weights(head, head_ckpt.weights, str(folder), "give an EAGLE-3 head of this recipe's target")
        draft_t = torch.from_numpy(head_ckpt.draft_ids)  # [V_draft] target ids
        draft_of = torch.full((cfg.vocab_size,), -1, dtype=torch.long)  # [V] draft id or -1
        draft_of[draft_t] = torch.arange(len(draft_t))
        in_vocab = np.zeros(cfg.vocab_size, dtype=bool)
        in_vocab[head_ckpt.draft_ids] = True
        with tempfile.TemporaryDirectory() as cache:
            teacher = Teacher(target.model, taps, head_ckpt.draft_ids, 64, cpu, Path(cache), 0, 8192)
            cells, members_all = [], list(range(len(categories)))
            for c in names + ["all"]:
                members = members_all if c == "all" else [i for i, x in enumerate(categories) if x == c]
                r = evaluate(head, teacher, seqs, members, args.draft, args.draft, draft_t, draft_of, 8192, cpu)
                tokens = np.concatenate([answers[i] for i in members])
                cells.append((r["expected_length"], float((~in_vocab[tokens]).mean())))
        print(f"{str(folder):40s} " + " ".join(f"{e:6.2f} ({o:5.1%})" for e, o in cells[:-1])
              + f" {cells[-1][0]:7.2f}", flush=True)
    print(f"cells: teacher-forced E[L] at D={args.draft} (share of response tokens outside the draft vocabulary)")


if __name__ == "__main__":
    main()
