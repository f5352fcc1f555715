"""Runtimes that run the engines' contracts on machines without TensorRT."""

from .reference_llm import GenerationResult, LLMRequest, ReferenceLLM
from .sampling import SamplingParams

__all__ = ["GenerationResult", "LLMRequest", "ReferenceLLM", "SamplingParams"]
