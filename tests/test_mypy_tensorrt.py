"""mypy over the TensorRT modules against the tensorrt-stubs type stubs.

Every TensorRT call must name a real API with the right arguments; on a machine without
TensorRT this is the only check of that. Two things stand between the published stubs and
mypy, and both are handled here, in a temporary folder, leaving the install untouched:
- tensorrt-stubs installs ``tensorrt/__init__.pyi`` without a py.typed marker, so mypy would
  skip it as an untyped package: the stubs are copied into a folder on MYPYPATH instead;
- the generated ``tensorrt_bindings/tensorrt.pyi`` has a few signatures Python cannot parse
  (a parameter named ``in``; a parameter without default after defaulted ones): those
  methods (plugin interfaces, ``add_scale_nd``) get a ``(*args, **kwargs)`` signature.
The package is installed with a path mapping (specexport.exporter -> exporter/) that mypy
cannot follow, so the test lays out the same mapping with symlinks.

A control file with wrong TensorRT calls must produce errors: that proves the stubs are read
(an unresolved module would make every call pass as Any).

By hand: .venv/bin/python tests/test_mypy_tensorrt.py
"""

from __future__ import annotations

import ast
import importlib.metadata as md
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# The modules that call TensorRT or CUDA.
CHECKED = ["runtime/trt_engine.py", "runtime/trt_store.py", "exporter/trt_build.py", "exporter/trt_parity.py", "exporter/trt_from_onnx.py",
           "exporter/lint.py", "specexport/cli/trt.py", "specexport/atomic.py"]
STUB_PACKAGES = ("tensorrt", "tensorrt_bindings")

# Wrong on purpose, one error per line; the test expects exactly these lines to be reported.
CONTROL = '''\
import tensorrt as trt

logger = trt.Logger(trt.Logger.WARNING)
builder = trt.Builder(logger)
network = builder.create_network("strongly typed")
config = builder.create_builder_config()
config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE)
config.set_flag(trt.BuilderFlag.FP61)
parser = trt.OnnxParser(network)
plan = builder.build_engine(network, config)
context = trt.Runtime(logger).deserialize_cuda_engine(b"").create_execution_context()
context.execute_async_v3()
'''
CONTROL_ERROR_LINES = {5, 7, 8, 9, 10, 12}


def stub_files() -> list[Path]:
    try:
        files = md.files("tensorrt-stubs") or []
    except md.PackageNotFoundError:
        return []
    return [Path(str(f.locate())) for f in files if f.suffix == ".pyi" and f.parts[0] in STUB_PACKAGES]


def repair_stub(source: str) -> tuple[str, list[str]]:
    """Give every method Python cannot parse a catch-all signature; return the new text and
    the names of the methods changed."""
    lines = source.splitlines()
    changed: list[str] = []
    for _ in range(200):
        try:
            ast.parse("\n".join(lines))
            break
        except SyntaxError as err:
            i = (err.lineno or 1) - 1
            m = re.match(r"(\s*def (\w+))\(.*\)(\s*->\s*.*)?:\s*$", lines[i])
            if m is None:
                raise
            lines[i] = f"{m[1]}(*args: typing.Any, **kwargs: typing.Any){m[3] or ''}:"
            changed.append(m[2])
    else:
        raise RuntimeError("the stubs keep failing to parse")
    text = "\n".join(lines) + "\n"
    if changed and not re.search(r"^import typing$", text, re.M):
        text = "import typing\n" + text
    return text, changed


