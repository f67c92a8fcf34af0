"""Write an engine directory atomically: build beside it, then swap it in.

A build goes into ``.NAME.partial-PID`` next to the destination. On success it is exchanged
with the old engine directory in one step (specexport.atomic.replace_dir: Linux
renameat2 RENAME_EXCHANGE, so the destination never disappears), and the old one removed. On
any failure, interrupt included, the partial directory is deleted; what a killed build left
(``.NAME.partial-PID``, ``.NAME.old-PID`` whose process is gone) is swept at the next build.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from specexport import atomic
from specexport.contract import MANIFEST
from specexport.errors import BadInput


def existing_manifest(out: Path) -> dict | None:
    """The manifest of an existing engine directory at ``out``, None when there is nothing.

    Raises BadInput when ``out`` is a file or a directory that is not an engine directory:
    we never overwrite what we did not write.
    """
    if not out.exists():
        return None
    if not out.is_dir():
        raise BadInput(f"{out}: output path is a file; choose a directory with -o")
    manifest = out / MANIFEST
    if manifest.is_file():
        try:
            data = json.loads(manifest.read_text())
        except ValueError:
            data = None
        if isinstance(data, dict) and "specexport" in data:
            return data
    if any(out.iterdir()):
        raise BadInput(
            f"{out}: directory exists and is not a specexport engine directory; "
            "choose another -o or remove it"
        )
    return None


def sweep_stale(out: Path) -> None:
    """Remove what killed builds left beside ``out`` (``.NAME.partial-PID``, ``.NAME.old-PID``)."""
    atomic.sweep(out)


class AtomicDir:
    """``with AtomicDir(out) as tmp:`` build into tmp; it replaces ``out`` only on success."""

    def __init__(self, out: Path):
        self.out = out
        self.tmp = atomic.temp_name(out)

    def __enter__(self) -> Path:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        sweep_stale(self.out)
        if self.tmp.exists():
            shutil.rmtree(self.tmp)
        self.tmp.mkdir()
        return self.tmp

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            return False
        try:
            atomic.replace_dir(self.tmp, self.out)
        except BaseException:
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise
        return False
