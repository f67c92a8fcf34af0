"""What pip installs for each extra, read from pyproject.toml: exactly one onnxruntime in any
combination of extras, the package behind each command's one-line missing-extra error, and
the CPU-only torch the Makefile bootstraps."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import time

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from specexport.errors import EXTRA_OF_MODULE
from tests.conftest import REPO, run_cli

# Distributions that install the module `onnxruntime` (each overwrites the others' files). The
# add-ons named onnxruntime-* install modules of their own.
ONNXRUNTIME_ADDONS = {"onnxruntime-genai", "onnxruntime-genai-cuda", "onnxruntime-extensions", "onnxruntime-tools"}
# modules whose distribution has another name
DISTRIBUTION_OF_MODULE = {"cuda": "cuda-python"}


def is_onnxruntime(name: str) -> bool:
    name = canonicalize_name(name)
    return name not in ONNXRUNTIME_ADDONS and (name in ("onnxruntime", "ort-nightly")
                                               or name.startswith(("onnxruntime-", "ort-nightly-")))


@pytest.fixture(scope="module")
def project() -> dict:
    tomllib = pytest.importorskip("tomllib", reason="Python 3.11's tomllib")
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def resolve(project: dict, extras: tuple[str, ...]) -> list[Requirement]:
    """The requirements `pip install 'specexport[EXTRAS]'` asks for: the dependencies, then each
    extra's, following self-references (`specexport[serve]`) to every extra they name."""
    own = canonicalize_name(project["name"])
    wanted, seen, found = list(extras), set(), [Requirement(r) for r in project["dependencies"]]
    while wanted:
        extra = wanted.pop()
        if extra in seen:
            continue
        seen.add(extra)
        for requirement in map(Requirement, project["optional-dependencies"][extra]):
            if canonicalize_name(requirement.name) == own:
                wanted.extend(requirement.extras)
            else:
                found.append(requirement)
    return found


def combinations(extras) -> list[tuple[str, ...]]:
    return [c for n in range(1, len(extras) + 1) for c in itertools.combinations(sorted(extras), n)]


def test_every_combination_of_extras_installs_exactly_one_onnxruntime(project):
    wrong = {}
    for extras in combinations(project["optional-dependencies"]):
        runtimes = sorted({canonicalize_name(r.name) for r in resolve(project, extras) if is_onnxruntime(r.name)})
        if len(runtimes) != 1:
            wrong[",".join(extras)] = runtimes
    assert not wrong, f"extras that install no onnxruntime or two (one module, overwritten): {wrong}"


@pytest.mark.parametrize("extra", ["serve", "ray", "export", "bench", "gpu"])
def test_each_command_extra_alone_brings_the_onnxruntime_its_engines_run_on(project, extra):
    assert [r.name for r in resolve(project, (extra,)) if is_onnxruntime(r.name)] == ["onnxruntime"]


def test_the_extra_each_missing_module_error_names_installs_that_module(project):
    for module, extra in EXTRA_OF_MODULE.items():
        wanted = canonicalize_name(DISTRIBUTION_OF_MODULE.get(module, module))
        names = {canonicalize_name(r.name) for r in resolve(project, (extra,))}
        assert wanted in names, f"the error for a missing {module} says specexport[{extra}], which does not install it"


def test_a_command_missing_its_extra_says_which_in_one_line():
    # `build` in an interpreter where torch is not importable (a runtime-only install)
    script = ("import sys; sys.modules['torch'] = None; from specexport.cli import main; "
              "sys.argv = ['specexport', 'build', 'recipes/tiny-llama.yaml', '-o', 'unused']; main()")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "torch is not installed" in done.stderr and "pip install 'specexport[export]'" in done.stderr
    assert not (REPO / "unused").exists()


def test_a_cuda_device_without_onnxruntime_gpu_names_the_swap_in_one_line(tiny_engines):
    import onnxruntime

    if "CUDAExecutionProvider" in onnxruntime.get_available_providers():
        pytest.skip("this onnxruntime has the CUDA provider (onnxruntime-gpu is installed)")
    engines = tiny_engines.get("llama", max_seq_len=160, prefill_chunk=16)  # the session's shared build
    code, _, err = run_cli("generate", str(engines), "--prompt", "hi", "-n", "2", "--device", "cuda")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert "CUDAExecutionProvider" in err and "pip uninstall -y onnxruntime && pip install 'onnxruntime-gpu" in err


def make_install(venv, **variables) -> list[str]:
    """The commands `make install` would run for a venv at ``venv`` (make -n: nothing runs)."""
    args = [f"{k}={v}" for k, v in {"VENV": venv, **variables}.items()]
    done = subprocess.run(["make", "-n", "install", *args], cwd=REPO, capture_output=True, text=True, check=True)
    return done.stdout.splitlines()


def torch_line(lines: list[str]) -> str:
    found = [line for line in lines if " pip install " in line and "torch" in line and "-e " not in line
             and "stubs" not in line]
    assert len(found) == 1, lines
    return found[0]


def test_make_install_takes_the_cpu_torch_wheel_from_its_index_unless_told_otherwise(tmp_path):
    line = torch_line(make_install(tmp_path / "venv"))
    requirement = Requirement(line.rsplit(" ", 1)[1].strip("'"))
    assert requirement.name == "torch" and str(requirement.specifier).endswith("+cpu"), line
    index = line.split("--extra-index-url ", 1)[1].split()[0]
    assert index.rstrip("/").endswith("/cpu"), line
    assert "--retries 0" in line  # an unreachable index must not stall the bootstrap

    line = torch_line(make_install(tmp_path / "venv", TORCH="torch==2.13.0", TORCH_INDEX=""))
    assert line.endswith("'torch==2.13.0'") and "--extra-index-url" not in line, line


def test_make_install_is_done_once_its_stamp_is_newer_than_pyproject(tmp_path):
    venv = tmp_path / "venv"
    assert any("pip install" in line for line in make_install(venv))
    venv.mkdir()
    stamp = venv / ".installed"
    stamp.touch()
    later = time.time() + 60
    os.utime(stamp, (later, later))
    assert not any("pip install" in line for line in make_install(venv))
