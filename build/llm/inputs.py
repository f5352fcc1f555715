"""The LLM engine's per-request inputs beyond text ids: visual fake ids, the DeepStack-interleaved
prompt-embedding table, 3-D rope positions and the mrope cos/sin table.

The engine follows TensorRT-LLM 1.2.1's legacy multimodal contract (the one its qwen2_vl path uses);
the layouts below are the ones its code reads:

- Fake ids and the prompt table: `tensorrt_llm/layers/embedding.py` (PromptTuningEmbedding: an id >=
  vocab_size looks up row `id - vocab_size` of the request's table). Our table interleaves, per
  visual token, the main embedding and the K DeepStack features, so the k-th visual token's id is
  `vocab_size + (K+1)*k`; the Qwen3-VL engine model adds row `id - vocab_size + j + 1` after
  decoder layer j.
- `mrope_rotary_cos_sin`: `tensorrt_llm/runtime/multimodal_model_runner.py`
  (setup_fake_prompts_qwen2vl) builds it from `RopeEmbeddingUtils.create_sinusoidal_positions_for_
  attention_plugin` (`tensorrt_llm/functional.py`): float32, per request max_position_embeddings x
  rotary_dim values, as (cos, sin) pairs: [p * rotary_dim + 2*i] = cos, [+1] = sin for sequence
  position p and rotary pair i, with the 3-D position of the pair's axis already chosen. The context
  attention kernel (`cpp/tensorrt_llm/kernels/unfusedAttentionKernels/unfusedAttentionKernels_2_
  template.h`, applyBiasRopeUpdateKVCacheV2) reads it as float2 at `p * rotary_dim/2 + i` and
  rotates GPT-NeoX style (pair i rotates dims i and i + rotary_dim/2), as transformers does.
  Positions past the prompt are padded with position 0 (cos 1, sin 0), as the runner does.
- `mrope_position_deltas`: int32 [1] per request, max(position) + 1 - prompt length; generation
  steps use position `step + delta` on every axis (decoderMaskedMultiheadAttentionTemplate.h).

The frequencies are computed as transformers does, in float32 torch (Qwen3VLTextRotaryEmbedding;
rope_inv_freq). The angles, float32 products taken in numpy (mrope_cos_sin), equal its own; their
cos/sin, numpy's too, agree with torch's to float32 rounding (within 1e-7), not bit for bit.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np
import torch

from ..errors import InputError

# Axis of each rope pair: 0 temporal, 1 height, 2 width.
T_AXIS, H_AXIS, W_AXIS = 0, 1, 2


def rope_index(
    input_ids: np.ndarray, image_grid_thw: np.ndarray, visual_token_ids: int | Sequence[int], merge_size: int
) -> tuple[np.ndarray, int]:
    """3-D positions [3, L] and the position delta of one unpadded request, as transformers'
    Qwen3-VL get_rope_index computes them: text advances all axes together; an image's tokens take
    (t, row, col) offsets from the position after the preceding text, and the text after it resumes
    at that start + max(rows, cols). image_grid_thw: one grid per run of visual tokens, in order; a video
    comes as one [1, h, w] grid per temporal patch (get_rope_index splits video grids so: each patch has its
    own timestamp text and placeholder run).

    Vectorized over tokens: every token starts from the sum of what the tokens before it advance
    (a text token 1, an image max(rows, cols) at its last token, 0 at the others)."""
    ids = np.asarray(input_ids).reshape(-1)
    grids = np.asarray(image_grid_thw, dtype=np.int64).reshape(-1, 3)
    is_image = np.isin(ids, visual_token_ids)
    t, rows, cols = grids[:, 0], grids[:, 1] // merge_size, grids[:, 2] // merge_size
    counts = t * rows * cols
    if int(is_image.sum()) != int(counts.sum()):
        raise InputError(f"{int(is_image.sum())} image tokens in input_ids but the grids make {int(counts.sum())}")
    image_positions = np.flatnonzero(is_image)
    advance = (~is_image).astype(np.int64)
    ends = np.cumsum(counts)
    advance[image_positions[ends - 1]] = np.maximum(rows, cols)
    start = np.cumsum(advance) - advance
    positions = np.broadcast_to(start, (3, ids.size)).copy()
    # Each image token's (t, row, col) within its image, from its rank among the image's tokens.
    image = np.repeat(np.arange(len(grids)), counts)
    rank = np.arange(image_positions.size) - (ends - counts)[image]
    plane = (rows * cols)[image]
    positions[:, image_positions] += np.stack([rank // plane, rank % plane // cols[image], rank % cols[image]])
    delta = int(positions.max()) + 1 - ids.size if ids.size else 0
    return positions, delta


def rope_pair_axes(rotary_dim: int, mrope_section: Sequence[int]) -> np.ndarray:
    """Which position axis each of the rotary_dim/2 pairs rotates with, interleaved as Qwen3-VL does
    (the checkpoint reader refuses any other layout): pair i is H if i % 3 == 1 and i < 3*section[1],
    W if i % 3 == 2 and i < 3*section[2], else T."""
    half = rotary_dim // 2
    if sum(mrope_section) != half:
        raise InputError(f"mrope_section {list(mrope_section)} must sum to rotary_dim/2 = {half}")
    axes = np.full(half, T_AXIS, dtype=np.int64)
    pair = np.arange(half)
    axes[(pair % 3 == 1) & (pair < 3 * mrope_section[H_AXIS])] = H_AXIS
    axes[(pair % 3 == 2) & (pair < 3 * mrope_section[W_AXIS])] = W_AXIS
    return axes


def rope_inv_freq(rotary_dim: int, theta: float) -> torch.Tensor:
    """transformers' default rope frequencies, in float32 as it computes them."""
    return 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))


