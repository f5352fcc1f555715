"""Triton python-backend model `preprocessing`: an adapter over the qwen3vl_trt package."""

from qwen3vl_trt.serving.stages.triton_adapters import PreprocessingModel as TritonPythonModel

__all__ = ["TritonPythonModel"]
