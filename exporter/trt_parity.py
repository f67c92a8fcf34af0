"""Build-time parity of each TensorRT engine with the ONNX graph it was built from.

Right after a plan is built, it runs on the GPU beside its ONNX graph on onnxruntime (CPU,
fp32: the graph the build validated against transformers) on the same inputs: random tokens
at several cache lengths over one random cache (the two implementations of one graph must
agree on any input, and the mask must hide the same slots). The figures are validate.Parity's
and the limits validate.TOLERANCES' for the engine's precision (relative to the logit scale;
an argmax may differ only at a near-tie of the reference). They are recorded in the engine's
manifest entry (``parity``), and a difference beyond them fails the build unless the recipe
says ``tensorrt.parity: record``.

Every graph kind is compared the same way, the hidden-state heads' too: the inputs are made from
the entry's own specs (``FEEDS``: tokens, cache length, a chain head's features, a block head's
context rows and how many are valid), the logits over the columns the reference can produce (a
head with a reduced draft vocabulary gives -inf elsewhere, and the engine must too), the in-graph
argmax against the reference's wherever the two argmaxes agree (a block head's next_tokens are
mapped through d2t, so not its logits' own argmax), and every other float output (the present
K/V, a head's hidden_out or block_hidden, the target's aux_hidden_states) as max |Δ| over its
scale, enforced where validate.TOLERANCES has a limit for hidden states (fp32).

The comparison takes two callables (feeds -> outputs), so it is tested without a GPU; the
TensorRT side (``TrtPlanRunner``) has only ever been type-checked.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from specexport.contract import (
    CACHE_LENGTH,
    CONTEXT_VALID,
    INPUT_IDS,
    LOGITS,
    NEXT_TOKENS,
    VALID_TOKENS,
    EngineEntry,
    TensorSpec,
)
from specexport.errors import SpecexportError
from specexport.exporter.validate import TOLERANCES, Parity, cache_lengths
from specexport.runtime import trt_engine
from specexport.runtime.engine import EngineOptions

Feeds = dict[str, np.ndarray]
Runner = Callable[[Feeds], Mapping[str, np.ndarray]]
OUTPUTS = (LOGITS, NEXT_TOKENS)  # what every graph has; compared_outputs adds the rest
PARITY_SEED = 0


@dataclass(frozen=True)
class FeedCase:
    """One comparison's facts the inputs are made from."""

    entry: EngineEntry
    cache_length: int
    index: int  # which of the cache lengths (0, 1, ...)
    rng: np.random.Generator


def _token_ids(spec: TensorSpec, case: FeedCase) -> np.ndarray:
    vocab = case.entry.outputs[LOGITS].shape[-1]  # a block head's draft vocabulary: ids below it are target ids too
    return case.rng.integers(0, vocab, size=spec.shape).astype(spec.dtype)  # [B, T]


def _cache_length(spec: TensorSpec, case: FeedCase) -> np.ndarray:
    return np.full(spec.shape, case.cache_length, dtype=spec.dtype)  # [B]


def _all_tokens(spec: TensorSpec, case: FeedCase) -> np.ndarray:
    return np.full(spec.shape, case.entry.tokens, dtype=spec.dtype)  # [B]