def mrope_cos_sin(positions: np.ndarray, inv_freq: torch.Tensor, pair_axes: np.ndarray) -> np.ndarray:
    """[L, rotary_dim/2, 2] float32 (cos, sin) of each prompt position and rotary pair. In numpy: a prompt's table
    is small, and torch's per-op cost made it half of a text request's time in the preprocessing stub (milliseconds
    between requests against 25 us in a loop)."""
    chosen = np.asarray(positions, np.float32)[pair_axes].T  # [L, half]: the axis position each pair rotates with
    angles = chosen * inv_freq.numpy()
    table = np.empty((*angles.shape, 2), np.float32)
    np.cos(angles, out=table[..., 0])
    np.sin(angles, out=table[..., 1])
    return table


def engine_mrope_rotary_cos_sin(cos_sin: np.ndarray, max_position_embeddings: int) -> np.ndarray:
    """The engine input for one request: [max_position_embeddings * rotary_dim] float32, (cos, sin)
    pairs per position and rotary pair, prompt positions first, the rest position 0 (cos 1, sin 0)."""
    length, half, _ = cos_sin.shape
    if length > max_position_embeddings:
        raise InputError(f"prompt of {length} tokens is longer than the engine's {max_position_embeddings} positions")
    table = np.zeros((max_position_embeddings, half, 2), dtype=np.float32)
    table[:, :, 0] = 1.0
    table[:length] = cos_sin
    return table.reshape(-1)


def fake_prompt_ids(
    input_ids: np.ndarray, visual_token_ids: int | Sequence[int], vocab_size: int, deepstack_count: int
) -> np.ndarray:
    """int32 engine ids: the k-th visual token (image or video) of the request becomes vocab_size + (K+1)*k."""
    ids = np.asarray(input_ids, dtype=np.int64).reshape(-1)
    engine_ids = ids.copy()
    visual = np.isin(ids, visual_token_ids)
    engine_ids[visual] = vocab_size + (deepstack_count + 1) * np.arange(int(visual.sum()))
    return engine_ids.astype(np.int32)


