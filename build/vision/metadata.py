"""Grid-dependent vision encoder inputs, computed on the host from grid_thw (numpy only).

Everything here depends on the image grids, not on pixels: the bilinear taps that resample the
learned position grid to each image, the 2-D rotary positions and the attention segments. The
stock transformers forward computes them with data-dependent Python inside the graph, which does
not export; here they are plain per-patch arrays, so the arrays of several requests concatenate
into one valid batch (the Triton vision encoder batches requests that way).

Patch order is the processor's: for each image, temporal patches, then spatial_merge_size x
spatial_merge_size blocks in row-major order, then row-major patches inside a block.

Attention segments travel as segment_start flags, which concatenate; the plugin graph variant's
cu_seqlens (offsets, which do not) and its max-seqlen carrier are derived from the flags of the
whole batch, once its requests are concatenated (attention_segments, graph_feeds).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from ..common.contracts import (
    CU_SEQLENS,
    MAX_SEQLEN_CARRIER,
    PLUGIN,
    PORTABLE,
    POS_EMBED_IDX,
    POS_EMBED_W,
    ROTARY_POS,
    SEGMENT_START,
    VISION_GRAPH_INPUTS,
)
from ..errors import InputError


def check_grid_thw(grid_thw: np.ndarray, merge_size: int) -> np.ndarray:
    grid = np.asarray(grid_thw)
    if grid.ndim != 2 or grid.shape[1] != 3 or grid.shape[0] == 0:
        raise InputError(f"grid_thw must have shape [num_images, 3], got {list(grid.shape)}")
    if not np.issubdtype(grid.dtype, np.integer):
        raise InputError(f"grid_thw must be integers, got {grid.dtype}")
    grid = grid.astype(np.int64)
    if (grid <= 0).any():
        raise InputError(f"grid_thw entries must be positive, got {grid.tolist()}")
    if (grid[:, 1:] % merge_size).any():
        raise InputError(
            f"grid_thw heights and widths must be multiples of spatial_merge_size={merge_size}, got {grid.tolist()}"
        )
    return grid


def num_patches(grid_thw: np.ndarray) -> int:
    return int(np.prod(np.asarray(grid_thw), axis=1).sum())


def _block_order_rows_cols(h: int, w: int, m: int) -> tuple[np.ndarray, np.ndarray]:
    """(row, col) of each patch of an h x w grid in merge-block order."""
    bh, bw, ir, ic = np.meshgrid(np.arange(h // m), np.arange(w // m), np.arange(m), np.arange(m), indexing="ij")
    return (bh * m + ir).reshape(-1), (bw * m + ic).reshape(-1)


def _bilinear_taps(coord: np.ndarray, size: int, side: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """align_corners=True resampling of `side` grid points onto `size` output points."""
    scale = (side - 1) / (size - 1) if size > 1 else 0.0
    src = coord.astype(np.float64) * scale
    lo = np.floor(src).astype(np.int64)
    hi = np.minimum(lo + 1, side - 1)
    return lo, hi, src - lo


def vision_metadata(grid_thw: np.ndarray, merge_size: int, num_grid_per_side: int) -> dict[str, np.ndarray]:
    """Per-patch host inputs of the vision encoder, keyed by their contract names."""
    grid = check_grid_thw(grid_thw, merge_size)
    side = num_grid_per_side
    idx, wts, pos, starts = [], [], [], []
    for t, h, w in grid.tolist():
        rows, cols = _block_order_rows_cols(h, w, merge_size)
        r0, r1, dr = _bilinear_taps(rows, h, side)
        c0, c1, dc = _bilinear_taps(cols, w, side)
        frame_idx = np.stack([r0 * side + c0, r0 * side + c1, r1 * side + c0, r1 * side + c1], axis=1)
        frame_w = np.stack([(1 - dr) * (1 - dc), (1 - dr) * dc, dr * (1 - dc), dr * dc], axis=1)
        frame_start = np.zeros(h * w, dtype=np.int32)
        frame_start[0] = 1
        idx.append(np.tile(frame_idx, (t, 1)))
        wts.append(np.tile(frame_w, (t, 1)))
        pos.append(np.tile(np.stack([rows, cols], axis=1), (t, 1)))
        starts.append(np.tile(frame_start, t))
    return {
        POS_EMBED_IDX.name: np.concatenate(idx).astype(np.int32),
        POS_EMBED_W.name: np.concatenate(wts).astype(np.float32),
        ROTARY_POS.name: np.concatenate(pos).astype(np.int32),
        SEGMENT_START.name: np.concatenate(starts),
    }


def attention_segments(segment_start: np.ndarray) -> dict[str, np.ndarray]:
    """cu_seqlens (int32 [S+1]) and the max-seqlen carrier (int32 zeros [L], L = the longest segment)
    of a batch's segment_start flags, those of several requests concatenated included."""
    flags = np.asarray(segment_start)
    if flags.ndim != 1 or flags.size == 0 or flags[0] != 1 or not np.isin(flags, (0, 1)).all():
        raise InputError(
            f"{SEGMENT_START.name} must be a non-empty [N] array of 0/1 flags starting with 1, "
            f"got shape {list(flags.shape)}" + (f" starting with {flags.flat[0]}" if flags.size else "")
        )
    cu_seqlens = np.append(np.flatnonzero(flags), flags.size).astype(np.int32)
    longest = int(np.diff(cu_seqlens).max())
    return {CU_SEQLENS.name: cu_seqlens, MAX_SEQLEN_CARRIER.name: np.zeros(longest, dtype=np.int32)}


def graph_feeds(per_patch: Mapping[str, np.ndarray], variant: str) -> dict[str, np.ndarray]:
    """A graph variant's input feed from the per-patch inputs (contracts.VISION_INPUTS) of a batch."""
    if variant == PORTABLE:
        return dict(per_patch)
    if variant != PLUGIN:
        raise InputError(f"unknown vision graph variant {variant!r}; expected one of {', '.join(VISION_GRAPH_INPUTS)}")
    feeds = {name: array for name, array in per_patch.items() if name != SEGMENT_START.name}
    feeds.update(attention_segments(per_patch[SEGMENT_START.name]))
    return feeds
