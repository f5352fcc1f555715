"""Varlen non-causal attention over packed segments, written in the Triton language.

q, k, v and the output are [N, heads, head_dim] (contiguous): the patches of every image of a batch one after the
other. `cu_seqlens` (int32 [S + 1]) holds the segment boundaries: tokens attend to the tokens of their own segment
only. Each program computes BLOCK_M queries of one (segment, head) with a flash-style online softmax over key blocks of
BLOCK_N, in fp32, so nothing of size N x N ever exists.

The launch grid is (ceil(max_seqlen / BLOCK_M), S, heads): only shapes, as a TensorRT ahead-of-time plugin requires
(the plugin carries max_seqlen in an input's shape). The kernel's arguments are the plugin's inputs then its output
(q, k, v, cu_seqlens, max_seqlen_carrier, out); the carrier's data is never read.

A head_dim that is not a power of two (72 on the larger Qwen3-VL towers) is split inside the kernel into a power-of-two
main part and a tail of 16 columns or more, masked past head_dim: 72 computes on 64 + 16 columns instead of 128, and
the tensors keep their exact layout in memory.
"""

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

# The triton type names of the supported input dtypes (the AOT signature uses them too).
TRITON_DTYPES: dict[torch.dtype, str] = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
# tl.dot needs a reduction width of at least 16.
_MIN_DOT_WIDTH = 16