def _context_valid(spec: TensorSpec, case: FeedCase) -> np.ndarray:
    # every context row, then half of them, in turn: the mask must hide the same padding rows
    rows = case.entry.tokens if case.index % 2 == 0 else max(1, case.entry.tokens // 2)
    return np.full(spec.shape, rows, dtype=spec.dtype)  # [B]


def _features(spec: TensorSpec, case: FeedCase) -> np.ndarray:
    return case.rng.standard_normal(spec.shape).astype(spec.dtype)  # draft_features, context_features [B, T, F]


# input name -> how its value is made; any other input (features) is random normal
FEEDS: dict[str, Callable[[TensorSpec, FeedCase], np.ndarray]] = {
    INPUT_IDS: _token_ids,
    CACHE_LENGTH: _cache_length,
    VALID_TOKENS: _all_tokens,
    CONTEXT_VALID: _context_valid,
}


def parity_feeds(entry: EngineEntry, seed: int = PARITY_SEED) -> list[Feeds]:
    """Inputs for one graph: one random cache [B, n_kv, S_max, hd] per past input, and the other
    inputs by ``FEEDS`` (random tokens [B, T], features), at the cache lengths validation uses
    (empty to nearly full)."""
    rng = np.random.default_rng(seed)
    past = {n: s for n, s in entry.inputs.items() if n.startswith(trt_engine.PAST)}
    max_seq_len = next(iter(past.values())).shape[2] if past else entry.tokens + 1
    cache = {n: rng.standard_normal(s.shape).astype(s.dtype) for n, s in past.items()}  # [B, n_kv, S_max, hd]
    feeds = []
    for index, length in enumerate(cache_lengths(max_seq_len, entry.tokens)):
        case = FeedCase(entry, length, index, rng)
        feeds.append({**cache, **{n: FEEDS.get(n, _features)(s, case) for n, s in entry.inputs.items() if n not in past}})
    return feeds


def compared_outputs(entry: EngineEntry) -> list[str]:
    """The logits, the in-graph argmax and every other float output of ``entry``."""
    rest = [n for n, s in entry.outputs.items() if n not in OUTPUTS and np.dtype(s.dtype).kind == "f"]
    return [*OUTPUTS, *rest]


def _producible(got: np.ndarray, want: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The logits [N, V] over the columns the reference can produce (a reduced draft vocabulary
    scattered into the target's is -inf elsewhere); the engine must give -inf there too, else its
    figures are made NaN (which fails)."""
    columns = np.isfinite(want).any(axis=0)  # [V]
    kept = got[:, columns].astype(np.float64)
    if not np.isneginf(got[:, ~columns]).all():
        kept = kept + np.nan
    return kept, want[:, columns].astype(np.float64)


@dataclass
class OutputDiff:
    """One float output's worst difference and its scale (max(1, max |reference|))."""

    diff: float = 0.0
    scale: float = 1.0

    def add(self, got: np.ndarray, want: np.ndarray) -> None:
        diff = float(np.abs(got.astype(np.float64) - want).max()) if want.size else 0.0  # NaN when either has one
        self.diff = diff if not diff <= self.diff else self.diff
        self.scale = max(self.scale, float(np.abs(want).max()) if want.size else 0.0)

    @property
    def relative(self) -> float:
        return self.diff / self.scale


def _outputs_dict(diffs: dict[str, OutputDiff]) -> dict:
    if not diffs:
        return {}
    worst = max(diffs, key=lambda n: (diffs[n].relative != diffs[n].relative, diffs[n].relative))  # NaN first
    return {"max_rel_output_diff": diffs[worst].relative, "worst_output": worst,
            "output_rel_diffs": {n: d.relative for n, d in diffs.items()}}


def compare(engine: Runner, reference: Runner, feeds: Sequence[Feeds]) -> dict:
    """validate.Parity figures of ``engine`` against ``reference`` over ``feeds``, and the
    relative difference of every other float output both return."""
    parity = Parity()
    others: dict[str, OutputDiff] = {}
    for f in feeds:
        got, want = engine(f), reference(f)
        vocab = want[LOGITS].shape[-1]
        got_logits, want_logits = _producible(np.asarray(got[LOGITS]).reshape(-1, vocab),
                                              np.asarray(want[LOGITS]).reshape(-1, vocab))  # [B*T, V']
        parity.add(got_logits, want_logits)
        # the in-graph argmax (mapped to target ids by some heads) must be the reference's
        # wherever both logits agree on the argmax
        same = got_logits.argmax(-1) == want_logits.argmax(-1)  # [B*T]
        got_next, want_next = (np.asarray(x[NEXT_TOKENS]).reshape(-1) for x in (got, want))
        if not np.array_equal(got_next[same], want_next[same]):
            parity.next_tokens_match = False
        for name in want:
            if name not in OUTPUTS and name in got and np.asarray(want[name]).dtype.kind == "f":
                others.setdefault(name, OutputDiff()).add(np.asarray(got[name]), np.asarray(want[name]))
    return {**parity.to_dict(), **_outputs_dict(others)}


def check(name: str, figures: dict, precision: str) -> dict:
    """The limits for ``precision`` applied to ``figures`` (compare's); raises a one-line
    error when the engine is outside them. Returns the limits, for the manifest."""
    tol = TOLERANCES[precision]
    if tol.logit_rtol is None:
        return {"enforced": False}
    scale = figures["logit_scale"]
    logit_limit, tie_limit = tol.logit_rtol * scale, tol.near_tie_rtol * scale
    where = f"TensorRT engine {name} ({precision}) differs from its ONNX graph on onnxruntime"
    if not figures["max_abs_logit_diff"] <= logit_limit:  # `not <=`: NaN fails too
        raise SpecexportError(f"{where}: max |Δlogit| {figures['max_abs_logit_diff']:.3g} exceeds "
                              f"{logit_limit:.3g} ({tol.logit_rtol:g} x logit scale {scale:.3g})")
    if not figures["next_tokens_match"]:
        raise SpecexportError(f"{where}: its in-graph argmax (next_tokens) differs from the ONNX graph's "
                              "where their logits agree on the argmax")
    if figures["max_margin_at_disagreement"] >= tie_limit:
        raise SpecexportError(f"{where}: argmax differs where the reference's top-2 margin is "
                              f"{figures['max_margin_at_disagreement']:.3g}, above the near-tie limit {tie_limit:.3g}; "
                              f"argmax agreement {figures['argmax_agreement']:.2%}")
    limits = {"enforced": True, "max_abs_logit_diff_limit": logit_limit, "near_tie_margin_limit": tie_limit}
    if tol.aux_rtol is not None and "max_rel_output_diff" in figures:  # hidden states: fp32 only
        if not figures["max_rel_output_diff"] <= tol.aux_rtol:
            raise SpecexportError(f"{where}: its output {figures['worst_output']} differs by "
                                  f"{figures['max_rel_output_diff']:.3g} of its scale, above {tol.aux_rtol:g}")
        limits["max_rel_output_diff_limit"] = tol.aux_rtol
    return limits


def onnx_runner(entry: EngineEntry, path: Path) -> Runner:
    """The ONNX graph on onnxruntime's CPU provider, fp32, opened as the runtime and the build's
    validation open it (the process shares one onnxruntime thread pool)."""
    from specexport.runtime.ort_engine import OrtEngine

    engine = OrtEngine(entry.name, path, entry.inputs, entry.outputs, EngineOptions(device="cpu"))
    outputs = compared_outputs(entry)
    return lambda feeds: engine.run(feeds, outputs)


class TrtPlanRunner:
    """A freshly built plan behind the runtime's own TrtEngine (host KV: the feeds hold it)."""

    def __init__(self, entry: EngineEntry, root: Path, device: trt_engine.CudaDevice):
        self._engine = trt_engine.TrtEngine(entry, root, EngineOptions(device_kv=False), device)
        self._outputs = compared_outputs(entry)

    def __call__(self, feeds: Feeds) -> dict[str, np.ndarray]:
        return self._engine.run(feeds, self._outputs)

    def close(self) -> None:
        self._engine.close()


def engine_parity(entry: EngineEntry, root: Path, onnx_path: Path, precision: str,
                  device: trt_engine.CudaDevice, enforce: bool = True) -> dict:
    """Run the plan of ``entry`` (in ``root``) and ``onnx_path`` on the same inputs; return
    the ``parity`` record for its manifest entry; raise when out of tolerance and ``enforce``."""
    engine = TrtPlanRunner(entry, root, device)
    try:
        figures = compare(engine, onnx_runner(entry, onnx_path), parity_feeds(entry))
    finally:
        engine.close()
    return parity_record(entry.name, figures, precision, enforce)


def parity_record(name: str, figures: dict, precision: str, enforce: bool) -> dict:
    """The manifest's ``parity`` for an engine: the figures, the limits, whether they hold.
    Out of tolerance raises when ``enforce`` (tensorrt.parity: enforce), else is recorded."""
    record: dict[str, Any] = {**figures, "precision": precision,
                              "reference": "onnxruntime cpu fp32, same graph, random inputs"}
    try:
        record.update(check(name, figures, precision), within_tolerance=True)
        record["enforced"] = enforce and record["enforced"]
    except SpecexportError as err:
        if enforce:
            raise
        record.update(enforced=False, within_tolerance=False, problem=str(err))
    return record
