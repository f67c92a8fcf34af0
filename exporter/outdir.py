"""Write an engine directory atomically: build beside it, then swap it in with renames.

A build goes into ``.NAME.partial-PID`` next to the destination. On success the old engine
directory (if any) is renamed away, the new one renamed into place, the old one removed. On
any failure, interrupt included, the partial directory is deleted; partial directories left
by a killed build (their process is gone) are swept at the next build.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from specexport.errors import BadInput

MANIFEST = "manifest.json"


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


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale(out: Path) -> None:
    for leftover in out.parent.glob(f".{out.name}.partial-*"):
        pid = leftover.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(leftover, ignore_errors=True)


class AtomicDir:
    """``with AtomicDir(out) as tmp:`` build into tmp; it replaces ``out`` only on success."""

    def __init__(self, out: Path):
        self.out = out
        self.tmp = out.parent / f".{out.name}.partial-{os.getpid()}"

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
        old = self.out.parent / f".{self.out.name}.old-{os.getpid()}"
        if self.out.exists():
            os.rename(self.out, old)
        os.rename(self.tmp, self.out)
        shutil.rmtree(old, ignore_errors=True)
        return False
