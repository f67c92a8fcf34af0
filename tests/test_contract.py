"""specexport.contract: every engine directory the builders write reads back to the same
structures (write -> read -> write gives identical JSON; the dataclasses are equal), follows
the naming and layout conventions, and older manifests still load."""

from __future__ import annotations

import io
import json
import re
import tokenize
import typing
from pathlib import Path

import numpy as np
import pytest
import yaml

from specexport import contract
from specexport.contract import (
    DRAFTER_KINDS,
    KV_UPDATE_OF_ATTENTION,
    MANIFEST,
    DrafterEntry,
    DrafterFamily,
    DrafterKind,
    DrafterParams,
    KVLayout,
    KVUpdate,
    Manifest,
    ModelEntry,
    Role,
    StateLayout,
    drafter_kinds,
    dumps,
    engine_name,
    graph_inputs,
    graph_outputs,
    is_cache_output,
    manifest_from_json,
    manifest_to_json,
    model_from_json,
    model_to_json,
    past_names,
    read_manifest,
    write_manifest,
)
from specexport.errors import BadInput
from tests.conftest import TINY_SHAPE, copy_engines


@pytest.fixture(scope="module", params=["standard", "ort-gqa"])
def built(request, tiny_engines):
    """A tiny build with every drafter (ngram, quantized-self, draft model)."""
    return tiny_engines.get("llama", attention=request.param, **TINY_SHAPE)


def assert_round_trip(directory) -> Manifest:
    text = (directory / MANIFEST).read_text()
    manifest = read_manifest(directory)
    assert dumps(manifest_to_json(manifest)) == text  # write -> read -> write: the same bytes
    again = manifest_from_json(json.loads(text), directory)
    assert again == manifest
    assert manifest_from_json(manifest_to_json(manifest), directory) == manifest
    return manifest


def test_a_build_reads_back_to_the_same_manifest(built):
    manifest = assert_round_trip(built)
    assert set(manifest.models) == {"target", "quantized-self", "draft-model"}
    assert [d.kind for d in manifest.drafters.values()] == ["ngram", "quantized-self", "model"]
    manifest.verify_files()


def test_a_build_follows_the_conventions(built):
    manifest = read_manifest(built)
    attention = manifest.models["target"].attention
    for e in manifest.engines:
        model = manifest.models[e.model]
        assert e.name == engine_name(e.model, e.role, e.batch, e.tokens)
        assert list(e.inputs) == graph_inputs(model.num_layers, valid_tokens=attention == "ort-gqa")
        outputs = graph_outputs(model.num_layers)  # a fill graph (Role.FILL): the cache's alone
        assert list(e.outputs) == ([o for o in outputs if is_cache_output(o)] if e.role is Role.FILL else outputs)
        for past in past_names(model.num_layers):
            assert e.inputs[past].shape == model.kv.shape(e.batch)  # [B, n_kv, S_max, hd]
        assert e.kv_update == KV_UPDATE_OF_ATTENTION[attention]
        assert e.sha256 == manifest.files[e.path] and e.weights == model.weights
        assert e.cost_ms is not None and e.parity
    target_roles = {e.tokens: e.role for e in manifest.engines_of("target", "onnxruntime")}
    # ort-gqa: a verify entry at every size 2..1+D of the one graph (the 2-token one is the catch-up's too)
    verify = range(2, 2 + manifest.draft_len) if attention == "ort-gqa" else [1 + manifest.draft_len]
    assert target_roles == {1: Role.DECODE, 2: Role.CATCHUP, **dict.fromkeys(verify, Role.VERIFY), 16: Role.PREFILL}


def test_a_tensorrt_manifest_written_by_the_same_path_reads_back(tiny_engines, tmp_path):
    """trt_from_onnx's manifest step with trt_build's entries, minus TensorRT itself: the .plan
    files are placeholders."""
    from specexport.exporter.trt_build import TrtBuildOptions, _entry
    from specexport.exporter.trt_from_onnx import with_tensorrt_engines
    from specexport.runtime.trt_engine import CudaDevice

    src = tiny_engines.get("llama", **TINY_SHAPE)
    dst = tmp_path / "trt"
    copy_engines(src, dst)
    manifest = read_manifest(dst)
    device, options = CudaDevice(0, "NVIDIA H200", "9.0"), TrtBuildOptions(precision="fp16")
    compiled = []
    for entry in manifest.engines:
        if entry.model == "quantized-self":
            continue  # MatMulNBits: no TensorRT importer (compile_engines skips these)
        plan = dst / f"{entry.name}.plan"
        plan.write_bytes(b"placeholder engine " + entry.name.encode())
        compiled.append(_entry(entry, plan, "10.13.0.35", device, options))
    updated = with_tensorrt_engines(manifest, compiled, dst, options, "2026-11-30T00:00:00+00:00")
    written = write_manifest(dst, updated)
    again = assert_round_trip(dst)
    assert again == updated and manifest_to_json(again) == written
    again.verify_files()
    trt = again.engines_of("target", "tensorrt")
    assert [e.tokens for e in trt] == [e.tokens for e in again.engines_of("target", "onnxruntime")]
    for e in trt:
        assert e.extra["tensorrt_version"] == "10.13.0.35" and e.extra["onnx"] == f"{e.name}.onnx"
        assert e.path == f"{e.name}.plan" and e.weights is None and e.kv_update == KVUpdate.APPEND
    assert again.extra["tensorrt_build"]["precision"] == "fp16"
    assert again.toolchain["compute_capability"] == "9.0"
    # a second rebuild replaces the TensorRT engines rather than adding to them
    twice = with_tensorrt_engines(again, compiled, dst, options, "2026-11-30T00:00:01+00:00")
    assert len(twice.engines) == len(again.engines)


