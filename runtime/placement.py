"""Where onnxruntime places a graph's nodes: on `--device cuda` every node that computes on
tensors must run on the GPU.

A node the CUDA provider has no kernel for (an fp32 GroupQueryAttention, say) silently falls
back to the CPU provider, and every call then copies its inputs and outputs between host and
device. So a cuda session records its placement (``session.record_ep_graph_assignment_info``)
and is refused, in one line naming the graph file, the nodes and the fix, when a node lands on
the CPU that the exporter did not list as host arithmetic.

Host arithmetic: onnxruntime places on the CPU, by design, the small integer subgraphs whose
results a CUDA kernel reads from host memory, such as GroupQueryAttention's
total_sequence_length (cache length + tokens, ReduceMax, Cast). onnxruntime's own switch,
``session.disable_cpu_ep_fallback``, refuses those too, so every ort-gqa graph; instead the
exporter lists them in the graph's metadata (``HOST_NODES``: the nodes that read and write only
integers, exporter/gpu_build.py) and only the others are refused.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from specexport.errors import BadInput

# onnxruntime's session config key (onnxruntime_session_options_config_keys.h)
RECORD_PLACEMENT = "session.record_ep_graph_assignment_info"
CPU_PROVIDER = "CPUExecutionProvider"
# the graph metadata key listing the nodes allowed on the CPU (comma-separated node names)
HOST_NODES = "specexport.host_nodes"

# EngineOptions.device -> providers
PROVIDERS = {
    "cpu": [CPU_PROVIDER],
    "cuda": ["CUDAExecutionProvider", CPU_PROVIDER],
}
# devices whose sessions must keep every tensor computation off the CPU
STRICT_DEVICES = frozenset({"cuda"})

GPU_BUILD_FIX = ("build the engines for the GPU: `device: cuda` in the recipe (fp16 ort-gqa graphs, "
                 "recipes/smollm2-135m-cuda.yaml), then specexport build")


def require_device_placement(so, device: str) -> None:
    """Set ``so`` (SessionOptions) so that a session on ``device`` records where its nodes run."""
    if device in STRICT_DEVICES:
        so.add_session_config_entry(RECORD_PLACEMENT, "1")


def host_nodes(session) -> frozenset[str]:
    """The node names the graph's metadata allows on the CPU (none when it lists none)."""
    listed = session.get_modelmeta().custom_metadata_map.get(HOST_NODES, "")
    return frozenset(name for name in listed.split(",") if name)


def cpu_nodes(session) -> list[tuple[str, str]]:
    """(name, op type) of every node ``session`` placed on the CPU provider (its options set by
    ``require_device_placement``)."""
    return [(node.name, node.op_type) for sub in session.get_provider_graph_assignment_info()
            if sub.ep_name == CPU_PROVIDER for node in sub.get_nodes()]


def misplaced(session) -> Counter:
    """op type -> count of the nodes on the CPU that the graph does not list as host arithmetic."""
    allowed = host_nodes(session)
    return Counter(op for name, op in cpu_nodes(session) if name not in allowed)


def placement_error(path: str | Path, device: str, placed: Counter) -> BadInput:
    """The one line for a graph that would run nodes on the CPU on ``device``."""
    nodes = ", ".join(f"{op} x{n}" if n > 1 else op for op, n in placed.most_common(6))
    more = f" and {len(placed) - 6} more op types" if len(placed) > 6 else ""
    return BadInput(f"{path}: onnxruntime would run {nodes}{more} on the CPU, not on {device} "
                    f"(every call would copy between host and device); {GPU_BUILD_FIX}")


def open_session(ort, path: str | Path, so, device: str, providers: list | None = None):
    """An InferenceSession of ``path`` on ``device``'s providers (``providers``: those with their
    options, e.g. CUDA graph capture; default the device's), with ``so`` (set by
    ``require_device_placement``); on a strict device, one that places a tensor computation on
    the CPU is refused with ``placement_error``."""
    session = ort.InferenceSession(str(path), so, providers=providers or PROVIDERS[device])
    if device in STRICT_DEVICES:
        placed = misplaced(session)
        if placed:
            raise placement_error(path, device, placed)
    return session
