"""tensorrt_llm/quantization/functional.py: preprocess_weights_for_mixed_gemm, which permutes and interleaves int8 /
packed int4 weights [.., K, N(/2)] into the CUTLASS mixed-GEMM layout of the GPU's SM (sm_ from torch.cuda unless
given). The layout needs the GPU; here the values pass through in their shape (upstream keeps it), and each call is
recorded so that tests see which tensors were processed."""

CALLS = []


def preprocess_weights_for_mixed_gemm(tensor, quant_mode, act_dtype, sm_=-1, do_weight_interleave=True):
    import torch

    if tensor.dtype != torch.int8 or quant_mode not in (torch.int8, torch.quint4x2):
        raise ValueError(f"expects int8 storage and quant_mode int8 or quint4x2, got {tensor.dtype}, {quant_mode}")
    CALLS.append((tuple(tensor.shape), quant_mode, act_dtype))
    return tensor
