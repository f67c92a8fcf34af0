"""Check exported graphs numerically against transformers, through the runtime's own path.

For each model: transformers computes reference logits for a real token sequence in one full
forward pass (and, for a target whose graphs output aux_hidden_states, the hidden states at the
tapped indices from the same pass). The graphs then run in onnxruntime exactly as the runtime
runs them: the cache is filled by the prefill graph chunk by chunk, and every graph is run at
several cache lengths (empty, half full, nearly full) with the slots past the length holding
stale data, which the in-graph mask must hide.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from specexport.contract import (
    AUX_HIDDEN_STATES,
    CACHE_LENGTH,
    INPUT_IDS,
    LOGITS,
    NEXT_TOKENS,
    VALID_TOKENS,
    StateLayout,
    is_present,
    present_of,
)
from specexport.errors import SpecexportError
from specexport.runtime.engine import EngineOptions, SharedGraphs
from specexport.runtime.kv_cache import KVCache, open_host_cache
from specexport.runtime.ort_engine import OrtEngine
from specexport.runtime.runner import PAD_ID, ModelRunner
from specexport.runtime.tree import DraftTree
from specexport.runtime.tree_verify import batched_tree_feeds, tree_feeds

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


@dataclass(frozen=True)
class Tolerance:
    """What a graph of one precision may differ from transformers. The logit limits scale with
    the logit scale (the largest |reference logit|, at least 1), the taps' with each tap's own
    scale: rounding error grows with the magnitudes a model computes, so one relative figure
    fits tiny and large models alike."""

    logit_rtol: float | None  # max |Δlogit| <= logit_rtol · scale; None: recorded, not enforced
    near_tie_rtol: float = 0.0  # an argmax may differ only where the reference's top-2 margin < this · scale
    # tapped hidden states (aux_hidden_states): per tap, max |Δh| <= aux_rtol · that tap's scale
    # (its largest |reference value|, at least 1); None: recorded, not enforced
    aux_rtol: float | None = None


# The one table of validation limits, keyed by the precision of the graph under test.
# fp32: measured max |Δlogit| 2e-5..8e-5 on tiny models (logit scale ~17: under 5e-6 relative)
# and 5e-5..1.2e-4 on SmolLM2-135M (scale ~43: under 3e-6); 1e-4 leaves 20x headroom, while
# one corrupt weight misses it by orders of magnitude. The near-tie limit is about the README's
# losslessness rule (1e-3 at scale 20). fp16/bf16 (TensorRT casts) keep 10 and 7 mantissa bits.
# int4 (the quantized-self drafter) differs from the fp32 target by design: recorded only.
# precision int4 / int8 graphs are checked against transformers on their own dequantized weights
# (exporter/quantized_model.py), per MatMulNBits accuracy level. Levels 0-3 compute in floats:
# measured 5e-6 relative on tiny models and 3e-6 on SmolLM2 (level 1), so fp32's limits hold.
# Level 4 quantizes activations to int8 per block of 32, a real error: measured max |Δlogit|
# 0.13 x scale on tiny models and SmolLM2 (GGUF blocks kept), argmax differing at margins up to
# 0.05 x scale, taps up to 0.051 x their scale (SmolLM2 tap 2); the limits leave 2-3x headroom,
# while a wrong block layout (codes, scales or zero points misplaced) is off by the whole scale.
# Taps (aux_hidden_states), fp32: the figure is per tap, max |Δh| over that tap's scale (its
# largest |reference value|). Measured 4e-7..1.5e-5 on tiny models of every architecture, standard
# and ort-gqa (4 layers, taps 0, 1, 2, L), and at most 2.4e-6 on SmolLM2-135M (taps 0, 1, 2, 15, 27,
# 29, 30; scales 1 to 2.3e4: the middle of the stream carries massive activations). The worst is
# mostly the final-normed tap L, which shares the logits' rounding: the same 1e-4 as logit_rtol
# leaves 7x headroom over tiny models and 40x over SmolLM2, while a tap one layer off misses it by
# 20x (SmolLM2 tap 15, where a 2.3e4 activation sets the scale) to over 1e5x (tap 0).
# fp16/bf16 taps are recorded only (TensorRT parity compares logits; no GPU figures yet).
AUX_RTOL_FP32 = 1e-4
# fp16/bf16 onnxruntime graphs against transformers fp32: the error the type makes depends on the
# model's magnitudes (the tiny test models, drawn at std 0.5, make large ones: transformers in
# fp16 differs from its fp32 run by 3.3% of the logit scale, in bf16 by 21%), so the limit is
# also this many times transformers' own error in that type, run on the same tokens (the graphs
# keep norms and rotary angles in fp32 and measured under 1x of it: exporter/low_precision.py).
LOW_REFERENCE_FACTOR = 1.5
LOW_TORCH_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
TOLERANCES: dict[str, Tolerance] = {
    "fp32": Tolerance(logit_rtol=1e-4, near_tie_rtol=5e-5, aux_rtol=AUX_RTOL_FP32),
    "fp16": Tolerance(logit_rtol=1e-2, near_tie_rtol=5e-3),
    "bf16": Tolerance(logit_rtol=4e-2, near_tie_rtol=2e-2),
    "int4": Tolerance(logit_rtol=None),  # the quantized-self drafter against the fp32 model: recorded
    # precision int4 / int8 against transformers on the graph's own dequantized weights, per
    # MatMulNBits accuracy level (exporter/quantized_model.py)
    **{f"{p}/acc{level}": Tolerance(logit_rtol=1e-4, near_tie_rtol=5e-5, aux_rtol=AUX_RTOL_FP32)
       for p in ("int4", "int8") for level in range(4)},
    **{f"{p}/acc4": Tolerance(logit_rtol=0.3, near_tie_rtol=0.1, aux_rtol=0.15) for p in ("int4", "int8")},
    # a drafter head at `precision: int8` against its fp32 reference, the quantization inside the
    # comparison: SmolLM2's EAGLE-3 head measured 0.017 of the logit scale and argmax flips under
    # 0.007-scale margins (a wrong graph is off by the scale); its drafts are judged by acceptance
    "int8/head": Tolerance(logit_rtol=0.1, near_tie_rtol=0.05),
}


@dataclass
class Parity:
    """One graph's figures against the reference, accumulated over the positions it ran."""

    max_abs_logit_diff: float = 0.0
    logit_scale: float = 1.0
    agree: int = 0
    positions: int = 0
    max_margin_at_disagreement: float = 0.0  # the reference's top-2 gap where the argmax differs
    next_tokens_match: bool = True  # the in-graph argmax equals the graph's own logits' argmax
    # aux_hidden_states, per tap (hidden_states index -> figure); empty: the graph has no taps
    aux_diff: dict[int, float] = field(default_factory=dict)  # max |Δh|
    aux_scale: dict[int, float] = field(default_factory=dict)  # max(1, max |reference h|)

    def add(self, got: np.ndarray, want: np.ndarray, next_tokens: np.ndarray | None = None) -> None:
        """``got``/``want``: [T, V] logits of the graph and the reference; ``next_tokens`` [T]."""
        diff = float(np.abs(got - want).max())  # NaN when either side has one
        self.max_abs_logit_diff = diff if not diff <= self.max_abs_logit_diff else self.max_abs_logit_diff
        self.logit_scale = max(self.logit_scale, float(np.abs(want).max()))
        same = got.argmax(-1) == want.argmax(-1)  # [T]
        self.agree += int(same.sum())
        self.positions += len(same)
        if not same.all():
            top2 = np.sort(want[~same], axis=-1)[:, -2:]  # [n_differ, 2]
            self.max_margin_at_disagreement = max(self.max_margin_at_disagreement,
                                                  float((top2[:, 1] - top2[:, 0]).max()))
        if next_tokens is not None and not np.array_equal(next_tokens, got.argmax(-1)):
            self.next_tokens_match = False

    def add_aux(self, got: np.ndarray, want: np.ndarray, taps: tuple[int, ...]) -> None:
        """``got``/``want``: [T, n_taps·hidden] tapped hidden states of the graph and the
        reference, the taps concatenated in the order of ``taps``."""
        if got.shape != want.shape or got.shape[-1] % len(taps):
            raise SpecexportError(f"aux_hidden_states has shape {list(got.shape)}, the reference "
                                  f"{list(want.shape)} for taps {list(taps)}; the graph's taps differ from the model's")
        hidden = got.shape[-1] // len(taps)
        for k, tap in enumerate(taps):
            cols = slice(k * hidden, (k + 1) * hidden)
            diff = float(np.abs(got[:, cols] - want[:, cols]).max())  # NaN when either side has one
            current = self.aux_diff.get(tap, 0.0)
            self.aux_diff[tap] = diff if not diff <= current else current
            self.aux_scale[tap] = max(self.aux_scale.get(tap, 1.0), float(np.abs(want[:, cols]).max()))

    def _aux_dict(self) -> dict:
        if not self.aux_diff:
            return {}
        rel = {tap: self.aux_diff[tap] / self.aux_scale[tap] for tap in self.aux_diff}
        worst = max(rel, key=lambda tap: (rel[tap] != rel[tap], rel[tap]))  # a NaN ranks first
        return {
            "aux_taps": sorted(self.aux_diff),
            "max_abs_aux_diff": max(self.aux_diff.values(), key=lambda d: (d != d, d)),
            "aux_scale": max(self.aux_scale.values()),
            "max_rel_aux_diff": rel[worst],  # per tap: |Δh| / that tap's scale
            "worst_aux_tap": worst,
        }

    def to_dict(self) -> dict:
        return {
            "max_abs_logit_diff": self.max_abs_logit_diff,
            "logit_scale": self.logit_scale,
            "max_rel_logit_diff": self.max_abs_logit_diff / self.logit_scale,
            "argmax_agreement": self.agree / self.positions if self.positions else 0.0,
            "positions": self.positions,
            "max_margin_at_disagreement": self.max_margin_at_disagreement,
            "next_tokens_match": self.next_tokens_match,
            **self._aux_dict(),
        }


