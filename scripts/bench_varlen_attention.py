#!/usr/bin/env python3
"""The varlen attention kernel against per-segment SDPA (and flash-attn's varlen kernel where importable).

Packed q/k/v [N, heads, head_dim] of several images (one attention segment each) at Qwen3-VL's sizes (16 heads,
head_dim 72 by default); for each batch and dtype: each method's error against an fp32 per-segment reference (max
abs error over the reference's max magnitude), the median time of each, and the speed ratios. Aim: faster than a
loop of per-segment torch.nn.functional.scaled_dot_product_attention calls outright, and at least 0.7x flash-attn's
varlen speed. Exits 1 where the kernel's error is over its tolerance.

    python scripts/bench_varlen_attention.py [--dtype bf16 fp16] [--heads 16] [--head-dim 72] [--json FILE]

On a GPU host; `--batches 2x64 --repeats 1` with TRITON_INTERPRET=1 runs it small on a CPU (for the script itself).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from benchutil import time_interleaved
from qwen3vl_trt.plugins.reference import varlen_attention_reference
from qwen3vl_trt.plugins.varlen_kernel import varlen_attention

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# Images per batch x patches per image; "mixed" draws each image's patch count from 1024..4096.
DEFAULT_BATCHES = ("4x1024", "4x4096", "16x1024", "8xmixed", "16xmixed")
SDPA_LOOP_AIM, FLASH_AIM = 1.0, 0.7
# The kernel's relative error bound per dtype (tests/test_varlen_attention.py holds it to the same).
TOLERANCE = {"fp32": 1e-5, "fp16": 1e-3, "bf16": 1.6e-2}


def segment_lengths(batch: str, generator: torch.Generator) -> list[int]:
    images, patches = batch.split("x", 1)
    if patches == "mixed":  # whole 2x2 merge blocks, as real grids are
        return [4 * int(n) for n in torch.randint(256, 1025, (int(images),), generator=generator)]
    return [int(patches)] * int(images)


def sdpa_loop(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: list[int]) -> torch.Tensor:
    """One SDPA call per segment, host-side bounds: what a Python loop over images costs."""
    out = torch.empty_like(q)
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        qs, ks, vs = (t[start:end].transpose(0, 1) for t in (q, k, v))  # SDPA wants [heads, seq, head_dim]
        out[start:end] = F.scaled_dot_product_attention(qs, ks, vs).transpose(0, 1)
    return out


def flash_varlen() -> Callable[..., torch.Tensor] | None:
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    return flash_attn_varlen_func


def measure(
    batch: str,
    lengths: list[int],
    dtype_name: str,
    args: argparse.Namespace,
    device: torch.device,
    flash: Callable[..., torch.Tensor] | None,
    generator: torch.Generator,
) -> dict:
    """Errors and median times of every method on one random batch."""
    bounds = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    cu_seqlens = torch.tensor(bounds, dtype=torch.int32, device=device)
    n, longest = bounds[-1], max(lengths)
    shape = (n, args.heads, args.head_dim)
    q, k, v = (torch.randn(shape, generator=generator).to(device, DTYPES[dtype_name]) for _ in range(3))
    reference = varlen_attention_reference(q.float(), k.float(), v.float(), cu_seqlens)
    methods: dict[str, Callable[[], torch.Tensor]] = {
        "kernel": lambda: varlen_attention(q, k, v, cu_seqlens, longest),
        "sdpa_loop": lambda: sdpa_loop(q, k, v, bounds),
    }
    if flash is not None and dtype_name != "fp32":
        methods["flash_varlen"] = lambda: flash(q, k, v, cu_seqlens, cu_seqlens, longest, longest)
    scale = float(reference.abs().max())
    errors = {name: float((fn().float() - reference).abs().max()) / scale for name, fn in methods.items()}
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def synced(fn: Callable[[], torch.Tensor]) -> Callable[[], None]:
        return lambda: (fn(), sync())[1]

    times = time_interleaved([synced(fn) for fn in methods.values()], args.warmup, args.repeats)
    ms = {name: 1e3 * statistics.median(t) for name, t in zip(methods, times, strict=True)}
    return {
        "batch": batch,
        "patches": n,
        "segments": len(lengths),
        "longest": longest,
        "dtype": dtype_name,
        "relative_error": errors,
        "median_ms": ms,
        "sdpa_loop_over_kernel": ms["sdpa_loop"] / ms["kernel"],
        "kernel_vs_flash": ms["flash_varlen"] / ms["kernel"] if "flash_varlen" in ms else None,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", nargs="+", default=list(DEFAULT_BATCHES), help="IMAGESxPATCHES or IMAGESxmixed")
    p.add_argument("--dtype", nargs="+", default=["bf16", "fp16"], choices=list(DTYPES))
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=72)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--json", type=Path, help="also write the rows to this file")
    args = p.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    flash = flash_varlen() if device.type == "cuda" else None
    where = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (TRITON_INTERPRET)"
    print(
        f"device: {where}; flash-attn varlen: {'yes' if flash else 'not importable'}; "
        f"heads {args.heads}, head_dim {args.head_dim}"
    )
    generator = torch.Generator().manual_seed(0)
    rows = []
    for batch in args.batches:
        lengths = segment_lengths(batch, generator)
        for dtype_name in args.dtype:
            rows.append(measure(batch, lengths, dtype_name, args, device, flash, generator))
    _print_table(rows)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    missed = [
        r
        for r in rows
        if r["sdpa_loop_over_kernel"] <= SDPA_LOOP_AIM
        or (r["kernel_vs_flash"] is not None and r["kernel_vs_flash"] < FLASH_AIM)
    ]
    print(
        f"aims (faster than the SDPA loop, >= {FLASH_AIM}x flash-attn's speed): "
        + ("met in every row" if not missed else f"missed in {len(missed)} of {len(rows)} rows")
    )
    wrong = [r for r in rows if r["relative_error"]["kernel"] > TOLERANCE[r["dtype"]]]
    for r in wrong:
        print(
            f"FAIL: kernel error {r['relative_error']['kernel']:.2e} on {r['batch']} {r['dtype']} exceeds "
            f"{TOLERANCE[r['dtype']]:.1e}"
        )
    return 1 if wrong else 0


def _print_table(rows: list[dict]) -> None:
    header = (
        f"{'batch':>10} {'N':>6} {'S':>3} {'dtype':>5} | {'kernel ms':>9} {'sdpa ms':>8} {'flash ms':>8} | "
        f"{'sdpa/kernel':>11} {'flash/kernel':>12} | {'rel err kernel':>14} {'sdpa':>9} {'flash':>9}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        ms, err = r["median_ms"], r["relative_error"]
        flash_ms = f"{ms['flash_varlen']:8.3f}" if "flash_varlen" in ms else f"{'-':>8}"
        flash_err = f"{err['flash_varlen']:9.2e}" if "flash_varlen" in err else f"{'-':>9}"
        ratio = f"{r['kernel_vs_flash']:12.2f}" if r["kernel_vs_flash"] is not None else f"{'-':>12}"
        print(
            f"{r['batch']:>10} {r['patches']:>6} {r['segments']:>3} {r['dtype']:>5} | {ms['kernel']:9.3f} "
            f"{ms['sdpa_loop']:8.3f} {flash_ms} | {r['sdpa_loop_over_kernel']:11.2f} {ratio} | "
            f"{err['kernel']:14.2e} {err['sdpa_loop']:9.2e} {flash_err}"
        )


if __name__ == "__main__":
    sys.exit(main())
