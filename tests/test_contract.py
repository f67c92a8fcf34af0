"""specexport.contract: every engine directory the builders write reads back to the same
structures (write -> read -> write gives identical JSON; the dataclasses are equal), follows
the naming and layout conventions, and older manifests still load."""

from __future__ import annotations

import json
import shutil

import pytest

from specexport.contract import (
    KV_UPDATE_OF_ATTENTION,
    MANIFEST,
    KVLayout,
    KVUpdate,
    Manifest,
    ModelEntry,
    Role,
    StateLayout,
    dumps,
    engine_name,
    graph_inputs,
    graph_outputs,
    manifest_from_json,
    manifest_to_json,
    model_from_json,
    model_to_json,
    past_names,
    read_manifest,
    write_manifest,
)
from specexport.errors import BadInput
from tests.conftest import TINY_SHAPE


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
        assert list(e.outputs) == graph_outputs(model.num_layers)
        for past in past_names(model.num_layers):
            assert e.inputs[past].shape == model.kv.shape(e.batch)  # [B, n_kv, S_max, hd]
        assert e.kv_update == KV_UPDATE_OF_ATTENTION[attention]
        assert e.sha256 == manifest.files[e.path] and e.weights == model.weights
        assert e.cost_ms is not None and e.parity
    target_roles = {e.tokens: e.role for e in manifest.engines_of("target", "onnxruntime")}
    assert target_roles == {1: Role.DECODE, 2: Role.CATCHUP, 1 + manifest.draft_len: Role.VERIFY,
                            16: Role.PREFILL}


def test_a_tensorrt_manifest_written_by_the_same_path_reads_back(tiny_engines, tmp_path):
    """trt_from_onnx's manifest step with trt_build's entries, minus TensorRT itself: the .plan
    files are placeholders."""
    from specexport.exporter.trt_build import TrtBuildOptions, _entry
    from specexport.exporter.trt_from_onnx import with_tensorrt_engines
    from specexport.runtime.trt_engine import CudaDevice

    src = tiny_engines.get("llama", **TINY_SHAPE)
    dst = tmp_path / "trt"
    shutil.copytree(src, dst)
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
    shutil.copytree(src, dst)
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
    shutil.copytree(tiny_engines.get("llama", **TINY_SHAPE), dst)
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
