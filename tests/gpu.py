"""Whether the GPU tests (marked ``gpu``) can run on this machine."""

from __future__ import annotations

from specexport.errors import BadInput


def gpu_unavailable() -> str | None:
    """Why the GPU tests cannot run here (None when they can)."""
    from specexport.runtime.trt_engine import cuda_device, require_tensorrt

    try:
        require_tensorrt()
        cuda_device()
    except BadInput as err:
        return str(err)
    return None
