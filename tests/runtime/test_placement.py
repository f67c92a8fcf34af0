"""runtime/placement.py: a cuda session may not place a node on the CPU. The refusal is
onnxruntime's (session.disable_cpu_ep_fallback); what is checked here without a GPU: the entry is
set for cuda alone, the CUDA provider is named alone (onnxruntime refuses the entry beside an
explicit CPU provider), and onnxruntime's failure becomes one line naming the file, the nodes
and the fix."""

from __future__ import annotations

from collections import Counter

import onnxruntime as ort
import pytest

from specexport.errors import BadInput
from specexport.runtime import placement
from specexport.runtime.placement import (
    DISABLE_CPU_FALLBACK,
    PROVIDERS,
    open_session,
    require_device_placement,
)
from tests.conftest import TINY_SHAPE

# what onnxruntime's InferenceSession raises (inference_session.cc) when fallback is disabled
REFUSAL = ("[ONNXRuntimeError] : 1 : FAIL : This session contains graph nodes that are assigned to the default "
           "CPU EP, but fallback to CPU EP has been explicitly disabled by the user.")


def test_the_fallback_entry_is_set_for_cuda_and_not_for_the_cpu():
    cuda, cpu = ort.SessionOptions(), ort.SessionOptions()
    require_device_placement(cuda, "cuda")
    require_device_placement(cpu, "cpu")
    assert cuda.get_session_config_entry(DISABLE_CPU_FALLBACK) == "1"
    assert not strict(cpu)
    assert "CPUExecutionProvider" not in PROVIDERS["cuda"]  # an explicit CPU provider conflicts with the entry


def strict(so) -> bool:
    """Whether ``so`` disables CPU fallback (onnxruntime raises for an entry never set)."""
    try:
        return so.get_session_config_entry(DISABLE_CPU_FALLBACK) == "1"
    except RuntimeError:
        return False


class FakeOrt:
    """onnxruntime as a CUDA build would answer: the strict session fails, the recording one
    reports what it placed on the CPU."""

    SessionOptions = ort.SessionOptions

    def __init__(self, placed: dict[str, list[str]]):
        self.placed = placed
        self.calls: list[tuple[list[str], bool]] = []

    def InferenceSession(self, path, so, providers):  # noqa: N802 (onnxruntime's name)
        self.calls.append((providers, strict(so)))
        if strict(so):
            raise RuntimeError(REFUSAL)
        return FakeSession(self.placed)


class FakeSession:
    def __init__(self, placed):
        self.placed = placed

    def get_provider_graph_assignment_info(self):
        return [FakeSubgraph(ep, ops) for ep, ops in self.placed.items()]


class FakeSubgraph:
    def __init__(self, ep, ops):
        self.ep_name = ep
        self.ops = ops

    def get_nodes(self):
        return [type("Node", (), {"op_type": op})() for op in self.ops]


def test_a_cuda_session_with_a_node_on_the_cpu_is_refused_in_one_line_naming_file_nodes_and_fix():
    fake = FakeOrt({"CUDAExecutionProvider": ["MatMul"] * 9,
                    "CPUExecutionProvider": ["GroupQueryAttention", "GroupQueryAttention", "Shape"]})
    so = ort.SessionOptions()
    require_device_placement(so, "cuda")
    with pytest.raises(BadInput) as err:
        open_session(fake, "engines/x/target.onnx", so, "cuda", ort.SessionOptions)
    message = str(err.value)
    assert "\n" not in message and message.startswith("engines/x/target.onnx: ")
    assert "GroupQueryAttention x2, Shape on the CPU" in message and "device: cuda" in message
    assert fake.calls[0] == (["CUDAExecutionProvider"], True)
    assert fake.calls[1] == (["CUDAExecutionProvider", "CPUExecutionProvider"], False)  # the recording one


def test_other_session_failures_pass_through():
    class Broken(FakeOrt):
        def InferenceSession(self, path, so, providers):  # noqa: N802
            raise RuntimeError("[ONNXRuntimeError] : 3 : NO_SUCHFILE")

    so = ort.SessionOptions()
    require_device_placement(so, "cuda")
    with pytest.raises(RuntimeError, match="NO_SUCHFILE"):
        open_session(Broken({}), "x.onnx", so, "cuda", ort.SessionOptions)


def test_the_cpu_nodes_are_read_from_onnxruntimes_own_placement_record(tiny_engines):
    from specexport.runtime.ort_engine import session_options

    engines = tiny_engines.get("llama", drafters=(), attention="ort-gqa", **TINY_SHAPE)
    # the CPU build places everything on the CPU; options as the runtime makes them (its shared pool)
    placed = placement.cpu_nodes(ort, engines / "target.onnx", [], session_options(ort, 1))
    assert placed["GroupQueryAttention"] == 2 and sum(placed.values()) > 10
    assert isinstance(placed, Counter)
