"""`specexport build`: recipe -> validated engine directory.

Steps: load -> plan -> export (+ quantize) -> validate -> write, each shown with its time.
The directory is written atomically (outdir.AtomicDir), and an unchanged rebuild reuses it.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import platform
from dataclasses import dataclass, field, replace
from importlib import metadata
from pathlib import Path

import numpy as np
import onnx

from specexport import __version__
from specexport.backends import BACKENDS, ONNXRUNTIME, TENSORRT
from specexport.contract import (
    AUX_HIDDEN_STATES,
    BATCHED_ROLES,
    KV_UPDATE_OF_ATTENTION,
    ROLE_PRIORITY,
    DrafterEntry,
    EngineEntry,
    KVLayout,
    KVUpdate,
    Manifest,
    ModelEntry,
    Role,
    engine_name,
    sha256_of,
    write_manifest,
)
from specexport.errors import BadInput, SpecexportError
from specexport.exporter.archs import read_decoder
from specexport.exporter.exact_rows import RowExactness
from specexport.exporter.fill import check_fill, fill_copy, fill_sizes
from specexport.exporter.gpu_build import mark_host_nodes
from specexport.exporter.graph_model import StaticDecoder, attention_refusal
from specexport.exporter.heads import HeadContext, LoadedHead, load_head, merged_taps
from specexport.exporter.low_precision import bf16_refusal, kv_dtype, low_precision_graph
from specexport.exporter.onnx_export import (
    WeightStore,
    chain_inputs,
    drop_outputs,
    export_graph,
    export_tree_graph,
    tensor_specs,
)
from specexport.exporter.outdir import AtomicDir, existing_manifest
from specexport.exporter.plan import DraftPlanResult, calibration_file, plan_recipe_draft
from specexport.exporter.quantize import count_quantized, quantize_int4
from specexport.exporter.quantized_model import Quantizer, dequantized_reference
from specexport.exporter.recipe import (
    HIDDEN_STATE_KINDS,
    LOW_PRECISIONS,
    WEIGHT_PRECISIONS,
    ModelDrafterSpec,
    QuantizedSelfDrafterSpec,
    Recipe,
    load_recipe,
)
from specexport.exporter.sources import (
    LoadedModel,
    eos_token_ids,
    file_sha256,
    fingerprint,
    folder_fingerprint,
    load_source,
)
from specexport.exporter.validate import (
    TOLERANCES,
    BatchedGraph,
    GraphUnderTest,
    check_parity,
    low_precision_error,
    reference_forward,
    reference_ids,
    validate_batched,
    validate_batched_append,
    validate_batched_tree,
    validate_model,
    validate_tree,
)
from specexport.exporter.validate_state import validate_batched_state
from specexport.progress import Reporter
from specexport.runtime.integrity import ensure_verified
from specexport.runtime.runner import FillTiming, ModelRunner, time_interleaved

# The models whose shared (ort-gqa) graph gets a fill copy (exporter/fill.py): the drafters'
FILL_KINDS = ("model", "quantized-self")

# Token counts a drafter model needs: one token per draft step, two to catch up after a
# round where every draft was accepted (the last draft and the bonus token).
DRAFTER_DECODE_SIZES = (1, 2)


@dataclass
class GraphSet:
    """The graphs of one model: token count -> role."""

    model: str
    sizes: dict[int, Role] = field(default_factory=dict)

    def add(self, tokens: int, role: Role) -> None:
        # one graph per size: the role first in ROLE_PRIORITY names it
        current = self.sizes.get(tokens)
        if current is None or ROLE_PRIORITY.index(role) < ROLE_PRIORITY.index(current):
            self.sizes[tokens] = role

    def names(self, batch: int) -> dict[int, str]:
        return {t: engine_name(self.model, role, batch, t) for t, role in sorted(self.sizes.items())}

    def batched(self, tokens: int | None) -> bool:
        """Is the graph of ``tokens`` built at every batch size (its role in BATCHED_ROLES)?"""
        return tokens in self.sizes and self.sizes[tokens] in BATCHED_ROLES

    def every_verify_size(self) -> GraphSet:
        """A copy with a verify graph at every size 2..1+D (1+D: the largest verify size): a round
        at depth k then runs 1+k rows, not 1+D (SmolLM2 int4, D=7: a depth-1 round ran 8 rows,
        15 ms against 9.5 ms for a decode step). Only for a graph whose token count is symbolic
        (ort-gqa), where each size is one more entry of the same file."""
        verify = [t for t, role in self.sizes.items() if role is Role.VERIFY]
        spread = GraphSet(self.model, dict(self.sizes))
        for tokens in range(2, max(verify, default=1) + 1):
            spread.add(tokens, Role.VERIFY)  # a probe of that size becomes the verify entry: no double
        return spread


def target_graphs(recipe: Recipe, plan: DraftPlanResult) -> GraphSet:
    graphs = GraphSet("target")
    graphs.add(1, Role.DECODE)
    graphs.add(plan.tokens_per_verify, Role.VERIFY)
    graphs.add(recipe.shapes.prefill_chunk, Role.PREFILL)
    for tokens in recipe.draft.probe_tokens:
        graphs.add(tokens, Role.PROBE)
    if any(isinstance(d, QuantizedSelfDrafterSpec) for d in recipe.drafters):
        graphs.add(2, Role.CATCHUP)  # the int4 copy is made from these fp32 graphs
    return graphs


def drafter_graphs(name: str, recipe: Recipe) -> GraphSet:
    graphs = GraphSet(name)
    graphs.add(1, Role.DECODE)
    graphs.add(2, Role.CATCHUP)
    graphs.add(recipe.shapes.prefill_chunk, Role.PREFILL)
    return graphs


def toolchain() -> dict:
    def version(dist: str) -> str | None:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    return {
        "specexport": __version__,
        "python": platform.python_version(),
        "torch": version("torch"),
        "transformers": version("transformers"),
        "onnx": version("onnx"),
        "onnxscript": version("onnxscript"),
        **{b.name: next(filter(None, map(version, b.dists)), None) for b in BACKENDS.values()},
        "device": f"cpu ({platform.machine()})",
        "compute_capability": None,
    }


def exporter_digest() -> str:
    """The exporter's own code is an input of the build too."""
    digest = hashlib.sha256()
    for path in sorted(Path(__file__).parent.rglob("*.py")):  # the heads' subpackage too
        digest.update(path.read_bytes())
    return digest.hexdigest()


