import json, time, numpy as np
import onnxruntime_genai as og
ids_all = json.load(open("/tmp/agg_ids.json"))
model = og.Model("/work/main/engines/.smollm2-135m.peers/ort-genai-fp32")
tok = og.Tokenizer(model)
pad = json.load(open("/work/main/engines/.smollm2-135m.peers/ort-genai-fp32/genai_config.json"))["model"].get("pad_token_id", 0)
def run(batch, n):
    width = max(len(i) for i in batch)
    ids = np.full((len(batch), width), pad, np.int32)
    for r, i in enumerate(batch): ids[r, width - len(i):] = i
    p = og.GeneratorParams(model); p.set_search_options(do_sample=False, max_length=width + n, batch_size=len(batch))
    g = og.Generator(model, p); g.append_tokens(ids)
    while not g.is_done(): g.generate_next_token()
    return [g.get_sequence(r)[width:] for r in range(len(batch))]
for B in (1, 4):
    run(ids_all[:B], 2)
    t = time.perf_counter(); outs = [o for s in range(0, 12, B) for o in run(ids_all[s:s + B], 48)]; w = time.perf_counter() - t
    n = sum(min(len(o), 48) for o in outs)
    print("genai B", B, n, round(w, 2), round(n / w, 1))
