"""FP8 engines (TensorRT-LLM QuantAlgo FP8, sm89+): per-tensor e4m3 weights and static activation scales.

1.2.1's rowwise FP8 (FP8_PER_CHANNEL_PER_TOKEN) does not apply to QWen: its Fp8RowwiseAttention takes neither
the q/k RMSNorm nor the mrope inputs (`quantization/layers.py`), and Qwen's converter has no rowwise path. The
per-tensor recipe is the one upstream tests Qwen3 with: each quantized linear holds `weight` e4m3 [out, in],
`weights_scaling_factor` (1,) and `activation_scaling_factor` (1,) in float32 (FP8Linear / FP8RowLinear), MoE
experts `weight` [E, out, in], `weights_scaling_factor` (E, 1) and one `activation_scaling_factor` (1,)
(layers/moe.py); a scale maps fp8 back to the original (amax / 448). FP8Linear computes
fp8(x / a) @ fp8(w / s)^T * (a * s) with a and s in the engine dtype, which `linear` emulates in float32 on a
CPU (e4m3 products are exact in float32, as in the tensor cores' float32 accumulation). Weight scales are per
tensor across ranks (the whole tensor's amax); the activation scales come from qwen3vl_trt.pipeline.calibration.
The dense MLP's fc and gate share one weight scale (their max), which is what the build's gate/up fusion
(fuse_gate_mlp) would requantize them to, so the fused GEMM computes with the stored values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

FP8_ALGO = "FP8"
E4M3_MAX = 448.0
WEIGHT_SCALE = "weights_scaling_factor"
ACTIVATION_SCALE = "activation_scaling_factor"


def scale_of(amax: torch.Tensor) -> torch.Tensor:
    """The float32 scale of values up to `amax` (amax / 448; 1 where amax is 0)."""
    import torch

    amax = amax.float()
    return torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))


def to_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """e4m3 values of x / scale, saturated at the format's range."""
    import torch

    return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


@dataclass
class FP8Weight:
    """A quantized linear as the engine holds it: e4m3 weight [..., out, in], its scale ((1,) or (E, 1)), the
    activation scale (1,)."""

    weight: torch.Tensor
    weight_scale: torch.Tensor
    activation_scale: torch.Tensor

    def __getitem__(self, expert: int) -> FP8Weight:
        return FP8Weight(self.weight[expert], self.weight_scale[expert], self.activation_scale)

    def split(self, sizes: list[int], dim: int) -> list[FP8Weight]:
        return [FP8Weight(w, self.weight_scale, self.activation_scale) for w in self.weight.split(sizes, dim)]

    def to(self, device: str | torch.device) -> FP8Weight:
        return FP8Weight(self.weight.to(device), self.weight_scale.to(device), self.activation_scale.to(device))


def linear(x: torch.Tensor, w: torch.Tensor | FP8Weight) -> torch.Tensor:
    """F.linear, or FP8Linear's arithmetic for an FP8Weight (output in x's dtype): its scales are cast to the
    engine dtype first (FP8Linear.forward casts both, quantization/layers.py)."""
    import torch.nn.functional as F

    if not isinstance(w, FP8Weight):
        return F.linear(x, w)
    a = w.activation_scale.to(x.dtype).float()
    s = w.weight_scale.to(x.dtype).float().reshape(-1)[0]
    out = F.linear(to_fp8(x, a).float(), w.weight.float())
    return (out * (a * s)).to(x.dtype)


@dataclass(frozen=True)
class FP8PerTensor:
    """The FP8 scheme of a checkpoint (quant_algo FP8), beside weight_only.WeightOnly."""

    algo: str = FP8_ALGO
