"""Where onnxruntime places a graph's nodes: on `--device cuda` every node must run on the GPU.

A node the CUDA provider has no kernel for (an fp32 GroupQueryAttention, say) silently falls
back to the CPU provider, and every call then copies its inputs and outputs between host and
device. So a cuda session is made with onnxruntime's ``session.disable_cpu_ep_fallback``: its
creation fails when any node lands on the CPU, and that failure becomes one line naming the
graph file, the nodes placed there (found by a second, recording session) and the fix.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from specexport.errors import BadInput

# onnxruntime's session config keys (onnxruntime_session_options_config_keys.h)
DISABLE_CPU_FALLBACK = "session.disable_cpu_ep_fallback"
RECORD_PLACEMENT = "session.record_ep_graph_assignment_info"
CPU_PROVIDER = "CPUExecutionProvider"
# what onnxruntime's failure says (inference_session.cc) when a node was assigned to the CPU
_FALLBACK_REFUSED = "fallback to CPU EP has been explicitly disabled"

# EngineOptions.device -> providers. cuda names the CUDA provider alone: with fallback disabled,
# onnxruntime refuses a session that also lists the CPU provider explicitly.
PROVIDERS = {
    "cpu": [CPU_PROVIDER],
    "cuda": ["CUDAExecutionProvider"],
}
# devices whose sessions must keep every node off the CPU
STRICT_DEVICES = frozenset({"cuda"})

GPU_BUILD_FIX = ("build the engines for the GPU: `device: cuda` in the recipe (fp16 ort-gqa graphs, "
                 "recipes/smollm2-135m-cuda.yaml), then specexport build")


def require_device_placement(so, device: str) -> None:
    """Set ``so`` (SessionOptions) so that a session on ``device`` fails rather than run a node
    on the CPU."""
    if device in STRICT_DEVICES:
        so.add_session_config_entry(DISABLE_CPU_FALLBACK, "1")


def is_cpu_fallback_refusal(err: Exception) -> bool:
    return _FALLBACK_REFUSED in str(err)


def cpu_nodes(ort, path: str | Path, providers: list[str], so) -> Counter:
    """op type -> count of the nodes of ``path`` that onnxruntime places on the CPU when allowed
    to (a session on ``so``, fresh SessionOptions with fallback on, recording its placement);
    empty where onnxruntime cannot report it."""
    so.add_session_config_entry(RECORD_PLACEMENT, "1")
    try:
        session = ort.InferenceSession(str(path), so, providers=[*providers, CPU_PROVIDER])
        assigned = session.get_provider_graph_assignment_info()
    except Exception:  # an older onnxruntime, or a graph that fails for another reason
        return Counter()
    return Counter(node.op_type for sub in assigned if sub.ep_name == CPU_PROVIDER for node in sub.get_nodes())


def placement_error(path: str | Path, device: str, placed: Counter) -> BadInput:
    """The one line for a graph that would run nodes on the CPU on ``device``."""
    nodes = ", ".join(f"{op} x{n}" if n > 1 else op for op, n in placed.most_common(6)) or "some nodes"
    return BadInput(f"{path}: onnxruntime would run {nodes} on the CPU, not on {device} "
                    f"(every call would copy between host and device); {GPU_BUILD_FIX}")


def open_session(ort, path: str | Path, so, device: str, fresh_options: Callable[[], Any]):
    """An InferenceSession of ``path`` on ``device``'s providers, with ``so`` (set by
    ``require_device_placement``); on a strict device, one that places a node on the CPU is
    refused with ``placement_error``. ``fresh_options``: SessionOptions like ``so`` without its
    entries, for the session that finds the nodes (the process's thread pool decides how
    every session's options must be made)."""
    providers = PROVIDERS[device]
    try:
        return ort.InferenceSession(str(path), so, providers=providers)
    except Exception as err:
        if device in STRICT_DEVICES and is_cpu_fallback_refusal(err):
            raise placement_error(path, device, cpu_nodes(ort, path, providers, fresh_options())) from None
        raise