def check_parity(graph: str, parity: dict, precision: str, max_abs_logit_diff: float | None = None,
                 min_argmax_agreement: float | None = None, reference: str = "transformers",
                 reference_error: float | None = None) -> dict:
    """Raise a one-line error when ``graph``'s figures (Parity.to_dict) break the limits for
    ``precision``; return the limits applied (recorded in the manifest). The recipe's
    ``max_abs_logit_diff`` (absolute) and ``min_argmax_agreement`` replace the table's where set.
    ``reference_error``: an fp16/bf16 graph's max |Δlogit| that transformers itself makes in that
    type against its fp32 run (``low_precision_error``); the limits widen to what it justifies
    (LOW_REFERENCE_FACTOR times it; argmax flips where the fp32 margin is under twice it)."""
    if precision not in TOLERANCES:
        raise SpecexportError(f"no validation limits for precision {precision!r}; known: {', '.join(TOLERANCES)}")
    tol = TOLERANCES[precision]
    if tol.logit_rtol is None:
        return {"precision": precision, "enforced": False}
    scale = parity["logit_scale"]
    logit_limit = max_abs_logit_diff if max_abs_logit_diff is not None else tol.logit_rtol * scale
    tie_limit = tol.near_tie_rtol * scale
    if reference_error is not None and max_abs_logit_diff is None:
        logit_limit = max(logit_limit, LOW_REFERENCE_FACTOR * reference_error)
        tie_limit = max(tie_limit, 2 * reference_error)
    where = f"validation failed for {graph} ({precision}, against {reference})"
    if not parity["max_abs_logit_diff"] <= logit_limit:  # `not <=`: a NaN difference fails too
        raise SpecexportError(
            f"{where}: max |Δlogit| {parity['max_abs_logit_diff']:.3g} exceeds the limit {logit_limit:.3g} "
            f"({_limit_source(max_abs_logit_diff, tol.logit_rtol, scale, reference_error)}); "
            "the export does not match the model"
        )
    if not parity["next_tokens_match"]:
        raise SpecexportError(f"{where}: the in-graph argmax (next_tokens) differs from the graph's own logits")
    if parity["max_margin_at_disagreement"] >= tie_limit:  # 0 when every argmax agrees
        raise SpecexportError(
            f"{where}: argmax differs where the reference's top-2 margin is "
            f"{parity['max_margin_at_disagreement']:.3g}, above the near-tie limit {tie_limit:.3g} "
            f"({tol.near_tie_rtol:g} x logit scale {scale:.3g}, or twice transformers' own {precision} error); "
            f"argmax agreement {parity['argmax_agreement']:.2%}"
        )
    if min_argmax_agreement is not None and parity["argmax_agreement"] < min_argmax_agreement:
        raise SpecexportError(
            f"{where}: argmax agreement {parity['argmax_agreement']:.2%} is below the recipe's "
            f"validation.min_argmax_agreement {min_argmax_agreement:.2%}"
        )
    applied = {"precision": precision, "enforced": True, "max_abs_logit_diff_limit": logit_limit,
               "near_tie_margin_limit": tie_limit}
    if reference_error is not None:
        applied["reference_low_precision_error"] = reference_error
    if "max_rel_aux_diff" in parity and tol.aux_rtol is not None:
        if not parity["max_rel_aux_diff"] <= tol.aux_rtol:  # `not <=`: NaN fails too
            tap = parity["worst_aux_tap"]
            raise SpecexportError(
                f"{where}: aux_hidden_states at tap {tap} (hidden_states[{tap}]) differs by "
                f"{parity['max_rel_aux_diff']:.3g} x its scale, above the limit {tol.aux_rtol:g}; "
                "the tapped hidden states do not match the model's"
            )
        applied["max_rel_aux_diff_limit"] = tol.aux_rtol
    return applied


