"""specexport.runtime: run an engine directory as a lossless speculative decoder.

Needs numpy, tokenizers, jinja2 and an engine backend (onnxruntime, or tensorrt); never torch,
transformers or onnx.
"""

from specexport.runtime.api import Generation, Pipeline, load

__all__ = ["Generation", "Pipeline", "load"]
