"""TensorRT batched, on the fake TensorRT and CUDA of tests/fake_gpu (README there): the device
cache store (runtime/trt_store.py) does what the host store does, every verb a device copy;
requests decoded together on fake TensorRT engines (the first B rows of a [slots] device cache
bound to a batch-B engine) get what onnxruntime gives them, greedy and seeded sampled, chains
and trees, rows joining and leaving; no decode step moves a cache byte between host and
device; and `serve --backend tensorrt` answers requests.

Each case runs in a child interpreter whose `tensorrt` and `cuda` are the fakes; nothing in
this process is patched.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.conftest import ALL_DRAFTERS, TINY_SHAPE
from tests.scaffold import REPO, as_tensorrt_build, fake_gpu_env, json_from_fake_gpu

NODES = 6  # the tree graph's draft nodes

# -- the store's verbs against the host store's ----------------------------------------------

# Applies one sequence of verbs to a HostStore and a DeviceStore of the same shape and prints,
# after each, whether the device's bytes equal the host's, and the kinds of copy each made.
VERBS = textwrap.dedent("""
    import json
    import numpy as np
    from cuda.bindings import runtime as cudart
    from specexport.runtime.cache_store import HostStore
    from specexport.runtime.trt_engine import DeviceTensor, cuda_call
    from specexport.runtime.trt_store import DeviceStore

    layers, shape = 2, (4, 2, 12, 3)  # [slots, n_kv, S_max, hd]
    host, device = HostStore.allocate(layers, shape, "float32"), DeviceStore.allocate(layers, shape, "float32")
    rng = np.random.default_rng(0)
    keep = []

    def presents(batch, tokens):  # what an engine left on the device, and its host copy
        out, arrays = {}, {}
        for name in device.presents:
            array = rng.standard_normal((batch, 2, tokens, 3)).astype(np.float32) + 1  # [B, n_kv, T, hd]
            ptr = cuda_call(cudart, "cudaMalloc", array.nbytes)
            cuda_call(cudart, "cudaMemcpyAsync", ptr, array.ctypes.data, array.nbytes,
                      cudart.cudaMemcpyKind.cudaMemcpyHostToDevice, device.stream)
            out[name], arrays[name] = DeviceTensor(ptr, array.shape, array.dtype, device.stream), array
        keep.append(out)
        return out, arrays

    def same():
        got = device.read()
        return all(np.array_equal(got[name], host.rows()[name]) for name in host.names)

    steps = {}
    def step(label, verb):
        del cudart.TRAFFIC[:]
        verb()
        kinds, copies = sorted({kind for kind, _ in cudart.TRAFFIC}), len(cudart.TRAFFIC)
        steps[label] = {"same": same(), "kinds": kinds, "copies": copies}  # same() reads the cache back

    out, arrays = presents(4, 5)
    written = [(0, 0, 5), (1, 3, 2), (3, 7, 4)]  # row 2 idle; rows 1 and 3 padded
    step("write", lambda: (host.write(arrays, written), device.write(out, written)))
    step("move", lambda: (host.move(3, 2, 11), device.move(3, 2, 11)))
    out, arrays = presents(2, 6)
    step("write b2", lambda: (host.write(arrays, [(1, 5, 6)]), device.write(out, [(1, 5, 6)])))
    step("compact presents", lambda: (host.compact(1, 5, [0, 2, 3, 5], arrays),
                                      device.compact(1, 5, [0, 2, 3, 5], out)))
    step("compact in row", lambda: (host.compact(0, 1, [0, 1, 3, 4]), device.compact(0, 1, [0, 1, 3, 4])))
    saved = {}
    def save():
        saved["host"], saved["device"] = host.save(4, 6), device.save(4, 6)
    step("save", save)
    out, arrays = presents(4, 6)
    overwrite = [(r, 6, 6) for r in range(4)]
    step("timing run", lambda: (host.write(arrays, overwrite), device.write(out, overwrite)))
    step("restore", lambda: (host.restore(saved["host"], 4, 6), device.restore(saved["device"], 4, 6)))
    one = device.slot(2)
    out, arrays = presents(1, 3)
    step("slot write", lambda: (host.slot(2).write(arrays, [(0, 1, 3)]), one.write(out, [(0, 1, 3)])))
    source_host, source_device = HostStore.allocate(layers, shape, "float32"), DeviceStore.allocate(layers, shape, "float32")
    out, arrays = presents(4, 9)
    source_host.write(arrays, [(r, 0, 9) for r in range(4)])
    source_device.write(out, [(r, 0, 9) for r in range(4)])
    step("take", lambda: (host.slot(1).take(source_host.slot(1), 2, 6), device.slot(1).take(source_device.slot(1), 2, 6)))
    print(json.dumps({"steps": steps, "row_ptr": one.rows(1)["past_key_values.0.key"].ptr
                      - device.rows(4)["past_key_values.0.key"].ptr, "row_bytes": 2 * 12 * 3 * 4}))
