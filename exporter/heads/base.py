"""What a hidden-state drafter head gets from the builder, and what it gives back.

A head's module loads its checkpoint into a ``LoadedHead`` (which target layers it reads, and
how to build its graphs). The builder merges every head's taps into the target's one
``aux_hidden_states`` output, exports and validates the target, then calls ``head.build(ctx)``
for each head. ``HeadContext`` is everything a head needs to write graphs into the engine
directory the same way the builder does: a weights file, graph entries with roles, parity
checked against the precision's limits, the target's hidden states on the reference text, and
its runners timed with every other graph.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import onnx
import torch

from specexport.backends import ONNXRUNTIME
from specexport.contract import DrafterEntry, EngineEntry, KVUpdate, ModelEntry, Role, engine_name
from specexport.exporter.exact_rows import HEAD_REWRITES, RowExactness
from specexport.exporter.fill import fill_copy, fill_sizes
from specexport.exporter.gpu_build import mark_host_nodes
from specexport.exporter.onnx_export import WeightStore, tensor_specs
from specexport.exporter.validate import reference_ids

HEAD_BITS = {"int8": 8}  # a head's `precision:` -> MatMulNBits bits

if TYPE_CHECKING:
    from specexport.exporter.builder import Builder
    from specexport.exporter.plan import DraftPlanResult
    from specexport.exporter.sources import LoadedModel
    from specexport.runtime.runner import ModelRunner


class LoadedHead(Protocol):
    # the target's hidden states this head reads, in transformers' output_hidden_states indices
    # (i < L: the stream entering layer i; L: after the final norm), in the head's own order
    taps: tuple[int, ...]

    def build(self, ctx: HeadContext) -> None:
        """Export, validate and register the head's graphs and model entry through ``ctx``."""

    def drafter_entry(self, name: str) -> DrafterEntry:
        """The manifest's drafter entry (kind, model = name, params the runtime reads)."""


def merged_taps(heads: list[LoadedHead]) -> tuple[int, ...]:
    """The target's tapped layers for every head together: sorted, each once. A head finds its
    own columns with ``tap_columns``."""
    return tuple(sorted({i for head in heads for i in head.taps}))


def tap_columns(target_taps: tuple[int, ...], head_taps: tuple[int, ...], hidden: int) -> list[int]:
    """Column indices of ``aux_hidden_states`` [.., len(target_taps)·hidden] holding the head's
    taps, in the head's order (a head graph gathers them itself, so the runtime passes the
    target's tensor through untouched)."""
    columns: list[int] = []
    for tap in head_taps:
        start = target_taps.index(tap) * hidden
        columns += range(start, start + hidden)
    return columns


