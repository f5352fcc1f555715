"""Tensor contracts shared by exporters, config writers, runtimes and tests.

Every tensor that crosses a stage boundary is declared here once. Symbolic dimensions are
strings: N is the number of patches of all images in a batch, M = N / merge_size**2 the number of
merged (LLM) tokens, K the number of DeepStack features, D the LLM hidden size.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # numpy dtype name, or "model" for the exported compute dtype
    shape: tuple[int | str, ...]
    doc: str

    def as_dict(self) -> dict[str, object]:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape), "doc": self.doc}

    def resolved(self, sizes: Mapping[str, int], model_dtype: str) -> dict[str, object]:
        """as_dict for one export: the named sizes it fixes (patch_dim, D, K) and its compute dtype filled in."""
        shape = [sizes.get(d, d) if isinstance(d, str) else d for d in self.shape]
        return {**self.as_dict(), "dtype": model_dtype if self.dtype == "model" else self.dtype, "shape": shape}


def contract_sha256(tensors: Iterable[Mapping[str, object]]) -> str:
    """Identity of a resolved tensor contract: the names, dtypes and shapes in order, not the docs."""
    key = [[t["name"], t["dtype"], t["shape"]] for t in tensors]
    return hashlib.sha256(json.dumps(key, separators=(",", ":")).encode()).hexdigest()


# Values per patch of Conv3d's input: channels x temporal patch x patch x patch (3 x 2 x 16 x 16).
PIXEL_VALUES = TensorSpec(
    "pixel_values",
    "float32",
    ("N", "patch_dim"),
    "normalized patches in the HF processor's order (2x2 merge blocks, row-major within a block)",
)
POS_EMBED_IDX = TensorSpec(
    "pos_embed_idx",
    "int32",
    ("N", 4),
    "flat indices into the learned position grid of the 4 bilinear taps of each patch",
)
POS_EMBED_W = TensorSpec("pos_embed_w", "float32", ("N", 4), "bilinear weights of the 4 taps (align_corners=True)")
ROTARY_POS = TensorSpec("rotary_pos", "int32", ("N", 2), "(row, col) of each patch in its image; 2-D rotary positions")
SEGMENT_START = TensorSpec(
    "segment_start",
    "int32",
    ("N",),
    "1 on the first patch of each attention segment (one per image and temporal patch), else 0; "
    "concatenating the arrays of several requests stays valid",
)
# The plugin variant's attention segmentation, derived from SEGMENT_START after requests are concatenated
# (offsets do not concatenate; flags do). S is the number of segments, L the longest segment's patches.
CU_SEQLENS = TensorSpec(
    "cu_seqlens",
    "int32",
    ("S+1",),
    "first patch of each attention segment, then N: segment s is rows cu_seqlens[s] .. cu_seqlens[s+1]",
)
MAX_SEQLEN_CARRIER = TensorSpec(
    "max_seqlen_carrier",
    "int32",
    ("L",),
    "only its shape is read: L = the longest segment's patch count (TensorRT plugin launch grids are "
    "expressions of input shapes, never of values)",
)
IMAGE_EMBEDS = TensorSpec("image_embeds", "model", ("M", "D"), "merged visual tokens for the LLM")
DEEPSTACK_EMBEDS = TensorSpec(
    "deepstack_embeds",
    "model",
    ("K", "M", "D"),
    "DeepStack features, one per deepstack_visual_indexes entry, added after LLM layer k",
)

# Per-patch inputs, what preprocessing produces and requests concatenate; the portable graph's inputs.
VISION_INPUTS: tuple[TensorSpec, ...] = (PIXEL_VALUES, POS_EMBED_IDX, POS_EMBED_W, ROTARY_POS, SEGMENT_START)
VISION_OUTPUTS: tuple[TensorSpec, ...] = (IMAGE_EMBEDS, DEEPSTACK_EMBEDS)
# The graph variants' inputs: portable (standard ONNX ops, a block-diagonal N x N mask) and plugin (each
# block's attention is one TensorRT plugin node on cu_seqlens; nothing quadratic in N).
PORTABLE, PLUGIN = "portable", "plugin"
VISION_GRAPH_INPUTS: dict[str, tuple[TensorSpec, ...]] = {
    PORTABLE: VISION_INPUTS,
    PLUGIN: (PIXEL_VALUES, POS_EMBED_IDX, POS_EMBED_W, ROTARY_POS, CU_SEQLENS, MAX_SEQLEN_CARRIER),
}


def vision_graph_contract(
    variant: str, model_dtype: str, patch_dim: int, out_hidden_size: int, deepstack_count: int
) -> dict[str, list[dict[str, object]]]:
    """A graph variant's inputs and outputs for one export, resolved (as its sidecar records them)."""
    sizes = {"patch_dim": patch_dim, "D": out_hidden_size, "K": deepstack_count}
    return {
        "inputs": [spec.resolved(sizes, model_dtype) for spec in VISION_GRAPH_INPUTS[variant]],
        "outputs": [spec.resolved(sizes, model_dtype) for spec in VISION_OUTPUTS],
    }


