"""runtime/placement.py: a cuda session may not place a computation on tensors on the CPU.
Checked here without a GPU: the recording entry is set for cuda alone, onnxruntime's placement
record is read by node name against the graph's listed host arithmetic (names that survive
onnxruntime's optimizations, on the real CPU build), and a misplaced node becomes one line
naming the file, the nodes and the fix (a fake onnxruntime stands in for the CUDA build)."""

from __future__ import annotations

import shutil

import onnx
import onnxruntime as ort
import pytest

from specexport.errors import BadInput
from specexport.exporter.gpu_build import mark_host_nodes
from specexport.runtime import placement
from specexport.runtime.ort_engine import session_options
from specexport.runtime.placement import (
    HOST_NODES,
    PROVIDERS,
    RECORD_PLACEMENT,
    open_session,
    require_device_placement,
)
from tests.conftest import TINY_SHAPE


def records(so) -> bool:
    """Whether ``so`` records placement (onnxruntime raises for an entry never set)."""
    try:
        return so.get_session_config_entry(RECORD_PLACEMENT) == "1"
    except RuntimeError:
        return False


def test_placement_is_recorded_for_cuda_and_not_for_the_cpu():
    cuda, cpu = ort.SessionOptions(), ort.SessionOptions()
    require_device_placement(cuda, "cuda")
    require_device_placement(cpu, "cpu")
    assert records(cuda) and not records(cpu)
    assert PROVIDERS["cuda"][0] == "CUDAExecutionProvider" and PROVIDERS["cpu"] == ["CPUExecutionProvider"]


class FakeOrt:
    """onnxruntime as a CUDA build would answer: a session whose placement record puts
    ``on_cpu`` (name -> op type) on the CPU, its graph listing ``host`` as host arithmetic."""

    def __init__(self, on_cpu: dict[str, str], host: list[str]):
        self.on_cpu, self.host = on_cpu, host
        self.providers: list[str] = []

    def InferenceSession(self, path, so, providers):  # noqa: N802 (onnxruntime's name)
        self.providers = providers
        return FakeSession(self.on_cpu, self.host)


class FakeNode:
    def __init__(self, name: str, op_type: str):
        self.name, self.op_type = name, op_type


class FakeSubgraph:
    def __init__(self, ep_name: str, nodes: dict[str, str]):
        self.ep_name, self.nodes = ep_name, nodes

    def get_nodes(self):
        return [FakeNode(name, op) for name, op in self.nodes.items()]


class FakeSession:
    def __init__(self, on_cpu: dict[str, str], host: list[str]):
        self.on_cpu, self.host = on_cpu, host

    def get_modelmeta(self):
        return type("Meta", (), {"custom_metadata_map": {HOST_NODES: ",".join(self.host)} if self.host else {}})()

    def get_provider_graph_assignment_info(self):
        return [FakeSubgraph("CUDAExecutionProvider", {"mm": "MatMul"}), FakeSubgraph("CPUExecutionProvider", self.on_cpu)]


def open_fake(on_cpu: dict[str, str], host: list[str]):
    fake = FakeOrt(on_cpu, host)
    so = ort.SessionOptions()
    require_device_placement(so, "cuda")
    return fake, open_session(fake, "engines/x/target.onnx", so, "cuda")


def test_a_cuda_session_with_a_computation_on_the_cpu_is_refused_in_one_line():
    on_cpu = {"gqa_0": "GroupQueryAttention", "gqa_1": "GroupQueryAttention", "node_add_68": "Add",
              "node_max_1": "ReduceMax"}
    with pytest.raises(BadInput) as err:
        open_fake(on_cpu, ["node_add_68", "node_max_1"])
    message = str(err.value)
    assert "\n" not in message and message.startswith("engines/x/target.onnx: ")
    assert "would run GroupQueryAttention x2 on the CPU" in message and "device: cuda" in message
    assert "Add" not in message and "ReduceMax" not in message  # listed host arithmetic


def test_host_arithmetic_on_the_cpu_is_accepted():
    fake, session = open_fake({"node_add_68": "Add", "node_max_1": "ReduceMax"}, ["node_add_68", "node_max_1"])
    assert isinstance(session, FakeSession) and fake.providers == PROVIDERS["cuda"]


def test_a_graph_listing_nothing_may_place_nothing_on_the_cpu():
    with pytest.raises(BadInput, match="would run Add on the CPU"):
        open_fake({"node_add_68": "Add"}, [])


def test_listed_host_nodes_keep_their_names_through_onnxruntimes_optimizations(tiny_engines, tmp_path):
    engines = tiny_engines.get("llama", drafters=(), attention="ort-gqa", precision="fp16", **TINY_SHAPE)
    graph = mark_host_nodes(onnx.load(str(engines / "target.onnx"), load_external_data=False))
    shutil.copy(engines / "target.weights", tmp_path / "target.weights")
    onnx.save(graph, str(tmp_path / "target.onnx"))
    so = session_options(ort, 1)  # the runtime's: every optimization, the process's one pool
    require_device_placement(so, "cuda")
    # the CPU build places every node on the CPU: the listed ones are all found by name, the rest misplaced
    session = ort.InferenceSession(str(tmp_path / "target.onnx"), so, providers=["CPUExecutionProvider"])
    listed, placed = placement.host_nodes(session), {name for name, _ in placement.cpu_nodes(session)}
    assert listed and listed <= placed
    misplaced = placement.misplaced(session)
    assert misplaced["GroupQueryAttention"] == 2 and misplaced["MatMul"] > 0 and "ReduceMax" not in misplaced


def test_the_providers_asked_for_reach_the_session():
    """CUDA graph capture is a CUDA provider option (runtime/device_binding.with_cuda_graphs): the
    session must get the providers as given, not the device's plain list."""
    from specexport.runtime.device_binding import with_cuda_graphs

    fake = FakeOrt({}, [])
    so = ort.SessionOptions()
    providers = with_cuda_graphs(PROVIDERS["cuda"], True)
    open_session(fake, "engines/x/target.onnx", so, "cuda", providers)
    assert fake.providers == providers and fake.providers[0][1] == {"enable_cuda_graph": "1"}
    open_session(fake, "engines/x/target.onnx", so, "cuda")
    assert fake.providers == PROVIDERS["cuda"]
