"""Triton python-backend model `llm`: an adapter over the qwen3vl_trt package."""

from qwen3vl_trt.serving.stages.triton_adapters import LLMModel as TritonPythonModel

__all__ = ["TritonPythonModel"]