""")


@pytest.fixture(scope="module")
def verbs() -> dict:
    return json_from_fake_gpu(VERBS)


@pytest.mark.parametrize("verb", ["write", "move", "write b2", "compact presents", "compact in row", "save",
                                  "timing run", "restore", "slot write", "take"])
def test_the_device_store_does_what_the_host_store_does(verbs, verb):
    step = verbs["steps"][verb]
    assert step["same"], verb  # the whole cache, idle rows and positions past each write included
    assert step["kinds"] == ["cudaMemcpyDeviceToDevice"], step  # nothing crosses the bus


def test_the_device_store_writes_only_the_fed_rows(verbs):
    # one copy per tensor per fed row (2 layers x K, V; 3 of 4 rows fed): idle rows are not written
    assert verbs["steps"]["write"]["copies"] == 4 * 3
    assert verbs["row_ptr"] == 2 * verbs["row_bytes"]  # a slot's row: base + slot x row


# -- decoding batched on fake TensorRT engines -----------------------------------------------

PROMPTS = ["hello hello hello world, hello", "1, 2, 3, 1, 2, 3, 1,", "abc abc ab",
           "1, 2, 3, 1, 2, 3, 1,", "the cat sat on the mat, the cat", "zz"]
NEW_TOKENS = [5, 14, 9, 11, 20, 7]  # rows leave in different rounds and waiting ones join their slots

# Decodes PROMPTS together (up to 4 at once) on onnxruntime, on TensorRT with the device store,
# and on TensorRT with the host cache (--host-kv), with the bytes each step copied between host
# and device; prints one JSON line.
DECODE = textwrap.dedent(f"""
    import json, sys
    import numpy as np
    from cuda.bindings import runtime as cudart
    from specexport.runtime import load
    from specexport.runtime.api import Pipeline
    from specexport.runtime.engine import EngineOptions

    root, prompts, new_tokens = sys.argv[1], {PROMPTS!r}, {NEW_TOKENS!r}
    CASES = {{
        "none": dict(drafter="none"),
        "ngram": dict(drafter="ngram"),
        "draft-model": dict(drafter="draft-model"),
        "tree": dict(drafter="ngram", tree_nodes={NODES}),
        "sampled none": dict(drafter="none", temperature=0.8, seed=5),
        "sampled draft-model": dict(drafter="draft-model", temperature=0.8, seed=5, adaptive=False),
        "sampled adaptive": dict(drafter="draft-model", temperature=0.8, seed=5),
    }}

    def decode(pipe, drafter, temperature=0.0, seed=None, adaptive=True, tree_nodes=0):
        loop = pipe.batch_loop(drafter=drafter, max_batch=4, adaptive=adaptive, tree_nodes=tree_nodes)
        for i, (prompt, n) in enumerate(zip(prompts, new_tokens)):
            request, _ = pipe.batch_request(pipe.text.encode(prompt), max_new_tokens=n, temperature=temperature,
                                            seed=None if seed is None else seed + i)
            loop.submit(i, request)
        done, steps = {{}}, []
        while loop.busy:
            del cudart.COPIES[:]
            joining = bool(loop.waiting) and len(loop.running) < loop.target.slots
            for key, finished in loop.step():
                done[key] = finished.tokens
            # each copy between host and device by the device address it read or wrote
            bus = [(src if kind == "cudaMemcpyDeviceToHost" else dst, n) for kind, dst, src, n in cudart.COPIES
                   if kind in ("cudaMemcpyHostToDevice", "cudaMemcpyDeviceToHost")]
            steps.append({{"joined": joining, "bus": bus, "bus bytes": sum(n for _, n in bus),
                           "device": sum(n for kind, *_, n in cudart.COPIES if kind == "cudaMemcpyDeviceToDevice")}})
        return [done[i] for i in range(len(prompts))], steps

    lone = load(root)
    out = {{"alone": [lone.generate(prompt_ids=lone.text.encode(p), max_new_tokens=n).token_ids
                     for p, n in zip(prompts, new_tokens)]}}
    pipes = {{"onnxruntime": load(root, check_prices=False),
              "device": load(root, backend="tensorrt", check_prices=False),
              "host": load(root, backend="tensorrt", device_kv=False, check_prices=False)}}
    pipes["graphs"] = Pipeline(pipes["device"].manifest, EngineOptions(cuda_graphs=True), "tensorrt",
                               check_prices=False)
    for key, pipe in pipes.items():
        out[key] = {{}}
        for case, kwargs in CASES.items():
            tokens, steps = decode(pipe, **kwargs)
            out[key][case] = {{"tokens": tokens, "steps": steps}}
        target = pipe.batched_target(4)
        out[key]["store"] = type(target.caches.store).__name__
        out[key]["slot cache"] = type(target.runners[1].cache).__name__
        out[key]["batched calls"] = sum(call.call.calls for call in target.calls.values())
        tree = pipe.tree_verifier(target)
        out[key]["tree calls"] = tree.calls if tree is not None else 0
    # the device memory that holds K/V: every cache store's, and every engine's own past and
    # present buffers (all still allocated: the pipelines are alive)
    import gc
    from specexport.runtime.trt_engine import TrtEngine
    from specexport.runtime.trt_store import DeviceStore

    kv = []
    for obj in gc.get_objects():
        if isinstance(obj, DeviceStore):
            kv += [(ptr, ptr + int(np.prod(obj.shape)) * obj.dtype.itemsize) for ptr in obj.pointers.values()]
        elif isinstance(obj, TrtEngine):
            kv += [(ptr, ptr + obj._nbytes[name]) for name, ptr in obj._device.items()
                   if name.startswith(("past_key_values.", "present."))]
    for key in pipes:
        for case in CASES:
            for step in out[key][case]["steps"]:
                step["cache bytes"] = sum(n for ptr, n in step.pop("bus") if any(lo <= ptr < hi for lo, hi in kv))
    print(json.dumps(out))