@dataclass(frozen=True)
class TileConfig:
    """Tile sizes and launch shape of one compiled kernel."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


# Shipped configurations per (head_dim, dtype): each fits 48 KB of shared memory (the most a launch gets without
# opting in) and compiles without register spills on sm_80, sm_86, sm_89 and sm_90 (scripts/aot_report.py). Where the
# classic 128 x 64 tile in two stages is over 48 KB on sm_90 (head_dim 72 and 80: Q is staged in shared memory for
# wgmma), the key block halves. fp16 and bf16 share their tiles; fp32 is the numerics path (exact fp32 dots, no tensor
# cores), small enough not to spill. The spill check holds for the GPU image's Triton 3.5.1 and the development
# version alike (scripts/test.sh runs the report under both): 3.5.1 spills fp32 head_dim 80 at 32 x 32 on sm_90, so
# that one takes 16-query blocks.
_HALF_CONFIGS = {
    64: TileConfig(block_m=128, block_n=64, num_warps=8, num_stages=2),
    72: TileConfig(block_m=128, block_n=32, num_warps=8, num_stages=2),
    80: TileConfig(block_m=128, block_n=32, num_warps=8, num_stages=2),
    128: TileConfig(block_m=64, block_n=32, num_warps=4, num_stages=2),
}
_FP32_CONFIGS = {
    64: TileConfig(block_m=32, block_n=32, num_warps=4, num_stages=2),
    72: TileConfig(block_m=32, block_n=32, num_warps=4, num_stages=2),
    80: TileConfig(block_m=16, block_n=32, num_warps=4, num_stages=2),
    128: TileConfig(block_m=32, block_n=16, num_warps=4, num_stages=2),
}
SHIPPED_CONFIGS: dict[tuple[int, str], TileConfig] = {
    **{(head_dim, dtype): config for head_dim, config in _HALF_CONFIGS.items() for dtype in ("fp16", "bf16")},
    **{(head_dim, "fp32"): config for head_dim, config in _FP32_CONFIGS.items()},
}


def shipped_config(head_dim: int, dtype: str) -> TileConfig:
    """The tile configuration shipped for a head_dim and a triton dtype name ("fp16", "bf16", "fp32")."""
    try:
        return SHIPPED_CONFIGS[(head_dim, dtype)]
    except KeyError:
        raise ValueError(
            f"varlen attention supports head_dim {sorted(_HALF_CONFIGS)} and dtypes fp16/bf16/fp32, "
            f"got head_dim {head_dim}, {dtype}"
        ) from None


def kernel_constexprs(
    heads: int, head_dim: int, config: TileConfig, upcast_dots: bool = False
) -> dict[str, int | float | str | bool]:
    """The compile-time arguments of the kernel: shapes, tiles, the head_dim split and the softmax scale.

    upcast_dots: fp32 dot operands, for bf16 in Triton's CPU interpreter only (compiled kernels never need it).
    """
    main_width = 1 << (head_dim.bit_length() - 1)
    tail = head_dim - main_width
    tail_width = max(_MIN_DOT_WIDTH, triton.next_power_of_2(tail)) if tail else 0
    return {
        "HEADS": heads,
        "HEAD_DIM": head_dim,
        "D_MAIN": main_width,
        "D_TAIL": tail_width,
        "BLOCK_M": config.block_m,
        "BLOCK_N": config.block_n,
        # exp2 replaces exp: the scores are scaled by log2(e) / sqrt(head_dim) once.
        "QK_SCALE": math.log2(math.e) / math.sqrt(head_dim),
        # fp32 inputs get exact fp32 dots (the default would be tf32); fp16/bf16 dots ignore this.
        "DOT_PRECISION": "ieee",
        "UPCAST_DOTS": upcast_dots,
    }


@triton.jit
def _load_rows(
    base_ptr, rows, row_mask, col_start, WIDTH: tl.constexpr, HEAD_DIM: tl.constexpr, ROW_STRIDE: tl.constexpr
):
    """Loads rows x [col_start, col_start + WIDTH) of one head, zero past the segment and past head_dim."""
    cols = col_start + tl.arange(0, WIDTH)
    mask = row_mask[:, None] & (cols < HEAD_DIM)[None, :]
    return tl.load(base_ptr + rows[:, None] * ROW_STRIDE + cols[None, :], mask=mask, other=0.0)


@triton.jit
def _store_rows(
    base_ptr, values, rows, row_mask, col_start, WIDTH: tl.constexpr, HEAD_DIM: tl.constexpr, ROW_STRIDE: tl.constexpr
):
    cols = col_start + tl.arange(0, WIDTH)
    mask = row_mask[:, None] & (cols < HEAD_DIM)[None, :]
    tl.store(base_ptr + rows[:, None] * ROW_STRIDE + cols[None, :], values, mask=mask)


@triton.jit
def _dot(a, b, acc, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    # Triton's CPU interpreter multiplies the bit patterns of bf16 operands (triton-lang/triton#11584); the GPU's bf16
    # dot has exact products and fp32 sums, which fp32 operands reproduce.
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def varlen_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    cu_seqlens_ptr,
    max_seqlen_carrier_ptr,  # the TensorRT plugin's shape carrier: part of the launch ABI, never read
    out_ptr,
    HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_MAIN: tl.constexpr,
    D_TAIL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    QK_SCALE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOTS: tl.constexpr,
):
    ROW_STRIDE: tl.constexpr = HEADS * HEAD_DIM
    block = tl.program_id(0)
    segment = tl.program_id(1)
    head = tl.program_id(2)
    seq_start = tl.load(cu_seqlens_ptr + segment)
    seq_len = tl.load(cu_seqlens_ptr + segment + 1) - seq_start
    # The grid covers the longest segment; the other segments' programs past their end have nothing to do.
    if block * BLOCK_M >= seq_len:
        return

    # 64-bit offsets: N x heads x head_dim passes 2^31 elements at a few hundred thousand patches.
    head_offset = seq_start.to(tl.int64) * ROW_STRIDE + head * HEAD_DIM
    q_base = q_ptr + head_offset
    k_base = k_ptr + head_offset
    v_base = v_ptr + head_offset
    q_rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    q_mask = q_rows < seq_len
    q_main = _load_rows(q_base, q_rows, q_mask, 0, D_MAIN, HEAD_DIM, ROW_STRIDE)
    if D_TAIL > 0:
        q_tail = _load_rows(q_base, q_rows, q_mask, D_MAIN, D_TAIL, HEAD_DIM, ROW_STRIDE)

    row_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc_main = tl.zeros([BLOCK_M, D_MAIN], dtype=tl.float32)
    if D_TAIL > 0:
        acc_tail = tl.zeros([BLOCK_M, D_TAIL], dtype=tl.float32)

    for key_start in range(0, seq_len, BLOCK_N):
        k_rows = key_start + tl.arange(0, BLOCK_N)
        k_mask = k_rows < seq_len
        k_main = _load_rows(k_base, k_rows, k_mask, 0, D_MAIN, HEAD_DIM, ROW_STRIDE)
        scores = _dot(
            q_main, tl.trans(k_main), tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), DOT_PRECISION, UPCAST_DOTS
        )
        if D_TAIL > 0:
            k_tail = _load_rows(k_base, k_rows, k_mask, D_MAIN, D_TAIL, HEAD_DIM, ROW_STRIDE)
            scores = _dot(q_tail, tl.trans(k_tail), scores, DOT_PRECISION, UPCAST_DOTS)
        scores = tl.where(k_mask[None, :], scores * QK_SCALE, float("-inf"))

        # Every key block holds at least one key of the segment, so the new maximum is finite.
        new_max = tl.maximum(row_max, tl.max(scores, 1))
        probs = tl.math.exp2(scores - new_max[:, None])
        rescale = tl.math.exp2(row_max - new_max)
        row_sum = row_sum * rescale + tl.sum(probs, 1)
        row_max = new_max

        v_main = _load_rows(v_base, k_rows, k_mask, 0, D_MAIN, HEAD_DIM, ROW_STRIDE)
        # P goes to the dot in the input dtype (fp16/bf16 tensor cores), accumulated in fp32.
        probs_in = probs.to(v_main.dtype)
        acc_main = _dot(probs_in, v_main, acc_main * rescale[:, None], DOT_PRECISION, UPCAST_DOTS)
        if D_TAIL > 0:
            v_tail = _load_rows(v_base, k_rows, k_mask, D_MAIN, D_TAIL, HEAD_DIM, ROW_STRIDE)
            acc_tail = _dot(probs_in, v_tail, acc_tail * rescale[:, None], DOT_PRECISION, UPCAST_DOTS)

    out_base = out_ptr + head_offset
    inv_sum = 1.0 / row_sum
    out_main = (acc_main * inv_sum[:, None]).to(out_ptr.dtype.element_ty)
    _store_rows(out_base, out_main, q_rows, q_mask, 0, D_MAIN, HEAD_DIM, ROW_STRIDE)
    if D_TAIL > 0:
        out_tail = (acc_tail * inv_sum[:, None]).to(out_ptr.dtype.element_ty)
        _store_rows(out_base, out_tail, q_rows, q_mask, D_MAIN, D_TAIL, HEAD_DIM, ROW_STRIDE)


def launch_grid(max_seqlen: int, num_segments: int, heads: int, config: TileConfig) -> tuple[int, int, int]:
    """(query blocks of the longest segment, segments, heads): the grid the TensorRT plugin builds from shapes."""
    return (triton.cdiv(max_seqlen, config.block_m), num_segments, heads)


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    config: TileConfig | None = None,
) -> torch.Tensor:
    """Runs the kernel on the tensors' CUDA device, or on CPU in Triton's interpreter (TRITON_INTERPRET=1 set before
    triton is first imported).

    q, k, v: [N, heads, head_dim], one dtype of fp16/bf16/fp32; cu_seqlens: int32 [S + 1] from 0 to N;
    max_seqlen: at least the longest segment (rows of a longer one are left unwritten; passing it spares reading
    cu_seqlens back from the device). config defaults to the shipped one for head_dim and dtype.
    """
    if q.dim() != 3 or q.shape != k.shape or q.shape != v.shape:
        raise ValueError(f"q, k, v must share one [N, heads, head_dim] shape, got {q.shape}, {k.shape}, {v.shape}")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in TRITON_DTYPES:
        raise ValueError(f"q, k, v must share one dtype of {list(TRITON_DTYPES)}, got {q.dtype}, {k.dtype}, {v.dtype}")
    if cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be int32 [S + 1], got {cu_seqlens.dtype} {tuple(cu_seqlens.shape)}")
    _, heads, head_dim = q.shape
    config = config or shipped_config(head_dim, TRITON_DTYPES[q.dtype])
    q, k, v, cu_seqlens = (t.contiguous() for t in (q, k, v, cu_seqlens))
    out = torch.empty_like(q)
    grid = launch_grid(max_seqlen, cu_seqlens.numel() - 1, heads, config)
    interpreted = not isinstance(varlen_attention_kernel, JITFunction)
    # cu_seqlens stands in for the shape carrier: the kernel never reads that argument.
    varlen_attention_kernel[grid](
        q,
        k,
        v,
        cu_seqlens,
        cu_seqlens,
        out,
        **kernel_constexprs(heads, head_dim, config, upcast_dots=interpreted and q.dtype == torch.bfloat16),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out
