"""Atomic outputs: a failure or a kill in the middle leaves the old file or directory whole,
and the next writer removes what the dead one left."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from specexport import atomic
from specexport.exporter.outdir import AtomicDir

REPO = Path(__file__).resolve().parents[1]


def dead_pid() -> int:
    """The id of a process that has exited."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def killed(code: str) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter that SIGKILLs itself where the code says ``die()``."""
    prelude = "import os, signal\ndef die():\n    os.kill(os.getpid(), signal.SIGKILL)\n"
    done = subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == -signal.SIGKILL, done.stderr
    return done


def exchange_supported(where: Path) -> bool:
    a, b = where / ".probe-a", where / ".probe-b"
    a.mkdir(), b.mkdir()
    try:
        return atomic.exchange(a, b)
    finally:
        a.rmdir(), b.rmdir()


def beside(path: Path) -> list[str]:
    return sorted(p.name for p in path.parent.iterdir() if p.name != path.name)


# -- files ----------------------------------------------------------------------------------


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "baseline.json"
    target.write_text("old")
    with pytest.raises(RuntimeError), atomic.atomic_open(target) as fh:
        fh.write("half of the new")
        raise RuntimeError("serializer failed")
    assert target.read_text() == "old"
    assert beside(target) == []
    atomic.write_text(target, "new")
    assert target.read_text() == "new" and beside(target) == []


def test_a_killed_write_leaves_the_old_file_and_the_next_write_sweeps(tmp_path):
    target = tmp_path / "calibration.json"
    target.write_text("old")
    killed(f"""
        from specexport import atomic
        with atomic.atomic_open({str(target)!r}) as fh:
            fh.write("half")
            fh.flush()
            die()
    """)
    assert target.read_text() == "old"
    assert len(beside(target)) == 1 and beside(target)[0].startswith(".calibration.json.partial-")
    atomic.write_text(target, "new")
    assert target.read_text() == "new" and beside(target) == []


def test_atomic_path_keeps_the_suffix_and_needs_the_file(tmp_path):
    target = tmp_path / "plot.png"
    with atomic.atomic_path(target) as tmp:
        assert tmp.suffix == ".png" and tmp.parent == tmp_path
        tmp.write_bytes(b"png")
    assert target.read_bytes() == b"png"
    with pytest.raises(FileNotFoundError), atomic.atomic_path(target) as tmp:
        tmp.unlink()  # a writer that wrote nothing
    assert target.read_bytes() == b"png" and beside(target) == []


def test_a_live_writers_temporary_is_not_swept(tmp_path):
    target = tmp_path / "x.json"
    live = tmp_path / f".x.json.partial-{os.getppid()}-abc.json"  # our parent is alive
    live.write_text("in progress")
    atomic.write_text(target, "{}")
    assert live.exists()


def test_bench_baseline_and_report_are_written_atomically(tmp_path):
    from specexport.bench.gate import load_baseline, write_baseline
    from specexport.bench.report import write

    result = {"settings": {"max_new_tokens": 8, "temperature": 0.0, "adaptive": True, "draft_len": 3},
              "categories": []}
    baseline = tmp_path / "baseline.json"
    baseline.write_text('{"categories": [], "old": true}')  # a baseline from before the CPU classes
    with pytest.raises(KeyError):
        write_baseline(baseline, {"settings": {}}, "avx2")  # fails while serializing: the old file stays
    assert json.loads(baseline.read_text()) == {"categories": [], "old": True} and beside(baseline) == []
    write_baseline(baseline, result, "avx2")
    machines = load_baseline(baseline)["machines"]
    assert machines["avx2"]["settings"]["draft_len"] == 3 and machines["unrecorded"]["old"] is True  # kept
    with pytest.raises(KeyError):
        write({"settings": {}}, tmp_path / "out")  # the markdown report fails to render
    assert not [p for p in (tmp_path / "out").iterdir() if p.name.startswith(".")]  # no temporaries


# -- directories ----------------------------------------------------------------------------


def engine_dir(path: Path, tag: str) -> Path:
    path.mkdir(parents=True)
    (path / "manifest.json").write_text(json.dumps({"specexport": "0", "tag": tag}))
    return path


def tag_of(path: Path) -> str:
    return json.loads((path / "manifest.json").read_text())["tag"]


