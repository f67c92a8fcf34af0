"""`specexport build --from-onnx DIR`: compile an engine directory's ONNX graphs on this machine.

The edge workflow: export and validate on a workstation (no GPU needed), copy the directory to
the device, rebuild its TensorRT engines there, because an engine only runs in the TensorRT
version and on the GPU architecture that built it. The ONNX graphs, weights, tokenizer and
parity figures are kept (hard links into the new directory, so nothing large is copied); old
TensorRT engines are replaced; the directory is swapped in atomically like any build.
"""

from __future__ import annotations

import datetime as _dt
import os
import shutil
from dataclasses import replace
from pathlib import Path

from specexport.backends import ONNXRUNTIME, TENSORRT
from specexport.contract import (
    MANIFEST,
    EngineEntry,
    Manifest,
    read_manifest,
    sha256_of,
    write_manifest,
)
from specexport.errors import BadInput
from specexport.exporter.outdir import AtomicDir
from specexport.exporter.recipe import parse_recipe
from specexport.exporter.trt_build import TrtBuildOptions, compile_engines, require_tensorrt
from specexport.progress import Reporter


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another filesystem, or links not allowed
        shutil.copy2(src, dst)


def with_tensorrt_engines(manifest: Manifest, compiled: list[EngineEntry], directory: Path,
                          options: TrtBuildOptions, created: str) -> Manifest:
    """``manifest`` with its TensorRT engines replaced by ``compiled`` (whose files, hashed,
    lie in ``directory``), and the toolchain and build facts that go with them."""
    old_plans = {e.path for e in manifest.engines if e.backend == TENSORRT}
    files = {rel: sha for rel, sha in manifest.files.items() if rel not in old_plans}
    hashes = {e.path: sha256_of(directory / e.path) for e in compiled}
    new = [replace(e, sha256=hashes[e.path]) for e in compiled]
    files.update(hashes)
    first = new[0].extra if new else {}
    return replace(
        manifest,
        engines=[e for e in manifest.engines if e.backend == ONNXRUNTIME] + new,
        files=dict(sorted(files.items())),
        toolchain={**manifest.toolchain, TENSORRT: first.get("tensorrt_version"), "device": first.get("device_name"),
                   "compute_capability": first.get("compute_capability")},
        extra={**manifest.extra, "tensorrt_build": {"from_onnx": True, "created": created,
                                                    "precision": options.precision,
                                                    "workspace_mb": options.workspace_mb}},
    )


def rebuild_from_onnx(directory: str | Path, reporter: Reporter, precision: str | None = None,
                      workspace_mb: int | None = None) -> dict:
    """Rebuild the TensorRT engines of ``directory`` from its ONNX graphs; return the manifest."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    with reporter.step("inputs", "verify ONNX graphs") as s:
        manifest.verify_files()
        s.detail = f"{len(manifest.files)} files"
    recipe = parse_recipe(manifest.recipe, f"{directory / MANIFEST} (its recipe)")
    options = TrtBuildOptions.from_recipe(recipe, precision, workspace_mb)
    require_tensorrt()
    onnx_entries = [e for e in manifest.engines if e.backend == ONNXRUNTIME]
    if not onnx_entries:
        raise BadInput(f"{directory}: no ONNX graphs to compile (the manifest lists none)")
    old_plans = {e.path for e in manifest.engines if e.backend == TENSORRT}

    with AtomicDir(directory) as tmp:
        for rel in manifest.files:
            if rel not in old_plans:
                _link_or_copy(directory / rel, tmp / rel)
        new = compile_engines(tmp, onnx_entries, recipe, reporter,
                              timing_cache_dir=directory.resolve().parent, options=options)
        with reporter.step("write", "manifest") as s:
            created = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
            updated = with_tensorrt_engines(manifest, new, tmp, options, created)
            raw = write_manifest(tmp, replace(updated, root=tmp))
            s.detail = f"{len(new)} TensorRT engines"
    return raw
