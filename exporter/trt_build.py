"""TensorRT engine building (the `tensorrt` backend of `specexport build`)."""

from __future__ import annotations

from specexport.errors import missing_extra


def require_tensorrt():
    """Import tensorrt or fail with the extra to install (exit code 2)."""
    try:
        import tensorrt
    except ImportError:
        raise missing_extra("tensorrt", "gpu") from None
    return tensorrt
