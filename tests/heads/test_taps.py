"""Target taps: aux_hidden_states equals transformers' output_hidden_states at the tapped indices.

The index convention (specexport/contract.py): i < L is the residual stream entering layer i
(hidden_states[0] = the embeddings), i = L the output after the final norm. Checked per
architecture and attention kind on tiny exported graphs run in onnxruntime, through the build's
own validation (exporter/validate.py); a wrong tap must fail it, and a recipe without a
hidden-state drafter must export exactly the graphs it did before.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
import yaml

from specexport.contract import (
    AUX_HIDDEN_STATES,
    CACHE_LENGTH,
    INPUT_IDS,
    NEXT_TOKENS,
    VALID_TOKENS,
    DrafterEntry,
    graph_outputs,
    is_cache_output,
)
from specexport.errors import SpecexportError
from specexport.exporter.archs import read_decoder
from specexport.exporter.graph_model import StaticDecoder
from specexport.exporter.lint import lint_file
from specexport.exporter.onnx_export import WeightStore, export_graph, tensor_specs
from specexport.exporter.recipe import TinySource
from specexport.exporter.tiny import tiny_model
from specexport.exporter.validate import (
    TOLERANCES,
    GraphUnderTest,
    Parity,
    check_parity,
    reference_forward,
    reference_ids,
    validate_model,
)
from specexport.runtime.engine import EngineOptions
from specexport.runtime.kv_cache import KVCache
from specexport.runtime.ort_engine import OrtEngine
from specexport.runtime.runner import ModelRunner
from tests.conftest import run_cli

LAYERS = 4
TAPS = (0, 2, LAYERS)  # the embeddings, a middle layer's input, the final-normed output
SEQ = 40  # max_seq_len of the direct exports
VERIFY = 5  # T of the verify graph
AUX_RTOL = TOLERANCES["fp32"].aux_rtol

ARCH_ATTENTION = [(arch, attention) for arch in ("llama", "qwen3", "gemma2") for attention in ("standard", "ort-gqa")]


class Exported:
    """A tiny model, its decoder parts and graphs (T = 1 and VERIFY) exported with ``taps``."""

    def __init__(self, root: Path, arch: str, attention: str, taps: tuple[int, ...], model=None, tokenizer=None):
        src = TinySource(source="tiny", arch=arch, num_layers=LAYERS, head_dim=16 if arch.startswith("gemma") else None)
        self.model, self.tokenizer = (model, tokenizer) if model is not None else tiny_model(src)
        self.parts = read_decoder(self.model, SEQ, "target")
        self.attention, self.taps = attention, taps
        decoder = StaticDecoder(self.parts, SEQ, attention, taps=taps).eval()
        root.mkdir(parents=True)
        store = WeightStore(root / "target.weights")
        self.graphs: list[GraphUnderTest] = []
        self.specs: dict[str, tuple] = {}
        self.protos: dict[str, onnx.ModelProto] = {}
        # T = 1 as well: an in-place (ort-gqa) graph must fit the free slots when validation fills the cache
        for tokens in (1, VERIFY):
            name = f"target.t{tokens}"
            proto = export_graph(decoder, 1, tokens, 17)
            self.specs[name] = (tensor_specs(proto, "inputs"), tensor_specs(proto, "outputs"))
            self.protos[name] = proto
            store.save(proto, root / f"{name}.onnx")
            self.graphs.append(GraphUnderTest(name, root / f"{name}.onnx", tokens))
        store.close()

    def validate(self, ref_taps: tuple[int, ...] | None = None) -> dict[str, dict]:
        """The build's validation of these graphs against transformers at ``ref_taps`` (default: the
        graphs' own taps)."""
        ref_taps = self.taps if ref_taps is None else ref_taps
        ids = reference_ids(self.tokenizer, SEQ)
        logits, aux = reference_forward(self.model, ids, ref_taps)
        return validate_model(self.graphs, self.specs, LAYERS, self.parts.num_key_value_heads, self.parts.head_dim,
                              SEQ, ids, logits, threads=None, in_place=self.attention == "ort-gqa", keep=[],
                              ref_aux=aux, taps=ref_taps)

    def run_verify(self, ids: np.ndarray) -> np.ndarray:
        """aux_hidden_states [T, n_taps·hidden] of the verify graph on ``ids`` [T] over an empty cache."""
        graph = self.graphs[1]
        engine = OrtEngine(graph.name, graph.path, *self.specs[graph.name], EngineOptions())
        cache = KVCache(LAYERS, 1, self.parts.num_key_value_heads, SEQ, self.parts.head_dim)
        feeds = {**cache.view(), INPUT_IDS: ids[None, :], CACHE_LENGTH: np.zeros(1, dtype=np.int64)}
        if VALID_TOKENS in engine.inputs:  # ort-gqa
            feeds[VALID_TOKENS] = np.array([len(ids)], dtype=np.int64)
        bound = cache.in_place_outputs() if self.attention == "ort-gqa" else None
        return engine.run(feeds, [NEXT_TOKENS, AUX_HIDDEN_STATES], bound)[AUX_HIDDEN_STATES][0]


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """(arch, attention, taps) -> Exported, each made once for the module."""
    made: dict[tuple, Exported] = {}

    def get(arch: str, attention: str, taps: tuple[int, ...] = TAPS) -> Exported:
        key = (arch, attention, taps)
        if key not in made:
            same_model = next((e for (a, _, _), e in made.items() if a == arch), None)
            root = tmp_path_factory.mktemp(f"{arch}-{attention}-{'-'.join(map(str, taps)) or 'none'}")
            made[key] = Exported(root / "g", arch, attention, taps,
                                 *((same_model.model, same_model.tokenizer) if same_model else ()))
        return made[key]

    return get


