"""Which --llm-quant a build uses, for which GPU: the choice is made (and refused) before any stage runs.

FP8 GEMMs need Ada or Hopper tensor cores (sm89+); the weight-only GEMMs run from Ampere (sm80) on, except on
sm100-sm119, where TensorRT-LLM 1.2.1's builder refuses INT8/INT4 weight-only and INT8 KV caches (`builder.py`,
build: "INT8/INT4 quantization is not supported on SM>=100.", raised after the checkpoint has been loaded). The target
GPU is `--gpu-arch` where given, else the visible GPU; a build with neither (a CPU machine) runs the chosen mode's
arithmetic in the reference runtime and names the GPUs an engine of it can serve on.
"""

from __future__ import annotations

import re

from ..common.dtypes import LLM_QUANT_CHOICES
from ..errors import UnsupportedModelError
from .weight_only import QUANT_ALGO_SCHEMES, WEIGHT_ONLY_MODES

MIN_SM = {"none": 0, "int8-wo": 80, "int4-wo": 80, "fp8": 89}


def refuses_int8_int4(arch: int) -> bool:
    """Whether TensorRT-LLM's builder refuses INT8/INT4 weight-only and INT8 KV caches for the GPU (`builder.py`,
    build: `if get_sm_version() >= 100 and get_sm_version() < 120`)."""
    return 100 <= arch < 120


def parse_gpu_arch(value: str) -> int:
    """sm90, sm_90, 90 or 9.0 -> 90; sm100 or 10.0 -> 100."""
    text = value.strip().lower()
    dotted = re.fullmatch(r"(\d{1,2})\.(\d)", text)
    if dotted is not None:
        return int(dotted.group(1)) * 10 + int(dotted.group(2))
    plain = re.fullmatch(r"(?:sm_?)?(\d{2,3})", text)
    if plain is None:
        raise ValueError(f"{value!r} is not a GPU architecture: write it as sm80, sm89, sm90, sm100, ...")
    return int(plain.group(1))


def visible_gpu_arch() -> int | None:
    import torch

    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability()
    return major * 10 + minor


def choose_llm_quant(requested: str | None, fp8_checkpoint: bool, arch: int | None) -> tuple[str, str]:
    """(mode, why): the requested mode checked against the GPU, or the default (fp8 for an FP8 checkpoint on an
    FP8-capable GPU, else none)."""
    target = f"sm{arch}" if arch is not None else "no GPU visible and no --gpu-arch"
    if requested is None:
        if fp8_checkpoint and arch is not None and arch >= MIN_SM["fp8"]:
            return "fp8", f"the default for an FP8 checkpoint on {target}"
        if fp8_checkpoint:
            return "none", f"the default for an FP8 checkpoint without an FP8-capable GPU ({target}): dequantized"
        return "none", "the default"
    if requested not in LLM_QUANT_CHOICES:
        raise UnsupportedModelError(f"--llm-quant must be one of {', '.join(LLM_QUANT_CHOICES)}, got {requested!r}")
    need = MIN_SM[requested]
    if arch is not None and arch < need:
        works = [m for m in LLM_QUANT_CHOICES if MIN_SM[m] <= arch]
        raise UnsupportedModelError(
            f"--llm-quant {requested} needs a GPU of sm{need} or newer, and the target is sm{arch}; "
            f"use --llm-quant {' or '.join(works)}"
        )
    if arch is not None and requested in WEIGHT_ONLY_MODES and refuses_int8_int4(arch):
        raise UnsupportedModelError(
            f"TensorRT-LLM builds no INT8/INT4 weight-only engine for sm{arch}; use --llm-quant fp8 or none"
        )
    if arch is not None:
        return requested, f"asked for, on {target}"
    return requested, f"asked for; {target}" + (f": an engine of it needs sm{need}+" if need else "")


def check_kv_cache(kv_cache_dtype: str, arch: int | None, dtype: str) -> None:
    """Refuses a KV-cache dtype the engine cannot hold. A quantized cache beside fp32 activations: TensorRT-LLM has
    no check against it, but nothing upstream runs it either (fp32 attention takes neither context FMHA nor XQA,
    `attentionOp.cpp` initialize, only the unfused path and MMHA; upstream's calibration exports fp16/bf16 models,
    `quantize_by_modelopt.py`), so it is refused rather than built unverified. For the target GPU: FP8 needs sm89+,
    and TensorRT-LLM's builder refuses an INT8 KV cache on sm100-sm119 (`builder.py`, build)."""
    if kv_cache_dtype == "auto":
        return
    if dtype == "fp32":
        raise UnsupportedModelError(
            f"--kv-cache-dtype {kv_cache_dtype} quantizes the KV cache of a bf16 or fp16 engine, not fp32; use "
            "--kv-cache-dtype auto, or bf16 weights (convert-llm --dtype, build --llm-dtype)"
        )
    if arch is None:
        return
    if kv_cache_dtype == "fp8" and arch < MIN_SM["fp8"]:
        raise UnsupportedModelError(f"--kv-cache-dtype fp8 needs sm89 or newer, the target is sm{arch}; use int8")
    if kv_cache_dtype == "int8" and refuses_int8_int4(arch):
        raise UnsupportedModelError(f"TensorRT-LLM builds no INT8 KV cache for sm{arch}; use --kv-cache-dtype fp8")


def check_engine_arch(quant_algo: str | None, kv_cache_quant_algo: str | None, arch: int) -> None:
    """Refuses, before trtllm-build runs, a converted checkpoint that TensorRT-LLM's builder refuses for the GPU it
    builds on once the weights are loaded: INT8/INT4 weight-only or an INT8 KV cache on sm100-sm119."""
    if not refuses_int8_int4(arch):
        return
    if quant_algo in QUANT_ALGO_SCHEMES:
        raise UnsupportedModelError(
            f"TensorRT-LLM builds no INT8/INT4 weight-only engine for sm{arch}, and the checkpoint holds "
            f"{quant_algo} weights; convert it again with --llm-quant fp8 or none"
        )
    if kv_cache_quant_algo == "INT8":
        raise UnsupportedModelError(
            f"TensorRT-LLM builds no INT8 KV cache for sm{arch}, and the checkpoint has one; "
            "convert it again with --kv-cache-dtype fp8 or auto"
        )