def _limit_source(override: float | None, rtol: float, scale: float, reference_error: float | None = None) -> str:
    if override is not None:
        return "the recipe's validation.max_abs_logit_diff"
    if reference_error is not None and LOW_REFERENCE_FACTOR * reference_error > rtol * scale:
        return f"{LOW_REFERENCE_FACTOR:g} x transformers' own error in this type, {reference_error:.3g}"
    return f"{rtol:g} x logit scale {scale:.3g}"


def low_precision_error(hf_model, ids: np.ndarray, precision: str, ref_logits: np.ndarray) -> float:
    """max |Δlogit| of transformers run in ``precision`` (fp16 | bf16) against its fp32 logits
    ``ref_logits`` [S, V] on the same ``ids`` [S]: the error the type alone makes."""
    low = copy.deepcopy(hf_model).to(LOW_TORCH_DTYPES[precision])
    logits, _ = reference_forward(low, ids)  # [S, V]
    del low
    return float(np.abs(logits - ref_logits).max())


def reference_ids(tokenizer, length: int) -> np.ndarray:
    ids = tokenizer(CORPUS, add_special_tokens=False)["input_ids"]
    reps = -(-length // len(ids))
    return np.asarray((ids * reps)[:length], dtype=np.int64)  # [length]


def reference_logits(hf_model, ids: np.ndarray) -> np.ndarray:
    """transformers' logits [S, V] on ``ids`` [S] (reference_forward has the taps too)."""
    return reference_forward(hf_model, ids)[0]


def reference_continuations(hf_model, prefix: np.ndarray, continuations: list[np.ndarray]) -> np.ndarray:
    """transformers' last logits [n, V] on ``prefix`` [S] followed by each continuation: the
    prefix runs once, each continuation from a copy of transformers' own cache of it (a full
    pass per path cost the build 13 passes over a half-full cache at each length)."""
    with torch.no_grad():
        past = hf_model(torch.from_numpy(prefix).unsqueeze(0), use_cache=True).cache
        rows = [hf_model(torch.from_numpy(ids).unsqueeze(0), cache=copy.deepcopy(past), use_cache=True).logits[0, -1]
                for ids in continuations]  # n of [V]
    return torch.stack(rows).float().numpy()


def reference_forward(hf_model, ids: np.ndarray, taps: tuple[int, ...] = ()) -> tuple[np.ndarray, np.ndarray | None]:
    """One full transformers pass on ``ids`` [S]: logits [S, V], and with ``taps`` the hidden
    states at those output_hidden_states indices concatenated as aux_hidden_states is
    [S, n_taps·hidden] (None without taps)."""
    with torch.no_grad():
        out = hf_model(torch.from_numpy(ids).unsqueeze(0), use_cache=False, output_hidden_states=bool(taps))
    logits = out.logits[0].float().numpy()  # [S, V]
    if not taps:
        return logits, None
    states = out.hidden_states  # L+1 of [1, S, hidden]
    if any(not 0 <= tap < len(states) for tap in taps):
        raise SpecexportError(f"taps {list(taps)} must lie in 0..{len(states) - 1} (the model's layer count)")
    aux = torch.cat([states[tap][0] for tap in taps], dim=-1)  # [S, n_taps·hidden]
    return logits, aux.float().numpy()


def cache_lengths(max_seq_len: int, tokens: int) -> list[int]:
    """Empty, a quarter, half and three quarters full, and nearly full (the graph's tokens
    end at the last slot)."""
    last = max_seq_len - tokens
    return sorted({0, last // 4, last // 2, 3 * last // 4, last})


def validate_model(graphs: list[GraphUnderTest], specs, num_layers: int, num_kv_heads: int, head_dim: int,
                   max_seq_len: int, ref_ids: np.ndarray, ref_logits: np.ndarray,
                   threads: int | None, in_place: bool = False,
                   keep: list[ModelRunner] | None = None,
                   ref_aux: np.ndarray | None = None, taps: tuple[int, ...] = (),
                   state: StateLayout | None = None, full_rows: bool = False,
                   kv_dtype: str = "float32") -> dict[str, dict]:
    """Return graph name -> parity figures and the cost of one run (ms). ``specs`` gives
    (inputs, outputs) per graph name; ``in_place``: the graphs update the cache in place.
    ``keep``: no timing here; the runner is appended to it for the caller, which times every
    model's graphs in one interleaved schedule (the builder). ``ref_aux`` [S, n_taps·hidden]:
    the reference's hidden states at ``taps`` (reference_forward), compared with every graph's
    aux_hidden_states; a graph with that output needs them, and with them every graph needs it.
    ``state``: the model's linear-attention layers keep a recurrent state (RecurrentCache),
    which cannot be rewound to an arbitrary length: before each test the cache is refilled up
    to its length through the runner (so the per-position states the runner selects are
    checked on the way). ``full_rows``: the model's rows must agree bit for bit between calls
    (a quantized model, ModelEntry.full_rows): every graph's rows are also checked against
    one-token calls over the same positions (``rows_agree``). ``kv_dtype``: the graphs' KV cache
    type (float16 for fp16 graphs)."""
    for g in graphs:
        if (AUX_HIDDEN_STATES in specs[g.name][1]) != (ref_aux is not None):
            has = "outputs" if ref_aux is None else "lacks"
            raise SpecexportError(f"{g.name} {has} {AUX_HIDDEN_STATES} but the model's taps are {list(taps)}; "
                                  "export the graphs and the reference with the same taps")
    options = EngineOptions(threads=threads)
    shared = SharedGraphs()  # sizes of one shared graph file run on one session, as at run time
    engines = [OrtEngine(g.name, g.path, *specs[g.name], options, shared) for g in graphs]
    cache = open_host_cache(num_layers, 1, num_kv_heads, max_seq_len, head_dim, kv_dtype, state=state)
    runner = ModelRunner("validate", engines, cache, {g.name: g.tokens for g in graphs},
                         in_place=frozenset(g.name for g in graphs) if in_place else frozenset(),
                         full_rows=full_rows)
    # Fill the cache once, chunk by chunk, through the runtime's runner. Each test rewinds to
    # its length, so the slots past the length hold data the mask must hide.
    runner.forward(ref_ids[: max_seq_len - 1].tolist())

    by_name = {e.name: e for e in engines}
    results: dict[str, dict] = {}
    for graph in graphs:
        engine = by_name[graph.name]
        parity = Parity()
        tested: list[int] = []
        for length in cache_lengths(max_seq_len, graph.tokens):
            # Tests only read the cache, so every slot still holds the filled data; the
            # length alone decides what the graph may see. A recurrent state is refilled to
            # the length instead (the KV slots past it still hold stale data).
            if state is not None:
                runner.cache.set_length(0)
                runner.forward(ref_ids[:length].tolist())
            cache.length = length
            feeds = dict(cache.view())
            feeds[INPUT_IDS] = ref_ids[length : length + graph.tokens][None, :]  # [1, T]
            feeds[CACHE_LENGTH] = np.array([length], dtype=np.int64)  # [1]
            if VALID_TOKENS in engine.inputs:
                feeds[VALID_TOKENS] = np.array([graph.tokens], dtype=np.int64)  # [1]
            # an in-place graph must see its cache bound as its present outputs (otherwise it
            # reads the whole buffer as past); it rewrites these positions with the same K/V
            bound = cache.in_place_outputs() if in_place else None
            outputs = [LOGITS, NEXT_TOKENS] + ([AUX_HIDDEN_STATES] if ref_aux is not None else [])
            with _restored(cache, length, graph.tokens + 1 if in_place else 0):  # a padded call writes one more
                out = engine.run(feeds, outputs, bound)
            want = ref_logits[length : length + graph.tokens]  # [T, V]
            parity.add(out[LOGITS][0], want, out[NEXT_TOKENS][0])  # [T, V], [T, V], [T]
            if ref_aux is not None:  # [T, n_taps·hidden] each
                parity.add_aux(out[AUX_HIDDEN_STATES][0], ref_aux[length : length + graph.tokens], taps)
            tested.append(length)
        results[graph.name] = {**parity.to_dict(), "cache_lengths": sorted(tested)}
    if full_rows:
        one = by_name[next(g.name for g in graphs if g.tokens == 1)]
        for graph in graphs:
            results[graph.name]["rows_agree_max_abs_diff"] = _rows_against_one(
                by_name[graph.name], one, cache, graph.tokens, ref_ids, max_seq_len, in_place)
    # Timing last: an in-place graph writes into the cache it is timed on. Shapes are static,
    # so the cost is the same at any length for standard graphs; an in-place (GQA) graph
    # attends to the filled part only and is timed half full.
    if keep is not None:
        keep.append(runner)
        return results
    costs = runner.time_engines([g.tokens for g in graphs], rounds=9)
    for graph in graphs:
        results[graph.name]["cost_ms"] = round(costs[graph.tokens] * 1e3, 3)
    return results


def validation_tree(nodes: int, ids: np.ndarray, start: int) -> DraftTree:
    """A tree of ``nodes`` for validation: three children under the root, then two under each
    node in turn (every depth, several siblings and cousins), its first path the reference
    text after ``start`` and the other nodes tokens from elsewhere in it."""
    parents = np.array([-1 if i < 3 else (i - 3) // 2 for i in range(nodes)], dtype=np.int64)
    tree = DraftTree(np.zeros(nodes, dtype=np.int64), parents)
    depth = tree.depths()
    first = {0}
    for i in range(nodes):
        if int(parents[i]) in first and i == min(tree.children(int(parents[i]))):
            first.add(i)
    tokens = [ids[(start + d) % len(ids)] if i in first else ids[(start + 7 * i + 3) % len(ids)]
              for i, d in enumerate(depth.tolist())]
    return DraftTree(np.asarray(tokens, dtype=np.int64), parents)


def validate_tree(graph: GraphUnderTest, specs, cache, ref_ids: np.ndarray, hf_model, threads: int | None,
                  in_place: bool, max_seq_len: int) -> dict:
    """A tree verify graph (Role.TREE) against transformers: at a short and a half-full cache,
    every row of ``validation_tree`` equals transformers' last logits on the prompt and that row's
    root-to-node path. ``cache``: the model's validation cache, filled with ``ref_ids``."""
    engine = OrtEngine(graph.name, graph.path, *specs[graph.name], EngineOptions(threads=threads))
    parity = Parity()
    lengths = sorted({8, (max_seq_len - graph.tokens) // 2})
    for length in lengths:
        tree = validation_tree(graph.tokens - 1, ref_ids, length + 1)
        root = int(ref_ids[length])
        cache.length = length
        feeds = {**cache.view(), **tree_feeds(tree, root, length, VALID_TOKENS in engine.inputs)}
        bound = cache.in_place_outputs() if in_place else None
        with _restored(cache, length, graph.tokens if in_place else 0):
            out = engine.run(feeds, [LOGITS, NEXT_TOKENS], bound)
        paths = [np.array([root, *tree.tokens[tree.path(row - 1)].tolist()]) for row in range(graph.tokens)]
        want = reference_continuations(hf_model, np.asarray(ref_ids[:length]), paths)  # [T, V]
        parity.add(out[LOGITS][0], want, out[NEXT_TOKENS][0])
    return {**parity.to_dict(), "cache_lengths": lengths, "tree_parents": validation_tree(graph.tokens - 1, ref_ids, 0)
            .parents.tolist()}


def validate_batched_tree(graph: BatchedGraph, single: GraphUnderTest, specs, cache, ref_ids: np.ndarray,
                          threads: int | None, in_place: bool, tolerance: float = 1e-4) -> dict:
    """A batched tree verify graph against the batch-1 tree graph (itself checked against
    transformers) on each row alone: rows at spread cache lengths, each with its own tree (the
    validation tree, and a chain in every other row, so the rows' masks differ), and with 3 rows
    or more the last one idle. Each row's logits (the Parity figures) and the K/V it writes
    (in place: its slots; appended: its presents) must agree to fp32 rounding, else a one-line
    error naming the row; an idle row's cache must stay untouched. ``cache``: the batch-1
    validation cache, filled with ``ref_ids``."""
    shared, options = SharedGraphs(), EngineOptions(threads=threads)
    engine = OrtEngine(graph.name, graph.path, *specs[graph.name], options, shared)
    one = OrtEngine(single.name, single.path, *specs[single.name], options, shared)
    nodes, batch = graph.tokens - 1, graph.batch
    valid = VALID_TOKENS in engine.inputs
    idle = batch - 1 if batch >= 3 else None
    last = cache.max_seq_len - graph.tokens
    rows = {}  # slot -> (cache length, root, tree); the idle slot has none
    for r in (r for r in range(batch) if r != idle):
        length = (last * (r + 1)) // batch
        tree = (DraftTree.chain(ref_ids[(length + 1 + np.arange(nodes)) % len(ref_ids)]) if r % 2
                else validation_tree(nodes, ref_ids, length + 1))
        rows[r] = (length, int(ref_ids[length]), tree)
    feeds = batched_tree_feeds(rows, batch, nodes, valid)  # [B, ...]
    filled = cache.view()  # name -> [1, n_kv, S_max, hd]
    past = {name: np.repeat(array, batch, axis=0) for name, array in filled.items()}  # [B, n_kv, S_max, hd]
    before = {name: array.copy() for name, array in past.items()}
    names = [LOGITS, NEXT_TOKENS] + ([] if in_place else [present_of(p) for p in past])
    out = engine.run({**past, **feeds}, names, {present_of(p): a for p, a in past.items()} if in_place else None)
    if idle is not None and any(not np.array_equal(past[name][idle], before[name][idle]) for name in past):
        raise SpecexportError(f"{graph.name}: the idle row {idle} wrote into its cache; its valid_tokens input is "
                              "not honoured")
    parity, worst = Parity(), 0.0
    for r, (length, root, tree) in rows.items():
        with _restored(cache, length, graph.tokens if in_place else 0):
            alone = one.run({**filled, **tree_feeds(tree, root, length, valid)}, names,
                            cache.in_place_outputs() if in_place else None)
            pairs = [(LOGITS, out[LOGITS][r], alone[LOGITS][0])]
            span = slice(length, length + graph.tokens)
            pairs += [(name, past[name][r, :, span], filled[name][0, :, span]) if in_place else
                      (name, out[present_of(name)][r], alone[present_of(name)][0]) for name in past]
            worst = max(worst, _pairs_agree(pairs, tolerance, f"{graph.name}: row {r} (a tree of {tree.size} nodes "
                                                              f"at cache length {length})",
                                            "the batch-1 tree graph run on that row alone"))
        parity.add(out[LOGITS][r], alone[LOGITS][0], out[NEXT_TOKENS][r])
    return {**parity.to_dict(), "rows": [[length, tree.size] for length, _, tree in rows.values()], "idle_row": idle,
            "max_rel_output_diff": worst}


@contextmanager
def _restored(cache, start: int, count: int):
    """Put back the K/V positions [start, start + count) after the block (in-place writes; a
    recurrent state is only read by the graphs)."""
    saved = cache.rows_store.save(1, start, count) if count else {}
    try:
        yield
    finally:
        cache.rows_store.restore(saved, 1, start)


def _rows_against_one(engine, one, cache, tokens: int, ref_ids: np.ndarray, max_seq_len: int,
                      in_place: bool) -> float:
    """Max |Δlogit| between a ``tokens``-token call's rows and one-token calls over the same
    positions, at two cache lengths (0 when every row agrees bit for bit)."""
    worst = 0.0
    for length in sorted({0, (max_seq_len - tokens - 1) // 2}):
        def run(graph, start: int, count: int) -> np.ndarray:
            feeds = dict(cache.view())
            feeds[INPUT_IDS] = ref_ids[start : start + count][None, :]  # [1, count]
            feeds[CACHE_LENGTH] = np.array([start], dtype=np.int64)
            if VALID_TOKENS in graph.inputs:
                feeds[VALID_TOKENS] = np.array([count], dtype=np.int64)
            return graph.run(feeds, [LOGITS], cache.in_place_outputs() if in_place else None)[LOGITS][0]  # [count, V]

        with _restored(cache, length, tokens + 2):
            many = run(engine, length, tokens)  # [T, V]
            ones = np.concatenate([run(one, length + i, 1) for i in range(tokens)])  # [T, V]
        worst = max(worst, float(np.abs(many - ones).max()))
    return worst


# -- batched graphs: every row against the batch-1 graph --------------------------------------


@dataclass(frozen=True)
class BatchedGraph:
    name: str
    path: Path
    tokens: int
    batch: int


def row_plan(batch: int, tokens: int, max_seq_len: int) -> list[tuple[int, int]]:
    """(cache length, valid tokens) of each row of a batched check: lengths spread over the
    cache, counts T, T-1, ... (right-padded rows), and with 2 rows or more the last one idle."""
    last = max_seq_len - tokens
    rows = []
    for r in range(batch):
        if batch > 1 and r == batch - 1:
            rows.append((0, 0))  # idle: nothing read, nothing written
        else:
            rows.append(((last * (r + 1)) // batch, tokens - r % tokens))
    return rows


def validate_batched(graphs: list[BatchedGraph], single_name: dict[int, str], specs, single: KVCache,
                     ref_ids: np.ndarray, threads: int | None, full_rows: bool = False,
                     tap_tolerance: float = 1e-4) -> dict[str, dict]:
    """Each batched (in-place, ort-gqa) graph on rows at different cache lengths with different
    valid counts and an idle row, against the batch-1 graph of its size on each row alone (its
    logits, and the aux_hidden_states of a recipe with a head: those must agree to fp32 rounding):
    graph name -> Parity figures (the batch-1 graph as reference), plus whether padding and the
    idle row left the cache untouched (a one-line error when not). ``single``: a batch-1 cache
    filled with ``ref_ids`` (validate_model's), ``single_name``: tokens -> batch-1 graph name.
    ``full_rows``: fed rows count all T tokens as real, as the runtime feeds a quantized model
    (ModelEntry.full_rows), and must agree with the batch-1 graph bit for bit."""
    shared = SharedGraphs()
    options = EngineOptions(threads=threads)
    results = {}
    for graph in graphs:
        engine = OrtEngine(graph.name, graph.path, *specs[graph.name], options, shared)
        one = OrtEngine(single_name[graph.tokens], graph.path, *specs[single_name[graph.tokens]], options, shared)
        rows = row_plan(graph.batch, graph.tokens, single.max_seq_len)
        filled = single.view()  # name -> [1, n_kv, S_max, hd]
        cache = {name: np.repeat(array, graph.batch, axis=0) for name, array in filled.items()}  # [B, n_kv, S_max, hd]
        before = {name: array.copy() for name, array in cache.items()}
        ids = np.full((graph.batch, graph.tokens), PAD_ID, dtype=np.int64)  # [B, T]
        for r, (length, valid) in enumerate(rows):
            ids[r, :valid] = ref_ids[length : length + valid]
        fed = [graph.tokens if full_rows and valid else valid for _, valid in rows]  # what valid_tokens says
        # positions a row may write: its fed tokens, and a quantized graph's pad token after one (row_pad)
        written = [n + (1 if full_rows and n == 1 else 0) for n in fed]
        feeds = {**cache, INPUT_IDS: ids,
                 CACHE_LENGTH: np.array([length for length, _ in rows], dtype=np.int64),  # [B]
                 VALID_TOKENS: np.array(fed, dtype=np.int64)}  # [B]
        presents = {present_of(name): array for name, array in cache.items()}
        # a recipe with a hidden-state head: the taps the batched loop hands each row's head
        taps = [AUX_HIDDEN_STATES] if AUX_HIDDEN_STATES in specs[graph.name][1] else []
        out = engine.run(feeds, [LOGITS, NEXT_TOKENS, *taps], presents)  # logits [B, T, V], aux [B, T, F]
        parity, exact = Parity(), True
        for r, (length, valid) in enumerate(rows):
            if valid == 0:
                continue
            row_feeds = {**filled, INPUT_IDS: ids[r : r + 1], CACHE_LENGTH: np.array([length], dtype=np.int64),
                         VALID_TOKENS: np.array([fed[r]], dtype=np.int64)}
            with _restored(single, length, graph.tokens + 1):
                alone = one.run(row_feeds, [LOGITS, *taps], single.in_place_outputs())
            parity.add(out[LOGITS][r, :valid], alone[LOGITS][0, :valid], out[NEXT_TOKENS][r, :valid])
            if full_rows:  # bit for bit is not promised across batch sizes: recorded
                exact = exact and np.array_equal(out[LOGITS][r, :valid], alone[LOGITS][0, :valid])
            for name in taps:
                if _rows_agree(out[name][r, :valid], alone[name][0, :valid], tap_tolerance) is None:
                    diff = float(np.abs(out[name][r, :valid] - alone[name][0, :valid]).max())
                    raise SpecexportError(f"{graph.name}: row {r}'s {name} differs from the batch-1 graph run on "
                                          f"that row alone by {diff:.3g}; the heads would read another row's features")
        untouched = all(np.array_equal(cache[name][r, :, length + written[r] :], before[name][r, :, length + written[r] :])
                        for name in cache for r, (length, _) in enumerate(rows))
        if not untouched:
            raise SpecexportError(f"{graph.name}: the batched graph wrote cache positions past a row's valid "
                                  "tokens (padding or an idle row); its valid_tokens input is not honoured")
        results[graph.name] = {**parity.to_dict(), "rows": [list(row) for row in rows], "padding_untouched": True,
                               **({"rows_equal_batch_1": exact} if full_rows else {})}
    return results


def append_rows(batch: int, tokens: int, max_seq_len: int, ref_ids: np.ndarray) -> tuple[list[dict[str, np.ndarray]], list[int]]:
    """The batch-1 feeds of each row of a batched append graph's check (``row_plan``: spread
    cache lengths, T, T-1, ... real tokens right-padded, the last row idle) on the reference
    text: row r reads ``ref_ids`` from its cache length on. Returns (rows, real tokens of each)."""
    rows, valid = [], []
    for length, count in row_plan(batch, tokens, max_seq_len):
        ids = np.full((1, tokens), PAD_ID, dtype=np.int64)  # [1, T]
        ids[0, :count] = ref_ids[length : length + count]
        rows.append({INPUT_IDS: ids, CACHE_LENGTH: np.array([length], dtype=np.int64)})  # [1, T], [1]
        valid.append(count)
    return rows, valid


def validate_batched_append(graphs: list[BatchedGraph], single: dict[int, GraphUnderTest], specs, cache: KVCache,
                            ref_ids: np.ndarray, threads: int | None, tolerance: float = 1e-4) -> dict[str, dict]:
    """Each batched append graph (standard attention: a static graph per batch size, returning
    the new K/V that the runtime writes into each row's cache itself) on rows at different cache
    lengths, with different counts of real tokens (the rest padding) and an idle row, against the
    batch-1 graph of its size (``single``: tokens -> batch-1 graph) fed each row alone: the same
    padded tokens at that row's cache length (validate.check_batched_rows). The logits, next
    tokens, presents (and taps) of a row's real positions, which the runtime keeps, must agree
    to ``tolerance`` of their scale (fp32 rounding), else a one-line error naming the row: a mask
    that ignored a row's own cache length, or rows mixed up, fails here. ``cache``: a batch-1
    cache filled with ``ref_ids`` (validate_model's; the slots past each row's length hold data
    the mask must hide). Returns graph name -> Parity figures (the batch-1 graph as reference),
    the rows, and the worst relative difference of the other outputs."""
    shared = SharedGraphs()
    options = EngineOptions(threads=threads)
    past = cache.view()  # name -> [1, n_kv, S_max, hd]
    results = {}
    for graph in graphs:
        alone = single[graph.tokens]
        engine = OrtEngine(graph.name, graph.path, *specs[graph.name], options, shared)
        one = OrtEngine(alone.name, alone.path, *specs[alone.name], options, shared)
        rows, valid = append_rows(graph.batch, graph.tokens, cache.max_seq_len, ref_ids)
        outputs = [name for name in specs[graph.name][1] if name != LOGITS]  # next tokens, presents, taps
        parity, worst = check_batched_rows(graph.name, engine, one, past, rows, valid, [LOGITS, *outputs],
                                           tolerance=tolerance)
        results[graph.name] = {**parity.to_dict(), "rows": [[int(r[CACHE_LENGTH][0]), v] for r, v in zip(rows, valid)],
                               "max_rel_output_diff": worst, "outputs_compared": sorted([LOGITS, *outputs])}
    return results


def _token_rows(name: str, array: np.ndarray, row: int, count: int | None) -> np.ndarray:
    """Row ``row``'s first ``count`` tokens of an output (None: all): present.* [B, n_kv, T, hd]
    on axis 2, every other output [B, T, ...] on axis 1."""
    return array[row, :, :count] if is_present(name) else array[row, :count]


def _pairs_agree(pairs, tolerance: float, where: str, alone: str = "the batch-1 graph run on that row alone") -> float:
    """The worst ``_rows_agree`` of one batched row's outputs ``pairs`` (name, got, want), or a
    one-line error naming the row (``where``: "graph: row r (...)") and the first that differs."""
    worst = 0.0
    for name, got, want in pairs:
        agree = _rows_agree(got, want, tolerance)
        if agree is None:
            raise SpecexportError(f"{where} differs in {name} from {alone}; the batched graph mixes or misplaces rows")
        worst = max(worst, agree)
    return worst


def _rows_agree(got: np.ndarray, want: np.ndarray, tolerance: float = 1e-4) -> float | None:
    """max |Δ| / scale of two outputs of one row (0 for equal integers), or None when they do
    not agree: integers differ, -inf (a head's logits off its draft vocabulary) in other
    places, or finite values apart by more than ``tolerance`` of the scale (fp32 rounding: 1e-4)."""
    if not np.issubdtype(want.dtype, np.floating):
        return 0.0 if np.array_equal(got, want) else None
    finite = np.isfinite(want)
    if not np.array_equal(finite, np.isfinite(got)):
        return None
    if not finite.any():
        return 0.0
    diff = float(np.abs(got[finite] - want[finite]).max()) / max(1.0, float(np.abs(want[finite]).max()))
    return diff if diff <= tolerance else None


def _as_is(got: np.ndarray, want: np.ndarray, next_tokens: np.ndarray | None):
    return got, want, next_tokens


def check_batched_rows(graph: str, batched, single, past: dict[str, np.ndarray], rows: list[dict[str, np.ndarray]],
                       valid: list[int], outputs: list[str], figures=_as_is, whole: tuple[str, ...] = (),
                       tolerance: float = 1e-4):
    """An append-mode batched graph (a head's: the runtime writes each row's first valid
    presents, so it needs no valid_tokens) against its batch-1 graph on each row alone.
    ``past``: the batch-1 cache every row reads ([1, n_kv, S_max, hd] each); ``rows``: each
    row's other feeds at batch 1 (input_ids [1, T], cache_length [1], features), right-padded;
    ``valid``: its real tokens (0: an idle row, not compared). Every output in ``outputs`` must
    agree over each row's valid tokens (those in ``whole``, a block head's drafts: over all of
    theirs), else the build fails in one line naming the row.
    Returns the Parity of the logits (``figures`` maps (got, want, next tokens) to what
    Parity.add takes: a head's draftable columns) and the worst relative difference."""
    feeds = {name: np.repeat(array, len(rows), axis=0) for name, array in past.items()}  # [B, n_kv, S_max, hd]
    for key in rows[0]:
        feeds[key] = np.concatenate([row[key] for row in rows])  # [B, T, ...]
    got = batched.run(feeds, outputs)
    parity, worst = Parity(), 0.0
    for r, (row, count) in enumerate(zip(rows, valid)):
        if count == 0:
            continue
        want = single.run({**past, **row}, outputs)
        pairs = [(name, _token_rows(name, got[name], r, None if name in whole else count),
                  _token_rows(name, want[name], 0, None if name in whole else count)) for name in outputs]
        worst = max(worst, _pairs_agree(pairs, tolerance,
                                        f"{graph}: row {r} ({count} tokens at cache length {int(row[CACHE_LENGTH][0])})"))
        span = None if LOGITS in whole else count
        parity.add(*figures(got[LOGITS][r, :span], want[LOGITS][0, :span], got[NEXT_TOKENS][r, :span]))
    return parity, worst
