"""`specexport build --from-onnx DIR`: compile an engine directory's ONNX graphs on this machine.

The edge workflow: export and validate on a workstation (no GPU needed), copy the directory to
the device, rebuild its TensorRT engines there, because an engine only runs in the TensorRT
version and on the GPU architecture that built it. The ONNX graphs, weights, tokenizer and
parity figures are kept (hard links into the new directory, so nothing large is copied); old
TensorRT engines are replaced; the directory is swapped in atomically like any build.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import shutil
from pathlib import Path

from specexport.errors import BadInput
from specexport.exporter.outdir import AtomicDir
from specexport.exporter.progress import Reporter
from specexport.exporter.recipe import parse_recipe
from specexport.exporter.trt_build import TrtBuildOptions, compile_engines, require_tensorrt
from specexport.runtime.manifest import MANIFEST, Manifest, sha256_of


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another filesystem, or links not allowed
        shutil.copy2(src, dst)


def rebuild_from_onnx(directory: str | Path, reporter: Reporter, precision: str | None = None,
                      workspace_mb: int | None = None) -> dict:
    """Rebuild the TensorRT engines of ``directory`` from its ONNX graphs; return the manifest."""
    directory = Path(directory)
    manifest = Manifest.load(directory)
    with reporter.step("inputs", "verify ONNX graphs") as s:
        manifest.verify_files()
        s.detail = f"{len(manifest.files)} files"
    raw = manifest.raw
    recipe = parse_recipe(raw.get("recipe"), f"{directory / MANIFEST} (its recipe)")
    options = TrtBuildOptions.from_recipe(recipe, precision, workspace_mb)
    require_tensorrt()
    onnx_entries = [e for e in raw["engines"] if e["backend"] == "onnxruntime"]
    if not onnx_entries:
        raise BadInput(f"{directory}: no ONNX graphs to compile (the manifest lists none)")
    old_plans = {e["path"] for e in raw["engines"] if e["backend"] == "tensorrt"}

    with AtomicDir(directory) as tmp:
        kept = {rel: sha for rel, sha in raw["files"].items() if rel not in old_plans}
        for rel in kept:
            _link_or_copy(directory / rel, tmp / rel)
        new = compile_engines(tmp, onnx_entries, recipe, reporter, timing_cache_dir=directory.resolve().parent,
                              options=options)
        with reporter.step("write", "manifest") as s:
            for entry in new:
                entry["sha256"] = kept[entry["path"]] = sha256_of(tmp / entry["path"])
            first = new[0]["extra"] if new else {}
            raw = {
                **raw,
                "engines": onnx_entries + new,
                "files": dict(sorted(kept.items())),
                "toolchain": {
                    **raw.get("toolchain", {}),
                    "tensorrt": first.get("tensorrt_version"),
                    "device": first.get("device_name"),
                    "compute_capability": first.get("compute_capability"),
                },
                "tensorrt_build": {
                    "from_onnx": True,
                    "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                    "precision": options.precision,
                    "workspace_mb": options.workspace_mb,
                },
            }
            (tmp / MANIFEST).write_text(json.dumps(raw, indent=1))
            s.detail = f"{len(new)} TensorRT engines"
    return raw
