"""Bad input to the runtime: one line on stderr, exit code 2."""

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO, TINY_SHAPE, check_one_line, copy_engines, run_cli
from tests.lossless import assert_lossless


@pytest.fixture
def engines_copy(tiny_engines, tmp_path):
    copy = tmp_path / "engines"
    copy_engines(tiny_engines.get("llama", **TINY_SHAPE), copy)
    return copy


def test_engine_directory_missing(tmp_path):
    code, _, err = run_cli("generate", tmp_path / "nothing", "--prompt", "hi")
    check_one_line(code, err, "engine directory not found", alone=True)


def test_foreign_directory(tmp_path):
    (tmp_path / "x.txt").write_text("hello")
    code, _, err = run_cli("generate", tmp_path, "--prompt", "hi")
    check_one_line(code, err, "not an engine directory", alone=True)


def test_unknown_manifest_format(engines_copy):
    manifest = json.loads((engines_copy / "manifest.json").read_text())
    manifest["format"] = 99
    (engines_copy / "manifest.json").write_text(json.dumps(manifest))
    code, _, err = run_cli("generate", engines_copy, "--prompt", "hi")
    check_one_line(code, err, "format 99 is not supported", alone=True)


def test_tampered_engine_file(engines_copy):
    with open(engines_copy / "target.weights", "r+b") as fh:
        fh.seek(64)
        fh.write(b"\xff\xfe")
    code, _, err = run_cli("generate", engines_copy, "--prompt", "hi")
    check_one_line(code, err, "target.weights", "sha256 does not match", alone=True)


def test_missing_engine_file(engines_copy):
    (engines_copy / "target.verify.b1.t5.onnx").unlink()
    code, _, err = run_cli("generate", engines_copy, "--prompt", "hi")
    check_one_line(code, err, "target.verify.b1.t5.onnx", "missing", alone=True)


def test_unknown_drafter(tiny_engines):
    code, _, err = run_cli("generate", tiny_engines.get("llama", **TINY_SHAPE), "--prompt", "hi", "--drafter", "eagle")
    check_one_line(code, err, "unknown drafter 'eagle'", "ngram", alone=True)


def test_prompt_longer_than_the_cache(tiny_engines):
    code, _, err = run_cli("generate", tiny_engines.get("llama", **TINY_SHAPE), "--prompt", "y" * 400)
    check_one_line(code, err, "400 tokens", "160", alone=True)


@pytest.mark.parametrize("prompt", ["", "   "])
def test_empty_prompt(tiny_engines, prompt):
    code, _, err = run_cli("generate", tiny_engines.get("llama", **TINY_SHAPE), "--prompt", prompt)
    check_one_line(code, err, "prompt is empty", alone=True)


def test_no_prompt_at_all(tiny_engines):
    code, _, err = run_cli("generate", tiny_engines.get("llama", **TINY_SHAPE))
    check_one_line(code, err, "prompt is empty", alone=True)


@pytest.mark.parametrize("args, needle", [
    (["--temperature", "-1"], "--temperature"),
    (["--top-p", "0"], "--top-p"),
    (["--top-p", "1.5"], "--top-p"),
    (["--top-k", "-3"], "--top-k"),
    (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--draft-len", "99"], "draft length"),
])
def test_invalid_sampling_values(tiny_engines, args, needle):
    code, _, err = run_cli("generate", tiny_engines.get("llama", **TINY_SHAPE), "--prompt", "hi", *args)
    check_one_line(code, err, needle, alone=True)


def test_prompt_file_unreadable(tiny_engines, tmp_path):
    code, _, err = run_cli("generate", tiny_engines.get("llama", **TINY_SHAPE), "--prompt-file", tmp_path / "none.txt")
    check_one_line(code, err, "cannot read the prompt file", alone=True)


def test_runtime_never_imports_the_exporter_stack(tiny_engines):
    """A full generation in a fresh interpreter: torch, transformers, onnx, the exporter stay out."""
    engines = tiny_engines.get("llama", **TINY_SHAPE)
    script = (
        "import sys\n"
        "from specexport.runtime import load\n"
        f"pipe = load({str(engines)!r}, check_prices=False)\n"  # fixed prices: a seeded run's depths repeat
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

    pipe = load(engines, check_prices=False)
    ids = pipe.prompt_ids("Once upon a time")
    assert_lossless(pipe, ids, pipe.generate(prompt_ids=ids, max_new_tokens=16).token_ids, done["greedy"],
                    "fresh interpreter/quantized-self")
    assert done["sampled"] == pipe.generate(prompt_ids=ids, drafter="draft-model", max_new_tokens=16,
                                            temperature=0.8, seed=1).token_ids


def test_cli_generate_path_is_light_too(tiny_engines):
    engines = tiny_engines.get("llama", **TINY_SHAPE)
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