def test_manifests_written_before_the_contract_still_load(tiny_engines, tmp_path):
    """The hand-built writers of before: TensorRT entries without kv_update or weights, no
    optional sections. They load to the defaults."""
    src = tiny_engines.get("llama", **TINY_SHAPE)
    dst = tmp_path / "old"
    copy_engines(src, dst)
    raw = json.loads((dst / MANIFEST).read_text())
    old_trt = {k: v for k, v in raw["engines"][0].items() if k in
               ("name", "model", "role", "batch", "tokens", "inputs", "outputs")}
    raw["engines"].append({**old_trt, "backend": "tensorrt", "path": "tokenizer.json",
                           "extra": {"tensorrt_version": "10.12"}})
    for key in ("build", "toolchain", "created"):
        del raw[key]
    (dst / MANIFEST).write_text(json.dumps(raw))
    manifest = read_manifest(dst)
    trt = manifest.engines[-1]
    assert trt.kv_update == KVUpdate.APPEND and trt.weights is None and trt.cost_ms is None and trt.parity == {}
    assert manifest.toolchain == {} and manifest.created is None
    # nothing lost; nothing added but the default kv_update the old TensorRT entry left out
    raw["engines"][-1]["kv_update"] = "append"
    assert manifest_to_json(manifest) == raw


def test_an_unknown_role_is_one_line_naming_the_manifest(tiny_engines, tmp_path):
    dst = tmp_path / "bad"
    copy_engines(tiny_engines.get("llama", **TINY_SHAPE), dst)
    raw = json.loads((dst / MANIFEST).read_text())
    raw["engines"][0]["role"] = "draft"
    (dst / MANIFEST).write_text(json.dumps(raw))
    with pytest.raises(BadInput) as err:
        read_manifest(dst)
    message = str(err.value)
    assert str(dst / MANIFEST) in message and "'draft'" in message and "\n" not in message


def test_a_recurrent_state_layout_reads_back_and_names_its_tensors():
    state = StateLayout(num_layers=3, conv_channels=96, conv_kernel=4, heads=4, key_dim=16, value_dim=16)
    entry = ModelEntry("target", "target", KVLayout(1, 2, 16, 64), 259, "target.weights", "standard",
                       {"layer_types": ["linear_attention"] * 3 + ["full_attention"]}, state)
    back = model_from_json("target", json.loads(json.dumps(model_to_json(entry))))
    assert back == entry and back.state.conv_shape(2) == (2, 96, 3) and back.state.recurrent_shape(1) == (1, 4, 16, 16)
    assert model_from_json("t", model_to_json(ModelEntry("t", "target", KVLayout(2, 2, 16, 64), 259))).state is None
    inputs, outputs = graph_inputs(1, state_layers=3), graph_outputs(1, state_layers=3)
    assert inputs[-6:] == [f"past_state.{j}.{k}" for j in range(3) for k in ("conv", "recurrent")]
    assert outputs[-6:] == [f"present_state.{j}.{k}" for j in range(3) for k in ("conv", "recurrent")]
    assert graph_inputs(2) == graph_inputs(2, state_layers=0)  # attention-only graphs unchanged


# -- the drafter-kind registry ----------------------------------------------------------------

REPO = Path(__file__).resolve().parents[1]


def recipe_kinds() -> set[str]:
    """The `kind` tags the recipe's drafter union accepts (one Literal per drafter class)."""
    from specexport.exporter.recipe import DrafterSpec

    union = typing.get_args(DrafterSpec)[0]
    return {tag for cls in typing.get_args(union) for tag in typing.get_args(cls.model_fields["kind"].annotation)}


