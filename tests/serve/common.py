"""A real server on 127.0.0.1 (uvicorn in a thread, on a socket bound here) for the serve tests."""

from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager

import httpx
import uvicorn


@contextmanager
def running(app, *, ready: bool = True, timeout: float = 60.0):
    """Serve ``app`` on 127.0.0.1 at a free port; yields the base URL. ``ready``: wait until
    /health says 200 (the engine has loaded)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while not server.started:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)
        while ready and httpx.get(f"{url}/health").status_code != 200:
            assert time.monotonic() < deadline, f"the engine did not load: {httpx.get(f'{url}/health').text}"
            time.sleep(0.05)
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample of a Prometheus exposition (0 when absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


def wait_idle(url: str, timeout: float = 30.0) -> None:
    """Until the engine has no request running or waiting (a stream an earlier test broke off
    leaves its row in the batch until the next round)."""
    deadline = time.monotonic() + timeout
    while True:
        text = httpx.get(f"{url}/metrics").text
        if metric(text, "specexport_num_requests_running") + metric(text, "specexport_num_requests_waiting") == 0:
            return
        assert time.monotonic() < deadline, "the server did not become idle"
        time.sleep(0.05)


def concurrent_token_ids(url: str, model: str, prompts, max_tokens) -> list[list[int]]:
    """Greedy completions of every prompt (token ids or text), each with its own ``max_tokens``,
    sent all at once: the token ids of each answer, in the prompts' order."""
    from concurrent.futures import ThreadPoolExecutor

    def complete(i: int) -> list[int]:
        body = {"model": model, "prompt": prompts[i], "max_tokens": max_tokens[i], "temperature": 0,
                "return_token_ids": True}
        reply = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        return reply.json()["choices"][0]["token_ids"]

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(complete, range(len(prompts))))
