"""manifest.json: the only contract between the exporter and the runtime.

``Manifest.load`` checks the format and that every file it names exists; ``verify_files``
checks their sha256. Both raise ``BadInput`` with one line that names the file and the fix.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from specexport.errors import BadInput

FORMAT = 1
MANIFEST = "manifest.json"


@dataclass(frozen=True)
class TensorSpec:
    dtype: str  # numpy dtype name
    shape: tuple[int, ...]

    @classmethod
    def parse(cls, raw: list) -> TensorSpec:
        return cls(str(raw[0]), tuple(int(d) for d in raw[1]))


@dataclass(frozen=True)
class EngineEntry:
    name: str  # target.verify.b1.t8
    model: str  # which model's weights and cache
    role: str  # prefill | verify | decode | probe
    backend: str  # onnxruntime | tensorrt
    path: str
    batch: int
    tokens: int
    inputs: dict[str, TensorSpec]
    outputs: dict[str, TensorSpec]
    parity: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)  # backend-specific facts (TensorRT version, GPU)
    cost_ms: float | None = None  # one run, measured at build time (adaptive depth reads it)
    kv_update: str = "append"  # append: present.* are the new positions; in_place: the whole cache


@dataclass(frozen=True)
class ModelEntry:
    name: str
    kind: str  # target | quantized-self | model
    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_seq_len: int
    vocab_size: int
    kv_dtype: str
    summary: dict


@dataclass(frozen=True)
class DrafterEntry:
    name: str
    kind: str  # ngram | quantized-self | model
    model: str | None  # the ModelEntry it runs, if any
    params: dict


@dataclass(frozen=True)
class Manifest:
    root: Path
    raw: dict
    name: str
    plan: dict
    tokenizer: dict
    models: dict[str, ModelEntry]
    drafters: dict[str, DrafterEntry]
    engines: list[EngineEntry]
    files: dict[str, str]  # relative path -> sha256

    @property
    def draft_len(self) -> int:
        return int(self.plan["draft_len"])

    def engines_of(self, model: str, backend: str) -> list[EngineEntry]:
        return sorted(
            (e for e in self.engines if e.model == model and e.backend == backend), key=lambda e: e.tokens
        )

    def backends(self) -> list[str]:
        return sorted({e.backend for e in self.engines})

    @classmethod
    def load(cls, root: str | Path) -> Manifest:
        root = Path(root)
        if not root.exists():
            raise BadInput(f"{root}: engine directory not found (build one with: specexport build RECIPE -o {root})")
        path = root / MANIFEST
        if not root.is_dir() or not path.is_file():
            raise BadInput(f"{root}: not an engine directory (no {MANIFEST}); build one with specexport build")
        try:
            raw = json.loads(path.read_text())
        except ValueError as err:
            raise BadInput(f"{path}: not valid JSON ({err}); rebuild the engine directory") from None
        fmt = raw.get("format") if isinstance(raw, dict) else None
        if fmt != FORMAT:
            raise BadInput(
                f"{path}: manifest format {fmt!r} is not supported (this runtime reads format {FORMAT}); "
                "rebuild with this version of specexport"
            )
        try:
            manifest = cls._parse(root, raw)
        except (KeyError, TypeError, ValueError, IndexError) as err:
            raise BadInput(f"{path}: malformed manifest ({type(err).__name__}: {err}); rebuild it") from None
        for rel in manifest.files:
            if not (root / rel).is_file():
                raise BadInput(f"{root / rel}: file named in the manifest is missing; rebuild the engine directory")
        return manifest

    @classmethod
    def _parse(cls, root: Path, raw: dict) -> Manifest:
        models = {
            name: ModelEntry(
                name=name,
                kind=m["kind"],
                num_layers=int(m["kv"]["num_layers"]),
                num_kv_heads=int(m["kv"]["num_kv_heads"]),
                head_dim=int(m["kv"]["head_dim"]),
                max_seq_len=int(m["kv"]["max_seq_len"]),
                vocab_size=int(m["vocab_size"]),
                kv_dtype=m["kv"]["dtype"],
                summary=m,
            )
            for name, m in raw["models"].items()
        }
        drafters = {
            d["name"]: DrafterEntry(d["name"], d["kind"], d.get("model"), dict(d.get("params", {})))
            for d in raw.get("drafters", [])
        }
        engines = [
            EngineEntry(
                name=e["name"],
                model=e["model"],
                role=e["role"],
                backend=e["backend"],
                path=e["path"],
                batch=int(e["batch"]),
                tokens=int(e["tokens"]),
                inputs={k: TensorSpec.parse(v) for k, v in e["inputs"].items()},
                outputs={k: TensorSpec.parse(v) for k, v in e["outputs"].items()},
                parity=dict(e.get("parity", {})),
                extra=dict(e.get("extra", {})),
                cost_ms=e.get("cost_ms"),
                kv_update=e.get("kv_update", "append"),
            )
            for e in raw["engines"]
        ]
        return cls(
            root=root,
            raw=raw,
            name=raw["name"],
            plan=dict(raw["plan"]),
            tokenizer=dict(raw["tokenizer"]),
            models=models,
            drafters=drafters,
            engines=engines,
            files=dict(raw["files"]),
        )

    def verify_files(self, only: list[str] | None = None) -> None:
        """Check the sha256 of every file (or of ``only``) against the manifest."""
        for rel, expected in self.files.items():
            if only is not None and rel not in only:
                continue
            if sha256_of(self.root / rel) != expected:
                raise BadInput(
                    f"{self.root / rel}: sha256 does not match the manifest (the file was changed "
                    "after the build); rebuild the engine directory with specexport build --force"
                )


def sha256_of(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()
