"""Files kept beside an engine directory that the build does not write (the integrity record,
tuned costs): in the directory itself when it is writable, else in a per-user cache.

Why a fallback: an engine directory may be read-only (a package, a mounted image, another
user's install), and a load must still be able to remember what it checked. The cache is
``$XDG_CACHE_HOME/specexport/engines/<sha256 of the directory's real path>/`` (``~/.cache``
without the variable); readers look in the directory first, then there.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

from specexport import atomic

_log = logging.getLogger(__name__)


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "specexport" / "engines"


def real_root(root: Path) -> str:
    return os.path.realpath(root)


def candidates(root: Path, name: str) -> list[Path]:
    """Where ``name`` for the directory ``root`` may be, in the order readers look."""
    key = hashlib.sha256(real_root(root).encode()).hexdigest()[:24]
    return [Path(root) / name, cache_root() / key / name]


def read_json(root: Path, name: str) -> tuple[dict, Path] | None:
    """The first readable JSON object named ``name`` for ``root``, and where it was."""
    for path in candidates(root, name):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict):
            return data, path
    return None


def write_json(root: Path, name: str, data: dict) -> Path | None:
    """Write ``name`` beside ``root`` (atomically), else in the cache; None when neither can
    be written (the caller goes on: these files save work, they are never required)."""
    text = json.dumps(data, indent=1, sort_keys=True) + "\n"
    for path in candidates(root, name):
        try:
            atomic.write_text(path, text)
        except OSError as err:
            _log.debug("cannot write %s (%s)", path, err)
            continue
        return path
    _log.warning("%s: cannot record %s beside it or in %s", root, name, cache_root())
    return None