def interleave_prompt_table(image_embeds: torch.Tensor, deepstack_embeds: torch.Tensor) -> torch.Tensor:
    """image_embeds [M, D] + deepstack_embeds [K, M, D] -> prompt_embedding_table [(K+1)*M, D]: per
    visual token, its main embedding then its K DeepStack features."""
    if image_embeds.ndim != 2 or deepstack_embeds.ndim != 3 or deepstack_embeds.shape[1:] != image_embeds.shape:
        raise InputError(
            f"expected image_embeds [M, D] and deepstack_embeds [K, M, D], got {list(image_embeds.shape)} "
            f"and {list(deepstack_embeds.shape)}"
        )
    rows = torch.cat([image_embeds.unsqueeze(1), deepstack_embeds.transpose(0, 1)], dim=1)
    return rows.reshape(-1, image_embeds.shape[1])


def prompt_table_row(token_ids, vocab_size: int, layer: int | None = None):
    """Row of a request's prompt table for visual fake ids: the main embedding (layer None), or the
    DeepStack feature added after decoder layer `layer`.

    The one definition of the DeepStack index arithmetic: the reference runtime calls it on torch
    tensors and the TensorRT-LLM engine model on its graph tensors (only `-` and `+` of ints)."""
    feature = 0 if layer is None else layer + 1
    return token_ids - vocab_size + feature


def visual_digest(grid_thw: np.ndarray, *content: bytes | memoryview) -> bytes:
    """16 bytes that name the embeddings an image or video yields within one deployment: a hash of its grid and
    its content (encoded bytes; a caller-decoded video's frames and times). A deployment's preprocessing settings
    (sampling included) are fixed, so these fix its pixels. The visual-feature cache keys images and videos by it,
    and KV-cache block reuse by image_content_id, its first 8 bytes."""
    digest = hashlib.blake2b(np.asarray(grid_thw, dtype=np.int64).tobytes(), digest_size=16)
    for part in content:
        digest.update(part)
    return digest.digest()


def image_content_id(digest: bytes) -> int:
    """The 64-bit id of the embeddings an image or video yields, from its visual_digest. Never 0 (text)."""
    return int.from_bytes(digest[:8], "little") | 1


def prompt_table_extra_ids(
    input_ids: np.ndarray,
    visual_token_ids: int | Sequence[int],
    image_digests: Sequence[bytes],
    image_grid_thw: np.ndarray,
    merge_size: int,
) -> np.ndarray:
    """TensorRT-LLM's `prompt_table_extra_ids` for one request: uint64, one per prompt token, 0 for
    text and the content id of the image or video for each of its visual tokens (digests and grids of the
    request's images and videos in prompt order).

    The tensorrtllm backend hands them to the executor as PromptTuningConfig's inputTokenExtraIds
    (triton_backend inflight_batcher_llm/src/utils.cc, getPromptTuningConfigFromTensors; ignored
    unless there is one per input token), and KV-cache block reuse keys each token on (id, extra
    id): the fake ids alone are the same for any two images of the same size at the same place."""
    ids = np.asarray(input_ids).reshape(-1)
    grids = np.asarray(image_grid_thw, dtype=np.int64).reshape(-1, 3)
    visual = np.isin(ids, visual_token_ids)
    tokens_per_image = grids.prod(axis=1) // (merge_size * merge_size)
    if len(image_digests) != len(grids) or int(visual.sum()) != int(tokens_per_image.sum()):
        raise InputError(
            f"{len(image_digests)} images with {len(grids)} grids ({int(tokens_per_image.sum())} tokens) do not "
            f"match the {int(visual.sum())} image tokens in input_ids"
        )
    content_ids = np.array([image_content_id(digest) for digest in image_digests], dtype=np.uint64)
    extra_ids = np.zeros(ids.size, dtype=np.uint64)
    extra_ids[visual] = np.repeat(content_ids, tokens_per_image)
    return extra_ids
