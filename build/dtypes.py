"""Dtype tables, declared once: compute dtypes by their command-line names (--dtype fp32|fp16|bf16).
Their torch dtypes, and those of safetensors files by header tag, are in torch_dtypes: these names load
without torch (the command line's light paths read them)."""

from __future__ import annotations

# As ONNX tensor types, TensorRT-LLM checkpoints and Hugging Face configs spell them.
DTYPE_NAMES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
DTYPE_CHOICES = {name: choice for choice, name in DTYPE_NAMES.items()}
