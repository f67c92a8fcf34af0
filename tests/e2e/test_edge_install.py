"""The edge install: the wheel with the `cpu` extra alone, in a fresh virtual environment, runs
`generate` and `bench` on a copied engine directory without torch, transformers, onnx or the
exporter. Slow: it builds the wheel and installs its dependencies (about a minute)."""

import json
import shutil
import subprocess
import sys

import pytest

from tests.conftest import REPO, TINY_SHAPE, copy_engines
from tests.test_packaging import is_onnxruntime

pytestmark = pytest.mark.slow

# runs the CLI in the venv's interpreter, then names what it imported that an edge device lacks
_RUN = """
import sys
from specexport.cli import main
sys.argv = ["specexport", *sys.argv[1:]]
try:
    main()
except SystemExit as done:
    code = done.code
else:
    code = 0
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers", "onnx")
               or m.startswith("specexport.exporter"))
print(json.dumps({"code": code, "heavy": heavy}), file=sys.stderr)
"""


def _source_tree(dest):
    """The project's files as git sees them (tracked and new, not ignored): no stale build/."""
    names = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, check=True,
                           capture_output=True).stdout.decode().split("\0")
    for name in filter(None, names):
        if (REPO / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, dest / name)
    return dest


def test_cpu_extra_alone_runs_generate_and_bench(tiny_engines, tmp_path):
    src = _source_tree(tmp_path / "src")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", str(src), "-w", str(tmp_path / "wheel")],
                   check=True, capture_output=True)
    wheel = next((tmp_path / "wheel").glob("specexport-*.whl"))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "-q", f"specexport[cpu] @ {wheel.as_uri()}"], check=True,
                   capture_output=True)
    installed = subprocess.run([str(python), "-c", "import importlib.metadata as m\n"
                                "for d in m.distributions(): print(d.metadata['Name'])"],
                               capture_output=True, text=True, check=True).stdout.split()
    assert [name for name in installed if is_onnxruntime(name)] == ["onnxruntime"], installed
    for package in ("torch", "transformers", "onnx"):
        found = subprocess.run([str(python), "-c", f"import importlib.util as u; print(u.find_spec('{package}') is None)"],
                               capture_output=True, text=True, check=True).stdout.strip()
        assert found == "True", f"{package} is importable in the cpu-only install"

    engines = tmp_path / "device" / "engines"  # a copy elsewhere, as deployed
    copy_engines(tiny_engines.get("llama", **TINY_SHAPE), engines)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "loop", "category": "grounded", "prompt": "1, 2, 3, 1, 2, 3, 1,"}) + "\n")

    def run(*args):
        done = subprocess.run([str(python), "-c", "import json\n" + _RUN, *map(str, args)], capture_output=True,
                              text=True, cwd=tmp_path)  # not the repository: only the installed package
        report = json.loads(done.stderr.strip().splitlines()[-1])
        assert report["code"] in (0, None), done.stderr
        assert report["heavy"] == [], f"{args[0]} imported {report['heavy']}"
        return done.stdout

    out = json.loads(run("generate", engines, "--prompt", "hello", "-n", "4", "--drafter", "quantized-self", "--json"))
    assert len(out["token_ids"]) == 4 and out["memory"]["peak_rss_mb"] > 0
    bench = json.loads(run("bench", engines, "--prompts", prompts, "-n", "8", "--repeats", "1",
                           "--out", tmp_path / "bench", "--json"))
    assert bench["memory"]["peak_rss_mb"] > 0 and {r["drafter"] for r in bench["results"]} >= {"none", "ngram"}
