"""Plain torch reference of the varlen attention plugin: one SDPA call per segment."""

import torch
import torch.nn.functional as F


def varlen_attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor
) -> torch.Tensor:
    """Non-causal attention within each segment of packed q/k/v [N, heads, head_dim].

    Segment s covers rows cu_seqlens[s] .. cu_seqlens[s + 1] (int32 [S + 1], starting at 0, ending at N).
    The softmax scale is 1 / sqrt(head_dim); the output has the inputs' shape and dtype.
    """
    if q.shape != k.shape or q.shape != v.shape or q.dim() != 3:
        raise ValueError(f"q, k, v must share one [N, heads, head_dim] shape, got {q.shape}, {k.shape}, {v.shape}")
    bounds = cu_seqlens.tolist()
    segments = list(zip(bounds[:-1], bounds[1:], strict=True))
    if bounds[0] != 0 or bounds[-1] != q.shape[0] or any(start > end for start, end in segments):
        raise ValueError(f"cu_seqlens must rise from 0 to N = {q.shape[0]}, got {bounds}")
    out = torch.empty_like(q)
    for start, end in segments:
        if start == end:
            continue
        # SDPA wants [heads, seq, head_dim].
        q_seg, k_seg, v_seg = (t[start:end].transpose(0, 1) for t in (q, k, v))
        out[start:end] = F.scaled_dot_product_attention(q_seg, k_seg, v_seg).transpose(0, 1)
    return out
