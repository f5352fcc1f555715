"""Dtype tables, declared once: compute dtypes by their command-line names (--dtype fp32|fp16|bf16).
Their torch dtypes, and those of safetensors files by header tag, are in torch_dtypes: these names load
without torch (the command line's light paths read them)."""

from __future__ import annotations

# As ONNX tensor types, TensorRT-LLM checkpoints and Hugging Face configs spell them.
DTYPE_NAMES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
DTYPE_CHOICES = {name: choice for choice, name in DTYPE_NAMES.items()}

# --llm-quant: the language model engine's precision. "none": its dtype (FP8 checkpoints dequantized); weight-only
# INT8 / INT4 (llm/weight_only.py); "fp8": FP8 weights and activations (llm/fp8.py).
LLM_QUANT_CHOICES = ("none", "int8-wo", "int4-wo", "fp8")
# --kv-cache-dtype: "auto" keeps the engine dtype; fp8 / int8 (llm/kv_cache.py).
KV_CACHE_DTYPE_CHOICES = ("auto", "fp8", "int8")
