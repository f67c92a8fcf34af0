"""A server killed under load (SIGKILL, mid-stream) leaves nothing behind: its clients get an
error rather than hanging, and a server restarted on the same port serves the same greedy
output with an empty queue. Processes listen on 127.0.0.1 only; every wait is bounded."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.serve.common import metric

MODEL = "tiny"
START_TIMEOUT_S = 120
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "Write about rivers and stars."}],
        "max_tokens": 24, "temperature": 0}


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start(engines: Path, port: int, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "specexport", "serve", str(engines), "--host", "127.0.0.1", "--port", str(port),
           "--threads", "2", "--served-model-name", MODEL, "--drafter", "ngram"]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            pytest.fail(f"the server exited with {proc.returncode}:\n{log.read_text(errors='replace')[-3000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, log.read_text(errors="replace")[-3000:]
        time.sleep(0.2)


def _greedy(port: int) -> list[int]:
    reply = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=60,
                       json={**BODY, "return_token_ids": True})
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["token_ids"]


def test_a_killed_server_restarts_clean(batched_engines, tmp_path):
    port = _free_port()
    first = _start(batched_engines, port, tmp_path / "first.log")
    try:
        want = _greedy(port)
        streaming, outcomes = threading.Event(), []

        def stream():
            try:
                with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", timeout=30,
                                  json={**BODY, "stream": True, "max_tokens": 96}) as reply:
                    lines = reply.iter_lines()
                    next(lines)  # the first chunk: the request is in the batch
                    streaming.set()
                    for _ in lines:
                        pass
                outcomes.append("finished")
            except httpx.HTTPError as err:
                outcomes.append(type(err).__name__)

        clients = [threading.Thread(target=stream) for _ in range(6)]
        for client in clients:
            client.start()
        # Killed as the first stream starts: that one has 95 tokens to go, the others are in the
        # batch or queued. (Waiting for all six first chunks let the tiny model finish every
        # request before the kill: the queued ones start only as others end.)
        assert streaming.wait(timeout=60), "no stream started"
        os.killpg(first.pid, signal.SIGKILL)
        for client in clients:
            client.join(timeout=60)
        assert not any(c.is_alive() for c in clients), "a client hung on a dead server"
        assert len(outcomes) == 6 and outcomes.count("finished") < 6, outcomes
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
        first.wait(timeout=30)
    second = _start(batched_engines, port, tmp_path / "second.log")
    try:
        exposition = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        assert metric(exposition, "specexport_num_requests_running") == 0
        assert metric(exposition, "specexport_num_requests_waiting") == 0
        assert _greedy(port) == want
    finally:
        os.killpg(second.pid, signal.SIGTERM)
        try:
            second.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(second.pid, signal.SIGKILL)
            second.wait(timeout=30)
