"""A quantized KV cache (`--kv-cache-dtype fp8|int8`, TensorRT-LLM kv_cache_quant_algo FP8 / INT8).

Each attention layer holds `kv_cache_scaling_factor` (1,) float32, one scale for its keys and values (the loader
takes the max of separate ones; `models/modeling_utils.py` preprocess_weights, which also derives
`kv_cache_rcp_scaling_factor` = 1 / scale when a checkpoint omits it). The attention kernels store k * rcp as e4m3,
or as int8 rounded to nearest even and saturated (`cvt.rni.sat.s8.f32`), and read back value * scale; so the scale
is amax / 448 (FP8) or amax / 127 (INT8), with the amax of the layer's keys and values after rotation from
calibration. An INT8 cache, and an FP8 one beside weights that are not FP8, turn paged context FMHA off in the build
(`builder.py`), so such engines neither reuse KV blocks nor chunk long prompts (serving.repository.trtllm_config
reads this from the engine; engine_build raises max_num_tokens to max_input_len for them).

An FP8 cache beside FP8 weights keeps paged context FMHA on, and then the builder turns FP8 context FMHA on
(`builder.py`, build: "FP8 Context FMHA is enabled to support FP8 Paged Context FMHA"). Its context phase quantizes
the rotated queries with the same scale as the keys and values (`cpp/tensorrt_llm/common/attentionOp.cpp`,
enqueueContext: `qkv_scale_orig_quant = kv_scale_orig_quant`; the preprocessing kernel stores q, k and v as e4m3
after RoPE, `unfusedAttentionKernels_2_template.h`, applyBiasRopeUpdateKVCache), and the FMHA reads q, k and v in
e4m3: the scale must cover the queries too, or they saturate at 448 times it (calibration measures them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

KV_SCALE = "kv_cache_scaling_factor"


@dataclass(frozen=True)
class KVCacheQuant:
    algo: str  # kv_cache_quant_algo
    levels: float  # what the scale maps amax to

    def round_trip(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """x as the cache gives it back: stored as the engine stores it, read times the scale, in x's dtype."""
        import torch

        y = x.float() / scale
        if self.algo == "FP8":
            y = y.clamp(-self.levels, self.levels).to(torch.float8_e4m3fn).float()
        else:
            y = torch.round(y).clamp(-128, 127)  # round half to even, as cvt.rni
        return (y * scale).to(x.dtype)


KV_CACHE_DTYPES = {"fp8": KVCacheQuant("FP8", 448.0), "int8": KVCacheQuant("INT8", 127.0)}
KV_CACHE_ALGOS = {q.algo: q for q in KV_CACHE_DTYPES.values()}


def fp8_context_fmha(quant_algo: str | None, kv_cache_quant_algo: str | None) -> bool:
    """Whether the engine's context phase runs FP8 FMHA, its queries quantized with the KV-cache scale: FP8 weights
    with an FP8 cache (the builder's rule for the build_llm_engine flags, which keep context FMHA and paged context
    FMHA on for them; FP8 needs sm89+, where the builder keeps it)."""
    return quant_algo == "FP8" and kv_cache_quant_algo == "FP8"
