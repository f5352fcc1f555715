"""Triton python-backend model `postprocessing`: an adapter over the qwen3vl_trt package."""

from qwen3vl_trt.serving.stages.triton_adapters import PostprocessingModel as TritonPythonModel

__all__ = ["TritonPythonModel"]
