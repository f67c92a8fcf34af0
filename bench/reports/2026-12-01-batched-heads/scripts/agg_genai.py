import json, time, numpy as np
import onnxruntime_genai as og
ids_all = json.load(open("/tmp/agg_ids.json")); ours = json.load(open("/tmp/agg_tok.json"))
model = og.Model("/work/main/engines/.smollm2-135m.peers/ort-genai-fp32")
def run(ids, n):
    p = og.GeneratorParams(model); p.set_search_options(do_sample=False, max_length=len(ids) + n, batch_size=1)
    g = og.Generator(model, p); g.append_tokens(np.asarray([ids], np.int32)); steps = 0
    while not g.is_done(): g.generate_next_token(); steps += 1
    return list(g.get_sequence(0)[len(ids):]), steps
run(ids_all[0], 2)
t = time.perf_counter(); outs = [run(ids, 48) for ids in ids_all]; w = time.perf_counter() - t
n = sum(len(o) for o, _ in outs)
print("genai", n, round(w, 2), round(n / w, 1), "steps", sum(s for _, s in outs), "equal", sum(list(map(int, o)) == t_[:len(o)] for (o, _), t_ in zip(outs, ours)))
