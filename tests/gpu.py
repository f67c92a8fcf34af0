"""Whether the GPU tests (marked ``gpu``) can run on this machine, and the marks that say so."""

from __future__ import annotations

import pytest

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


NO_GPU = gpu_unavailable()

# The refusals of a machine without TensorRT or a GPU: a machine with both has nothing to refuse.
without_gpu = pytest.mark.skipif(NO_GPU is None, reason="TensorRT and a GPU are present")


def needs_gpu(test):
    """Marks ``test`` gpu, and skips it, saying what is missing, where there is no GPU with TensorRT."""
    return pytest.mark.gpu(pytest.mark.skipif(NO_GPU is not None, reason=f"needs a CUDA GPU and TensorRT: {NO_GPU}")(test))


def cuda_ort_unavailable() -> str | None:
    """Why onnxruntime's CUDA provider, with torch on the same GPU, cannot run here (None when it can)."""
    import onnxruntime

    if "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
        return "onnxruntime has no CUDAExecutionProvider (the onnxruntime-gpu wheel is not installed)"
    import torch  # only where onnxruntime-gpu is: torch's import is slow

    return None if torch.cuda.is_available() else "torch sees no CUDA device"


NO_CUDA_ORT = cuda_ort_unavailable()


def needs_cuda_ort(test):
    """Marks ``test`` gpu, and skips it, saying what is missing, without onnxruntime-gpu and a CUDA GPU."""
    return pytest.mark.gpu(pytest.mark.skipif(NO_CUDA_ORT is not None,
                                              reason=f"needs onnxruntime-gpu and a CUDA GPU: {NO_CUDA_ORT}")(test))
