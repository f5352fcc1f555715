"""Weight-only INT8/INT4 engines (TensorRT-LLM W8A16 / W4A16): the quantization, its stored layout, its inverse.

The arithmetic is TensorRT-LLM's own weight-only quantizer (`cpp/tensorrt_llm/kernels/cutlass_kernels/
cutlass_preprocessors.cpp`, symmetric_quantize, read at the 1.2 line's b35ac1b), which trtllm-build runs on
float weights of a W8A16/W4A16 checkpoint (`models/modeling_utils.py` preprocess_weights ->
`weight_only_quantize_dict`): per output channel, scale = amax / 128 (int8) or amax / 8 (int4) in float32,
values round(w / scale) with C's round (half away from zero) clipped to [-128, 127] or [-8, 7], the scale
stored in the weight's dtype. The weight is quantized in the engine dtype, as upstream receives it.

Stored layout: what that quantizer produces before its arch-specific step, `[..., K, N]` int8 (the
transpose of F.linear's [N, K]); int4 packs two values per byte along N, the even column in the low
nibble; `per_channel_scale` [..., N]. The CUTLASS layout (`preprocess_weights_for_mixed_gemm`) depends on
the GPU's SM and needs a CUDA device, so the engine build applies it on the GPU host
(engine_model.Qwen3VLForCausalLM.from_checkpoint); the checkpoint stays portable between GPU types.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

# torch loads when weights are quantized: checkpoint_format, which the repository writer reads configs with, imports
# this module.
if TYPE_CHECKING:
    import torch

SCALE_NAME = "per_channel_scale"  # upstream's name beside `weight` (convert_utils.weight_only_quantize_dict)


@dataclass(frozen=True)
class WeightOnly:
    bits: int

    @property
    def levels(self) -> float:
        return float(1 << (self.bits - 1))  # 128 or 8

    def quantize(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(int8 values [..., N, K], float32 scales [..., N]) of F.linear weights [..., N, K]."""
        import torch

        w = weight.float()
        scale = w.abs().amax(dim=-1) / self.levels
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero channel quantizes to zeros
        x = w / safe[..., None]
        rounded = torch.round(x)  # half to even; C's round takes ties away from zero
        ties = (x - torch.trunc(x)).abs() == 0.5
        rounded = torch.where(ties, torch.trunc(x) + torch.sign(x), rounded)
        q = rounded.clamp(-self.levels, self.levels - 1).to(torch.int8)
        return q, scale

    def to_stored(self, q: torch.Tensor) -> torch.Tensor:
        """int8 values [..., N, K] -> the stored [..., K, N] (int4: [..., K, N/2], two per byte)."""
        import torch

        t = q.transpose(-1, -2).contiguous()
        if self.bits == 8:
            return t
        low, high = t[..., 0::2], t[..., 1::2]
        return ((low & 0x0F) | (high << 4)).to(torch.int8).contiguous()

    def from_stored(self, stored: torch.Tensor) -> torch.Tensor:
        """The stored layout back to int8 values [..., N, K]."""
        import torch

        if self.bits == 4:
            low = (stored << 4) >> 4  # arithmetic shifts sign-extend each nibble
            high = stored >> 4
            stored = torch.stack([low, high], dim=-1).flatten(-2)
        return stored.transpose(-1, -2).contiguous()

    def stored_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The stored weight's shape for F.linear weights of `shape` [..., N, K]."""
        *lead, n, k = shape
        return (*lead, k, n * self.bits // 8)

    @staticmethod
    def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """F.linear weights [..., N, K] in `dtype`: each value times its channel's stored scale."""
        return (q.float() * scale.float()[..., None]).to(dtype)


# --llm-quant choices that are weight-only, and their TensorRT-LLM QuantAlgo (quantization/mode.py).
WEIGHT_ONLY_MODES = {"int8-wo": ("W8A16", WeightOnly(8)), "int4-wo": ("W4A16", WeightOnly(4))}
QUANT_ALGO_SCHEMES = {algo: scheme for algo, scheme in WEIGHT_ONLY_MODES.values()}