def inputs_key(recipe: Recipe, fingerprints: dict, tools: dict) -> str:
    blob = json.dumps(
        {"recipe": recipe.model_dump(mode="json"), "sources": fingerprints, "toolchain": tools,
         "exporter": exporter_digest()},
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()


def check_tokenizers(target: LoadedModel, drafter: LoadedModel) -> None:
    t_vocab, d_vocab = target.tokenizer.get_vocab(), drafter.tokenizer.get_vocab()
    t_size = target.model.get_input_embeddings().weight.shape[0]
    d_size = drafter.model.get_input_embeddings().weight.shape[0]
    if t_size != d_size:
        raise BadInput(
            f"{drafter.origin}: vocabulary size {d_size} differs from the target's {t_size}; "
            "a draft model must share the target's tokenizer"
        )
    if t_vocab != d_vocab:
        differ = sorted(set(t_vocab.items()) ^ set(d_vocab.items()))[:1]
        raise BadInput(
            f"{drafter.origin}: tokenizer differs from the target's (token→id map; first difference "
            f"{differ[0] if differ else '?'}); a draft model must share the target's tokenizer"
        )


class Builder:
    def __init__(self, recipe: Recipe, base: Path, out: Path, reporter: Reporter, threads: int | None = None):
        self.recipe = recipe
        self.base = base
        self.out = out
        self.rep = reporter
        self.threads = threads
        self.engines: list[EngineEntry] = []
        self.models: dict[str, ModelEntry] = {}
        self.graph_files: dict[str, list[GraphUnderTest]] = {}  # batch 1, checked against transformers
        self.batched_files: dict[str, list[BatchedGraph]] = {}  # larger batches, checked row by row against batch 1
        self.tree_files: dict[str, GraphUnderTest] = {}  # the target's tree graph, checked path by path
        self.tree_batched: dict[str, list[BatchedGraph]] = {}  # its larger batches, checked row by row against it
        self.fill_files: dict[str, list[GraphUnderTest]] = {}  # drafters' fill graphs, checked against the full one
        self.specs: dict[str, tuple] = {}
        # model (or head part) -> its validated graphs, timed together at the end
        self.timing: dict[str, ModelRunner | FillTiming] = {}
        self.heads: dict[str, LoadedHead] = {}  # hidden-state drafters by name (exporter/heads)
        self.quantizers: dict[str, Quantizer] = {}  # int4 / int8 models: their quantization, for validation

    # -- steps ------------------------------------------------------------------------------

    def load(self) -> tuple[LoadedModel, dict[str, LoadedModel]]:
        with self.rep.step("load", "target") as s:
            target = load_source(self.recipe.target, self.base, "target")
            s.detail = f"{target.config.model_type}, {target.model.num_parameters() / 1e6:.1f}M params"
        drafter_models: dict[str, LoadedModel] = {}
        for i, spec in enumerate(self.recipe.drafters):
            if isinstance(spec, ModelDrafterSpec):
                with self.rep.step("load", f"drafter {spec.name}") as s:
                    loaded = load_source(spec.model, self.base, f"drafters.{i}.model")
                    check_tokenizers(target, loaded)
                    s.detail = f"{loaded.config.model_type}, {loaded.model.num_parameters() / 1e6:.1f}M params"
                drafter_models[spec.name] = loaded
            elif spec.kind in HIDDEN_STATE_KINDS:
                with self.rep.step("load", f"drafter {spec.name}") as s:
                    self.heads[spec.name] = load_head(spec, target, self.base, f"drafters.{i}")
                    s.detail = f"{spec.kind}, reads target layers {list(self.heads[spec.name].taps)}"
        return target, drafter_models

    def plan(self, target: LoadedModel) -> DraftPlanResult:
        with self.rep.step("plan", "draft length") as s:
            cfg = target.config
            plan = plan_recipe_draft(self.recipe, self.base, cfg.num_attention_heads,
                                     getattr(cfg, "num_key_value_heads", None))
            s.detail = f"G={plan.group_size}, D={plan.draft_len}"
        for warning in plan.warnings:
            self.rep.warn(warning)
        return plan

    def export_model(self, tmp: Path, name: str, kind: str, loaded: LoadedModel, graphs: GraphSet,
                     int4: tuple[str, QuantizedSelfDrafterSpec, GraphSet] | None = None,
                     taps: tuple[int, ...] = (), precision: str = "fp32", source=None) -> None:
        """``taps``: hidden states every graph also outputs (aux_hidden_states) for the heads.
        ``precision`` int4 / int8: the model's own graphs read quantized weights (``source``: its
        recipe source, whose GGUF blocks are kept where they map exactly)."""
        shapes = self.recipe.shapes
        parts = read_decoder(loaded.model, shapes.max_seq_len, loaded.origin)
        refusal = (attention_refusal(parts, self.recipe.attention) or self._state_refusal(parts)
                   or self._precision_refusal(parts, precision))
        if refusal is not None:
            raise BadInput(f"recipe: model '{name}': {refusal}")
        quantizer = Quantizer(self.recipe.quantization, precision, source, self.base, name) \
            if precision in WEIGHT_PRECISIONS else None
        decoder = StaticDecoder(parts, shapes.max_seq_len, self.recipe.attention, taps=taps).eval()
        state = decoder.state_layout  # linear-attention layers: a recurrent state beside the KV cache
        stores = {name: WeightStore(tmp / f"{name}.weights")}
        if int4 is not None:
            stores[int4[0]] = WeightStore(tmp / f"{int4[0]}.weights")
        # ort-gqa: one graph per model with a symbolic token count, every size an entry of it,
        # so that onnxruntime holds (and pre-packs) the weights once per model, not once per
        # size. With batch sizes above 1 its batch is symbolic too: every batch size shares the
        # weights. The standard graph stays one static graph per size (TensorRT's need), and per
        # batch size too: the decoding sizes (BATCHED_ROLES) again at each batch above 1, every
        # row with its own cache length (the mask is per row; the runtime keeps each row's
        # first real presents). A linear-attention model's graphs unroll their recurrence over
        # T: one static graph per size and batch, each row with its own recurrent state.
        shared = self.recipe.attention == "ort-gqa" and state is None
        if shared:  # one file serves every size: verify exactly what a round drafted
            graphs = graphs.every_verify_size()
        if quantizer is not None:  # its pad decided by this machine's kernels at the engine's largest call
            quantizer.exactness = RowExactness(name, self.threads, *self._largest_call(graphs))
        # the int4 copy's kernels: probed and recorded for bench, never padded (a drafter's rows need not agree)
        observed = RowExactness(int4[0], self.threads, *self._largest_call(int4[2])) if int4 is not None else None
        # ort-gqa trees: the target's one graph verifies trees too (its chain entries are fed a
        # chain's offsets and mask by the backend, contract.CHAIN_TREE_INPUTS), so trees cost no
        # second session and no second prepacked copy of the weights
        folded = shared and name == "target" and self.recipe.draft.tree.max_nodes > 0
        if folded:
            decoder = self._tree_decoder(parts, taps)
        batched = shapes.batches != [1]
        # (batch, tokens, label): None a symbolic size
        exports: list[tuple[int | None, int | None, str]]
        if shared:
            exports = [(None if batched else 1, None, f"{name} (every size)")]
        else:
            exports = [(1, tokens, label) for tokens, label in graphs.names(1).items()]
            for b in shapes.batches[1:]:
                exports += [(b, tokens, label) for tokens, label in graphs.names(b).items()
                            if graphs.batched(tokens) or (int4 is not None and int4[2].batched(tokens))]
        try:
            for batch, tokens, label in exports:
                with self.rep.step("export", label) as s:
                    proto = (export_tree_graph(decoder, None, self.recipe.opset, batch) if folded
                             else export_graph(decoder, batch, tokens, self.recipe.opset))
                    s.detail = f"{len(proto.graph.node)} nodes" + (
                        f", {'batch and ' if batched else ''}token count symbolic" if shared else "")
                static_batch = batch if batch is not None else 1  # a shared graph's files are named at batch 1
                if int4 is not None and (tokens is None or tokens in int4[2].sizes) and \
                        (static_batch == 1 or int4[2].batched(tokens)):
                    q_name, q_spec, q_graphs = int4
                    q_label = f"{q_name} (every size)" if tokens is None else q_graphs.names(static_batch)[tokens]
                    with self.rep.step("quantize", q_label) as s:
                        copy = onnx.ModelProto()
                        copy.CopyFrom(proto)
                        drop_outputs(copy, {AUX_HIDDEN_STATES})  # the heads read the fp32 target's taps
                        quantized = quantize_int4(copy, q_spec.block_size, q_spec.symmetric, q_spec.accuracy_level,
                                                  keep_head=not q_spec.quantize_head)
                        if observed is not None:
                            observed.observe(quantized)
                        s.detail = f"{count_quantized(quantized)} MatMulNBits, block {q_spec.block_size}"
                    quantized = self._cast(quantized, precision, q_label)  # the target's cache type
                    self._save(tmp, q_name, tokens, "quantized-self", quantized, stores[q_name], q_graphs,
                               static_batch)
                if quantizer is not None:
                    with self.rep.step("quantize", label) as s:
                        proto = quantizer.apply(proto, shapes.max_seq_len)
                        s.detail = quantizer.summary()
                    for line in quantizer.report_lines():
                        self.rep.note(line)
                proto = self._cast(proto, precision, label)
                if static_batch == 1 or graphs.batched(tokens):
                    self._save(tmp, name, tokens, kind, proto, stores[name], graphs, static_batch)
            if name == "target" and self.recipe.draft.tree.max_nodes:
                self._export_tree(tmp, name, parts, taps, stores[name], quantizer, proto if folded else None,
                                  precision)
        finally:
            for store in stores.values():
                store.close()
        kv = KVLayout(len(parts.attention_layers), parts.num_key_value_heads, parts.head_dim, shapes.max_seq_len,
                      kv_dtype(precision))
        summary = parts.summary()
        if taps:
            summary["taps"] = list(taps)
        vocab = int(summary.pop("vocab_size"))
        if quantizer is not None:
            summary["quantization"] = quantizer.manifest_info()
            self.quantizers[name] = quantizer
        self.models[name] = ModelEntry(name, kind, kv, vocab, f"{name}.weights", self.recipe.attention, summary, state)
        if int4 is not None:
            q_name, q_spec, _ = int4
            untapped = {k: v for k, v in summary.items() if k != "taps"}  # its graphs dropped the taps
            quant = {"bits": q_spec.bits, "block_size": q_spec.block_size, "symmetric": q_spec.symmetric,
                     "accuracy_level": q_spec.accuracy_level, "quantized_head": q_spec.quantize_head}
            probed = {"exactness": observed.record()} if observed is not None else {}
            self.models[q_name] = ModelEntry(q_name, "quantized-self", kv, vocab, f"{q_name}.weights",
                                             self.recipe.attention, {**untapped, **quant, **probed}, state)

    def _cast(self, proto: onnx.ModelProto, precision: str, label: str) -> onnx.ModelProto:
        """``proto`` in ``precision`` where that is fp16 or bf16 (exporter/low_precision.py); for
        device: cuda with its host arithmetic listed (gpu_build.mark_host_nodes)."""
        if precision in LOW_PRECISIONS:
            with self.rep.step("cast", label) as s:
                proto = low_precision_graph(proto, precision)
                s.detail = f"{precision}, KV cache {kv_dtype(precision)}"
        return mark_host_nodes(proto) if self.recipe.device == "cuda" else proto

    def _tree_decoder(self, parts, taps: tuple[int, ...]) -> StaticDecoder:
        try:
            return StaticDecoder(parts, self.recipe.shapes.max_seq_len, self.recipe.attention, taps=taps,
                                 tree=True).eval()
        except ValueError as err:
            raise BadInput(f"recipe: draft.tree: {err}") from None

    def _export_tree(self, tmp: Path, name: str, parts, taps: tuple[int, ...], store: WeightStore,
                     quantizer, folded: onnx.ModelProto | None, precision: str = "fp32") -> None:
        """The target's tree verify graphs, the same weights (contract.TREE_*; runtime/tree.py), at
        every batch size of the recipe: for ort-gqa entries of the model's one graph (``folded``,
        exported with the tree inputs and saved as ``{name}.onnx``), one for every tree size
        2..1 + draft.tree.max_nodes at each batch (a small tree runs only its rows); for standard
        attention one static graph of 1 + max_nodes rows per batch size (smaller trees are
        padded). Batch 1 is checked against transformers path by path, larger batches row by row
        against batch 1."""
        largest = 1 + self.recipe.draft.tree.max_nodes
        if largest > self.recipe.shapes.max_seq_len:
            raise BadInput(f"recipe: draft.tree.max_nodes ({largest - 1}) must be below shapes.max_seq_len")
        batches = self.recipe.shapes.batches
        # the batch sizes each file's entries serve: one file for all, or one per batch
        files = [batches] if folded is not None else [[b] for b in batches]
        decoder = None if folded is not None else self._tree_decoder(parts, taps)
        for served in files:
            if folded is not None:
                proto, path = folded, tmp / f"{name}.onnx"
            else:
                proto, path = self._export_static_tree(tmp, name, decoder, store, quantizer, served[0], largest,
                                                       precision)
            for batch in served:
                for tokens in range(2, largest + 1) if folded is not None else [largest]:
                    graph_name = engine_name(name, Role.TREE, batch, tokens)
                    inputs, outputs = tensor_specs(proto, "inputs", tokens, batch), tensor_specs(proto, "outputs", tokens, batch)
                    self.specs[graph_name] = (inputs, outputs)
                    self.engines.append(EngineEntry(
                        name=graph_name, model=name, role=Role.TREE, backend=ONNXRUNTIME, path=path.name, batch=batch,
                        tokens=tokens, inputs=inputs, outputs=outputs,
                        kv_update=KV_UPDATE_OF_ATTENTION[self.recipe.attention], weights=store.location,
                    ))
                graph = engine_name(name, Role.TREE, batch, largest)
                if batch == 1:
                    self.tree_files[name] = GraphUnderTest(graph, path, largest)
                else:
                    self.tree_batched.setdefault(name, []).append(BatchedGraph(graph, path, largest, batch))

    def _export_static_tree(self, tmp: Path, name: str, decoder: StaticDecoder, store: WeightStore,
                            quantizer, batch: int, rows: int, precision: str = "fp32") -> tuple[onnx.ModelProto, Path]:
        """Standard attention's tree verify graph of ``batch`` rows of ``rows`` tree rows."""
        file_name = engine_name(name, Role.TREE, batch, rows)
        with self.rep.step("export", file_name) as s:
            proto = export_tree_graph(decoder, rows, self.recipe.opset, batch)
            s.detail = f"{len(proto.graph.node)} nodes"
        if quantizer is not None:
            proto = quantizer.apply(proto, self.recipe.shapes.max_seq_len)
        proto = self._cast(proto, precision, file_name)
        path = tmp / f"{file_name}.onnx"
        store.save(proto, path)
        onnx.checker.check_model(str(path))
        return proto, path

    def _largest_call(self, graphs: GraphSet) -> tuple[int, int]:
        """(rows, tokens): the most rows (batch × tokens) and tokens one call of ``graphs`` runs,
        a tree verify's included."""
        tree = self.recipe.draft.tree.max_nodes + 1 if self.recipe.draft.tree.max_nodes else 0
        tokens = max(*graphs.sizes, tree)
        batched = max([t for t in graphs.sizes if graphs.batched(t)] + [tree, 1])
        return max(tokens, max(self.recipe.shapes.batches) * batched), tokens

    def _precision_refusal(self, parts, precision: str) -> str | None:
        """Why ``precision`` cannot be built for this model; None when it can."""
        if precision in LOW_PRECISIONS and parts.linear_layers:
            return (f"precision {precision} casts the KV cache, not yet a linear-attention layer's recurrent state; "
                    "this model stays fp32 for now")
        if precision not in WEIGHT_PRECISIONS:
            return None
        if self.recipe.attention != "ort-gqa" or parts.linear_layers:
            return (f"precision {precision} is built as onnxruntime's one shared graph per model (attention: ort-gqa, "
                    "every layer attending), where a one-token call is made to compute as a multi-token one; "
                    "standard-attention and linear-attention models stay fp32 for now")
        return None

    def _state_refusal(self, parts) -> str | None:
        """Why a model with linear-attention layers (a recurrent state) cannot be built with this
        recipe; None when it can, or has none."""
        if not parts.linear_layers:
            return None
        if TENSORRT in self.recipe.backends:
            return ("its linear-attention layers keep a recurrent state, which the TensorRT path (device-resident "
                    "caches) does not carry yet: use backends: [onnxruntime]")
        return None

    def _save(self, tmp: Path, model: str, tokens: int | None, kind: str, proto: onnx.ModelProto,
              store: WeightStore, graphs: GraphSet, batch: int = 1) -> None:
        """Write one graph and its manifest entries: the static graph of ``batch`` rows of
        ``tokens`` tokens (a standard graph), or with ``tokens=None`` the model's shared graph
        (ort-gqa), one entry per size of ``graphs`` at batch 1, and per decoding size (decode,
        catch-up, verify) at each larger batch of the recipe. Entries above batch 1 are checked
        row by row against batch 1 (``validate``)."""
        names = graphs.names(batch)
        sizes = sorted(graphs.sizes) if tokens is None else [tokens]
        path = tmp / (f"{model}.onnx" if tokens is None else f"{names[tokens]}.onnx")
        # a drafter's shared graph: its fill copy too (exporter/fill.py), made before the weights go out
        # (onnxruntime only: TensorRT compiles a plan per entry, a fill graph would be one more)
        fill = fill_copy(proto) if tokens is None and kind in FILL_KINDS and TENSORRT not in self.recipe.backends \
            else None
        store.save(proto, path)
        onnx.checker.check_model(str(path))
        if fill is not None:
            self._save_fill(tmp, model, fill, store, graphs)
        for rows in (self.recipe.shapes.batches if tokens is None else [batch]):
            for size in sizes:
                role = graphs.sizes[size]
                if rows > 1 and role not in BATCHED_ROLES:
                    continue
                graph_name = engine_name(model, role, rows, size)
                inputs = chain_inputs(proto, size, rows)
                outputs = tensor_specs(proto, "outputs", size, rows)
                self.specs[graph_name] = (inputs, outputs)
                if rows == 1:
                    self.graph_files.setdefault(model, []).append(GraphUnderTest(graph_name, path, size))
                else:
                    self.batched_files.setdefault(model, []).append(BatchedGraph(graph_name, path, size, rows))
                self.engines.append(EngineEntry(
                    name=graph_name, model=model, role=role, backend=ONNXRUNTIME, path=path.name,
                    batch=rows, tokens=size, inputs=inputs, outputs=outputs,
                    kv_update=KV_UPDATE_OF_ATTENTION[self.recipe.attention], weights=store.location,
                ))

    def _save_fill(self, tmp: Path, model: str, proto: onnx.ModelProto, store: WeightStore, graphs: GraphSet) -> None:
        """Write ``model``'s fill graph (its weights already in ``store``), checked with its full
        graph at validation (``_validate_fill``)."""
        saved = self.save_fill(tmp, model, proto, store, fill_sizes(graphs.sizes),
                               KV_UPDATE_OF_ATTENTION[self.recipe.attention])
        self.fill_files[model] = [GraphUnderTest(name, path, size) for name, (size, path) in saved.items()]

    def save_fill(self, tmp: Path, model: str, proto: onnx.ModelProto, store: WeightStore, sizes: list[int],
                  kv_update: KVUpdate) -> dict[str, tuple[int, Path]]:
        """Write a fill graph as ``model``.fill.onnx over ``store``'s weights and register an entry
        of role fill at each of ``sizes`` (batch 1); a decoder's or a head's. Returns engine name
        -> (tokens, path)."""
        path = tmp / f"{model}.fill.onnx"
        store.save(proto, path)
        onnx.checker.check_model(str(path))
        saved = {}
        for size in sizes:
            graph_name = engine_name(model, Role.FILL, 1, size)
            # its chain's tree offsets and mask fed by the backend, as its full graph's entries
            inputs, outputs = chain_inputs(proto, size), tensor_specs(proto, "outputs", size)
            self.specs[graph_name] = (inputs, outputs)
            self.engines.append(EngineEntry(
                name=graph_name, model=model, role=Role.FILL, backend=ONNXRUNTIME, path=path.name, batch=1,
                tokens=size, inputs=inputs, outputs=outputs, kv_update=kv_update, weights=store.location,
            ))
            saved[graph_name] = (size, path)
        return saved

    def _validate_fill(self, model: str, ids: np.ndarray) -> None:
        """The model's fill graphs leave its cache as its full graphs do, bit for bit (exporter/fill.py);
        their runner joins the build's timing."""
        from specexport.runtime.engine import EngineOptions, SharedGraphs
        from specexport.runtime.kv_cache import open_host_cache
        from specexport.runtime.ort_engine import OrtEngine

        info = self.models[model]
        graphs = [*self.graph_files[model], *self.fill_files[model]]
        options, shared = EngineOptions(threads=self.threads), SharedGraphs()
        engines = [OrtEngine(g.name, g.path, *self.specs[g.name], options, shared) for g in graphs]
        cache = open_host_cache(info.num_layers, 1, info.num_kv_heads, info.max_seq_len, info.head_dim, info.kv_dtype)
        roles = {e.name: e.role for e in self.engines if e.model == model}
        runner = ModelRunner(f"{model} fill", engines, cache, {g.name: g.tokens for g in graphs},
                             in_place=frozenset(g.name for g in graphs) if info.attention == "ort-gqa" else frozenset(),
                             roles=roles, full_rows=info.full_rows)
        with self.rep.step("validate", f"{model} fill graphs") as s:
            length = info.max_seq_len // 2
            runner.forward(ids[:length].tolist())  # the cache below every length tested holds real text
            figures = check_fill(runner, ids, lengths=(0, length // 2, length))
            s.detail = f"{len(runner.fill_sizes)} sizes, cache = the full graph's bit for bit"
        for g in self.fill_files[model]:
            self.record_fill(g.name, figures)
        self.timing[f"{model}.fill"] = FillTiming(runner)

    def record_fill(self, graph: str, figures: dict) -> None:
        """A fill graph's check (exporter/fill.py), recorded as its parity."""
        self.engines = [replace(e, parity={**figures, "reference": "the model's full graph"}) if e.name == graph
                        else e for e in self.engines]

    def validate(self, model: str, reference: LoadedModel, precision: str) -> None:
        """Run ``model``'s graphs against transformers and record the figures; fail the build on
        a graph outside the limits for ``precision`` (exporter/validate.py TOLERANCES). A
        quantized model is checked against transformers on its dequantized weights, and its
        rows must agree bit for bit between calls of any size."""
        shapes = self.recipe.shapes
        info = self.models[model].kv
        taps = self.models[model].taps  # the graphs' aux_hidden_states, checked from the same pass
        quantizer = self.quantizers.get(model)
        hf_model, against = reference.model, "transformers fp32"
        if quantizer is not None:
            hf_model, missing = dequantized_reference(reference.model, quantizer)
            precision, against = quantizer.tolerance_key, f"transformers on the graph's {quantizer.precision} weights"
            if missing:  # e.g. fused expert tensors (not Linear modules): the reference would be fp32 there
                self.rep.warn(f"{model}: {len(missing)} quantized weights have no transformers Linear to place them in "
                              f"({missing[0]}, ...): validation figures recorded, not enforced")
                precision = "int4"
        with self.rep.step("validate", f"{model} reference") as s:
            ids = reference_ids(reference.tokenizer, shapes.max_seq_len)
            ref, ref_aux = reference_forward(hf_model, ids, taps)
            s.detail = f"{against}, {len(ids)} tokens" + (f", hidden states {list(taps)}" if taps else "")
            # an fp16/bf16 graph's limits widen to the error transformers itself makes in that type
            low_error = low_precision_error(hf_model, ids, precision, ref) if precision in LOW_PRECISIONS else None
            if low_error is not None:
                s.detail += f"; transformers {precision} differs by {low_error:.3g}"
        with self.rep.step("validate", f"{model} graphs") as s:
            kept: list[ModelRunner] = []
            results = validate_model(
                self.graph_files[model], self.specs, info.num_layers, info.num_kv_heads,
                info.head_dim, shapes.max_seq_len, ids, ref, self.threads,
                in_place=self.recipe.attention == "ort-gqa", keep=kept, ref_aux=ref_aux, taps=taps,
                state=self.models[model].state, full_rows=self.models[model].full_rows, kv_dtype=info.dtype,
            )
            self.timing[model] = kept[0]
            worst = max(r["max_abs_logit_diff"] for r in results.values())
            agree = min(r["argmax_agreement"] for r in results.values())
            s.detail = f"max |Δlogit| {worst:.2e}, argmax agreement {agree:.1%}"
            if taps:
                s.detail += f", max |Δh|/scale {max(r['max_rel_aux_diff'] for r in results.values()):.2e}"
            if self.models[model].full_rows:
                worst_rows = max(r["rows_agree_max_abs_diff"] for r in results.values())
                if worst_rows != 0:  # `!=`: NaN fails too
                    raise SpecexportError(
                        f"validation failed for {model}: a graph's rows differ from one-token calls over the same "
                        f"positions by {worst_rows:.3g}; decoding and verifying would not compute the same model")
                s.detail += ", rows = one-token calls bit for bit"
        for name, figures in results.items():
            self.record_parity(name, dict(figures), against, precision, low_error)
        if model in self.tree_files:
            with self.rep.step("validate", f"{model} tree graph") as s:
                tree = self.tree_files[model]
                figures = validate_tree(tree, self.specs, kept[0].cache, ids, hf_model, self.threads,
                                        self.recipe.attention == "ort-gqa", shapes.max_seq_len)
                s.detail = (f"each of {tree.tokens} rows against transformers on its path: "
                            f"max |Δlogit| {figures['max_abs_logit_diff']:.2e}")
            self.record_parity(tree.name, figures, f"{against}, each row on its root-to-node path", precision,
                               low_error)
            for graph in self.tree_batched.get(model, []):
                with self.rep.step("validate", f"{model} tree graph, batch {graph.batch}") as s:
                    figures = validate_batched_tree(graph, tree, self.specs, kept[0].cache, ids, self.threads,
                                                    self.recipe.attention == "ort-gqa")
                    s.detail = (f"{graph.batch} rows, each its own tree and cache length, against batch 1: "
                                f"max |Δlogit| {figures['max_abs_logit_diff']:.2e}")
                self.record_parity(graph.name, figures, "the batch-1 tree graph, row by row", precision)
        batched = self.batched_files.get(model, [])
        if batched:
            with self.rep.step("validate", f"{model} batched graphs") as s:
                if self.models[model].state is not None:  # each row's own recurrent state, in place or appended
                    alone = {g.tokens: g for g in self.graph_files[model]}
                    rows = validate_batched_state(batched, alone, self.specs, kept[0], ids, self.threads,
                                                  in_place=self.recipe.attention == "ort-gqa")
                elif self.recipe.attention == "ort-gqa":  # in place: entries of the batch-1 graph's file
                    single = {g.tokens: g.name for g in self.graph_files[model]}
                    rows = validate_batched(batched, single, self.specs, kept[0].cache, ids, self.threads,
                                            full_rows=self.models[model].full_rows,
                                            tap_tolerance=TOLERANCES[precision].aux_rtol or 1e-4)
                else:  # append: static graphs of their own, each row's real positions against batch 1
                    alone = {g.tokens: g for g in self.graph_files[model]}
                    rows = validate_batched_append(batched, alone, self.specs, kept[0].cache, ids, self.threads)
                worst = max(r["max_abs_logit_diff"] for r in rows.values())
                s.detail = f"{len(rows)} graphs, ragged rows and an idle row against batch 1: max |Δlogit| {worst:.2e}"
            for name, figures in rows.items():
                self.record_parity(name, dict(figures), "the batch-1 graph, row by row", precision)
        if model in self.fill_files:
            self._validate_fill(model, ids)

    @staticmethod
    def _tolerance_key(precision: str) -> str:
        """The validation limits of a model's graphs: fp16 / bf16 ones their own; fp32 otherwise
        (a quantized model's come from its quantizer)."""
        return precision if precision in LOW_PRECISIONS else "fp32"

    def record_parity(self, graph: str, figures: dict, reference: str, precision: str,
                      reference_error: float | None = None) -> None:
        """Check ``graph``'s figures against the limits for ``precision`` (raises a one-line
        error on a graph out of limits: the temporary directory is dropped) and record them in
        its entry. Heads record theirs through HeadContext.record_parity."""
        limits = self.recipe.validation
        if limits.enforce == "never":
            applied = {"precision": precision, "enforced": False}
        else:
            applied = check_parity(graph, figures, precision, limits.max_abs_logit_diff,
                                   limits.min_argmax_agreement, reference=reference, reference_error=reference_error)
        self.engines = [replace(e, parity={**figures, **applied, "reference": reference}) if e.name == graph else e
                        for e in self.engines]

    def measure_costs(self, rounds: int = 9) -> None:
        """One run's cost of every graph of every model, all taken in one interleaved schedule
        (round after round, each graph once), so a drift of the machine during the build hits
        every model alike: the costs the runtime compares across models (draft step against
        verify) come from the same minutes."""
        with self.rep.step("validate", "costs (all graphs, interleaved)") as s:
            runners = {key: (runner, runner.sizes) for key, runner in self.timing.items()}
            times = time_interleaved(runners, rounds)
            by_engine = {self.timing[key].engine_at(size): seconds
                         for key, by_size in times.items() for size, seconds in by_size.items()}
            for i, entry in enumerate(self.engines):
                if entry.name in by_engine and entry.backend == ONNXRUNTIME:
                    self.engines[i] = replace(entry, cost_ms=round(by_engine[entry.name] * 1e3, 3))
            s.detail = f"{sum(len(sizes) for _, sizes in runners.values())} graphs × {rounds} rounds"
        self.timing.clear()  # close the sessions

    def write_tokenizer(self, tmp: Path, target: LoadedModel) -> dict:
        tok = target.tokenizer
        (tmp / "tokenizer.json").write_text(tok.backend_tokenizer.to_str())
        template = tok.chat_template if isinstance(tok.chat_template, str) else None
        info = {
            "file": "tokenizer.json",
            "chat_template": None,
            "eos_token_ids": eos_token_ids(target),
            # what chat templates may refer to (bos_token, eos_token, ...)
            "special_tokens": {k: v for k, v in tok.special_tokens_map.items() if isinstance(v, str)},
            "vocab_size": len(tok),
        }
        if template:
            (tmp / "chat_template.jinja").write_text(template)
            info["chat_template"] = "chat_template.jinja"
        return info

    # -- the whole build --------------------------------------------------------------------

    def run(self, tmp: Path, key: str, tools: dict) -> dict:
        recipe = self.recipe
        target, drafter_models = self.load()
        plan = self.plan(target)
        int4 = next((d for d in recipe.drafters if isinstance(d, QuantizedSelfDrafterSpec)), None)
        t_graphs = target_graphs(recipe, plan)
        quant = (int4.name, int4, drafter_graphs(int4.name, recipe)) if int4 else None
        taps = merged_taps(list(self.heads.values()))
        self.export_model(tmp, "target", "target", target, t_graphs, quant, taps=taps,
                          precision=recipe.onnx_precision, source=recipe.target)
        model_specs = {d.name: d for d in recipe.drafters if isinstance(d, ModelDrafterSpec)}
        for name, loaded in drafter_models.items():
            self.export_model(tmp, name, "model", loaded, drafter_graphs(name, recipe),
                              precision=recipe.precision_of(model_specs[name]), source=model_specs[name].model)

        # fp32 graphs against transformers; int4 / int8 ones against transformers on their own
        # dequantized weights; the int4 copy (quantized-self) by its own (recorded) row
        self.validate("target", target, self._tolerance_key(recipe.onnx_precision))
        if int4:
            self.validate(int4.name, target, "int4")
        for spec in recipe.drafters:
            if isinstance(spec, ModelDrafterSpec):
                self.validate(spec.name, drafter_models[spec.name], self._tolerance_key(recipe.precision_of(spec)))
        for name, head in self.heads.items():  # after the target: heads read its validated taps
            spec = next(d for d in recipe.drafters if d.name == name)
            head.build(HeadContext(self, tmp, name, plan, target, taps, self.threads,
                                   precision=getattr(spec, "precision", None) or "fp32"))
        self.measure_costs()

        if TENSORRT in recipe.backends:
            from specexport.exporter.trt_build import compile_engines

            # one serialized engine per ONNX graph, appended as backend "tensorrt" entries
            self.engines += compile_engines(tmp, self.engines, recipe, self.rep, timing_cache_dir=self.out.parent)

        with self.rep.step("write", "manifest") as s:
            tokenizer = self.write_tokenizer(tmp, target)
            files = {p.name: sha256_of(p) for p in sorted(tmp.iterdir()) if p.is_file()}
            self.engines = [replace(e, sha256=files[e.path]) for e in self.engines]
            drafters = [self.heads[d.name].drafter_entry(d.name) if d.name in self.heads else self._drafter_entry(d)
                        for d in recipe.drafters]
            manifest = write_manifest(tmp, Manifest(
                root=tmp,
                name=recipe.name,
                plan=plan.to_dict(),
                tokenizer={**tokenizer, "sha256": files["tokenizer.json"]},
                models=self.models,
                drafters={d.name: d for d in drafters},
                engines=self.engines,
                files=files,
                specexport=__version__,
                created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                inputs_sha256=key,
                recipe=recipe.model_dump(mode="json"),
                recipe_dir=str(self.base),  # where relative model paths in the recipe point
                toolchain=tools,
                build={"steps": [{"kind": t.kind, "what": t.what, "seconds": round(t.seconds, 2)}
                                 for t in self.rep.timings],
                       # what the onnxruntime graphs were built for (kv dtype: models.*.kv.dtype)
                       "onnxruntime": {"device": recipe.device, "precision": recipe.onnx_precision,
                                       "attention": recipe.attention}},
            ))
            size = sum(p.stat().st_size for p in tmp.iterdir())
            s.detail = f"{len(self.engines)} engines, {size / 1e6:.1f} MB"
        return manifest

    @staticmethod
    def _drafter_entry(spec) -> DrafterEntry:
        params = spec.model_dump(mode="json", exclude={"kind", "name", "model"})
        model = spec.name if spec.kind in ("model", "quantized-self") else None
        return DrafterEntry(spec.name, spec.kind, model, params)


@dataclass
class BuildResult:
    out: Path
    reused: bool
    manifest: dict
    seconds: float


def build(recipe_path: str | Path, out: str | Path | None, force: bool, reporter: Reporter,
          threads: int | None = None) -> BuildResult:
    recipe, base = load_recipe(recipe_path)
    return build_recipe(recipe, base, out, force, reporter, threads)


def build_recipe(recipe: Recipe, base: Path, out: str | Path | None, force: bool, reporter: Reporter,
                 threads: int | None = None) -> BuildResult:
    import time

    start = time.perf_counter()
    if TENSORRT in recipe.backends:
        from specexport.exporter.trt_build import require_tensorrt

        require_tensorrt()
    refusal = bf16_refusal(recipe.onnx_precision)  # before the export, not after it
    if refusal is not None:
        raise BadInput(f"recipe: {refusal}")
    out_dir = Path(out) if out is not None else Path("engines") / recipe.name
    previous = existing_manifest(out_dir)

    with reporter.step("inputs", "fingerprint") as s:
        prints = {"target": fingerprint(recipe.target, base, "target")}
        for i, spec in enumerate(recipe.drafters):
            if isinstance(spec, ModelDrafterSpec):
                prints[spec.name] = fingerprint(spec.model, base, f"drafters.{i}.model")
            elif spec.kind in HIDDEN_STATE_KINDS and spec.path is not None:
                prints[spec.name] = folder_fingerprint(base / spec.path, f"drafters.{i}.path")
        calibration = calibration_file(recipe, base)
        if calibration is not None and calibration.is_file():
            prints["calibration"] = file_sha256(calibration)
        tools = toolchain()
        key = inputs_key(recipe, prints, tools)
        s.detail = key[:12]

    if previous is not None and not force and previous.get("inputs_sha256") == key:
        try:  # hashes only what changed since the last check (runtime/integrity.py)
            ensure_verified(Manifest.load(out_dir))
        except BadInput as err:
            reporter.warn(f"existing engines cannot be reused ({err}); rebuilding")
        else:
            reporter.note(f"{out_dir}: up to date (same recipe, models and toolchain); --force rebuilds")
            return BuildResult(out_dir, True, previous, time.perf_counter() - start)

    with AtomicDir(out_dir) as tmp:
        manifest = Builder(recipe, base, out_dir, reporter, threads).run(tmp, key, tools)
    return BuildResult(out_dir, False, manifest, time.perf_counter() - start)
