"""Scaffolding the test files share that is not a fixture: a TensorRT build without TensorRT,
and running code on the fake TensorRT and CUDA of tests/fake_gpu (in a child interpreter, so
nothing in the test process is patched)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Collection
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FAKE_GPU = REPO / "tests" / "fake_gpu"


def fake_gpu_env() -> dict[str, str]:
    """This process's environment with the fakes first on PYTHONPATH: a child interpreter then
    imports them as `tensorrt` and `cuda`, and the repository as `specexport` and `tests`."""
    path = os.pathsep.join([str(FAKE_GPU), str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    return {**os.environ, "PYTHONPATH": path}


def run_on_fake_gpu(args: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    """``python ARGS`` in a child interpreter on the fake GPU, from the repository root."""
    return subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, cwd=REPO,
                          timeout=timeout, env=fake_gpu_env())


def json_from_fake_gpu(script: str, *args: object, timeout: float = 600) -> dict:
    """Run ``script`` (Python source that prints one JSON line last) on the fake GPU; its result."""
    done = run_on_fake_gpu(["-c", script, *map(str, args)], timeout)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def as_tensorrt_build(src: Path, dst: Path, models: Collection[str] | None = None, fake_plans: bool = True,
                      precision: str = "fp32") -> Path:
    """A copy of the engine directory ``src`` at ``dst`` as `specexport build --from-onnx`
    leaves it on an H200 with TensorRT 10.13.0.35 (trt_build's entries, trt_from_onnx's
    manifest step), minus TensorRT itself: a plan for every graph of ``models`` (all by
    default). A plan is what the fake TensorRT loads with ``fake_plans`` (the line naming the
    graph TensorRT would parse, trt_build.tensorrt_graph: a shared catch-up graph's static copy
    per size), a placeholder otherwise."""
    from specexport.contract import read_manifest, write_manifest
    from specexport.exporter.trt_build import TrtBuildOptions, _entry, tensorrt_graph
    from specexport.exporter.trt_from_onnx import with_tensorrt_engines
    from specexport.runtime.trt_engine import CudaDevice

    shutil.copytree(src, dst)
    manifest = read_manifest(dst)
    device, options = CudaDevice(0, "NVIDIA H200", "9.0"), TrtBuildOptions(precision=precision)
    compiled = []
    for entry in manifest.engines:
        if models is not None and entry.model not in models:
            continue
        plan = dst / f"{entry.name}.plan"
        if fake_plans:
            plan.write_bytes(b"fake-trt:" + str(tensorrt_graph(entry, dst / entry.path, dst.parent / "parsed",
                                                                precision)).encode())
        else:
            plan.write_bytes(b"placeholder engine " + entry.name.encode())
        compiled.append(_entry(entry, plan, "10.13.0.35", device, options))
    write_manifest(dst, with_tensorrt_engines(manifest, compiled, dst, options, "2026-12-01T00:00:00+00:00"))
    return dst