def test_the_kind_registry_covers_every_kind_the_recipe_accepts():
    import importlib
    import importlib.util

    from specexport.exporter.heads import HEAD_MODULES
    from specexport.exporter.recipe import HIDDEN_STATE_KINDS, parse_recipe

    assert recipe_kinds() == {k.value for k in DrafterKind} == set(DRAFTER_KINDS)
    assert set(HIDDEN_STATE_KINDS) == set(HEAD_MODULES) == set(drafter_kinds(reads_taps=True))
    assert all(importlib.util.find_spec(module) for module in HEAD_MODULES.values())
    for kind, sig in DRAFTER_KINDS.items():
        assert sig.kind is kind
        assert bool(sig.roles) == sig.runs_model == (sig.family is not DrafterFamily.LOOKUP)
        assert sig.reads_taps == (sig.family in (DrafterFamily.CHAIN, DrafterFamily.BLOCK))
        assert sig.block_hidden == (kind is DrafterKind.DSPARK)
        # its runtime drafter: a factory in a runtime module, found from the registry alone
        module, factory = sig.drafter.split(":")
        assert module.startswith("specexport.runtime.") and callable(getattr(importlib.import_module(module), factory))
    # an unknown kind: one line listing the registry's kinds
    with pytest.raises(BadInput) as err:
        parse_recipe({"name": "x", "target": {"source": "tiny"}, "drafters": [{"kind": "medusa"}]}, "r.yaml")
    assert str(err.value) == ("r.yaml: drafters.0: unknown drafter kind 'medusa' (valid kinds: "
                              f"{', '.join(k.value for k in DrafterKind)})")


def test_every_kind_a_shipped_recipe_or_manifest_names_is_registered(tiny_engines):
    kinds = {d["kind"] for path in sorted((REPO / "recipes").rglob("*.yaml"))
             for d in (yaml.safe_load(path.read_text()).get("drafters") or [])}
    manifests = [tiny_engines.get("llama", **TINY_SHAPE) / MANIFEST, *sorted((REPO / "engines").glob(f"*/{MANIFEST}"))]
    for path in manifests:
        kinds |= {d["kind"] for d in json.loads(path.read_text())["drafters"]}
    assert kinds >= {"ngram", "quantized-self", "model", "eagle3", "mtp", "dflash", "dspark"}
    assert kinds <= set(DRAFTER_KINDS)


def test_drafter_models_follow_their_kinds_signature(built):
    manifest = read_manifest(built)
    gqa = manifest.models["target"].attention == "ort-gqa"
    for entry in manifest.drafters.values():
        assert isinstance(entry.kind, DrafterKind) and entry.signature is DRAFTER_KINDS[entry.kind]
        if not entry.signature.runs_model:
            assert entry.model is None and entry.kind not in {m.kind for m in manifest.models.values()}
            continue
        model = manifest.models[entry.model]
        for e in manifest.engines_of(entry.model, "onnxruntime", None):
            assert e.role in entry.signature.roles
            assert list(e.inputs) == entry.signature.graph_inputs(model.num_layers, valid_tokens=gqa)
            assert list(e.outputs) == entry.signature.graph_outputs(model.num_layers, fill=e.role is Role.FILL)
    assert manifest.target_source["source"] == "tiny" and manifest.recipe_root == Path(manifest.recipe_dir or ".")
    assert manifest.device == manifest.toolchain.get("device")


def test_head_params_are_typed_when_read(tiny_engines, tmp_path):
    assert set(contract._PARAM_TYPES) == set(DrafterParams.__dataclass_fields__)  # every field type-checked
    manifest = read_manifest(tiny_engines.get("llama", **TINY_SHAPE))
    ngram = manifest.drafters["ngram"]
    assert (ngram.settings.max_ngram, ngram.settings.min_ngram) == (ngram.params["max_ngram"], ngram.params["min_ngram"])
    assert manifest.drafters["quantized-self"].settings.bits == 4
    block = DrafterEntry("d", "dspark", "d", {"drafts": 4, "heads_file": None, "confidence_threshold": 0,
                                              "markov": "gated", "from_anchor": True})
    assert block.settings == DrafterParams(drafts=4, markov="gated", from_anchor=True, confidence_threshold=0.0)
    assert DrafterEntry("n", "ngram", None).settings == DrafterParams()  # the reader's defaults


def _edited_manifest(tiny_engines, tmp_path, edit) -> Path:
    dst = tmp_path / "edited"
    copy_engines(tiny_engines.get("llama", **TINY_SHAPE), dst)
    raw = json.loads((dst / MANIFEST).read_text())
    edit(raw)
    (dst / MANIFEST).write_text(json.dumps(raw))
    return dst