""")


@pytest.fixture(scope="module")
def batched_trt_dir(tiny_engines, tmp_path_factory) -> Path:
    """The tiny llama (standard attention: TensorRT's) at batch 1, 2 and 4 with chain and tree
    verify graphs, the n-gram drafter and a draft model, with fake TensorRT plans for both models."""
    drafters = tuple(d.get("name", d["kind"]) for d in ALL_DRAFTERS if d["kind"] in ("ngram", "model"))
    engines = tiny_engines.get("llama", drafters=drafters, batch=(1, 2, 4), tree_nodes=NODES, **TINY_SHAPE)
    return as_tensorrt_build(engines, tmp_path_factory.mktemp("trt-batched") / "engines", ("target", "draft-model"))


@pytest.fixture(scope="module")
def decoded(batched_trt_dir) -> dict:
    return json_from_fake_gpu(DECODE, batched_trt_dir)


CASES = ["none", "ngram", "draft-model", "tree", "sampled none", "sampled draft-model"]


@pytest.mark.parametrize("case", CASES)
def test_tensorrt_batched_on_the_device_store_equals_onnxruntime(decoded, case):
    assert decoded["device"][case]["tokens"] == decoded["onnxruntime"][case]["tokens"]
    if not case.startswith("sampled"):  # greedy: every request gets what it gets alone
        assert decoded["device"][case]["tokens"] == decoded["alone"]


@pytest.mark.parametrize("case", [*CASES, "sampled adaptive"])
@pytest.mark.parametrize("other", ["host", "graphs"])
def test_the_device_store_equals_the_host_cache_and_cuda_graphs(decoded, case, other):
    # the same engines and costs: adaptive depth chooses alike, so even adaptive sampled runs match
    assert decoded["device"][case]["tokens"] == decoded[other][case]["tokens"]


def test_the_rows_ran_batched_on_the_device_store(decoded):
    device = decoded["device"]
    assert device["store"] == "DeviceStore" and device["slot cache"] == "DeviceKVCache"
    assert device["batched calls"] > 0 and device["tree calls"] > 0
    assert decoded["host"]["store"] == "HostStore"
    steps = device["none"]["steps"]
    assert any(s["joined"] for s in steps[1:]), "a waiting request joined a slot freed by one that finished"


def test_no_step_copies_cache_bytes_between_host_and_device(decoded):
    for key in ("device", "graphs"):
        for case in CASES:
            for i, step in enumerate(decoded[key][case]["steps"]):
                assert step["cache bytes"] == 0, (key, case, i)  # no copy to or from K/V memory crosses the bus
                assert step["bus bytes"] > 0 and step["device"] > 0  # tokens in and out; K/V appended on the device
    # the control: the host cache goes to the device whole on every call
    for case in CASES:
        assert all(step["cache bytes"] > 0 for step in decoded["host"][case]["steps"]), case


# -- serve on a TensorRT directory -----------------------------------------------------------

SERVED = ["hello hello hello world, hello", "1, 2, 3, 1, 2, 3, 1,", "abc abc ab"]


def test_serve_answers_on_tensorrt(batched_trt_dir, tmp_path):
    """`specexport serve DIR --backend tensorrt` on 127.0.0.1 answers requests sent at once,
    each with what the target alone gives it (greedy)."""
    import httpx

    from specexport.runtime import load

    lone = load(batched_trt_dir)
    alone = [lone.generate(p, max_new_tokens=10).token_ids for p in SERVED]
    port = _free_port()
    log = tmp_path / "serve.log"
    args = [sys.executable, "-m", "specexport", "serve", str(batched_trt_dir), "--backend", "tensorrt",
            "--port", str(port), "--drafter", "ngram", "--fixed-prices", "--served-model-name", "tiny"]
    with log.open("w") as sink:
        server = subprocess.Popen(args, cwd=REPO, env=fake_gpu_env(), stdout=sink, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None, log.read_text()[-2000:]
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the server did not start: " + log.read_text()[-2000:]
            time.sleep(0.2)

        def complete(prompt: str) -> list[int]:
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 10, "temperature": 0, "return_token_ids": True}
            reply = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
            assert reply.status_code == 200, reply.text
            return reply.json()["choices"][0]["token_ids"]

        with ThreadPoolExecutor(len(SERVED)) as pool:
            got = list(pool.map(complete, SERVED))
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        health = httpx.get(f"{url}/health", timeout=10).json()
    finally:
        server.terminate()
        server.wait(timeout=30)
    assert got == alone
    assert health["backend"] == "tensorrt" and "on tensorrt" in log.read_text()
    assert _metric(metrics, "specexport_round_batch_size_sum") > _metric(metrics, "specexport_round_batch_size_count")


def _free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _metric(exposition: str, name: str) -> float:
    """The sum of a metric's samples over its labels."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in exposition.splitlines() if line.startswith(name + "{")
               or line.startswith(name + " "))


def test_serve_refuses_a_backend_the_directory_lacks(tiny_dir):
    from tests.conftest import check_one_line, run_cli

    code, _, err = run_cli("serve", tiny_dir, "--backend", "tensorrt", "--port", "0")
    check_one_line(code, err, "serve runs tensorrt engines and this directory has none")


if __name__ == "__main__":  # print the child's output, for debugging
    print(json.dumps(json_from_fake_gpu(VERBS), indent=1))
