import json, time
from specexport.runtime import load
from specexport.bench.harness import load_prompts
pipe = load("/work/main/engines/smollm2-135m", threads=2)
records = load_prompts(__import__("pathlib").Path("/work/main/bench/prompts/dev.jsonl"))
pipe.generate_batch(records[:1], drafter="none", max_new_tokens=4, max_batch=1)
t = time.perf_counter(); r = pipe.generate_batch(records, drafter="none", max_new_tokens=48, max_batch=4); w = time.perf_counter() - t
n = sum(x.stats.tokens for x in r); pf = sum(x.stats.prefill_s for x in r); dec = sum(x.stats.total_s for x in r)
print("ours B4", n, round(w, 2), round(n / w, 1), "prefill", round(pf, 2), "decode", round(dec, 2))
json.dump([x.prompt_ids for x in r], open("/tmp/agg_ids.json", "w")); json.dump([x.token_ids for x in r], open("/tmp/agg_tok.json", "w"))
