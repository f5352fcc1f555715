"""The serving limits, declared once for every stage that depends on them.

`EngineLimits` fixes the LLM engine's shapes (trtllm-build flags), the prompt-table size the
vision encoder may fill and the host's mrope table length; `RequestLimits` is what preprocessing
enforces per request. Both take their token defaults from the same constants, and
`EngineLimits.request_limits()` gives the request limits a given engine implies.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from ..errors import LimitsError

# Prompt tokens of one request (visual tokens included), and visual tokens of one request.
MAX_INPUT_LEN = 8192
MAX_VISUAL_TOKENS = 8192
# The most alternatives a generated token can report (OpenAI's top_logprobs cap).
TOP_LOGPROBS_CAP = 20


def _require_positive(limits: object, *, but: tuple[str, ...] = ()) -> None:
    for f in fields(limits):  # type: ignore[arg-type]
        value = getattr(limits, f.name)
        if f.name in but:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise LimitsError(f"{type(limits).__name__}.{f.name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class ImageLimits:
    """Image limits. The pixel cap lowers the processor's longest_edge (16.7 MP on released models),
    which would let one image cost 16k visual tokens; the decode cap bounds memory before decoding;
    the byte cap bounds an encoded image (checked before a data: URL is base64-decoded)."""

    max_image_pixels: int = 2560 * 1024
    max_decode_pixels: int = 64_000_000
    max_images: int = 16
    max_image_bytes: int = 64 * 2**20

    def __post_init__(self) -> None:
        _require_positive(self)


@dataclass(frozen=True)
class VideoLimits:
    """Video limits, all checked from the container's headers and packet index before any frame is decoded.
    max_video_pixels lowers the video processor's whole-video pixel budget (size.longest_edge: 24 MP on released
    models, 12k visual tokens) to 16 MP: 8192 visual tokens, the default request's visual-token limit; frames
    bounds the sampled frames (the processor samples at most max_frames, 768 on released models)."""

    max_videos: int = 4
    max_video_bytes: int = 256 * 2**20
    max_video_seconds: int = 3600
    max_video_frames: int = 768
    max_video_pixels: int = 16 * 2**20
    max_video_frame_pixels: int = 4096 * 2304  # one decoded frame: 4K UHD and smaller

    def __post_init__(self) -> None:
        _require_positive(self)


@dataclass(frozen=True)
class RequestLimits(ImageLimits, VideoLimits):
    """What preprocessing accepts in one request."""

    max_prompt_tokens: int = MAX_INPUT_LEN
    max_visual_tokens: int = MAX_VISUAL_TOKENS  # the request's share of the engine's prompt table


@dataclass(frozen=True)
class EngineLimits:
    """Limits of one engine build (and so of the deployment serving it).

    max_batch_size: requests in flight at once. max_input_len: prompt tokens of a request, visual
    tokens included. max_seq_len: prompt plus generated tokens; it is also the engine's rope table
    length (max_position_embeddings), so the per-request mrope input stays max_seq_len x head_dim.
    max_num_tokens: tokens one engine step processes (context chunks plus generation tokens); a longer
    prompt, up to max_input_len, is prefilled in chunks (the llm model's enable_chunked_context), and an
    engine without context FMHA (fp32) gets max_num_tokens >= max_input_len from trtllm-build.
    max_visual_tokens: visual (merged) tokens of one request; the prompt table holds (K+1) rows for
    each, for every request of a batch. tokens_per_block: paged KV cache block size.
    max_top_logprobs: the most alternatives a request may ask for each generated token (top_logprobs); 0 (the
    default) serves none. Above 0 the GPU engine is built to return its generation logits
    (--gather_generation_logits), which costs GPU memory and a host copy of the vocabulary's logits per token of
    the requests that ask (docs/serving.md, "Top log probabilities").
    """

    max_batch_size: int = 8
    max_input_len: int = MAX_INPUT_LEN
    max_seq_len: int = 16384
    max_num_tokens: int = 16384
    max_visual_tokens: int = MAX_VISUAL_TOKENS
    tokens_per_block: int = 32
    max_top_logprobs: int = 0

    def __post_init__(self) -> None:
        _require_positive(self, but=("max_top_logprobs",))
        top = self.max_top_logprobs
        if not isinstance(top, int) or isinstance(top, bool) or not 0 <= top <= TOP_LOGPROBS_CAP:
            raise LimitsError(f"EngineLimits.max_top_logprobs must be in [0, {TOP_LOGPROBS_CAP}], got {top!r}")
        if self.max_seq_len <= self.max_input_len:
            raise LimitsError(
                f"max_seq_len ({self.max_seq_len}) must exceed max_input_len ({self.max_input_len}) "
                "to leave room for generated tokens"
            )
        if self.max_visual_tokens > self.max_input_len:
            raise LimitsError(
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
