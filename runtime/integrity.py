"""Integrity of an engine directory without re-reading gigabytes on every load.

The manifest lists every file's sha256. The first load hashes them all and records, beside
the directory (``.verified.json``, or the per-user cache when the directory is read-only:
runtime/sidecar.py), each file's hash with its stat key (size, mtime_ns, ctime_ns, inode) and
the manifest's own sha256. A later load re-hashes only files whose key changed; a changed
manifest, a record of another directory (a copy: new inodes and path) or no record means a
full check. ``specexport verify`` always hashes everything.

What it protects against: corruption and accidental edits. Writing a file changes its mtime
and ctime; restoring the mtime with ``os.utime`` still changes the ctime, which no user call
sets back, so such a file is re-hashed too. What it does not: anyone able to write the
directory can rewrite the files, the manifest, ``manifest.sha256`` and the record together
(or change a file while the clock is set back): hashes beside the data detect accidents,
not a malicious actor. Only a signature kept elsewhere would.
"""

from __future__ import annotations

import datetime as _dt
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from specexport.contract import MANIFEST, MANIFEST_SHA256, Manifest, sha256_of
from specexport.errors import BadInput
from specexport.runtime import sidecar

RECORD = ".verified.json"
RECORD_FORMAT = 1


@dataclass(frozen=True)
class FileCheck:
    path: str  # relative to the engine directory
    size: int
    ok: bool
    hashed: bool  # False: trusted from the record (stat key unchanged)
    note: str = ""


def stat_key(path: Path) -> list[int]:
    st = os.stat(path)
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def _mismatch(root: Path, rel: str) -> BadInput:
    return BadInput(f"{root / rel}: sha256 does not match the manifest (the file was changed after the build); "
                    "rebuild the engine directory with specexport build --force")


def _trusted(manifest: Manifest, manifest_sha: str) -> dict[str, dict]:
    """The record's entries, when it is a record of this directory and this manifest."""
    found = sidecar.read_json(manifest.root, RECORD)
    if found is None:
        return {}
    record, _ = found
    if (record.get("format") != RECORD_FORMAT or record.get("manifest_sha256") != manifest_sha
            or record.get("root") != sidecar.real_root(manifest.root) or not isinstance(record.get("files"), dict)):
        return {}
    return record["files"]


def scan(manifest: Manifest, full: bool = False) -> Iterator[FileCheck]:
    """Check every file of the manifest (``full``: hash all; else trust unchanged stat keys
    from the record), then save the record of the files found good."""
    root = manifest.root
    manifest_sha = sha256_of(root / MANIFEST)
    trusted = {} if full else _trusted(manifest, manifest_sha)
    good: dict[str, dict] = {}
    hashed_any = False
    for rel, expected in manifest.files.items():
        key = stat_key(root / rel)  # before hashing: a write during the hash changes it
        seen = trusted.get(rel)
        if seen is not None and seen.get("key") == key and seen.get("sha256") == expected:
            good[rel] = seen
            yield FileCheck(rel, key[0], True, False)
            continue
        hashed_any = True
        ok = sha256_of(root / rel) == expected
        if ok:
            good[rel] = {"sha256": expected, "key": key}
        yield FileCheck(rel, key[0], ok, True)
    if hashed_any or len(good) != len(trusted):
        sidecar.write_json(root, RECORD, {
            "format": RECORD_FORMAT, "root": sidecar.real_root(root), "manifest_sha256": manifest_sha,
            "checked": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "files": good,
        })


def ensure_verified(manifest: Manifest) -> None:
    """What ``load`` runs: raise BadInput naming the first file whose hash is wrong."""
    for check in scan(manifest):
        if not check.ok:
            raise _mismatch(manifest.root, check.path)


def manifest_check(root: Path) -> FileCheck:
    """manifest.json against the ``manifest.sha256`` the builder wrote beside it (sha256sum's
    format, so ``sha256sum -c manifest.sha256`` checks it too). Directories built before it
    existed have none: not a failure, said in the note."""
    path = Path(root) / MANIFEST
    size = path.stat().st_size
    try:
        line = (Path(root) / MANIFEST_SHA256).read_text().split()
    except OSError:
        return FileCheck(MANIFEST, size, True, True, f"no {MANIFEST_SHA256} (built by an older specexport)")
    ok = bool(line) and line[0] == sha256_of(path)
    return FileCheck(MANIFEST, size, ok, True, "" if ok else f"does not match {MANIFEST_SHA256}")


def verify_all(manifest: Manifest) -> list[FileCheck]:
    """``specexport verify``: the manifest against manifest.sha256, then every file hashed."""
    return [manifest_check(manifest.root), *scan(manifest, full=True)]
