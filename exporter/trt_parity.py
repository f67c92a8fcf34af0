"""Build-time parity of each TensorRT engine with the ONNX graph it was built from.

Right after a plan is built, it runs on the GPU beside its ONNX graph on onnxruntime (CPU,
fp32: the graph the build validated against transformers) on the same inputs: random tokens
at several cache lengths over one random cache (the two implementations of one graph must
agree on any input, and the mask must hide the same slots). The figures are validate.Parity's
and the limits validate.TOLERANCES' for the engine's precision (relative to the logit scale;
an argmax may differ only at a near-tie of the reference). They are recorded in the engine's
manifest entry (``parity``), and a difference beyond them fails the build unless the recipe
says ``tensorrt.parity: record``.

The comparison takes two callables (feeds -> outputs), so it is tested without a GPU; the
TensorRT side (``TrtPlanRunner``) has only ever been type-checked.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from specexport.contract import EngineEntry
from specexport.errors import SpecexportError
from specexport.exporter.validate import TOLERANCES, Parity, cache_lengths
from specexport.runtime import trt_engine
from specexport.runtime.engine import EngineOptions

Feeds = dict[str, np.ndarray]
Runner = Callable[[Feeds], Mapping[str, np.ndarray]]
OUTPUTS = ("logits", "next_tokens")
PARITY_SEED = 0


def parity_feeds(entry: EngineEntry, seed: int = PARITY_SEED) -> list[Feeds]:
    """Inputs for one graph: one random cache [B, n_kv, S_max, hd] per past input, random tokens
    [B, T], at the cache lengths validation uses (empty to nearly full)."""
    rng = np.random.default_rng(seed)
    ids, vocab = entry.inputs["input_ids"], entry.outputs["logits"].shape[-1]
    past = {n: s for n, s in entry.inputs.items() if n.startswith(trt_engine.PAST)}
    max_seq_len = next(iter(past.values())).shape[2] if past else entry.tokens + 1
    cache = {n: rng.standard_normal(s.shape).astype(s.dtype) for n, s in past.items()}  # [B, n_kv, S_max, hd]
    lengths = entry.inputs["cache_length"]
    return [{
        **cache,
        "input_ids": rng.integers(0, vocab, size=ids.shape).astype(ids.dtype),  # [B, T]
        "cache_length": np.full(lengths.shape, length, dtype=lengths.dtype),  # [B]
    } for length in cache_lengths(max_seq_len, entry.tokens)]


def compare(engine: Runner, reference: Runner, feeds: Sequence[Feeds]) -> dict:
    """validate.Parity figures of ``engine`` against ``reference`` over ``feeds``."""
    parity = Parity()
    for f in feeds:
        got, want = engine(f), reference(f)
        vocab = want["logits"].shape[-1]
        parity.add(np.asarray(got["logits"]).reshape(-1, vocab), np.asarray(want["logits"]).reshape(-1, vocab),
                   np.asarray(got["next_tokens"]).reshape(-1))  # [B*T, V], [B*T, V], [B*T]
    return parity.to_dict()


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
        raise SpecexportError(f"{where}: its in-graph argmax (next_tokens) differs from its own logits")
    if figures["max_margin_at_disagreement"] >= tie_limit:
        raise SpecexportError(f"{where}: argmax differs where the reference's top-2 margin is "
                              f"{figures['max_margin_at_disagreement']:.3g}, above the near-tie limit {tie_limit:.3g}; "
                              f"argmax agreement {figures['argmax_agreement']:.2%}")
    return {"enforced": True, "max_abs_logit_diff_limit": logit_limit, "near_tie_margin_limit": tie_limit}


def onnx_runner(entry: EngineEntry, path: Path) -> Runner:
    """The ONNX graph on onnxruntime's CPU provider, fp32, opened as the runtime and the build's
    validation open it (the process shares one onnxruntime thread pool)."""
    from specexport.runtime.ort_engine import OrtEngine

    engine = OrtEngine(entry.name, path, entry.inputs, entry.outputs, EngineOptions(device="cpu"))
    return lambda feeds: engine.run(feeds, list(OUTPUTS))


class TrtPlanRunner:
    """A freshly built plan behind the runtime's own TrtEngine (host KV: the feeds hold it)."""

    def __init__(self, entry: EngineEntry, root: Path, device: trt_engine.CudaDevice):
        self._engine = trt_engine.TrtEngine(entry, root, EngineOptions(device_kv=False), device)

    def __call__(self, feeds: Feeds) -> dict[str, np.ndarray]:
        return self._engine.run(feeds, list(OUTPUTS))

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