@dataclass
class HeadContext:
    builder: Builder
    tmp: Path  # the engine directory being written
    name: str  # the drafter's name: its model's name in the manifest and its graphs' prefix
    plan: DraftPlanResult  # draft_len (D), tokens_per_verify
    target: LoadedModel  # the transformers target (the reference for taps)
    target_taps: tuple[int, ...]  # the target's aux_hidden_states columns, in this order
    threads: int | None = None
    precision: str = "fp32"  # the drafter's `precision:`: int8 / int4 graphs read MatMulNBits weights
    _hidden: dict[int, tuple[np.ndarray, ...]] = field(default_factory=dict)
    _quantized: dict[str, Any] = field(default_factory=dict)  # what quantize_head_graph did, for the model entry
    _exactness: RowExactness | None = None  # the probe of the quantized graphs' kernels (made at the first)

    @property
    def recipe(self):
        return self.builder.recipe

    @property
    def batch(self) -> int:
        return 1  # a head's reference graphs and checks run at batch 1; its batched entries: ``batches``

    @property
    def batches(self) -> list[int]:
        """The recipe's batch sizes above 1: a head with batched graphs registers entries there
        too (``save_batched``), over the same file as its batch-1 entries."""
        return [b for b in self.builder.recipe.shapes.batches if b > 1]

    @property
    def max_seq_len(self) -> int:
        return self.builder.recipe.shapes.max_seq_len

    @property
    def prefill_chunk(self) -> int:
        return self.builder.recipe.shapes.prefill_chunk

    @property
    def opset(self) -> int:
        return self.builder.recipe.opset

    def step(self, kind: str, what: str):
        """A progress step (``with ctx.step("export", graph) as s: s.detail = ...``)."""
        return self.builder.rep.step(kind, what)

    def weights(self) -> WeightStore:
        """The head's one weights file (close it when every graph is saved)."""
        return WeightStore(self.tmp / f"{self.name}.weights")

    def save_graph(self, proto: onnx.ModelProto, role: Role, tokens: int, store: WeightStore,
                   kv_update: KVUpdate = KVUpdate.APPEND) -> tuple[str, Path]:
        """Write one graph (weights into ``store``) and register its engine entry; returns its
        engine name and path. ``tokens``: the graph's T (rows of input_ids)."""
        name = engine_name(self.name, role, self.batch, tokens)
        return name, self.save_shared_graph(proto, name, {tokens: role}, store, kv_update)[name]

    def save_shared_graph(self, proto: onnx.ModelProto, file_stem: str, sizes: dict[int, Role],
                          store: WeightStore, kv_update: KVUpdate = KVUpdate.APPEND,
                          fills: dict[str, tuple[int, Path]] | None = None) -> dict[str, Path]:
        """Write one graph as ``file_stem``.onnx and register an engine entry per size (token
        count -> role): a graph with a symbolic token count serves them all from one session.
        Returns engine name -> path. ``fills``: also write its fill copy (exporter/fill.py) with
        an entry of role fill per size, added here as engine name -> (tokens, path)."""
        path = self.tmp / f"{file_stem}.onnx"
        proto = self._quantize(proto, max(sizes))
        if self.recipe.device == "cuda":  # its host arithmetic may stay on the CPU (runtime/placement.py)
            proto = mark_host_nodes(proto)
        specs = {t: (tensor_specs(proto, "inputs", t), tensor_specs(proto, "outputs", t)) for t in sizes}
        fill = fill_copy(proto) if fills is not None else None  # of the graph as saved: the same weights
        store.save(proto, path)
        onnx.checker.check_model(str(path))
        if fill is not None and fills is not None:
            fills.update(self.builder.save_fill(self.tmp, self.name, fill, store, fill_sizes(sizes), kv_update))
        paths = {}
        for tokens, role in sizes.items():
            name = engine_name(self.name, role, self.batch, tokens)
            inputs, outputs = specs[tokens]
            self.builder.specs[name] = (inputs, outputs)
            self.builder.engines.append(EngineEntry(
                name=name, model=self.name, role=role, backend=ONNXRUNTIME, path=path.name, batch=self.batch,
                tokens=tokens, inputs=inputs, outputs=outputs, kv_update=kv_update, weights=store.location,
            ))
            paths[name] = path
        return paths

    def _quantize(self, proto: onnx.ModelProto, tokens: int) -> onnx.ModelProto:
        """The graph at the drafter's precision (its inputs and outputs unchanged): every graph of
        the head quantized alike, so the weights file holds each tensor once. Its kernels are
        probed on this machine at its largest call (``tokens`` rows, at every batch size): a
        head's graph has no pad, so one whose row alone differs from verify's is refused."""
        if self.precision == "fp32":
            return proto
        from specexport.exporter.quantize import WeightQuant, quantize_head_graph

        options = self.recipe.quantization
        spec = WeightQuant(HEAD_BITS[self.precision], options.block_size, options.symmetric, options.accuracy_level,
                           HEAD_BITS[self.precision])
        with self.step("quantize", f"{self.name} graph ({self.precision})") as s:
            proto, done = quantize_head_graph(proto, spec)
            self._quantized = {**done, "matmuls": max(done["matmuls"], self._quantized.get("matmuls", 0))}
            exactness = self._row_exactness()
            exactness.pad(proto, self.max_seq_len, (tokens * max([1, *self.batches]), tokens))
            s.detail = (f"{done['matmuls']} MatMulNBits, block {spec.block_size}, embedding "
                        f"{'8-bit blocks' if done['embedding_bits'] else 'fp32'}, one-row calls {exactness.describe()}")
        return proto

    def _row_exactness(self) -> RowExactness:
        if self._exactness is None:
            self._exactness = RowExactness(self.name, self.threads, 1, 1, rewrites=HEAD_REWRITES,
                                           label=f"drafter '{self.name}' at precision {self.precision}",
                                           fix="use precision: fp32 for this drafter")
        return self._exactness

    def save_batched(self, proto: onnx.ModelProto, path: Path, sizes: dict[int, Role], store: WeightStore,
                     kv_update: KVUpdate = KVUpdate.APPEND) -> dict[str, tuple[int, int]]:
        """Register entries of a graph already written at ``path`` whose batch is symbolic, at
        each of ``batches`` for each size (token count -> role). Returns engine name -> (batch,
        tokens); the head validates them row by row against its batch-1 graph."""
        saved = {}
        for batch in self.batches:
            for tokens, role in sizes.items():
                name = engine_name(self.name, role, batch, tokens)
                inputs, outputs = (tensor_specs(proto, "inputs", tokens, batch),
                                   tensor_specs(proto, "outputs", tokens, batch))
                self.builder.specs[name] = (inputs, outputs)
                self.builder.engines.append(EngineEntry(
                    name=name, model=self.name, role=role, backend=ONNXRUNTIME, path=path.name, batch=batch,
                    tokens=tokens, inputs=inputs, outputs=outputs, kv_update=kv_update, weights=store.location,
                ))
                saved[name] = (batch, tokens)
        return saved

    def add_model(self, entry: ModelEntry) -> None:
        if self._quantized:
            probed = ({"one_row_calls": self._exactness.describe(), "exactness": self._exactness.record()}
                      if self._exactness is not None else {})
            entry = replace(entry, info={**entry.info, "weights_quantized": {"precision": self.precision,
                                                                            **self._quantized, **probed}})
        self.builder.models[entry.name] = entry

    def record_parity(self, graph: str, figures: dict[str, Any], reference: str, precision: str = "fp32") -> None:
        """Check ``graph``'s figures (validate.Parity.to_dict()) against the precision's limits
        (raises a one-line error: the build fails and leaves nothing) and record them."""
        if self.precision != "fp32" and precision == "fp32":  # against the fp32 reference: the head's limits
            precision = f"{self.precision}/head"
        self.builder.record_parity(graph, figures, reference, precision)

    def time_with(self, runner: ModelRunner) -> None:
        """Time ``runner``'s graphs in the builder's one interleaved schedule (cost_ms)."""
        self.builder.timing[self.name] = runner

    def time_fill(self, runner: ModelRunner) -> None:
        """Time ``runner``'s fill entries in the same schedule (cost_ms)."""
        from specexport.runtime.runner import FillTiming

        self.builder.timing[f"{self.name}.fill"] = FillTiming(runner)

    def reference_ids(self, length: int) -> np.ndarray:
        """Real text from the target's tokenizer (the builder's validation corpus): [length]."""
        return reference_ids(self.target.tokenizer, length)

    def target_hidden_states(self, ids: np.ndarray) -> tuple[np.ndarray, ...]:
        """transformers' output_hidden_states of the target on ``ids`` [S]: L+1 arrays [S, hidden]
        (index i < L: the stream entering layer i; L: after the final norm). Cached per length."""
        key = hash(ids.tobytes())
        if key not in self._hidden:
            with torch.no_grad():
                out = self.target.model(torch.from_numpy(ids).unsqueeze(0), use_cache=False, output_hidden_states=True)
            self._hidden[key] = tuple(h[0].float().numpy() for h in out.hidden_states)
        return self._hidden[key]
