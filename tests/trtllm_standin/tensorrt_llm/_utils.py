"""tensorrt_llm/_utils.py: str_dtype_to_torch."""


def str_dtype_to_torch(dtype):
    import torch

    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
