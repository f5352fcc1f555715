"""Tensor contracts shared by exporters, config writers, runtimes and tests.

Every tensor that crosses a stage boundary is declared here once. Symbolic dimensions are
strings: N is the number of patches of all images in a batch, M = N / merge_size**2 the number of
merged (LLM) tokens, K the number of DeepStack features, D the LLM hidden size.
"""

from __future__ import annotations

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
IMAGE_EMBEDS = TensorSpec("image_embeds", "model", ("M", "D"), "merged visual tokens for the LLM")
DEEPSTACK_EMBEDS = TensorSpec(
    "deepstack_embeds",
    "model",
    ("K", "M", "D"),
    "DeepStack features, one per deepstack_visual_indexes entry, added after LLM layer k",
)

VISION_INPUTS: tuple[TensorSpec, ...] = (PIXEL_VALUES, POS_EMBED_IDX, POS_EMBED_W, ROTARY_POS, SEGMENT_START)
VISION_OUTPUTS: tuple[TensorSpec, ...] = (IMAGE_EMBEDS, DEEPSTACK_EMBEDS)

VISION_ONNX_FILE = "vision_encoder.onnx"
VISION_ONNX_DATA_FILE = "vision_encoder.onnx.data"
VISION_SIDECAR_FILE = "vision_config.json"

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
    LLM_CHECKPOINT = "llm_checkpoint"
    LLM_ENGINE = "llm_engine"
    TRITON_REPO = "triton_repo"
    MANIFEST = "manifest.json"

    @property
    def vision(self) -> Path:
        return self.root / self.VISION

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