# -- the index convention, per architecture and attention kind -----------------------------------


@pytest.mark.parametrize("arch,attention", ARCH_ATTENTION)
def test_each_tap_block_is_the_hidden_state_it_names(exports, arch, attention):
    exported = exports(arch, attention)
    ids = reference_ids(exported.tokenizer, VERIFY)  # [T]
    with torch.no_grad():
        states = exported.model(torch.from_numpy(ids)[None], output_hidden_states=True).hidden_states
    states = [h[0].numpy() for h in states]  # L+1 of [T, hidden]
    assert len(states) == LAYERS + 1
    aux = exported.run_verify(ids)  # [T, n_taps·hidden]
    hidden = exported.parts.hidden_size
    assert aux.shape == (VERIFY, len(TAPS) * hidden)
    for k, tap in enumerate(TAPS):
        block = aux[:, k * hidden : (k + 1) * hidden]  # [T, hidden]
        distance = [np.abs(block - h).max() / max(1.0, np.abs(h).max()) for h in states]
        # the block is hidden_states[tap] to fp32 rounding, and no other index comes close
        assert int(np.argmin(distance)) == tap, (tap, distance)
        assert distance[tap] <= AUX_RTOL, (tap, distance)
        assert min(d for i, d in enumerate(distance) if i != tap) > 100 * AUX_RTOL, (tap, distance)


@pytest.mark.parametrize("arch,attention", ARCH_ATTENTION)
def test_build_validation_passes_and_records_the_tap_figures(exports, arch, attention):
    # every graph at every cache length the logits are checked at, through the runtime's runner
    results = exports(arch, attention).validate()
    for name, figures in results.items():
        assert figures["aux_taps"] == list(TAPS)
        assert 0 < figures["max_rel_aux_diff"] <= AUX_RTOL, (name, figures)
        assert figures["max_abs_aux_diff"] > 0 and figures["aux_scale"] >= 1.0
        applied = check_parity(name, figures, "fp32")
        assert applied["max_rel_aux_diff_limit"] == AUX_RTOL


def test_the_final_tap_is_after_the_final_norm(exports):
    # hidden_states[L] is the normed output the head multiplies (not the raw stream leaving the
    # last layer): the logits are its product with the output head
    exported = exports("llama", "standard")
    ids = reference_ids(exported.tokenizer, VERIFY)
    aux = exported.run_verify(ids)
    hidden = exported.parts.hidden_size
    final = torch.from_numpy(aux[:, TAPS.index(LAYERS) * hidden : (TAPS.index(LAYERS) + 1) * hidden])
    with torch.no_grad():
        logits = exported.model.lm_head(final).numpy()  # [T, V]
        want = exported.model(torch.from_numpy(ids)[None]).logits[0].numpy()
    assert np.abs(logits - want).max() <= TOLERANCES["fp32"].logit_rtol * max(1.0, np.abs(want).max())


# -- a wrong tap fails validation ----------------------------------------------------------------


def test_a_tap_one_layer_off_fails_validation_naming_it(exports):
    # graphs that output hidden_states[3] where the model's taps say 2, checked against the reference
    # at the unshifted taps: the build's check must refuse them, in one line naming tap 2
    shifted = exports("llama", "standard", (0, 3, LAYERS))
    results = shifted.validate(ref_taps=TAPS)
    for name, figures in results.items():
        assert figures["worst_aux_tap"] == 2 and figures["max_rel_aux_diff"] > 100 * AUX_RTOL
        with pytest.raises(SpecexportError, match=r"aux_hidden_states at tap 2 \(hidden_states\[2\]\)") as err:
            check_parity(name, figures, "fp32")
        assert "\n" not in str(err.value)


