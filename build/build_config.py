"""The serving limits an engine build fixes, declared once for every stage that depends on them.

The LLM engine's shapes (trtllm-build flags), the prompt-table size the vision encoder may fill,
the host's mrope table length and the preprocessing limits all derive from one BuildConfig.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .errors import Qwen3VLTrtError
from .preprocess.preprocessor import RequestLimits


@dataclass(frozen=True)
class BuildConfig:
    """Limits of one deployment.

    max_batch_size: requests in flight at once. max_input_len: prompt tokens of a request, visual
    tokens included. max_seq_len: prompt plus generated tokens; it is also the engine's rope table
    length (max_position_embeddings), so the per-request mrope input stays max_seq_len x head_dim.
    max_num_tokens: tokens one engine step processes (context chunks plus generation tokens).
    max_visual_tokens: visual (merged) tokens of one request; the prompt table holds (K+1) rows for
    each, for every request of a batch. tokens_per_block: paged KV cache block size.
    """

    max_batch_size: int = 8
    max_input_len: int = 8192
    max_seq_len: int = 16384
    max_num_tokens: int = 16384
    max_visual_tokens: int = 8192
    tokens_per_block: int = 32

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if value < 1:
                raise Qwen3VLTrtError(f"{name} must be positive, got {value}")
        if self.max_seq_len <= self.max_input_len:
            raise Qwen3VLTrtError(
                f"max_seq_len ({self.max_seq_len}) must exceed max_input_len ({self.max_input_len}) "
                "to leave room for generated tokens"
            )
        if self.max_visual_tokens > self.max_input_len:
            raise Qwen3VLTrtError(
                f"max_visual_tokens ({self.max_visual_tokens}) cannot exceed max_input_len ({self.max_input_len})"
            )

    def request_limits(self, **image_limits: int) -> RequestLimits:
        """The preprocessing limits that keep requests inside the engine (prompt and visual tokens);
        image limits (max_images, pixel caps) as given or RequestLimits' defaults."""
        return RequestLimits(
            max_prompt_tokens=self.max_input_len, max_visual_tokens=self.max_visual_tokens, **image_limits
        )

    def prompt_table_rows(self, deepstack_count: int) -> int:
        """max_prompt_embedding_table_size: (K+1) rows per visual token, for a full batch. TensorRT-LLM's
        runtime gives each batch slot an equal share (size / max_batch_size) of it."""
        return (deepstack_count + 1) * self.max_visual_tokens * self.max_batch_size