@pytest.mark.parametrize("edit, words", [
    (lambda raw: raw["drafters"][0]["params"].update(max_ngram="3"),
     "drafter 'ngram': params.max_ngram must be an integer (got '3')"),
    (lambda raw: raw["drafters"][0]["params"].update(min_ngram=True),
     "drafter 'ngram': params.min_ngram must be an integer (got True)"),
    (lambda raw: raw["drafters"][1]["params"].update(quantize_head="yes"),
     "drafter 'quantized-self': params.quantize_head must be true or false (got 'yes')"),
    (lambda raw: raw["drafters"].append({"name": "d", "kind": "dflash", "model": "d", "params": {"drafts": 4.0}}),
     "drafter 'd': params.drafts must be an integer (got 4.0)"),
    (lambda raw: raw["drafters"].append({"name": "d", "kind": "dflash", "model": "d", "params": {}}),
     "drafter 'd' (dflash): params.drafts is missing"),
    (lambda raw: raw["drafters"].append({"name": "m", "kind": "medusa", "model": None}),
     "drafter 'm': unknown drafter kind 'medusa' (valid kinds: ngram,"),
], ids=["str-int", "bool-int", "str-bool", "float-int", "missing", "unknown-kind"])
def test_a_wrong_drafter_entry_is_one_line_naming_the_field(tiny_engines, tmp_path, edit, words):
    dst = _edited_manifest(tiny_engines, tmp_path, edit)
    with pytest.raises(BadInput) as err:
        read_manifest(dst)
    message = str(err.value)
    assert str(dst / MANIFEST) in message and words in message and "\n" not in message


# -- no tensor-name literal outside the contract ----------------------------------------------

TENSOR_NAMES = {contract.INPUT_IDS, contract.CACHE_LENGTH, contract.VALID_TOKENS, contract.PAST, contract.PRESENT,
                contract.LOGITS, contract.NEXT_TOKENS, contract.AUX_HIDDEN_STATES, contract.DRAFT_FEATURES,
                contract.HIDDEN_OUT, contract.CONTEXT_FEATURES, contract.CONTEXT_VALID, contract.BLOCK_HIDDEN,
                contract.STATE_PAST, contract.STATE_PRESENT}
SCANNED = ("exporter", "specexport", "scripts", "runtime")
# Strings spelled like a tensor name that are not one: (file, literal).
NOT_TENSOR_NAMES = {
    ("exporter/validate.py", "input_ids"),  # transformers' tokenizer output key
    ("specexport/bench/harness.py", "logits"),  # the bench's costs flag: were logits copied out
    ("specexport/bench/summary.py", "logits"),  # the same key, copied into the summary
    ("specexport/bench/report.py", "logits"),  # the same key, read in an f-string (a STRING token from 3.12)
}
_PREFIX = re.compile(r"^[rRbBuUfF]*")


def _named(text: str) -> str | None:
    return next((n for n in TENSOR_NAMES if text == n or text.startswith((f"{n}.", f"{n}{{"))), None)


def tensor_name_literals(path: Path) -> list[tuple[int, str]]:
    """(line, name) of each string literal (not a triple-quoted docstring) that is a tensor name
    or starts one (``"present."``, ``f"past_key_values.{i}"``)."""
    hits, previous = [], None
    for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        text = None
        if tok.type == tokenize.STRING:
            body = _PREFIX.sub("", tok.string)
            if body[:3] not in ('"""', "\'\'\'"):
                text = body[1:-1]
        elif tok.type == getattr(tokenize, "FSTRING_MIDDLE", None) and previous == tokenize.FSTRING_START:
            text = tok.string  # Python 3.12+: an f-string's leading text
        if text is not None and (name := _named(text)):
            hits.append((tok.start[0], name))
        previous = tok.type
    return hits


def test_no_tensor_name_literal_outside_the_contract():
    found, used = [], set()
    for root in SCANNED:
        for path in sorted((REPO / root).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            if rel == "specexport/contract.py":
                continue
            for line, name in tensor_name_literals(path):
                if (rel, name) in NOT_TENSOR_NAMES:
                    used.add((rel, name))
                else:
                    found.append(f"{rel}:{line}: {name!r} (use the constant or helper of specexport/contract.py)")
    assert not found, "\n".join(found)


def test_a_chain_fed_to_a_tree_graph_is_each_row_at_its_offset_seeing_the_rows_before():
    ids = contract.TensorSpec("int64", (2, 3))
    feeds = contract.chain_tree_feeds(set(contract.CHAIN_TREE_INPUTS), ids)
    assert feeds[contract.TREE_OFFSETS].tolist() == [[0, 1, 2]] * 2
    causal = [[True, False, False], [True, True, False], [True, True, True]]
    assert feeds[contract.TREE_MASK].tolist() == [causal] * 2
    assert feeds[contract.TREE_MASK].dtype == bool and feeds[contract.TREE_OFFSETS].dtype == np.int64
    with pytest.raises(BadInput, match=r"\['valid_tokens'\].*rebuild"):
        contract.chain_tree_feeds({contract.TREE_MASK, "valid_tokens"}, ids)
