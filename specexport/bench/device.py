"""`bench --device`: what runs where. The engines' load options and the peers' placement for
each device, and the CPU's verify cost curve shown beside a GPU's.

The engines' load options for a device (the device-resident cache store, CUDA graphs) are
``load_options``'s.
"""

from __future__ import annotations

import json
from pathlib import Path

from specexport.bench.peers import BATCHED_PEERS, GPU_PEER_DEVICE, GPU_PEERS, PeerDevice

DEVICES = ("cpu", "cuda")


def load_options(device: str, cuda_graphs: bool = True) -> dict:
    """``runtime.load``'s keywords for the bench's engines on ``device``: on cuda every cache on
    the device (the device store, always on there) and, unless ``cuda_graphs`` is False, each
    static shape replayed as a CUDA graph: what a GPU user deploys."""
    return {"device": device, "cuda_graphs": device == "cuda" and cuda_graphs}


def peer_device(device: str) -> PeerDevice:
    """The transformers peers' placement: the same GPU in fp16 for cuda, else cpu and fp32."""
    return GPU_PEER_DEVICE if device == "cuda" else PeerDevice()


def default_peers(device: str, batched: bool = False) -> str:
    """--peers when it is not given: on a GPU, what a GPU user would otherwise run (those that
    batch, for --batch); none on a CPU."""
    if device != "cuda":
        return ""
    return ",".join(p for p in GPU_PEERS if not batched or p in BATCHED_PEERS)


def curve_from_file(path: Path) -> dict:
    """The verify cost curve of an earlier bench.json (``cost_curve``), as ``cost_curve_cpu``."""
    from specexport.errors import BadInput

    try:
        data = json.loads(Path(path).read_text())
        curve = [{"tokens": int(c["tokens"]), "ms": float(c["ms"]), "relative": float(c["relative"])}
                 for c in data["cost_curve"]]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise BadInput(f"--cpu-curve {path}: not a bench.json with a cost_curve ({type(err).__name__}: {err})") from None
    device = (data.get("settings") or {}).get("device", "cpu")
    if device != "cpu":
        raise BadInput(f"--cpu-curve {path}: that bench ran on {device}; give a CPU run's bench.json")
    return {"source": f"file {path}", "threads": (data.get("settings") or {}).get("threads"), "curve": curve}


def curve_measured(engine_dir: Path, threads: int, repeats: int) -> dict:
    """The same directory's verify cost curve on onnxruntime's CPU provider, measured now; a
    failure (graphs the CPU provider does not run) is reported, not raised."""
    from specexport.bench.harness import cost_curve
    from specexport.runtime import load

    try:
        curve = cost_curve(load(engine_dir, threads=threads, device="cpu"), repeats)
    except Exception as err:  # the GPU bench goes on without the CPU curve, saying why
        return {"source": "not measured", "threads": threads, "curve": [], "error": f"{type(err).__name__}: {err}"}
    return {"source": "measured in this run (onnxruntime CPU)", "threads": threads, "curve": curve}
