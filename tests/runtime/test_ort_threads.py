"""The onnxruntime backend runs every session on one shared intra-op pool, sized from `threads`.

onnxruntime's global pool lives as long as the process, so each check runs in a fresh
interpreter and counts the process's OS threads: a pool of N threads adds N-1 workers (the
caller is the N-th), once for the shared pool, once per session for private pools.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from specexport.runtime.ort_engine import SharedPool, physical_cores

pytest.importorskip("onnxruntime")

# Opens sessions of a one-MatMul graph with the given thread counts, one at a time, and
# prints the OS threads added by each one plus what the engine says about its pool.
_SCRIPT = textwrap.dedent("""
    import json, os, sys, tempfile
    import numpy as np
    import onnx
    from onnx import helper, TensorProto, numpy_helper
    from specexport.runtime.engine import EngineOptions
    from specexport.contract import TensorSpec
    from specexport.runtime.ort_engine import OrtEngine, SHARED_POOL

    w = numpy_helper.from_array(np.ones((64, 64), np.float32), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64])], [w])
    path = os.path.join(tempfile.mkdtemp(), "m.onnx")
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), path)
    spec_in = {"x": TensorSpec("float32", (1, 64))}
    spec_out = {"y": TensorSpec("float32", (1, 64))}

    def threads_now():
        return len(os.listdir("/proc/self/task"))

    rows = []
    engines = []
    for threads in json.loads(sys.argv[1]):
        before = threads_now()
        engine = OrtEngine("m", path, spec_in, spec_out, EngineOptions(threads=threads))
        y = engine.run({"x": np.ones((1, 64), np.float32)})["y"]
        assert float(y[0, 0]) == 64.0
        engines.append(engine)  # keep every session (and any private pool) alive
        rows.append({"added": threads_now() - before, "threads": engine.threads})
    print(json.dumps({"rows": rows, "pool": SHARED_POOL.size}))
""")


def _open_sessions(threads: list[int | None]) -> dict:
    done = subprocess.run([sys.executable, "-c", _SCRIPT, json.dumps(threads)], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "stderr": done.stderr}


def test_sessions_share_one_pool_sized_from_threads():
    result = _open_sessions([3, 3, 3])
    assert result["pool"] == 3  # `threads` reached the pool
    assert [row["threads"] for row in result["rows"]] == [3, 3, 3]
    # The first session makes the pool's 2 workers (plus at most onnxruntime's own
    # housekeeping); the next sessions add none.
    assert result["rows"][0]["added"] >= 2
    assert [row["added"] for row in result["rows"][1:]] == [0, 0]


def test_another_size_runs_on_the_same_pool_with_a_warning():
    # onnxruntime refuses a private pool once the global one exists: say so, never fail.
    result = _open_sessions([2, 4])
    assert result["pool"] == 2
    assert [row["threads"] for row in result["rows"]] == [2, 2]
    assert result["rows"][1]["added"] == 0
    assert "cannot be resized" in result["stderr"]


def test_default_threads_are_the_physical_cores():
    result = _open_sessions([None])
    assert result["pool"] == physical_cores()
    assert result["rows"][0]["threads"] == physical_cores()


class _FakeOrt:
    def __init__(self):
        self.calls: list[tuple[int, int]] = []

    def set_global_thread_pool_sizes(self, intra: int, inter: int) -> None:
        self.calls.append((intra, inter))


def test_pool_is_made_once_and_never_resized():
    ort, pool = _FakeOrt(), SharedPool()
    assert pool.threads_for(ort, 2) == 2 and pool.threads_for(ort, 2) == 2
    with pytest.warns(RuntimeWarning, match="cannot be resized"):
        assert pool.threads_for(ort, 3) == 2
    assert ort.calls == [(2, 1)]


def test_physical_cores_counts_each_core_once():
    assert 1 <= physical_cores() <= len(os.sched_getaffinity(0))
    assert physical_cores({0}) == 1
