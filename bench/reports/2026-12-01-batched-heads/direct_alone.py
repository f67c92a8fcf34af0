"""The target alone, ours or onnxruntime-genai's, timed directly in this process (run each side in
a process of its own): the bench's prompts, prefill included, static batches for genai.

    python direct_alone.py ours  --batch 1   # writes the prompt ids and tokens to a temporary file
    python direct_alone.py genai --batch 1   # reads them: same prompts, tokens compared
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
ENGINES = REPO / "engines" / "smollm2-135m"
GENAI = REPO / "engines" / ".smollm2-135m.peers" / "ort-genai-fp32"
IDS = Path(tempfile.gettempdir()) / "specexport-direct-alone.json"
NEW_TOKENS = 48


def ours(batch: int) -> dict:
    from specexport.bench.harness import load_prompts
    from specexport.runtime import load

    pipe = load(ENGINES, threads=2)
    records = load_prompts(REPO / "bench" / "prompts" / "dev.jsonl")
    pipe.generate_batch(records[:1], drafter="none", max_new_tokens=4, max_batch=batch)  # warm-up
    start = time.perf_counter()
    results = pipe.generate_batch(records, drafter="none", max_new_tokens=NEW_TOKENS, max_batch=batch)
    wall = time.perf_counter() - start
    IDS.write_text(json.dumps({"prompts": [r.prompt_ids for r in results], "tokens": [r.token_ids for r in results]}))
    tokens = sum(r.stats.tokens for r in results)
    return {"side": "ours", "batch": batch, "tokens": tokens, "seconds": round(wall, 2),
            "tokens_per_s": round(tokens / wall, 1)}


def genai(batch: int) -> dict:
    import onnxruntime_genai as og

    saved = json.loads(IDS.read_text())
    model = og.Model(str(GENAI))
    pad = json.loads((GENAI / "genai_config.json").read_text())["model"].get("pad_token_id", 0)

    def run(prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        width = max(len(p) for p in prompts)
        ids = np.full((len(prompts), width), pad, dtype=np.int32)  # left-padded
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt):] = prompt
        params = og.GeneratorParams(model)
        params.set_search_options(do_sample=False, max_length=width + new_tokens, batch_size=len(prompts))
        generator = og.Generator(model, params)
        generator.append_tokens(ids)
        while not generator.is_done():
            generator.generate_next_token()
        return [[int(t) for t in generator.get_sequence(row)[width:]] for row in range(len(prompts))]

    prompts = saved["prompts"]
    run(prompts[:batch], 2)  # warm-up
    start = time.perf_counter()
    outputs = [out for i in range(0, len(prompts), batch) for out in run(prompts[i:i + batch], NEW_TOKENS)]
    wall = time.perf_counter() - start
    tokens = sum(min(len(o), NEW_TOKENS) for o in outputs)  # padded rows may run past their EOS
    # genai leaves a final EOS out of the sequence that ours includes
    equal = sum(o[:len(t)] == t or o == t[:-1] for o, t in zip(outputs, saved["tokens"]))
    return {"side": "genai", "batch": batch, "tokens": tokens, "seconds": round(wall, 2),
            "tokens_per_s": round(tokens / wall, 1), "prompts_equal_ours": f"{equal}/{len(prompts)}"}


if __name__ == "__main__":
    side, batch = sys.argv[1], int(sys.argv[sys.argv.index("--batch") + 1]) if "--batch" in sys.argv else 1
    print(json.dumps({"ours": ours, "genai": genai}[side](batch)))
