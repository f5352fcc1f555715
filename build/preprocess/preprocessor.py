"""Preprocessor: a user's request -> exactly the tensors the vision encoder and the LLM engine consume."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from ..checkpoint import ModelInfo, parse_config, read_config
from ..contracts import LLM_INPUT_IDS, MROPE_POSITION_DELTAS, MROPE_ROTARY_COS_SIN, PROMPT_TABLE_EXTRA_IDS
from ..errors import CheckpointError, MessageError, PromptTooLongError, Qwen3VLTrtError, TooManyImagesError
from ..limits import RequestLimits
from ..llm.inputs import (
    engine_mrope_rotary_cos_sin,
    fake_prompt_ids,
    image_digest,
    interleave_prompt_table,
    mrope_cos_sin,
    prompt_table_extra_ids,
    rope_index,
    rope_inv_freq,
    rope_pair_axes,
)
from ..vision.metadata import vision_metadata
from .images import (
    FrameDecoder,
    ImageHeader,
    ImagePlan,
    ImageProcessingConfig,
    Normalizer,
    ResizeBackend,
    plan_images,
    render_pixels,
)
from .prompts import Prompt, PromptBuilder, expand_image_tokens

DecoderName = Literal["auto", "pillow", "nvimgcodec"]
# Per request's image plan, per image: whether its pixels are not needed (see Preprocessor.batch).
SkipDecoding = Callable[[Sequence[ImagePlan]], Sequence[Sequence[bool]]]


@dataclass(frozen=True)
class Request:
    """One request, in the form transformers' processor returns it and in the engines' form.

    HF form: input_ids, attention_mask, pixel_values, image_grid_thw.
    Vision encoder: pixel_values plus vision_inputs (host metadata from the export module).
    LLM engine: engine_input_ids (fake ids for visual tokens), position_ids / mrope_position_delta
    (3-D rope, as get_rope_index), rotary_cos_sin (the prompt's (cos, sin) per rope pair), laid
    out for TensorRT-LLM by mrope_rotary_cos_sin(), prompt_table_extra_ids (each visual token's image
    content id, for KV-cache block reuse), and prompt_embedding_table() for the encoder's outputs.
    """

    input_ids: np.ndarray  # [L] int64
    attention_mask: np.ndarray  # [L] int64
    pixel_values: torch.Tensor  # [N, patch_dim] float32 of the decoded images, on the preprocessing device
    image_grid_thw: np.ndarray  # [num_images, 3] int64
    vision_inputs: dict[str, np.ndarray]
    engine_input_ids: np.ndarray  # [L] int32
    position_ids: np.ndarray  # [3, L] int64
    mrope_position_delta: int
    rotary_cos_sin: np.ndarray  # [L, rotary_dim / 2, 2] float32
    prompt_table_extra_ids: np.ndarray  # [L] uint64, 0 for text tokens
    deepstack_count: int
    headers: tuple[ImageHeader, ...] = field(default=(), repr=False)
    image_digests: tuple[bytes, ...] = ()  # per image (llm.inputs.image_digest): what its features are cached by
    decoded: tuple[bool, ...] | None = None  # per image, whether pixel_values holds its rows (None: all do)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.size)

    @property
    def num_visual_tokens(self) -> int:
        return int((self.engine_input_ids != self.input_ids).sum())

    def mrope_rotary_cos_sin(self, max_position_embeddings: int) -> np.ndarray:
        """The engine input: [max_position_embeddings * rotary_dim] float32 (see llm_inputs)."""
        return engine_mrope_rotary_cos_sin(self.rotary_cos_sin, max_position_embeddings)

    @property
    def mrope_position_deltas(self) -> np.ndarray:
        return np.array([self.mrope_position_delta], dtype=np.int32)

    def engine_inputs(self, max_position_embeddings: int) -> dict[str, np.ndarray]:
        """The LLM engine's per-request inputs that need no vision output, keyed by contract name."""
        return {
            LLM_INPUT_IDS.name: self.engine_input_ids,
            MROPE_ROTARY_COS_SIN.name: self.mrope_rotary_cos_sin(max_position_embeddings),
            MROPE_POSITION_DELTAS.name: self.mrope_position_deltas,
            PROMPT_TABLE_EXTRA_IDS.name: self.prompt_table_extra_ids,
        }

    def prompt_embedding_table(self, image_embeds: torch.Tensor, deepstack_embeds: torch.Tensor) -> torch.Tensor:
        """The vision encoder's outputs for this request laid out for the fake ids: [(K+1)*M, D]."""
        expected = self.num_visual_tokens
        if image_embeds.shape[0] != expected or deepstack_embeds.shape[0] != self.deepstack_count:
            raise Qwen3VLTrtError(
                f"this request has {expected} visual tokens and {self.deepstack_count} DeepStack features; got "
                f"image_embeds {list(image_embeds.shape)} and deepstack_embeds {list(deepstack_embeds.shape)}"
            )
        return interleave_prompt_table(image_embeds, deepstack_embeds)


@dataclass(frozen=True)
class _Pending:
    """A request whose text and image headers are checked and whose pixels are not yet decoded."""

    input_ids: np.ndarray
    plan: ImagePlan


class Preprocessor:
    def __init__(
        self,
        info: ModelInfo,
        image_config: ImageProcessingConfig,
        prompts: PromptBuilder,
        device: str | torch.device = "cpu",
        resize_backend: ResizeBackend = "torchvision",
        decoder: DecoderName = "auto",
        limits: RequestLimits | None = None,
    ):
        self.info = info
        self.image_config = image_config
        self.prompts = prompts
        self.limits = limits or RequestLimits()
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise Qwen3VLTrtError(
                "device 'cuda' was asked for but torch sees no CUDA device (driver, CUDA_VISIBLE_DEVICES?); "
                "use device='cpu' on hosts without a GPU"
            )
        if self.device.type not in ("cpu", "cuda"):
            raise Qwen3VLTrtError(f"device must be 'cpu' or 'cuda', got {device!r}")
        if self.device.type == "cuda" and resize_backend == "pil":
            raise Qwen3VLTrtError(
                "the pil resize backend runs on the CPU only; use resize_backend='torchvision' on CUDA"
            )
        self.normalize = Normalizer(image_config, resize_backend, self.device)
        self.decoder = _make_decoder(decoder, self.device, resize_backend)
        text = info.text
        self._pair_axes = rope_pair_axes(text.head_dim, text.mrope_section)
        self._inv_freq = rope_inv_freq(text.head_dim, text.rope_theta)
        _check_consistent(info, image_config, prompts)

    @classmethod
    def from_pretrained(
        cls,
        model_dir: str | os.PathLike[str],
        device: str | torch.device = "cpu",
        resize_backend: ResizeBackend = "torchvision",
        decoder: DecoderName = "auto",
        limits: RequestLimits | None = None,
    ) -> Preprocessor:
        """Reads preprocessor_config.json, tokenizer.json, the chat template and config.json.

        device "cuda" decodes with nvImageCodec into device memory and resizes/patchifies there
        (transformers' torchvision semantics); "cpu" decodes with Pillow (or nvImageCodec's CPU
        backend with decoder="nvimgcodec"). resize_backend picks which transformers processor
        backend the pixels equal: "torchvision" (its default) or "pil".
        """
        root = Path(model_dir)
        if not root.is_dir():
            raise CheckpointError(f"model directory {root} does not exist")
        info = parse_config(read_config(root)[1])
        return cls(
            info,
            ImageProcessingConfig.from_pretrained(root),
            PromptBuilder(root),
            device=device,
            resize_backend=resize_backend,
            decoder=decoder,
            limits=limits,
        )

    def __call__(
        self,
        messages: Sequence[Mapping[str, Any]] | None = None,
        *,
        prompt: str | None = None,
        images: Sequence[bytes] = (),
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> Request:
        """Chat messages (OpenAI-style content parts) or a plain prompt with <|image_pad|> placeholders
        plus the images' encoded bytes, in order."""
        pending = self._prepare(self._prompt(messages, prompt, images, add_generation_prompt, template_kwargs))
        return self._finish([pending])[0]

    def count_tokens(
        self,
        messages: Sequence[Mapping[str, Any]] | None = None,
        *,
        prompt: str | None = None,
        images: Sequence[bytes] = (),
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> int:
        """The prompt's length in tokens, its images' tokens included, read from the image headers alone
        (no pixel is decoded); raises what __call__ raises for bad messages, image headers or limits."""
        prompt_ = self._prompt(messages, prompt, images, add_generation_prompt, template_kwargs)
        return int(self._prepare(prompt_).input_ids.size)

    def batch(self, requests: Sequence[Mapping[str, Any]], skip_decoding: SkipDecoding | None = None) -> list[Request]:
        """Several requests at once (each a dict of __call__'s keyword arguments); their images are
        decoded as one batch. A bad request raises before any image is decoded. skip_decoding, once every
        request is checked, tells per image of each request's plan whether its pixels are not needed (its
        features are at hand): those are not decoded (Request.decoded)."""
        pending = []
        for i, request in enumerate(requests):
            kwargs = dict(request)
            try:
                prompt = self._prompt(
                    kwargs.pop("messages", None),
                    kwargs.pop("prompt", None),
                    kwargs.pop("images", ()),
                    kwargs.pop("add_generation_prompt", True),
                    kwargs,
                )
                pending.append(self._prepare(prompt))
            except Qwen3VLTrtError as e:
                raise type(e)(f"request {i}: {e}") from e
        return self._finish(pending, skip_decoding)

    def _prompt(
        self,
        messages: Sequence[Mapping[str, Any]] | None,
        prompt: str | None,
        images: Sequence[bytes],
        add_generation_prompt: bool,
        template_kwargs: Mapping[str, Any],
    ) -> Prompt:
        if messages is not None and prompt is None:
            if images:
                raise MessageError("with chat messages, images go inside the messages as image parts")
            return self.prompts.from_messages(
                messages, add_generation_prompt, self.limits.max_image_bytes, **template_kwargs
            )
        if prompt is not None and messages is None:
            return self.prompts.from_prompt(prompt, list(images), self.limits.max_image_bytes)
        raise MessageError("pass either chat messages or prompt=, not both or neither")

    def _prepare(self, prompt: Prompt) -> _Pending:
        limits = self.limits
        if len(prompt.images) > limits.max_images:
            raise TooManyImagesError(f"{len(prompt.images)} images in one request; the limit is {limits.max_images}")
        plan = plan_images(prompt.images, self.image_config, limits)
        merge = self.image_config.merge_size
        tokens_per_image = (plan.image_grid_thw.prod(axis=1) // (merge * merge)).tolist()
        input_ids = expand_image_tokens(prompt.token_ids, self.prompts.image_token_id, tokens_per_image)
        if input_ids.size > limits.max_prompt_tokens:
            raise PromptTooLongError(
                f"the prompt is {input_ids.size} tokens ({sum(tokens_per_image)} of them for {len(tokens_per_image)} "
                f"image(s)); the limit is {limits.max_prompt_tokens}: shorten the text or send smaller images"
            )
        if sum(tokens_per_image) > limits.max_visual_tokens:
            raise PromptTooLongError(
                f"the images take {sum(tokens_per_image)} visual tokens; the limit is {limits.max_visual_tokens}: "
                "send fewer or smaller images"
            )
        return _Pending(input_ids, plan)

    def _finish(self, pending: Sequence[_Pending], skip_decoding: SkipDecoding | None = None) -> list[Request]:
        plans = [p.plan for p in pending]
        if skip_decoding is None:
            decoded: list[tuple[bool, ...] | None] = [None] * len(plans)
        else:
            decoded = [tuple(not skip for skip in mask) for mask in skip_decoding(plans)]
            plans = [plan if mask is None else plan.only(mask) for plan, mask in zip(plans, decoded, strict=True)]
        pixels = render_pixels(plans, self.image_config, self.normalize, self.decoder, self.limits.max_decode_pixels)
        return [self._request(p, px, d) for p, px, d in zip(pending, pixels, decoded, strict=True)]

    def _request(self, pending: _Pending, pixel_values: torch.Tensor, decoded: tuple[bool, ...] | None) -> Request:
        info, grid = self.info, pending.plan.image_grid_thw
        merge = self.image_config.merge_size
        positions, delta = rope_index(pending.input_ids, grid, info.image_token_id, merge)
        metadata = vision_metadata(grid, merge, info.vision.num_grid_per_side) if len(grid) else {}
        digests = tuple(image_digest(data, g) for data, g in zip(pending.plan.data, grid, strict=True))
        return Request(
            input_ids=pending.input_ids,
            attention_mask=np.ones_like(pending.input_ids),
            pixel_values=pixel_values,
            image_grid_thw=grid,
            vision_inputs=metadata,
            engine_input_ids=fake_prompt_ids(
                pending.input_ids, info.image_token_id, info.text.vocab_size, info.deepstack_count
            ),
            position_ids=positions,
            mrope_position_delta=delta,
            rotary_cos_sin=mrope_cos_sin(positions, self._inv_freq, self._pair_axes),
            prompt_table_extra_ids=prompt_table_extra_ids(pending.input_ids, info.image_token_id, digests, grid, merge),
            deepstack_count=info.deepstack_count,
            headers=pending.plan.headers,
            image_digests=digests,
            decoded=decoded,
        )


def _make_decoder(name: DecoderName, device: torch.device, resize_backend: ResizeBackend) -> FrameDecoder | None:
    if name not in ("auto", "pillow", "nvimgcodec"):
        raise Qwen3VLTrtError(f"decoder must be 'auto', 'pillow' or 'nvimgcodec', got {name!r}")
    if device.type == "cuda" and name == "pillow":
        raise Qwen3VLTrtError("on CUDA the images are decoded into device memory by nvImageCodec; use decoder='auto'")
    if name == "pillow" or (name == "auto" and device.type == "cpu"):
        return None
    if resize_backend == "pil":
        raise Qwen3VLTrtError("the pil resize backend needs Pillow-decoded images; use decoder='pillow'")
    from .nvimgcodec_decoder import NvImageCodecDecoder

    return NvImageCodecDecoder(device)


def _check_consistent(info: ModelInfo, image_config: ImageProcessingConfig, prompts: PromptBuilder) -> None:
    vision = info.vision
    if image_config.patch_size != vision.patch_size or image_config.merge_size != vision.spatial_merge_size:
        raise CheckpointError(
            f"preprocessor_config.json (patch {image_config.patch_size}, merge {image_config.merge_size}) does not "
            f"match config.json's vision tower (patch {vision.patch_size}, merge {vision.spatial_merge_size})"
        )
    if image_config.temporal_patch_size != vision.temporal_patch_size:
        raise CheckpointError("preprocessor_config.json and config.json disagree on temporal_patch_size")
    if prompts.image_token_id != info.image_token_id:
        raise CheckpointError(
            f"tokenizer.json's <|image_pad|> is id {prompts.image_token_id}, config.json says {info.image_token_id}"
        )