VISION_ONNX_FILE = "vision_encoder.onnx"
VISION_ONNX_DATA_FILE = "vision_encoder.onnx.data"
VISION_SIDECAR_FILE = "vision_config.json"
VISION_ENGINE_FILE = "vision_encoder.plan"
VISION_ENGINE_SIDECAR_FILE = "vision_engine.json"
VISION_TIMING_CACHE_FILE = "timing.cache"

# Visual weights live under this prefix in released Qwen3-VL checkpoints (both dense and MoE).
VISUAL_PREFIX = "model.visual."

# LLM engine inputs per request (TensorRT-LLM 1.2.1's legacy multimodal contract; see llm/inputs.py).
#
# The fake-id interleave (vocab_size + (K+1)*k) addresses rows of the request's own table, and two
# TensorRT-LLM runtime features would break it:
# - prompt-table offloading (ExecutorConfig prompt_table_offloading, off by default) rewrites fake
#   ids to consecutive rows, one row per visual token, so the DeepStack rows in between would be read
#   as other tokens' embeddings: engines and serving configurations keep it off;
# - KV-cache block reuse (the tensorrtllm backend's enable_kv_cache_reuse, on by default) keys blocks
#   by token ids, and two different images with the same token layout get the same fake ids: every
#   visual token therefore carries its image's content id in prompt_table_extra_ids (TensorRT-LLM's
#   PromptTuningConfig inputTokenExtraIds), which the block key includes, so only the same image at
#   the same place shares blocks. With reuse on, the executor refuses prompt-table requests without
#   them (batch_manager/llmRequest.cpp, validate).
LLM_INPUT_IDS = TensorSpec(
    "input_ids", "int32", ("L",), "prompt ids; the k-th visual token is the fake id vocab_size + (K+1)*k"
)
PROMPT_EMBEDDING_TABLE = TensorSpec(
    "prompt_embedding_table",
    "model",
    ("(K+1)*M", "D"),
    "per visual token: its main embedding, then its K DeepStack features",
)
MROPE_ROTARY_COS_SIN = TensorSpec(
    "mrope_rotary_cos_sin",
    "float32",
    ("max_position_embeddings*rotary_dim",),
    "(cos, sin) per sequence position and rotary pair, at the pair's 3-D rope axis; past the prompt, position 0",
)
# The engine's type; the tensorrtllm backend declares it INT64 and narrows it (serving.interface.BACKEND_DATA_TYPES).
MROPE_POSITION_DELTAS = TensorSpec(
    "mrope_position_deltas", "int32", (1,), "max 3-D position + 1 - prompt length; generation uses step + delta"
)
PROMPT_TABLE_EXTRA_IDS = TensorSpec(
    "prompt_table_extra_ids",
    "uint64",
    ("L",),
    "per prompt token: 0 for text, its image's content id (never 0) for visual tokens; KV block reuse keys on it",
)
LLM_INPUTS: tuple[TensorSpec, ...] = (
    LLM_INPUT_IDS,
    PROMPT_EMBEDDING_TABLE,
    MROPE_ROTARY_COS_SIN,
    MROPE_POSITION_DELTAS,
    PROMPT_TABLE_EXTRA_IDS,
)


@dataclass(frozen=True)
class BuildLayout:
    """Where each stage's output lies in a `qwen3vl-trt build` directory (relative names are what the
    manifest records)."""

    root: Path

    VISION = "vision"
    VISION_PLUGIN = "vision_plugin"
    VISION_ENGINE = "vision_engine"
    LLM_CHECKPOINT = "llm_checkpoint"
    LLM_ENGINE = "llm_engine"
    TRITON_REPO = "triton_repo"
    MANIFEST = "manifest.json"

    @property
    def vision(self) -> Path:
        return self.root / self.VISION

    @property
    def vision_plugin(self) -> Path:
        return self.root / self.VISION_PLUGIN

    @property
    def vision_engine(self) -> Path:
        return self.root / self.VISION_ENGINE

    @property
    def llm_checkpoint(self) -> Path:
        return self.root / self.LLM_CHECKPOINT

    @property
    def llm_engine(self) -> Path:
        return self.root / self.LLM_ENGINE

    @property
    def triton_repo(self) -> Path:
        return self.root / self.TRITON_REPO

    @property
    def manifest(self) -> Path:
        return self.root / self.MANIFEST
