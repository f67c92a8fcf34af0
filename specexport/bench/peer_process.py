"""Peers in processes of their own, driven over a pipe: the bench's peers run as their users run them.

Why not in the bench's process: onnxruntime keeps one environment per process, and ours holds
the global intra-op pool (runtime/ort_engine.SharedPool). onnxruntime-genai's session, made in a
process where that pool exists, ran its SmolLM2 decode step 6% faster than in a process of its
own (20.5 / 22.9 ms against 22.0 / 24.2 ms, two alternating pairs, 2 threads, 250-token prompt),
so the in-process bench compared our engines with a genai that no user runs; and torch's OpenMP
threads (the transformers peers) share the cores with our pool between calls. Here each peer is
made by ``peers.make_peers`` in a fresh (spawned) process, with the threads it is given, and
times its own calls there: the pipe is not counted.

Processes are started one after another (ort-genai and ort-genai-ngram share one model
directory, which the first may have to build) and ended by ``close``.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

from specexport.errors import BadInput


class _Channel:
    """Pickled messages over two pipes (the child's stdout and stderr stay the libraries')."""

    def __init__(self, read_fd: int, write_fd: int):
        self._read = os.fdopen(read_fd, "rb")
        self._write = os.fdopen(write_fd, "wb")

    def send(self, message) -> None:
        pickle.dump(message, self._write)
        self._write.flush()

    def recv(self):
        return pickle.load(self._read)  # EOFError once the other side has gone

    def close(self) -> None:
        for stream in (self._write, self._read):
            try:
                stream.close()
            except OSError:
                pass


def _serve(conn: _Channel) -> None:
    """The child: make one peer, say whether it is ready, then answer (method, args) calls until None."""
    from specexport.bench.peers import make_peers

    target_source, recipe_dir, name, threads, cache_dir, placement, draft_source = conn.recv()
    try:
        made, skipped = make_peers(target_source, Path(recipe_dir), [name], threads, Path(cache_dir), placement,
                                   draft_source)
    except BadInput as err:
        conn.send(("bad", str(err)))
        return
    if skipped:
        conn.send(("skipped", skipped[0]["skipped"]))
        return
    peer = made[0]
    conn.send(("ready", {"threads": peer.threads, "settings": getattr(peer, "settings", {}),
                         "speculative": getattr(peer, "speculative", None)}))
    while (message := conn.recv()) is not None:
        method, args = message
        try:
            conn.send(("ok", getattr(peer, method)(*args)))
        except BadInput as err:
            conn.send(("bad", str(err)))
        except Exception as err:  # the parent reports it in one line
            conn.send(("error", f"{type(err).__name__}: {err}"))


def _spawn(name: str) -> tuple[_Channel, subprocess.Popen]:
    """A fresh interpreter running this module (not a fork of one that holds onnxruntime's
    threads, and not multiprocessing's spawn, which re-imports the caller's main script)."""
    to_child_read, to_child_write = os.pipe()
    from_child_read, from_child_write = os.pipe()
    process = subprocess.Popen([sys.executable, "-m", "specexport.bench.peer_process",
                                str(to_child_read), str(from_child_write), name],
                               pass_fds=(to_child_read, from_child_write), stdin=subprocess.DEVNULL)
    os.close(to_child_read)
    os.close(from_child_write)
    return _Channel(from_child_read, to_child_write), process


class PeerProcess:
    """A peer living in its own process: ``run`` and ``run_batch`` as ``peers.Peer`` has them."""

    def __init__(self, name: str, conn, process, info: dict):
        self.name = name
        self.threads = info["threads"]
        self.settings = info["settings"]
        self.speculative = info["speculative"]
        self._conn = conn
        self._process = process

    def run(self, prompt_ids: list[int], max_new_tokens: int):
        return self._call("run", list(prompt_ids), max_new_tokens)

    def run_batch(self, prompts: list[list[int]], max_new_tokens: int):
        return self._call("run_batch", [list(p) for p in prompts], max_new_tokens)

    def _call(self, method: str, *args):
        try:
            self._conn.send((method, args))
            status, value = self._conn.recv()
        except (EOFError, OSError, ValueError):  # ValueError: the pipe was closed here (close)
            raise BadInput(f"peer {self.name}: its process ended (exit code {_ended(self._process)})") from None
        if status == "ok":
            return value
        raise BadInput(f"peer {self.name}: {value}")

    def close(self) -> None:
        try:
            self._conn.send(None)
        except (OSError, ValueError):  # gone already, or closed twice
            pass
        self._conn.close()
        _ended(self._process)


def start_peers(target_source: dict, recipe_dir: Path, names: list[str], threads: int,
                cache_dir: Path, placement=None, draft_source: dict | None = None) -> tuple[list[PeerProcess], list[dict]]:
    """``peers.make_peers``' answer, each peer in a process of its own: (peers, skipped).
    ``placement`` (peers.PeerDevice) and ``draft_source`` as make_peers takes them. Close the
    peers with ``close_peers`` when done."""
    if threads < 1:
        raise BadInput(f"peers: threads must be at least 1 (got {threads})")
    peers: list[PeerProcess] = []
    skipped: list[dict] = []
    try:
        for name in dict.fromkeys(names):
            conn, process = _spawn(name)
            try:
                conn.send((target_source, str(recipe_dir), name, threads, str(cache_dir), placement, draft_source))
                status, value = conn.recv()
            except (EOFError, OSError):
                status, value = "skipped", f"its process ended while starting (exit code {_ended(process)})"
            if status == "ready":
                peers.append(PeerProcess(name, conn, process, value))
                continue
            conn.close()
            _ended(process)
            if status == "bad":
                raise BadInput(value)
            skipped.append({"peer": name, "skipped": value})
    except BaseException:
        close_peers(peers)
        raise
    return peers, skipped


def close_peers(peers) -> None:
    """End the processes of the peers that have one (in-process peers need nothing)."""
    for peer in peers:
        close = getattr(peer, "close", None)
        if close is not None:
            close()


def _ended(process: subprocess.Popen) -> int | None:
    """Wait for the process to end (ending it if it will not): its exit code."""
    try:
        return process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        return process.wait(timeout=5)


if __name__ == "__main__":
    _serve(_Channel(int(sys.argv[1]), int(sys.argv[2])))
