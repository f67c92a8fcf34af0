"""Check exported graphs numerically against transformers, through the runtime's own path.

For each model: transformers computes reference logits for a real token sequence in one full
forward pass. The graphs then run in onnxruntime exactly as the runtime runs them: the cache
is filled by the prefill graph chunk by chunk, and every graph is run at several cache
lengths (empty, half full, nearly full) with the slots past the length holding stale data,
which the in-graph mask must hide.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from specexport.runtime.engine import EngineOptions
from specexport.runtime.kv_cache import KVCache
from specexport.runtime.ort_engine import OrtEngine
from specexport.runtime.runner import ModelRunner

# Real text (prose, code, numbers) so the sequence exercises ordinary predictions.
CORPUS = """\
The lighthouse keeper climbed the spiral stairs every evening at dusk. From the top he could
see the fishing boats returning, their lanterns swaying over the dark water, and he counted
them one by one until the harbour was full again.

def merge_intervals(intervals):
    intervals = sorted(intervals, key=lambda pair: pair[0])
    merged = []
    for start, end in intervals:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged

A train leaves the station at 3:15 pm travelling at 80 km/h; a second train follows at
4:00 pm at 120 km/h. The second train catches up after 1.5 hours, 180 km from the station.
Speculative decoding lets a small model guess several tokens that the large model then
checks in a single pass, so the output is exactly what the large model would have written.
"""


@dataclass
class GraphUnderTest:
    name: str
    path: Path
    tokens: int


def reference_ids(tokenizer, length: int) -> np.ndarray:
    ids = tokenizer(CORPUS, add_special_tokens=False)["input_ids"]
    reps = -(-length // len(ids))
    return np.asarray((ids * reps)[:length], dtype=np.int64)  # [length]


def reference_logits(hf_model, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        out = hf_model(torch.from_numpy(ids).unsqueeze(0), use_cache=False)
    return out.logits[0].float().numpy()  # [S, V]


def cache_lengths(max_seq_len: int, tokens: int) -> list[int]:
    """Empty, a quarter, half and three quarters full, and nearly full (the graph's tokens
    end at the last slot)."""
    last = max_seq_len - tokens
    return sorted({0, last // 4, last // 2, 3 * last // 4, last})


def validate_model(graphs: list[GraphUnderTest], specs, num_layers: int, num_kv_heads: int, head_dim: int,
                   max_seq_len: int, ref_ids: np.ndarray, ref_logits: np.ndarray,
                   threads: int | None, in_place: bool = False) -> dict[str, dict]:
    """Return graph name -> parity figures and the cost of one run (ms). ``specs`` gives
    (inputs, outputs) per graph name; ``in_place``: the graphs update the cache in place."""
    options = EngineOptions(threads=threads)
    engines = [OrtEngine(g.name, g.path, *specs[g.name], options) for g in graphs]
    cache = KVCache(num_layers, 1, num_kv_heads, max_seq_len, head_dim)
    runner = ModelRunner("validate", engines, cache, {g.name: g.tokens for g in graphs},
                         in_place=frozenset(g.name for g in graphs) if in_place else frozenset())
    # Fill the cache once, chunk by chunk, through the runtime's runner. Each test rewinds to
    # its length, so the slots past the length hold data the mask must hide.
    runner.forward(ref_ids[: max_seq_len - 1].tolist())

    by_name = {e.name: e for e in engines}
    results: dict[str, dict] = {}
    for graph in graphs:
        engine = by_name[graph.name]
        worst, agree, total, worst_margin = 0.0, 0, 0, 0.0
        tested: list[int] = []
        for length in cache_lengths(max_seq_len, graph.tokens):
            # Tests only read the cache, so every slot still holds the filled data; the
            # length alone decides what the graph may see.
            cache.length = length
            feeds = dict(cache.view())
            feeds["input_ids"] = ref_ids[length : length + graph.tokens][None, :]  # [1, T]
            feeds["cache_length"] = np.array([length], dtype=np.int64)  # [1]
            # an in-place graph must see its cache bound as its present outputs (otherwise it
            # reads the whole buffer as past); it rewrites these positions with the same K/V
            bound = cache.in_place_outputs() if in_place else None
            out = engine.run(feeds, ["logits", "next_tokens"], bound)
            got = out["logits"][0]  # [T, V]
            want = ref_logits[length : length + graph.tokens]  # [T, V]
            worst = max(worst, float(np.abs(got - want).max()))
            same = got.argmax(-1) == want.argmax(-1)  # [T]
            agree += int(same.sum())
            if not same.all():
                # the reference's top-2 gap where they disagree: tiny means a near-tie
                top2 = np.sort(want[~same], axis=-1)[:, -2:]
                worst_margin = max(worst_margin, float((top2[:, 1] - top2[:, 0]).max()))
            total += graph.tokens
            if not np.array_equal(out["next_tokens"][0], got.argmax(-1)):
                worst = float("inf")  # in-graph argmax disagrees with its own logits: broken
            tested.append(length)
        results[graph.name] = {
            "max_abs_logit_diff": worst,
            "argmax_agreement": agree / total,
            "positions": total,
            "max_margin_at_disagreement": worst_margin,
            "cache_lengths": sorted(tested),
        }
    # Timing last: an in-place graph writes into the cache it is timed on. Shapes are static,
    # so the cost is the same at any length for standard graphs; an in-place (GQA) graph
    # attends to the filled part only and is timed half full.
    costs = runner.time_engines([g.tokens for g in graphs], rounds=9)
    for graph in graphs:
        results[graph.name]["cost_ms"] = round(costs[graph.tokens] * 1e3, 3)
    return results
