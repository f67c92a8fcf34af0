"""The backends an engine directory's engines run on: one entry each, read by the recipe, the
build, the CLI, the runtime and the error messages.

A backend is one runtime module (its Engine, and a cache kept beside its engines where it has
one) plus one entry here. Stdlib only: the exporter and the runtime both import it.
"""

from __future__ import annotations

from dataclasses import dataclass

ONNXRUNTIME = "onnxruntime"
TENSORRT = "tensorrt"


@dataclass(frozen=True)
class Backend:
    name: str
    engine: str  # "module:factory" of one engine: (EngineEntry, engine dir, EngineOptions, SharedGraphs | None)
    # "module:factory" of a cache kept beside the engines (EngineOptions.device_kv): (ModelEntry,
    # EngineOptions); None: the host KVCache
    device_cache: str | None
    # "module:factory" of the same cache for several slots, whose rows the batched graphs share:
    # (ModelEntry, EngineOptions, slots) -> (store, one cache per slot); None: the host store
    device_slots: str | None
    fallback: str  # the backend a drafter model without engines of this one runs on (the target never falls back)
    suffix: str  # its engine files' suffix
    extra: str  # the pip extra that installs it (specexport[extra])
    packages: tuple[str, ...]  # the modules it imports, whose absence names the extra
    dists: tuple[str, ...]  # its distributions, the first installed giving the version recorded
    missing_hint: str = ""  # how to get its engines into a directory without them ({dir}: the directory)
    # "module:factory" of its cache rows on the engines' device: (num_layers, [slots, n_kv, S_max, hd],
    # dtype, EngineOptions, CopyCounter | None) -> a store, or None where the options keep host arrays
    row_store: str | None = None


BACKENDS: dict[str, Backend] = {b.name: b for b in (
    Backend(ONNXRUNTIME, "specexport.runtime.ort_engine:open_ort_engine", None, None,
            fallback=ONNXRUNTIME, suffix=".onnx", extra="cpu", packages=("onnxruntime",),
            dists=("onnxruntime", "onnxruntime-gpu"), row_store="specexport.runtime.device_store:open_row_store"),
    # the int4 drafter's MatMulNBits graphs have no TensorRT importer: it runs on onnxruntime beside
    Backend(TENSORRT, "specexport.runtime.trt_engine:open_trt_engine",
            "specexport.runtime.trt_store:open_device_kv_cache", "specexport.runtime.trt_store:open_device_slots",
            fallback=ONNXRUNTIME,
            suffix=".plan", extra="gpu", packages=("tensorrt", "cuda"), dists=("tensorrt",),
            missing_hint="; build them on this machine with: specexport build --from-onnx {dir}"),
)}
DEFAULT_BACKEND = ONNXRUNTIME  # what a directory runs on when no backend is asked for and it has its engines

