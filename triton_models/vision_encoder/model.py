"""Triton python-backend model `vision_encoder`: an adapter over the qwen3vl_trt package."""

from qwen3vl_trt.serving.stages.triton_adapters import VisionEncoderModel as TritonPythonModel

__all__ = ["TritonPythonModel"]