def test_graphs_and_reference_with_different_taps_are_refused(exports):
    exported = exports("llama", "standard")
    ids = reference_ids(exported.tokenizer, SEQ)
    logits, _ = reference_forward(exported.model, ids)
    with pytest.raises(SpecexportError, match=f"outputs {AUX_HIDDEN_STATES}"):  # tapped graphs, no reference taps
        validate_model(exported.graphs, exported.specs, LAYERS, exported.parts.num_key_value_heads,
                       exported.parts.head_dim, SEQ, ids, logits, threads=None, keep=[])
    with pytest.raises(SpecexportError, match="taps differ"):  # two taps in the reference, three in the graph
        exported.validate(ref_taps=(0, 2))


def test_nan_in_the_taps_fails():
    rng = np.random.default_rng(0)
    want = rng.standard_normal((3, 2 * 8)).astype(np.float32)  # [T, 2·hidden]
    got = want.copy()
    got[1, 12] = np.nan  # in tap 7's block
    logits = rng.standard_normal((3, 16)).astype(np.float32)  # [T, V]
    parity = Parity()
    parity.add(logits, logits, logits.argmax(-1))
    parity.add_aux(got, want, (0, 7))
    figures = parity.to_dict()
    assert figures["worst_aux_tap"] == 7
    with pytest.raises(SpecexportError, match="tap 7 .*nan"):
        check_parity("target.verify.b1.t5", figures, "fp32")


# -- taps out of range ---------------------------------------------------------------------------


@pytest.mark.parametrize("taps", [(LAYERS + 1,), (-1,), (0, LAYERS + 3)])
def test_taps_out_of_range_are_refused(exports, taps):
    exported = exports("llama", "standard")
    with pytest.raises(ValueError, match=f"0..{LAYERS}"):
        StaticDecoder(exported.parts, SEQ, "standard", taps=taps)
    with pytest.raises(SpecexportError, match=f"0..{LAYERS}"):
        reference_forward(exported.model, reference_ids(exported.tokenizer, 4), taps)


# -- nothing changes without taps ----------------------------------------------------------------


def test_tapped_graphs_add_exactly_aux_hidden_states(exports):
    # the untapped graphs' outputs: test_a_recipe_without_hidden_state_drafters_builds_no_taps
    for attention in ("standard", "ort-gqa"):
        for proto in exports("llama", attention).protos.values():
            assert [o.name for o in proto.graph.output] == [*graph_outputs(LAYERS), AUX_HIDDEN_STATES]


def test_a_tapped_standard_graph_passes_the_tensorrt_lint(exports):
    exported = exports("llama", "standard")
    for graph in exported.graphs:
        report = lint_file(graph.path)
        assert (report.status, report.problems) == ("ok", []), report
        model = onnx.load(str(graph.path), load_external_data=False)
        aux = next(o for o in model.graph.output if o.name == AUX_HIDDEN_STATES)
        dims = [d.dim_value for d in aux.type.tensor_type.shape.dim]
        assert dims == [1, graph.tokens, len(TAPS) * exported.parts.hidden_size]


# -- whole builds: the builder validates the taps a hidden-state drafter asks for ---------------


class _FakeHead:
    """Stands in for a hidden-state drafter head (the heads have their own tests): it asks the
    target for taps and builds nothing."""

    def __init__(self, taps):
        self.taps = tuple(taps)

    def build(self, ctx) -> None:
        pass

    def drafter_entry(self, name: str) -> DrafterEntry:
        return DrafterEntry(name, "mtp", None, {})


def _recipe(path: Path, drafters: list[dict], prefill_chunk: int = 8) -> Path:
    path.write_text(yaml.safe_dump({
        "name": "taps",
        "target": {"source": "tiny", "arch": "llama", "num_layers": LAYERS},
        "drafters": drafters,
        "shapes": {"max_seq_len": 32, "prefill_chunk": prefill_chunk},
        "draft": {"max_draft": 3},
    }))
    return path


def _outputs_of(engines: Path) -> tuple[dict[str, list[str]], dict]:
    manifest = json.loads((engines / "manifest.json").read_text())
    return {e["name"]: list(e["outputs"]) for e in manifest["engines"]}, manifest


