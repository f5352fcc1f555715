"""Compute dtypes by their command-line names (--dtype fp32|fp16|bf16), declared once."""

from __future__ import annotations

import torch

TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# As ONNX tensor types, TensorRT-LLM checkpoints and Hugging Face configs spell them.
DTYPE_NAMES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
DTYPE_CHOICES = {name: choice for choice, name in DTYPE_NAMES.items()}
