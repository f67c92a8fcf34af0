"""Bad input to the runtime: one line on stderr, exit code 2."""

import json
import shutil
import subprocess
import sys

import pytest

from tests.conftest import REPO, run_cli
from tests.lossless import assert_lossless

SHAPE = dict(max_seq_len=160, prefill_chunk=16)


def _check(code, err, *needles):
    assert code == 2, err
    lines = [line for line in err.strip().splitlines() if line]
    assert len(lines) == 1 and lines[0].startswith("specexport: error:"), err
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.fixture
def engines_copy(tiny_engines, tmp_path):
    copy = tmp_path / "engines"
    shutil.copytree(tiny_engines.get("llama", **SHAPE), copy)
    return copy


def test_engine_directory_missing(tmp_path):
    code, _, err = run_cli("generate", tmp_path / "nothing", "--prompt", "hi")
    _check(code, err, "engine directory not found")


def test_foreign_directory(tmp_path):
    (tmp_path / "x.txt").write_text("hello")
    code, _, err = run_cli("generate", tmp_path, "--prompt", "hi")
    _check(code, err, "not an engine directory")


def test_unknown_manifest_format(engines_copy):
    manifest = json.loads((engines_copy / "manifest.json").read_text())
    manifest["format"] = 99
    (engines_copy / "manifest.json").write_text(json.dumps(manifest))
    code, _, err = run_cli("generate", engines_copy, "--prompt", "hi")
    _check(code, err, "format 99 is not supported")


def test_tampered_engine_file(engines_copy):
    with open(engines_copy / "target.weights", "r+b") as fh:
        fh.seek(64)
        fh.write(b"\xff\xfe")
    code, _, err = run_cli("generate", engines_copy, "--prompt", "hi")
    _check(code, err, "target.weights", "sha256 does not match")


def test_missing_engine_file(engines_copy):
    (engines_copy / "target.verify.b1.t5.onnx").unlink()
    code, _, err = run_cli("generate", engines_copy, "--prompt", "hi")
    _check(code, err, "target.verify.b1.t5.onnx", "missing")


def test_unknown_drafter(tiny_engines):
    code, _, err = run_cli("generate", tiny_engines.get("llama", **SHAPE), "--prompt", "hi", "--drafter", "eagle")
    _check(code, err, "unknown drafter 'eagle'", "ngram")


def test_prompt_longer_than_the_cache(tiny_engines):
    code, _, err = run_cli("generate", tiny_engines.get("llama", **SHAPE), "--prompt", "y" * 400)
    _check(code, err, "400 tokens", "160")


@pytest.mark.parametrize("prompt", ["", "   "])
def test_empty_prompt(tiny_engines, prompt):
    code, _, err = run_cli("generate", tiny_engines.get("llama", **SHAPE), "--prompt", prompt)
    _check(code, err, "prompt is empty")


def test_no_prompt_at_all(tiny_engines):
    code, _, err = run_cli("generate", tiny_engines.get("llama", **SHAPE))
    _check(code, err, "prompt is empty")


@pytest.mark.parametrize("args, needle", [
    (["--temperature", "-1"], "--temperature"),
    (["--top-p", "0"], "--top-p"),
    (["--top-p", "1.5"], "--top-p"),
    (["--top-k", "-3"], "--top-k"),
    (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--draft-len", "99"], "draft length"),
])
def test_invalid_sampling_values(tiny_engines, args, needle):
    code, _, err = run_cli("generate", tiny_engines.get("llama", **SHAPE), "--prompt", "hi", *args)
    _check(code, err, needle)


def test_prompt_file_unreadable(tiny_engines, tmp_path):
    code, _, err = run_cli("generate", tiny_engines.get("llama", **SHAPE), "--prompt-file", tmp_path / "none.txt")
    _check(code, err, "cannot read the prompt file")


def test_runtime_never_imports_the_exporter_stack(tiny_engines):
    """A full generation in a fresh interpreter: torch, transformers, onnx, the exporter stay out."""
    engines = tiny_engines.get("llama", **SHAPE)
    script = (
        "import sys\n"
        "from specexport.runtime import load\n"
        f"pipe = load({str(engines)!r})\n"
        "q = pipe.generate('Once upon a time', drafter='quantized-self', max_new_tokens=16)\n"
        "s = pipe.generate('Once upon a time', drafter='draft-model', max_new_tokens=16, temperature=0.8, seed=1)\n"
        "heavy = [m for m in ('torch', 'transformers', 'onnx', 'onnxscript', 'specexport.exporter') if m in sys.modules]\n"
        "print(json.dumps({'heavy': heavy, 'greedy': q.token_ids, 'sampled': s.token_ids}))\n"
    )
    result = subprocess.run([sys.executable, "-c", "import json\n" + script], capture_output=True, text=True,
                            cwd=REPO)
    assert result.returncode == 0, result.stderr
    done = json.loads(result.stdout)
    assert done["heavy"] == []
    # and what it computed there is right: greedy equals the target alone, sampling is seeded
    from specexport.runtime import load

    pipe = load(engines)
    ids = pipe.prompt_ids("Once upon a time")
    assert_lossless(pipe, ids, pipe.generate(prompt_ids=ids, max_new_tokens=16).token_ids, done["greedy"],
                    "fresh interpreter/quantized-self")
    assert done["sampled"] == pipe.generate(prompt_ids=ids, drafter="draft-model", max_new_tokens=16,
                                            temperature=0.8, seed=1).token_ids


def test_cli_generate_path_is_light_too(tiny_engines):
    engines = tiny_engines.get("llama", **SHAPE)
    script = (
        "import sys\n"
        "from specexport.cli import main\n"
        f"sys.argv = ['specexport', 'generate', {str(engines)!r}, '--prompt', 'hi', '-n', '4', '--json']\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "heavy = [m for m in ('torch', 'transformers', 'onnx', 'specexport.exporter') if m in sys.modules]\n"
        "print(heavy, file=sys.stderr)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO)
    assert result.stderr.strip().splitlines()[-1] == "[]", result.stderr
