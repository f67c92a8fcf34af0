"""manifest.json: the only contract between the exporter and the runtime.

The schema, its writer and its reader live in ``specexport.contract`` (shared by both halves);
this module keeps the runtime's old import path. ``Manifest.load`` checks the format and that
every file it names exists; ``verify_files`` checks their sha256 (``load`` goes through
runtime/integrity.py, which re-hashes only the files changed since the last check). Both raise ``BadInput`` with
one line that names the file and the fix.
"""

from __future__ import annotations

from specexport.contract import (
    FORMAT,
    MANIFEST,
    DrafterEntry,
    EngineEntry,
    KVLayout,
    KVUpdate,
    Manifest,
    ModelEntry,
    Role,
    TensorSpec,
    read_manifest,
    sha256_of,
)

__all__ = ["FORMAT", "MANIFEST", "DrafterEntry", "EngineEntry", "KVLayout", "KVUpdate", "Manifest", "ModelEntry",
           "Role", "TensorSpec", "read_manifest", "sha256_of"]
