"""Atomic outputs: a file or directory is either the old one or the new one, never half of each.

Everything specexport writes for the user (engine directories, calibration files, bench
baselines and reports, timing caches) goes through a temporary name in the same folder (same
filesystem, so the final step is one rename) and then one ``os.replace``. Temporary names
carry the writer's process id (``.NAME.partial-PID...``, ``.NAME.old-PID``), so leftovers of a
killed writer are recognisable and swept by the next writer of the same name.

Directories: ``os.replace`` cannot replace a non-empty directory, and the usual two renames
(old away, new in) leave a moment with nothing at the destination. On Linux the swap is one
``renameat2(RENAME_EXCHANGE)``: the destination always exists, first as the old directory and
then as the new one. Why not a symlink to versioned directories (the other atomic scheme): an
engine directory is copied to devices (``cp -r``, ``rsync``, ``scp``) and hard-linked by
``build --from-onnx``, and a symlink would change what users hold in their hands. Where the
exchange is unsupported (not Linux, or a filesystem without it) the two renames remain, and a
crash between them is repaired by the next sweep, which puts the old directory back.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

_AT_FDCWD = -100
_RENAME_EXCHANGE = 1 << 1
_LEFTOVER = re.compile(r"\.(partial|old)-(\d+)(?:[-.]|$)")


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def _leftovers(path: Path) -> Iterator[tuple[Path, str]]:
    """(leftover, kind) for each temporary of ``path`` whose writer process is gone."""
    if not path.parent.is_dir():
        return
    prefix = f".{path.name}."
    for entry in path.parent.iterdir():
        if not entry.name.startswith(prefix):
            continue
        m = _LEFTOVER.match(entry.name, len(prefix) - 1)
        if m and int(m[2]) != os.getpid() and not pid_alive(int(m[2])):
            yield entry, m[1]


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def sweep(path: Path) -> None:
    """Remove the temporaries of ``path`` left by writers that died. When ``path`` itself is
    missing and a dead writer's ``.old-PID`` exists (it died between the two renames of the
    fallback swap), that old copy is put back instead of removed."""
    path = Path(path)
    for leftover, kind in sorted(_leftovers(path), key=lambda lk: lk[1] != "old"):
        if kind == "old" and not os.path.lexists(path):
            os.rename(leftover, path)
        else:
            _remove(leftover)


def temp_name(path: Path, kind: str = "partial") -> Path:
    """``.NAME.partial-PID`` beside ``path`` (directories use it as is)."""
    return path.parent / f".{path.name}.{kind}-{os.getpid()}"


def _file_mode() -> int:
    """0666 less the process umask, as ``open`` would create the file. Read from /proc (Linux):
    ``os.umask`` can only be read by setting it, which would race with other threads."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o644


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """``with atomic_path(p) as tmp:`` write the file ``tmp`` any way you like (a library's
    ``save(tmp)``); on success it replaces ``p`` in one rename, on failure it is deleted. The
    temporary keeps ``p``'s suffix, for writers that infer the format from it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    sweep(path)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.partial-{os.getpid()}-", suffix=path.suffix, dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        if not tmp.is_file():
            raise FileNotFoundError(f"{tmp}: the writer did not write the file")
        _fsync(tmp)
        os.chmod(tmp, _file_mode())  # mkstemp makes 0600; the output reads like any file written
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise


@contextlib.contextmanager
def atomic_open(path: str | Path, mode: str = "w", **kwargs: Any) -> Iterator[IO[Any]]:
    """``with atomic_open(p, "w") as fh:`` like ``open``; ``p`` changes only when the block ends
    without an error."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_open writes whole files: mode 'w' or 'wb', not {mode!r}")
    with atomic_path(path) as tmp, open(tmp, mode, **kwargs) as fh:
        yield fh


def write_text(path: str | Path, text: str, encoding: str = "utf-8") -> None:
    with atomic_open(path, "w", encoding=encoding) as fh:
        fh.write(text)


def write_bytes(path: str | Path, data: bytes | memoryview) -> None:
    with atomic_open(path, "wb") as fh:
        fh.write(data)


def _fsync(path: Path) -> None:
    """Flush the contents before the rename makes them the file (a power cut must not leave
    a renamed but empty file)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- directories ----------------------------------------------------------------------------


def exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux renameat2 RENAME_EXCHANGE). False where the kernel,
    the C library or the filesystem cannot; other failures raise OSError."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):  # not Linux, or a C library without renameat2 (glibc < 2.28)
        return False
    # int renameat2(int olddirfd, const char *oldpath, int newdirfd, const char *newpath, unsigned int flags)
    if renameat2(ctypes.c_int(_AT_FDCWD), os.fsencode(a), ctypes.c_int(_AT_FDCWD), os.fsencode(b),
                 ctypes.c_uint(_RENAME_EXCHANGE)) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


def replace_dir(new: Path, dest: Path) -> None:
    """Make the directory ``new`` be ``dest``; the old ``dest`` (if any) is removed. ``new``
    must be on ``dest``'s filesystem (beside it). ``dest`` exists throughout where the
    exchange is supported."""
    if not os.path.lexists(dest):
        os.rename(new, dest)
    elif exchange(new, dest):
        shutil.rmtree(new, ignore_errors=True)  # ``new`` now holds the old directory
    else:
        replace_dir_by_renames(new, dest)


def replace_dir_by_renames(new: Path, dest: Path) -> None:
    """The fallback: old away, new in. Between the two renames ``dest`` is missing; a crash
    there leaves ``.NAME.old-PID``, which the next sweep puts back."""
    old = temp_name(dest, "old")
    os.rename(dest, old)
    os.rename(new, dest)
    shutil.rmtree(old, ignore_errors=True)
