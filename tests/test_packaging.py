"""What pip installs for each extra, read from pyproject.toml: exactly one onnxruntime in every
combination of extras a user is told to use (the command extras with `cpu` or `cuda`, `dev`),
the package behind each command's one-line missing-extra error, the CPU-only torch the Makefile
bootstraps, and what make install-cuda installs."""

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


def combinations(extras, smallest: int = 1) -> list[tuple[str, ...]]:
    return [c for n in range(smallest, len(extras) + 1) for c in itertools.combinations(sorted(extras), n)]


# the extra that picks the onnxruntime -> the distribution it installs
RUNTIMES = {"cpu": "onnxruntime", "cuda": "onnxruntime-gpu"}
DEV = "dev"  # the CPU development install (make install): the cpu runtime and every command extra


def runtimes_of(project: dict, extras: tuple[str, ...]) -> list[str]:
    return sorted({canonicalize_name(r.name) for r in resolve(project, extras) if is_onnxruntime(r.name)})


def command_extras(project: dict) -> list[str]:
    return sorted(set(project["optional-dependencies"]) - set(RUNTIMES) - {DEV})


def test_every_combination_a_user_is_told_to_use_installs_exactly_one_onnxruntime(project):
    """Any command extras with `cpu` or with `cuda` (README's install table), or with `dev`."""
    wrong = {}
    for extras in combinations(command_extras(project), smallest=0):
        for runtime, dist in [*RUNTIMES.items(), (DEV, "onnxruntime")]:
            found = runtimes_of(project, (*extras, runtime))
            if found != [dist]:
                wrong[",".join((*extras, runtime))] = found
    assert not wrong, f"extras that install no onnxruntime, two (one module, overwritten) or another: {wrong}"


def test_only_a_second_runtime_brings_a_second_onnxruntime(project):
    """Every combination of every extra: two onnxruntimes exactly where both cuda and the CPU
    wheel (cpu, or dev) are named, none where neither is."""
    for extras in combinations(project["optional-dependencies"]):
        cpu, cuda = bool({"cpu", DEV} & set(extras)), "cuda" in extras
        assert len(runtimes_of(project, extras)) == cpu + cuda, extras


@pytest.mark.parametrize("extra", ["serve", "ray", "export", "bench", "gpu", "structured", "test"])
def test_each_command_extra_leaves_the_onnxruntime_to_the_user(project, extra):
    assert runtimes_of(project, (extra,)) == []


def test_the_cuda_extra_installs_a_cuda_13_onnxruntime_gpu(project):
    """onnxruntime-gpu 1.27-1.31 are CUDA 13 builds; 1.24-1.26 CUDA 12 (the issue's inspection)."""
    (gpu,) = [r for r in resolve(project, ("cuda",)) if is_onnxruntime(r.name)]
    assert canonicalize_name(gpu.name) == "onnxruntime-gpu"
    assert all(gpu.specifier.contains(v) for v in ("1.27.0", "1.30.0", "1.31.1"))
    assert not any(gpu.specifier.contains(v) for v in ("1.24.4", "1.26.0"))


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
    assert "CUDAExecutionProvider" in err and "pip uninstall -y onnxruntime && pip install 'specexport[cuda]'" in err


def make_install(venv, target: str = "install", **variables) -> list[str]:
    """The commands `make TARGET` would run for a venv at ``venv`` (make -n: nothing runs)."""
    args = [f"{k}={v}" for k, v in {"VENV": venv, **variables}.items()]
    # under `make test` the parent's MAKEFLAGS and MAKELEVEL would make this make print its directory
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES")}
    done = subprocess.run(
        ["make", "--no-print-directory", "-n", target, *args],
        cwd=REPO, env=env, capture_output=True, text=True, check=True,
    )
    return done.stdout.splitlines()


def installed_extras(lines: list[str]) -> tuple[str, ...]:
    """The extras of the one `pip install -e '.[...]'` line."""
    (line,) = [line for line in lines if " pip install " in line and "-e " in line]
    return tuple(line.split("'.[", 1)[1].split("]", 1)[0].split(","))


def test_make_install_cuda_installs_onnxruntime_gpu_alone_and_torch_for_cuda_13(project, tmp_path):
    lines = make_install(tmp_path / "venv", "install-cuda")
    assert runtimes_of(project, installed_extras(lines)) == ["onnxruntime-gpu"]
    # the CPU wheel of an earlier make install goes first (the same module), with the peer needing it
    uninstall = next(i for i, line in enumerate(lines) if " pip uninstall " in line)
    assert {"onnxruntime", "onnxruntime-genai"} <= set(lines[uninstall].split())
    assert uninstall < next(i for i, line in enumerate(lines) if "-e " in line and " pip install " in line)
    torch = torch_line(lines)
    assert torch.split("--extra-index-url ", 1)[1].split()[0].rstrip("/").endswith("/cu130"), torch
    assert "+cpu" not in torch
    assert lines[-1].startswith("touch ") and lines[-1].endswith("/.installed")  # make test then uses it


def test_make_install_brings_the_cpu_onnxruntime_alone(project, tmp_path):
    assert runtimes_of(project, installed_extras(make_install(tmp_path / "venv"))) == ["onnxruntime"]


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
