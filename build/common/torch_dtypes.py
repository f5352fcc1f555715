"""torch's dtypes of the command-line names in dtypes, and the tensor dtypes of safetensors files by their
header tags: apart from dtypes, whose names load without torch."""

from __future__ import annotations

import torch

TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}

# safetensors header tags ("BF16", ...) of the tensor dtypes checkpoints carry.
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,  # block-FP8 weights (quantization.py reads them dequantized)
}
SAFETENSORS_DTYPE_TAGS = {dtype: tag for tag, dtype in SAFETENSORS_DTYPES.items()}
