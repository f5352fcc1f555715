"""Runtimes that run the engines' contracts on machines without TensorRT."""

from .reference_llm import DecodeBatch, GenerationResult, LLMRequest, ReferenceLLM
from .sampling import SamplingParams

__all__ = ["DecodeBatch", "GenerationResult", "LLMRequest", "ReferenceLLM", "SamplingParams"]