def prepare(work: Path) -> tuple[Path, Path, list[str]]:
    """Repaired stubs in work/stubs, the package layout in work/src; returns both and the
    repaired method names."""
    stubs, src = work / "stubs", work / "src"
    repaired: list[str] = []
    for path in stub_files():
        package = next(p for p in path.parts[::-1] if p in STUB_PACKAGES)
        dest = stubs / package / path.name
        dest.parent.mkdir(parents=True, exist_ok=True)
        text, changed = repair_stub(path.read_text())
        dest.write_text(text)
        repaired += changed
    pkg = src / "specexport"
    pkg.mkdir(parents=True)
    for f in (REPO / "specexport").glob("*.py"):
        (pkg / f.name).symlink_to(f)
    (pkg / "cli").symlink_to(REPO / "specexport" / "cli", target_is_directory=True)  # cli/trt.py
    (pkg / "exporter").symlink_to(REPO / "exporter", target_is_directory=True)
    (pkg / "runtime").symlink_to(REPO / "runtime", target_is_directory=True)
    return stubs, src, repaired


def run_mypy(work: Path) -> tuple[subprocess.CompletedProcess, list[str], Path, Path]:
    stubs, src, repaired = prepare(work)
    control = work / "control_trt_calls.py"
    control.write_text(CONTROL)
    targets = [src / "specexport" / rel.replace("specexport/", "") if rel.startswith("specexport/")
               else src / "specexport" / rel for rel in CHECKED if (REPO / rel).exists()]
    env = {**os.environ, "MYPYPATH": f"{src}{os.pathsep}{stubs}"}
    cmd = [sys.executable, "-m", "mypy", "--config-file", str(REPO / "mypy.ini"), "--no-error-summary",
           "--show-error-codes", "--cache-dir", str(work / "cache"), *map(str, targets), str(control)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=work, timeout=600)
    return proc, repaired, src, control


def _requirements() -> None:
    try:
        import mypy  # noqa: F401
    except ImportError:
        pytest.skip("mypy is not installed (pip install 'specexport[dev]')")
    if not stub_files():
        pytest.skip("tensorrt-stubs is not installed (see docs/tensorrt.md: pip install --no-deps tensorrt-stubs)")


def test_tensorrt_modules_type_check_against_the_stubs(tmp_path: Path) -> None:
    _requirements()
    proc, repaired, src, control = run_mypy(tmp_path)
    out = proc.stdout + proc.stderr
    assert "Traceback" not in out, out
    ours = [line for line in out.splitlines() if line.startswith(("src/", str(src)))]
    assert not ours, "mypy errors in the TensorRT modules:\n" + "\n".join(ours)

    # The control file's wrong calls are caught, line by line: the stubs are really in use.
    flagged = {int(m[1]) for m in re.finditer(rf"^(?:.*/)?{re.escape(control.name)}:(\d+): error", out, re.M)}
    assert flagged == CONTROL_ERROR_LINES, out
    # Only a handful of stub methods needed repair, none of which specexport calls.
    assert len(repaired) < 20, repaired
    used = set(re.findall(r"\.(\w+)\(", "".join((REPO / rel).read_text() for rel in CHECKED if (REPO / rel).exists())))
    assert not used & set(repaired), f"specexport calls stub methods whose signatures were replaced: {used & set(repaired)}"


def test_stub_repair_keeps_valid_signatures() -> None:
    text, changed = repair_stub("class A:\n    def ok(self, x: int = 1) -> int:\n        ...\n"
                                "    def bad(self, in: int, out: int) -> None:\n        ...\n")
    assert changed == ["bad"]
    assert "def ok(self, x: int = 1) -> int:" in text
    assert "def bad(*args: typing.Any, **kwargs: typing.Any) -> None:" in text
    ast.parse(text)


if __name__ == "__main__":  # by hand or from make: print mypy's report, exit non-zero on errors
    with tempfile.TemporaryDirectory() as tmp:
        result, _, _, control_path = run_mypy(Path(tmp))
        lines = [ln for ln in (result.stdout + result.stderr).splitlines() if control_path.name not in ln]
        print("\n".join(lines) or "mypy: the TensorRT modules type-check against tensorrt-stubs")
        shutil.rmtree(tmp, ignore_errors=True)
        sys.exit(1 if lines else 0)
