"""specexport serve on Ray Serve (specexport/serve/ray_app.py): two replicas of the tiny batched
engines behind Ray Serve's HTTP proxy answer what the batch-1 loop decodes (both endpoints,
streamed or not), both replicas serve, and SIGTERM leaves no Ray process behind.

One local Ray instance (num_cpus=2, every port on 127.0.0.1), started by ``ray_app.run`` as
`specexport serve --ray` starts it, in a child process of its own session: the test process
never imports Ray, and whatever the run leaves is found (and ended) by that session's id."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from specexport.errors import BadInput
from specexport.serve.config import ServeConfig

pytest.importorskip("ray.serve", reason="the ray extra (pip install 'specexport[ray]')")

REPO = Path(__file__).resolve().parents[2]
MODEL = "tiny"
PROMPTS = [f"Ray {i}: a note about {'lakes' if i % 2 else 'hills'} and {i * 3} birds." for i in range(6)]
START_TIMEOUT_S = 240  # Ray, two replicas and their engines, on two busy cores
STOP_TIMEOUT_S = 90

SERVER = """
import sys
from specexport.serve import ray_app
from specexport.serve.config import ServeConfig
ray_app.run(ServeConfig(sys.argv[1], "tiny", drafter="ngram", threads=1), host="127.0.0.1",
            port=int(sys.argv[2]), replicas=int(sys.argv[3]), num_cpus=2, num_cpus_per_replica=1.0)
import ray
print("ray initialized after run:", ray.is_initialized(), flush=True)
"""


def test_missing_ray_names_the_extra(monkeypatch):
    from specexport.errors import MissingDependency
    from specexport.serve import ray_app

    monkeypatch.setitem(sys.modules, "ray", None)  # import ray: ImportError
    with pytest.raises(MissingDependency, match=r"pip install 'specexport\[ray\]'"):
        ray_app.deployment(ServeConfig("engines"))


def test_autoscaling_aims_at_one_full_batch_per_replica(batched_engines):
    from specexport.serve.ray_app import autoscaling_config, served_batch

    config = ServeConfig(str(batched_engines), MODEL)
    assert served_batch(config) == 4  # the largest batch size built
    assert served_batch(ServeConfig(str(batched_engines), MODEL, max_batch=3)) == 2  # as the batched loop picks
    assert served_batch(ServeConfig("/no/such/dir", max_batch=3)) == 3
    assert autoscaling_config(config, {"min_replicas": 1, "max_replicas": 4}, replicas=2) == {
        "min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 4, "initial_replicas": 2}
    assert autoscaling_config(config, {"min_replicas": 2, "max_replicas": 3}, replicas=1)["initial_replicas"] == 2
    assert autoscaling_config(config, {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 8}, None) == {
        "min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 8}
    with pytest.raises(BadInput):
        autoscaling_config(config, {"min_replicas": 3, "max_replicas": 2})


def test_app_builder_reads_serve_run_arguments(batched_engines):
    from ray.serve import Application

    from specexport.serve.ray_app import app_builder

    app = app_builder({"engine_dir": str(batched_engines), "model_name": MODEL, "max_batch": "2", "schedule": "false",
                       "threads": "none", "replicas": "2", "autoscale": "1:3", "num_cpus_per_replica": "0.5"})
    assert isinstance(app, Application)
    with pytest.raises(BadInput, match="unknown argument"):
        app_builder({"engine_dir": str(batched_engines), "replica": "2"})
    with pytest.raises(BadInput, match="engine_dir"):
        app_builder({"replicas": "2"})
    with pytest.raises(BadInput, match="schedule"):
        app_builder({"engine_dir": str(batched_engines), "schedule": "maybe"})


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _session_pids(sid: int) -> list[int]:
    """Live (not zombie) processes of session ``sid``."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.getsid(int(entry)) != sid:
                continue
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z":
            pids.append(int(entry))
    return pids


