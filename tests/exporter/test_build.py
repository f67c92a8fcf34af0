"""The engine directory: contents, manifest, shared weights, reuse, atomicity, local HF models."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import onnx
import pytest

from specexport.contract import Manifest, sha256_of
from specexport.runtime.costs import COSTS
from specexport.runtime.integrity import RECORD
from tests.conftest import ALL_DRAFTERS, TINY_SHAPE, copy_engines, run_cli, tiny_recipe


@pytest.fixture(scope="module")
def built(tiny_engines):
    """The session's shared tiny llama build with every drafter (tests/conftest.py TinyEngines,
    the one tests/exporter/test_archs.py and the runtime tests decode with): (directory, recipe)."""
    engines = tiny_engines.get("llama", **TINY_SHAPE)
    return engines, tiny_engines.recipe(engines)


# One quiet target-only build serves the tests below that need a built directory before
# they rebuild, tamper or check the output: each copies it. It starts beside the partial
# directory a killed build left (test_stale_partial_from_a_killed_build_is_swept). Its
# prefill chunk is 1+D: two graphs (decode, verify) per build.
SMALL = dict(max_seq_len=32, prefill_chunk=5)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    root = tmp_path_factory.mktemp("small")
    recipe = tiny_recipe(root / "r.yaml", "llama", **SMALL)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = root / f".engines.partial-{dead.pid}"
    stale.mkdir()
    (stale / "half.onnx").write_bytes(b"x")
    code, out, err = run_cli("build", recipe, "-o", root / "engines", "-q")
    return {"root": root, "recipe": recipe, "engines": root / "engines", "stale": stale, "code": code, "out": out,
            "err": err}


def _copy_small(small, tmp_path):
    """The shared small build and its recipe, copied into ``tmp_path`` (as "r.yaml", "engines")."""
    assert small["code"] == 0, small["err"]
    recipe = tmp_path / "r.yaml"
    shutil.copy2(small["recipe"], recipe)
    copy_engines(small["engines"], tmp_path / "engines")
    return recipe, tmp_path / "engines"


def test_directory_and_manifest(built):
    out, _ = built
    manifest = json.loads((out / "manifest.json").read_text())
    chunk = TINY_SHAPE["prefill_chunk"]
    assert manifest["format"] == 1 and manifest["specexport"]
    assert manifest["plan"]["draft_len"] == 4 and manifest["plan"]["group_size"] == 2
    assert {"torch", "transformers", "onnx", "onnxruntime"} <= set(manifest["toolchain"])
    assert manifest["tokenizer"]["file"] == "tokenizer.json"
    assert manifest["tokenizer"]["chat_template"] == "chat_template.jinja"
    assert manifest["tokenizer"]["eos_token_ids"]
    assert {d["name"] for d in manifest["drafters"]} == {"ngram", "quantized-self", "draft-model"}
    assert set(manifest["models"]) == {"target", "quantized-self", "draft-model"}
    # every file but the manifest (and its own hash, in sha256sum's format) is hashed, and right;
    # beside them only what loads of this shared directory write (the integrity record, costs)
    files = {p.name for p in out.iterdir()} - {"manifest.json", "manifest.sha256", RECORD, COSTS}
    assert (out / "manifest.sha256").read_text() == f"{sha256_of(out / 'manifest.json')}  manifest.json\n"
    assert set(manifest["files"]) == files
    for name, digest in manifest["files"].items():
        assert sha256_of(out / name) == digest
    names = {e["name"] for e in manifest["engines"]}
    assert {"target.decode.b1.t1", "target.verify.b1.t5", f"target.prefill.b1.t{chunk}",
            "quantized-self.decode.b1.t1", "quantized-self.catchup.b1.t2", f"quantized-self.prefill.b1.t{chunk}",
            "draft-model.decode.b1.t1", "draft-model.catchup.b1.t2", f"draft-model.prefill.b1.t{chunk}"} <= names
    for engine in manifest["engines"]:
        assert engine["sha256"] == manifest["files"][engine["path"]]
        # every fp32 graph was held to the limits; the int4 drafter's figures are only recorded
        int4 = engine["model"] == "quantized-self"
        assert engine["parity"]["enforced"] is not int4, engine["name"]
        assert engine["parity"]["precision"] == ("int4" if int4 else "fp32"), engine["name"]
    Manifest.load(out).verify_files()  # the runtime's own reading agrees


def test_graphs_are_static_and_share_one_weights_file_per_model(built):
    out, _ = built
    manifest = json.loads((out / "manifest.json").read_text())
    for engine in manifest["engines"]:
        model = onnx.load(str(out / engine["path"]), load_external_data=False)
        for value in [*model.graph.input, *model.graph.output]:
            dims = value.type.tensor_type.shape.dim
            assert all(d.HasField("dim_value") for d in dims), (engine["name"], value.name)
        locations = {
            entry.value
            for tensor in model.graph.initializer
            for entry in tensor.external_data
            if entry.key == "location"
        }
        assert locations == {f"{engine['model']}.weights"}, engine["name"]
        t = engine["tokens"]
        assert engine["inputs"]["input_ids"] == ["int64", [1, t]]
        assert engine["inputs"]["past_key_values.0.key"][1][2] == TINY_SHAPE["max_seq_len"]  # S_max
        assert engine["outputs"]["present.0.key"][1][2] == t
        assert engine["outputs"]["logits"] == ["float32", [1, t, 259]]


def _parameter_bytes(source: dict) -> int:
    """fp32 bytes of a tiny recipe model's parameters (tied weights counted once)."""
    from specexport.exporter.recipe import TinySource
    from specexport.exporter.tiny import tiny_model

    model, _ = tiny_model(TinySource(**source))
    return 4 * model.num_parameters()