@pytest.mark.parametrize("attention", ["standard", "ort-gqa"])
def test_a_recipe_without_hidden_state_drafters_builds_no_taps(tiny_engines, attention):
    # the session's shared llama builds (every drafter but the heads: tests/exporter/test_archs.py):
    # every graph of every model has exactly the contract's outputs, validated without taps
    engines = tiny_engines.for_arch("llama", attention)
    outputs, manifest = _outputs_of(engines)
    assert {e["model"] for e in manifest["engines"]} == {"target", "quantized-self", "draft-model"}
    for entry in manifest["engines"]:
        contract = graph_outputs(manifest["models"][entry["model"]]["kv"]["num_layers"])
        if entry["role"] == "fill":  # a drafter's fill graph (ort-gqa): the cache outputs alone
            contract = [name for name in contract if is_cache_output(name)]
        assert outputs[entry["name"]] == contract, entry["name"]
        onnx_outputs = [o.name for o in onnx.load(str(engines / entry["path"]), load_external_data=False).graph.output]
        assert onnx_outputs == contract, entry["name"]
        assert entry["parity"] and not any("aux" in key for key in entry["parity"]), entry["name"]
    assert not any("taps" in model for model in manifest["models"].values())


def test_a_head_s_taps_are_exported_and_validated_by_the_build(tmp_path, monkeypatch):
    import specexport.exporter.builder as builder

    monkeypatch.setattr(builder, "load_head", lambda spec, target, base, origin: _FakeHead((LAYERS, 1)))
    code, _, err = run_cli("build", _recipe(tmp_path / "r.yaml", [{"kind": "mtp"}]), "-o", tmp_path / "e")
    assert code == 0, err
    outputs, manifest = _outputs_of(tmp_path / "e")
    assert manifest["models"]["target"]["taps"] == [1, LAYERS]  # merged: sorted, each once
    targets = [e for e in manifest["engines"] if e["model"] == "target"]
    assert len(targets) == 3  # decode, verify, prefill
    for entry in targets:
        assert list(entry["outputs"]) == [*graph_outputs(LAYERS), AUX_HIDDEN_STATES]
        parity = entry["parity"]
        assert parity["aux_taps"] == [1, LAYERS] and 0 < parity["max_rel_aux_diff"] <= AUX_RTOL
        assert parity["max_rel_aux_diff_limit"] == AUX_RTOL


def test_a_corrupt_tap_fails_the_build_in_one_line(tmp_path, monkeypatch):
    import specexport.exporter.builder as builder

    real = builder.StaticDecoder

    def off_by_one(parts, max_seq_len, attention="standard", fusions=None, taps=()):
        return real(parts, max_seq_len, attention, fusions, taps=tuple(t + 1 for t in taps))

    monkeypatch.setattr(builder, "load_head", lambda spec, target, base, origin: _FakeHead((2,)))
    monkeypatch.setattr(builder, "StaticDecoder", off_by_one)
    # the prefill chunk equal to 1+D: two target graphs to export before the validation that fails
    code, _, err = run_cli("build", _recipe(tmp_path / "r.yaml", [{"kind": "mtp"}], prefill_chunk=4), "-o", tmp_path / "e")
    assert code == 1 and "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("specexport: error:")]
    assert len(errors) == 1, err  # the whole error on one line
    assert "validation failed for target." in errors[0] and "aux_hidden_states at tap 2 (hidden_states[2])" in errors[0]
    assert not (tmp_path / "e").exists()


@pytest.mark.parametrize("attention", ["standard", "ort-gqa"])
def test_taps_of_a_long_input_fed_in_pieces_equal_one_pass(exports, attention):
    """The runner feeds a long input in several runs and joins their outputs. An in-place graph
    runs through a reused I/O binding whose output buffers onnxruntime reuses: the taps of the
    first pieces must not be overwritten by the later runs (they were, before the engine copied
    its outputs: a chain drafter then read garbage features for the prompt)."""
    exported = exports("llama", attention)
    ids = reference_ids(exported.tokenizer, SEQ)[: 3 * VERIFY + 1]  # [3·T+1]: four runs of the T-token graph
    engines = [OrtEngine(g.name, g.path, *exported.specs[g.name], EngineOptions()) for g in exported.graphs]
    cache = KVCache(LAYERS, 1, exported.parts.num_key_value_heads, SEQ, exported.parts.head_dim)
    in_place = frozenset(g.name for g in exported.graphs) if attention == "ort-gqa" else frozenset()
    runner = ModelRunner("t", engines, cache, {g.name: g.tokens for g in exported.graphs}, in_place=in_place)
    pieces = runner.forward(ids.tolist(), want=(AUX_HIDDEN_STATES,)).extras[AUX_HIDDEN_STATES]  # [S, n·H]
    _, whole = reference_forward(exported.model, ids, exported.taps)  # [S, n·H]
    scale = max(1.0, float(np.abs(whole).max()))
    assert pieces.shape == whole.shape
    assert np.abs(pieces - whole).max() <= 1e-4 * scale