def _wait_ready(proc: subprocess.Popen, log: Path) -> None:
    """Until run() says it serves (serve.run returned: both replicas loaded and healthy)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while "serving 'tiny'" not in log.read_text(errors="replace"):
        if proc.poll() is not None:
            pytest.fail(f"the Ray server exited with {proc.returncode}:\n{log.read_text(errors='replace')[-4000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"Ray Serve did not start in {START_TIMEOUT_S} s:\n{log.read_text(errors='replace')[-4000:]}")
        time.sleep(0.25)


@pytest.fixture(scope="module")
def solo(batched_engines):
    """The batch-1 single-sequence loop on the same directory: the reference (greedy)."""
    from specexport.runtime import load

    pipe = load(batched_engines, threads=1)

    def generate(*, prompt: str | None = None, messages: list[dict] | None = None, max_tokens: int):
        ids = pipe.prompt_ids(prompt, messages=messages)
        return pipe.generate(prompt_ids=ids, drafter="ngram", max_new_tokens=max_tokens, temperature=0.0)

    return generate


def _sse(lines) -> list[dict]:
    import json

    events = [line[len("data: "):] for line in lines if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", events[-3:]
    return [json.loads(e) for e in events[:-1]]


@contextmanager
def _ray_server(engines: Path, replicas: int, log: Path):
    """`ray_app.run` on ``engines`` with ``replicas`` replicas in a child process leading a
    session of its own, on a free port of 127.0.0.1: yields (process, URL); whatever of that
    session is still alive afterwards (a failure) is killed."""
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_USAGE_STATS_ENABLED="0", RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", OMP_NUM_THREADS="1")
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-c", SERVER, str(engines), str(port), str(replicas)], cwd=REPO,
                                env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    sid = proc.pid  # start_new_session: the child leads a session of its own
    try:
        yield proc, f"http://127.0.0.1:{port}"
    finally:
        if proc.poll() is None:
            os.killpg(sid, signal.SIGKILL)
            proc.wait(timeout=30)
        for pid in _session_pids(sid):  # anything of that session still alive after a failure
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _stop_cleanly(proc: subprocess.Popen, log: Path) -> float:
    """SIGTERM: run() deletes the app (each replica's lifespan stops its engine thread), then
    stops Serve and Ray, and returns; nothing of its session is left. Returns the seconds it took."""
    proc.send_signal(signal.SIGTERM)
    stopping = time.monotonic()
    assert proc.wait(timeout=STOP_TIMEOUT_S) == 0, log.read_text(errors="replace")[-4000:]
    stop_s = time.monotonic() - stopping
    text = log.read_text(errors="replace")
    assert "ray initialized after run: False" in text, text[-4000:]
    deadline = time.monotonic() + 20
    while (left := _session_pids(proc.pid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, [Path(f"/proc/{p}/cmdline").read_bytes()[:120] for p in left]
    return stop_s


def test_two_replicas_serve_the_same_outputs_and_stop_cleanly(batched_engines, solo, tmp_path):
    started = time.monotonic()
    log = tmp_path / "ray-serve.log"
    with _ray_server(batched_engines, 2, log) as (proc, url):
        # the references, while Ray starts
        completions = {p: solo(prompt=p, max_tokens=16) for p in PROMPTS[:4]}
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPTS[4]}]
        chat = solo(messages=messages, max_tokens=20)
        streamed = solo(prompt=PROMPTS[5], max_tokens=16)
        _wait_ready(proc, log)
        ready_s = time.monotonic() - started

        served_by: set[str] = set()
        with httpx.Client(base_url=url, timeout=60) as client:
            assert [m["id"] for m in client.get("/v1/models").json()["data"]] == [MODEL]

            def complete(prompt: str) -> httpx.Response:
                return client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 16,
                                                            "temperature": 0})

            # concurrent greedy requests: Ray routes them over both replicas, each batches its own
            with ThreadPoolExecutor(4) as pool:
                answers = list(pool.map(complete, PROMPTS[:4]))
            for prompt, answer in zip(PROMPTS[:4], answers):
                assert answer.status_code == 200, answer.text
                body = answer.json()
                assert body["choices"][0]["text"] == completions[prompt].text
                assert body["usage"]["completion_tokens"] == len(completions[prompt].token_ids)
                served_by.add(answer.headers["x-served-by"])

            answer = client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages,
                                                               "max_tokens": 20, "temperature": 0})
            assert answer.status_code == 200, answer.text
            assert answer.json()["choices"][0]["message"]["content"] == chat.text
            served_by.add(answer.headers["x-served-by"])

            # SSE through Ray's proxy: chat deltas and completion pieces, then [DONE]
            body = {"model": MODEL, "messages": messages, "max_tokens": 20, "temperature": 0, "stream": True}
            with client.stream("POST", "/v1/chat/completions", json=body) as answer:
                assert answer.status_code == 200
                assert answer.headers["content-type"].startswith("text/event-stream")
                chunks = _sse(answer.iter_lines())
            assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
            assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == chat.text
            body = {"model": MODEL, "prompt": PROMPTS[5], "max_tokens": 16, "temperature": 0, "stream": True}
            with client.stream("POST", "/v1/completions", json=body) as answer:
                assert answer.status_code == 200
                pieces = _sse(answer.iter_lines())
                served_by.add(answer.headers["x-served-by"])
            assert len(pieces) > 1 and "".join(p["choices"][0]["text"] for p in pieces) == streamed.text

            # both replicas answer (Ray's router picks between them at random; bounded retries)
            for _ in range(10):
                if len(served_by) >= 2:
                    break
                with ThreadPoolExecutor(4) as pool:
                    more = list(pool.map(complete, PROMPTS[:4]))
                assert all(a.json()["choices"][0]["text"] == completions[p].text for p, a in zip(PROMPTS, more))
                served_by.update(a.headers["x-served-by"] for a in more)
        assert len(served_by) == 2, served_by
        replica_pids = [int(s.rsplit(":", 1)[1]) for s in served_by]
        assert proc.pid not in replica_pids  # the replicas are Ray actors, not the driver

        stop_s = _stop_cleanly(proc, log)
        print(f"ray serve: ready in {ready_s:.1f} s, stopped in {stop_s:.1f} s, "
              f"{time.monotonic() - started:.1f} s in all")


def test_one_replica_serves_a_batched_hybrid_target(batched_hybrid, tmp_path):
    """A hybrid target (linear-attention layers, each row its own recurrent state; issue 54)
    through Ray Serve: one replica of the tiny qwen3_5 built with batch sizes 1 and 4 answers
    four concurrent greedy completions, each its batch-1 output, and stops cleanly."""
    from specexport.runtime import load

    engines = batched_hybrid
    log = tmp_path / "ray-serve-hybrid.log"
    with _ray_server(engines, 1, log) as (proc, url):
        pipe = load(engines, threads=1)  # the references, while Ray starts
        wants = {p: pipe.generate(prompt_ids=pipe.prompt_ids(p), drafter="ngram", max_new_tokens=12,
                                  temperature=0.0).text for p in PROMPTS[:4]}
        _wait_ready(proc, log)
        with httpx.Client(base_url=url, timeout=60) as client:
            def complete(prompt: str) -> httpx.Response:
                return client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 12,
                                                            "temperature": 0})

            with ThreadPoolExecutor(4) as pool:
                answers = list(pool.map(complete, PROMPTS[:4]))
        for prompt, answer in zip(PROMPTS[:4], answers):
            assert answer.status_code == 200, answer.text
            assert answer.json()["choices"][0]["text"] == wants[prompt]
        _stop_cleanly(proc, log)