def test_weights_are_stored_once_per_model(built):
    out, _ = built
    manifest = json.loads((out / "manifest.json").read_text())
    recipe = manifest["recipe"]
    fp32_sources = {"target": recipe["target"], "draft-model": ALL_DRAFTERS[2]["model"]}
    stored = {}
    for model, info in manifest["models"].items():
        graphs = [e for e in manifest["engines"] if e["model"] == model]
        assert len(graphs) >= 3, model
        spans: dict[str, set] = {}  # initializer -> the (offset, length) each graph reads it at
        for engine in graphs:
            proto = onnx.load(str(out / engine["path"]), load_external_data=False)
            inline = 0
            for tensor in proto.graph.initializer:
                data = {e.key: e.value for e in tensor.external_data}
                if data:
                    assert data["location"] == info["weights"], (engine["name"], tensor.name)
                    spans.setdefault(tensor.name, set()).add((int(data["offset"]), int(data["length"])))
                else:
                    inline += onnx.numpy_helper.to_array(tensor).nbytes
            # only small constants (norm scales, shapes) stay in the graph file
            assert inline < 0.02 * _parameter_bytes(fp32_sources.get(model, recipe["target"])), engine["name"]
        # every graph of the model points at the same bytes for the same weight
        assert all(len(s) == 1 for s in spans.values()), model
        distinct = {span for s in spans.values() for span in s}
        size = (out / info["weights"]).stat().st_size
        total = sum(length for _, length in distinct)
        assert total <= size <= total + 4096 * len(distinct), model  # + alignment only
        # the rotary tables (cos and sin [S_max, head_dim], the rotation) are constants of the
        # graphs, not parameters: they grow with max_seq_len
        tables = {span for name, s in spans.items() if name.startswith("rope_") for span in s}
        assert tables, model
        stored[model] = total - sum(length for _, length in tables)
    for model, source in fp32_sources.items():
        params = _parameter_bytes(source)
        assert params <= stored[model] <= 1.05 * params, (model, stored[model], params)
    # int4: half a byte per quantized weight plus scales and the fp32 embedding table
    assert _parameter_bytes(recipe["target"]) / 8 < stored["quantized-self"] < 0.6 * stored["target"]


def test_quantized_self_is_int4_matmulnbits(built):
    out, _ = built
    model = onnx.load(str(out / "quantized-self.decode.b1.t1.onnx"), load_external_data=False)
    ops = [n for n in model.graph.node if n.op_type == "MatMulNBits"]
    assert ops and all(n.domain == "com.microsoft" for n in ops)
    attrs = {a.name: a.i for a in ops[0].attribute}
    assert attrs["bits"] == 4 and attrs["block_size"] == 32
    assert not [n for n in model.graph.node if n.op_type == "MatMul" and n.input[1].startswith("layers.")]


def test_unchanged_rebuild_is_reused(built):
    out_dir, recipe = built
    built_files = ["manifest.json", *json.loads((out_dir / "manifest.json").read_text())["files"]]
    before = {name: (out_dir / name).stat().st_mtime_ns for name in built_files}
    code, out, err = run_cli("build", recipe, "-o", out_dir, "--json")
    assert code == 0, err
    assert json.loads(out)["reused"] is True
    # nothing the build wrote was rewritten (speed is the bench's business, not a unit test's)
    assert {name: (out_dir / name).stat().st_mtime_ns for name in built_files} == before