def test_the_swap_replaces_the_directory_and_leaves_nothing(tmp_path):
    out = engine_dir(tmp_path / "engines", "old")
    with AtomicDir(out) as tmp:
        (tmp / "manifest.json").write_text(json.dumps({"specexport": "0", "tag": "new"}))
    assert tag_of(out) == "new" and beside(out) == []


def test_the_destination_exists_at_every_moment_of_the_swap(tmp_path):
    """renameat2(RENAME_EXCHANGE) where Linux has it: the exchange is one step."""
    a, b = engine_dir(tmp_path / "a", "new"), engine_dir(tmp_path / "b", "old")
    if not atomic.exchange(a, b):
        pytest.skip("this kernel or filesystem has no RENAME_EXCHANGE; the two-rename fallback is used")
    assert tag_of(b) == "new" and tag_of(a) == "old"


def test_an_exception_in_the_build_leaves_the_old_directory(tmp_path):
    out = engine_dir(tmp_path / "engines", "old")
    with pytest.raises(RuntimeError), AtomicDir(out) as tmp:
        (tmp / "half.onnx").write_bytes(b"x")
        raise RuntimeError("export failed")
    assert tag_of(out) == "old" and beside(out) == []


@pytest.mark.parametrize("where", ["during the build", "after the swap"])
def test_a_killed_build_leaves_the_old_or_new_directory_and_the_next_build_sweeps(tmp_path, where):
    out = engine_dir(tmp_path / "engines", "old")
    new_manifest = json.dumps({"specexport": "0", "tag": "new"})
    if where == "during the build":
        body = f"""
            with AtomicDir(out) as tmp:
                (tmp / "manifest.json").write_text({new_manifest!r})
                die()
        """
    else:  # killed after the exchange, before the old directory is removed
        body = f"""
            tmp = atomic.temp_name(out)
            tmp.mkdir()
            (tmp / "manifest.json").write_text({new_manifest!r})
            assert atomic.exchange(tmp, out)
            die()
        """
        if not exchange_supported(tmp_path):
            pytest.skip("no RENAME_EXCHANGE here")
    killed(f"from pathlib import Path\nfrom specexport import atomic\nfrom specexport.exporter.outdir import AtomicDir\n"
           f"out = Path({str(out)!r})\n" + textwrap.dedent(body))
    assert tag_of(out) == ("old" if where == "during the build" else "new")
    assert len(beside(out)) == 1 and ".partial-" in beside(out)[0]
    with AtomicDir(out) as tmp:
        (tmp / "manifest.json").write_text(json.dumps({"specexport": "0", "tag": "next"}))
    assert tag_of(out) == "next" and beside(out) == []


def test_a_leftover_old_directory_is_swept(tmp_path):
    out = engine_dir(tmp_path / "engines", "current")
    engine_dir(tmp_path / f".engines.old-{dead_pid()}", "stale")
    engine_dir(tmp_path / f".engines.partial-{dead_pid()}", "stale")
    with AtomicDir(out) as tmp:
        (tmp / "manifest.json").write_text(json.dumps({"specexport": "0", "tag": "new"}))
    assert tag_of(out) == "new" and beside(out) == []


def test_the_fallback_swap_without_exchange(tmp_path):
    out = engine_dir(tmp_path / "engines", "old")
    atomic.replace_dir_by_renames(engine_dir(tmp_path / ".engines.partial-1", "new"), out)
    assert tag_of(out) == "new" and beside(out) == []


def test_a_crash_between_the_fallback_renames_is_repaired(tmp_path):
    """Where there is no exchange: old renamed away, killed before the new one came in. The
    next sweep puts the old directory back rather than deleting the only copy."""
    out = tmp_path / "engines"
    engine_dir(tmp_path / f".engines.old-{dead_pid()}", "old")
    atomic.sweep(out)
    assert tag_of(out) == "old" and beside(out) == []


def test_written_files_get_the_usual_permissions_not_mkstemps_0600(tmp_path):
    """A manifest or report others must read (a server under another user) is 0666 less the
    umask, as a plain open() would make it."""
    umask = os.umask(0o022)  # this test's own process setting, restored below
    try:
        atomic.write_text(tmp_path / "manifest.json", "{}")
        with atomic.atomic_path(tmp_path / "plot.png") as tmp:
            tmp.write_bytes(b"png")
    finally:
        os.umask(umask)
    assert (tmp_path / "manifest.json").stat().st_mode & 0o777 == 0o644
    assert (tmp_path / "plot.png").stat().st_mode & 0o777 == 0o644