def test_changed_recipe_or_force_rebuilds_showing_every_step(small, tmp_path):
    recipe, out = _copy_small(small, tmp_path)
    first = json.loads((out / "manifest.json").read_text())
    assert first["plan"]["draft_len"] == 4
    inode = (out / "manifest.json").stat().st_ino
    code, text, _ = run_cli("build", recipe, "-o", out, "--force", "--json")
    assert code == 0 and json.loads(text)["reused"] is False
    assert (out / "manifest.json").stat().st_ino != inode  # a new directory was swapped in
    forced = json.loads((out / "manifest.json").read_text())
    assert forced["inputs_sha256"] == first["inputs_sha256"]  # same inputs, rebuilt anyway
    # a changed recipe (a shorter draft, an int4 drafter; the prefill chunk 1+D again: the
    # fewest graphs) is rebuilt; without --quiet or --json the build shows every step on stderr
    tiny_recipe(recipe, "llama", **{**SMALL, "prefill_chunk": 3}, max_draft=2, drafters=[{"kind": "quantized-self"}])
    code, _, err = run_cli("build", recipe, "-o", out)
    assert code == 0, err
    for step in ("load", "plan", "export", "quantize", "validate", "write"):
        assert f" {step} " in f" {err} ", step
    changed = json.loads((out / "manifest.json").read_text())
    assert changed["plan"]["draft_len"] == 2 and changed["inputs_sha256"] != first["inputs_sha256"]
    assert "target.verify.b1.t3.onnx" in changed["files"] and "target.verify.b1.t5.onnx" not in changed["files"]
    assert not (out / "target.verify.b1.t5.onnx").exists()  # replaced in place, not merged
    assert not list(tmp_path.glob(".engines.*"))
    # a full build with --quiet (the shared small one, -q) prints nothing at all
    assert small["err"] == "" and small["out"] == ""


def test_tampered_engine_directory_is_rebuilt_not_reused(small, tmp_path):
    recipe, out = _copy_small(small, tmp_path)
    with open(out / "target.weights", "r+b") as fh:
        fh.seek(100)
        fh.write(b"\x13\x37")
    code, text, _ = run_cli("build", recipe, "-o", out, "--json")
    assert code == 0 and json.loads(text)["reused"] is False
    Manifest.load(out).verify_files()


def test_interrupted_build_leaves_nothing(tmp_path):
    recipe = tiny_recipe(tmp_path / "r.yaml", "llama", max_seq_len=32, prefill_chunk=8,
                         drafters=ALL_DRAFTERS)
    out = tmp_path / "engines"
    proc = subprocess.Popen([sys.executable, "-m", "specexport", "build", str(recipe), "-o", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # wait until it is writing graphs into its partial directory, then stop it
    deadline = time.time() + 120
    while time.time() < deadline:
        partial = list(tmp_path.glob(".engines.partial-*"))
        if partial and any(p.suffix == ".onnx" for p in partial[0].iterdir()):
            break
        time.sleep(0.05)
    else:
        proc.kill()
        pytest.fail("the build never started writing")
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode != 0
    assert "interrupted" in err and "Traceback" not in err
    assert not out.exists()
    assert not list(tmp_path.glob(".engines.*"))


def test_stale_partial_from_a_killed_build_is_swept(small):
    # the shared small build started beside the partial directory of a dead process
    assert small["code"] == 0, small["err"]
    assert (small["engines"] / "manifest.json").is_file()
    assert not small["stale"].exists()
    assert not list(small["root"].glob(".engines.*"))


def test_local_transformers_directory_builds_offline(tmp_path, monkeypatch):
    from tests.exporter.hf_dirs import save_tiny_hf

    model_dir = save_tiny_hf(tmp_path / "qwen3-tiny", "qwen3", seed=5)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        f"name: local-qwen3\ntarget: {{source: hf, path: {model_dir.name}}}\n"
        "drafters: [{kind: ngram}]\nshapes: {max_seq_len: 48, prefill_chunk: 4}\n"
        "draft: {max_draft: 3}\n"
    )
    code, out, err = run_cli("build", recipe, "-o", tmp_path / "engines", "--json")
    assert code == 0, err
    for engine in json.loads(out)["engines"]:
        # by default, for a non-tiny source too (tests/exporter/test_validation.py: a limit that
        # cannot be met fails such a build)
        assert engine["parity"]["enforced"] is True and engine["parity"]["precision"] == "fp32"
        assert engine["parity"]["argmax_agreement"] == 1.0
        assert engine["parity"]["max_abs_logit_diff"] <= engine["parity"]["max_abs_logit_diff_limit"]
    manifest = json.loads((tmp_path / "engines" / "manifest.json").read_text())
    assert manifest["models"]["target"]["model_type"] == "qwen3"


if os.name != "posix":  # pragma: no cover
    pytest.skip("signals", allow_module_level=True)
