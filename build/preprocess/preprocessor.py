"""Preprocessor: a user's request -> exactly the tensors the vision encoder and the LLM engine consume."""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from ..common.contracts import LLM_INPUT_IDS, MROPE_POSITION_DELTAS, MROPE_ROTARY_COS_SIN, PROMPT_TABLE_EXTRA_IDS
from ..common.limits import RequestLimits
from ..errors import (
    CheckpointError,
    MessageError,
    PromptTooLongError,
    Qwen3VLTrtError,
    TooManyImagesError,
    TooManyVideosError,
)
from ..hf.checkpoint import ModelInfo, parse_config, read_config
from ..llm.inputs import (
    engine_mrope_rotary_cos_sin,
    fake_prompt_ids,
    interleave_prompt_table,
    mrope_cos_sin,
    prompt_table_extra_ids,
    rope_index,
    rope_inv_freq,
    rope_pair_axes,
    visual_digest,
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
from .prompts import NormalizedMessages, Prompt, PromptBuilder, expand_visual_tokens
from .videos import (
    VIDEO_PREPROCESSOR_CONFIG_FILE,
    DecodedVideo,
    VideoFrameDecoder,
    VideoPlan,
    VideoProcessingConfig,
    VideoSource,
    empty_rows,
    plan_video,
    render_video,
)

DecoderName = Literal["auto", "pillow", "nvimgcodec"]
VideoDecoderName = Literal["auto", "pyav", "nvdec"]
VisualKind = Literal["image", "video"]


@dataclass(frozen=True)
class VisualInput:
    """An image or video of a request, as the vision encoder and the feature cache see it."""

    kind: VisualKind
    digest: bytes  # llm.inputs.visual_digest: what its features are cached by
    grid_thw: np.ndarray  # [3] int64
    # What it was made from: the encoded file, or a video's decoded frames (what a vision pool is sent, if bytes).
    source: bytes | DecodedVideo | None = field(default=None, repr=False, compare=False)


# Per request, per visual input in prompt order: whether its pixels are not needed (see Preprocessor.batch).
SkipDecoding = Callable[[Sequence[Sequence[VisualInput]]], Sequence[Sequence[bool]]]


@dataclass(frozen=True)
class Request:
    """One request, in the form transformers' processor returns it and in the engines' form.

    HF form: input_ids, attention_mask, image_grid_thw, video_grid_thw, pixel_values_videos, and pixel_values
    (which is transformers' for a request of images only).
    Vision encoder: pixel_values (every decoded image's and video's patches, in prompt order) plus vision_inputs
    (host metadata from the export module, for vision_grid_thw of those).
    LLM engine: engine_input_ids (fake ids for visual tokens), position_ids / mrope_position_delta
    (3-D rope, as get_rope_index), rotary_cos_sin (the prompt's (cos, sin) per rope pair), laid
    out for TensorRT-LLM by mrope_rotary_cos_sin(), prompt_table_extra_ids (each visual token's image
    content id, for KV-cache block reuse), and prompt_embedding_table() for the encoder's outputs.
    """

    input_ids: np.ndarray  # [L] int64
    attention_mask: np.ndarray  # [L] int64
    pixel_values: torch.Tensor  # [N, patch_dim] float32 of the decoded images and videos, on the preprocessing device
    image_grid_thw: np.ndarray  # [num_images, 3] int64
    vision_inputs: dict[str, np.ndarray]
    engine_input_ids: np.ndarray  # [L] int32
    position_ids: np.ndarray  # [3, L] int64
    mrope_position_delta: int
    rotary_cos_sin: np.ndarray  # [L, rotary_dim / 2, 2] float32
    prompt_table_extra_ids: np.ndarray  # [L] uint64, 0 for text tokens
    deepstack_count: int
    headers: tuple[ImageHeader, ...] = field(default=(), repr=False)
    visual: tuple[VisualInput, ...] = ()  # images and videos in prompt order
    decoded: tuple[bool, ...] | None = None  # per visual input, whether pixel_values holds its rows (None: all do)
    video_grid_thw: np.ndarray = field(default_factory=lambda: np.zeros((0, 3), np.int64))  # [num_videos, 3]
    video_timestamps: tuple[tuple[float, ...], ...] = ()  # per video, per temporal patch (as the prompt shows them)

    @property
    def vision_grid_thw(self) -> np.ndarray:
        """[n, 3] grids of the images and videos whose rows pixel_values holds, in prompt order."""
        grids = [v.grid_thw for v, d in zip(self.visual, self.decoded or (True,) * len(self.visual), strict=True) if d]
        return np.array(grids, dtype=np.int64).reshape(-1, 3)

    @property
    def pixel_values_images(self) -> torch.Tensor:
        """The images' patches in order: transformers' pixel_values."""
        return self._rows_of("image")

    @property
    def pixel_values_videos(self) -> torch.Tensor:
        """The videos' patches in order: transformers' pixel_values_videos."""
        return self._rows_of("video")

    def _rows_of(self, kind: VisualKind) -> torch.Tensor:
        rows, first = [], 0
        for item, decoded in zip(self.visual, self.decoded or (True,) * len(self.visual), strict=True):
            patches = int(np.prod(item.grid_thw)) if decoded else 0
            if item.kind == kind and decoded:
                rows.append(self.pixel_values[first : first + patches])
            first += patches
        if not rows:
            return self.pixel_values[:0]
        return rows[0] if len(rows) == 1 else torch.cat(rows)

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
    """A request whose text and image and video headers are checked and whose pixels are not yet decoded."""

    ids: np.ndarray  # as tokenized, one placeholder per image and per video frame
    input_ids: np.ndarray  # with the visual tokens
    plan: ImagePlan
    videos: tuple[VideoPlan, ...]
    visual: tuple[VisualInput, ...]
    order: tuple[int, ...]  # per visual input: its index among the request's images, or videos


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
        video_config: VideoProcessingConfig | None = None,
        video_decoder: VideoDecoderName = "auto",
    ):
        """video_config None: the checkpoint takes no video (a request with one is refused)."""
        self.info = info
        self.image_config = image_config
        self.video_config = video_config
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
        self.video_normalize = (
            Normalizer(video_config.pixels, "torchvision", self.device) if video_config is not None else None
        )
        self.decoder = _make_decoder(decoder, self.device, resize_backend)
        self.video_decoder = _make_video_decoder(video_decoder, self.device) if video_config is not None else None
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
        video_decoder: VideoDecoderName = "auto",
    ) -> Preprocessor:
        """Reads preprocessor_config.json, tokenizer.json, the chat template and config.json.

        device "cuda" decodes with nvImageCodec into device memory and resizes/patchifies there
        (transformers' torchvision semantics); "cpu" decodes with Pillow (or nvImageCodec's CPU
        backend with decoder="nvimgcodec"). resize_backend picks which transformers processor
        backend the pixels equal: "torchvision" (its default) or "pil". Videos are decoded by FFmpeg (PyAV)
        on the host (video_decoder "pyav": the pixels transformers' PyAV path gives), or by NVDEC into device memory
        ("nvdec"; "auto" on "cuda": its colour conversion differs from FFmpeg's by a few levels, see nvdec_decoder),
        and resized with torchvision (transformers' video processor has that backend only).
        """
        root = Path(model_dir)
        if not root.is_dir():
            raise CheckpointError(f"model directory {root} does not exist")
        info = parse_config(read_config(root)[1])
        video_config = None
        if (root / VIDEO_PREPROCESSOR_CONFIG_FILE).is_file():
            video_config = VideoProcessingConfig.from_pretrained(root)
        return cls(
            info,
            ImageProcessingConfig.from_pretrained(root),
            PromptBuilder(root),
            device=device,
            resize_backend=resize_backend,
            decoder=decoder,
            limits=limits,
            video_config=video_config,
            video_decoder=video_decoder,
        )

    def __call__(
        self,
        messages: Sequence[Mapping[str, Any]] | NormalizedMessages | None = None,
        *,
        prompt: str | None = None,
        images: Sequence[bytes] = (),
        videos: Sequence[VideoSource] = (),
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> Request:
        """Chat messages (OpenAI-style content parts, or as prompts.normalize_messages returns them) or a plain
        prompt with <|image_pad|> and <|video_pad|> placeholders plus the images' and videos' encoded bytes (or
        DecodedVideo), in order."""
        prompt_ = self._prompt(messages, prompt, images, videos, add_generation_prompt, template_kwargs)
        return self._finish([self._prepare(prompt_)])[0]

    def prompt_ids(
        self,
        messages: Sequence[Mapping[str, Any]] | NormalizedMessages | None = None,
        *,
        prompt: str | None = None,
        images: Sequence[bytes] = (),
        videos: Sequence[VideoSource] = (),
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> tuple[np.ndarray, int]:
        """The prompt rendered and tokenized (one placeholder id per image, each video's temporal patches with
        their times), which batch() takes back as prompt_ids with the images and videos in their placeholders'
        order, and its length in tokens with the visual tokens, read from the image and video headers alone (no
        pixel is decoded); raises what __call__ raises for bad messages, headers or limits."""
        prepared = self._prepare(self._prompt(messages, prompt, images, videos, add_generation_prompt, template_kwargs))
        return prepared.ids, int(prepared.input_ids.size)

    def batch(self, requests: Sequence[Mapping[str, Any]], skip_decoding: SkipDecoding | None = None) -> list[Request]:
        """Several requests at once (each a dict of __call__'s keyword arguments, or prompt_ids, images and videos: a
        prompt tokenized by prompt_ids, which is not rendered again); their images are decoded as one batch.
        A bad request raises before any image is decoded. skip_decoding, once every request is checked,
        tells per image and video of each request whether its pixels are not needed (its features are at
        hand): those are not decoded (Request.decoded)."""
        pending = []
        for i, request in enumerate(requests):
            kwargs = dict(request)
            try:
                if "prompt_ids" in kwargs:
                    limits = (self.limits.max_image_bytes, self.limits.max_video_bytes)
                    pending.append(self._prepare(self.prompts.from_ids(**kwargs, max_bytes=limits)))
                    continue
                prompt = self._prompt(
                    kwargs.pop("messages", None),
                    kwargs.pop("prompt", None),
                    kwargs.pop("images", ()),
                    kwargs.pop("videos", ()),
                    kwargs.pop("add_generation_prompt", True),
                    kwargs,
                )
                pending.append(self._prepare(prompt))
            except Qwen3VLTrtError as e:
                raise type(e)(f"request {i}: {e}") from e
        return self._finish(pending, skip_decoding)

    def _prompt(
        self,
        messages: Sequence[Mapping[str, Any]] | NormalizedMessages | None,
        prompt: str | None,
        images: Sequence[bytes],
        videos: Sequence[VideoSource],
        add_generation_prompt: bool,
        template_kwargs: Mapping[str, Any],
    ) -> Prompt:
        limits = self.limits
        if messages is not None and prompt is None:
            if images or videos:
                raise MessageError("with chat messages, images and videos go inside the messages as their parts")
            return self.prompts.from_messages(
                messages, add_generation_prompt, limits.max_image_bytes, limits.max_video_bytes, **template_kwargs
            )
        if prompt is not None and messages is None:
            return self.prompts.from_prompt(
                prompt, list(images), limits.max_image_bytes, list(videos), limits.max_video_bytes
            )
        raise MessageError("pass either chat messages or prompt=, not both or neither")

    def _prepare(self, prompt: Prompt) -> _Pending:
        limits = self.limits
        if len(prompt.images) > limits.max_images:
            raise TooManyImagesError(f"{len(prompt.images)} images in one request; the limit is {limits.max_images}")
        if len(prompt.videos) > limits.max_videos:
            raise TooManyVideosError(f"{len(prompt.videos)} videos in one request; the limit is {limits.max_videos}")
        if prompt.videos and self.video_config is None:
            raise MessageError("this model's checkpoint has no video_preprocessor_config.json, so it takes no video")
        plan = plan_images(prompt.images, self.image_config, limits)
        videos = tuple(
            plan_video(video, k, self.video_config, limits)  # type: ignore[arg-type]
            for k, video in enumerate(prompt.videos)
        )
        ids = self.prompts.token_ids(prompt, [video.timestamps for video in videos])
        frames = sum(video.grid_thw[0] for video in videos)
        if prompt.ids is not None and int((ids == self.info.video_token_id).sum()) != frames:
            raise MessageError(f"prompt_ids do not hold one video placeholder for each of the videos' {frames} frames")
        merge = self.image_config.merge_size
        tokens_per_image = (plan.image_grid_thw.prod(axis=1) // (merge * merge)).tolist()
        tokens_per_patch = [h * w // (merge * merge) for video in videos for h, w in [video.grid_thw[1:]]]
        tokens_per_frame = [
            n for video, n in zip(videos, tokens_per_patch, strict=True) for _ in range(video.grid_thw[0])
        ]
        input_ids = expand_visual_tokens(
            ids, {self.prompts.image_token_id: tokens_per_image, self.info.video_token_id: tokens_per_frame}
        )
        visual_tokens = sum(tokens_per_image) + sum(tokens_per_frame)
        if input_ids.size > limits.max_prompt_tokens:
            raise PromptTooLongError(
                f"the prompt is {input_ids.size} tokens ({visual_tokens} of them for {len(tokens_per_image)} image(s) "
                f"and {len(videos)} video(s)); the limit is {limits.max_prompt_tokens}: shorten the text or send "
                "smaller images or shorter videos"
            )
        if visual_tokens > limits.max_visual_tokens:
            raise PromptTooLongError(
                f"the images and videos take {visual_tokens} visual tokens; the limit is {limits.max_visual_tokens}: "
                "send fewer or smaller images or shorter videos"
            )
        visual, order = self._visual_inputs(ids, plan, videos)
        return _Pending(ids, input_ids, plan, videos, visual, order)

    def _visual_inputs(
        self, ids: np.ndarray, plan: ImagePlan, videos: Sequence[VideoPlan]
    ) -> tuple[tuple[VisualInput, ...], tuple[int, ...]]:
        """The images and videos in the order their placeholders come in ids (a video's first temporal patch)."""
        kinds = ids[np.isin(ids, (self.prompts.image_token_id, self.info.video_token_id))]
        visual, order, image, video, skip = [], [], 0, 0, 0
        for token in kinds.tolist():
            if token == self.prompts.image_token_id:
                grid = plan.image_grid_thw[image]
                visual.append(VisualInput("image", visual_digest(grid, plan.data[image]), grid, plan.data[image]))
                order.append(image)
                image += 1
            elif skip:
                skip -= 1
            else:
                made = videos[video]
                grid = np.array(made.grid_thw, dtype=np.int64)
                visual.append(VisualInput("video", visual_digest(grid, *_video_content(made)), grid, made.source))
                order.append(video)
                skip, video = made.grid_thw[0] - 1, video + 1
        return tuple(visual), tuple(order)

    def _finish(self, pending: Sequence[_Pending], skip_decoding: SkipDecoding | None = None) -> list[Request]:
        if skip_decoding is None:
            decoded: list[tuple[bool, ...]] = [(True,) * len(p.visual) for p in pending]
        else:
            decoded = [tuple(not skip for skip in mask) for mask in skip_decoding([p.visual for p in pending])]
        plans = []
        for p, mask in zip(pending, decoded, strict=True):
            images = [d for item, d in zip(p.visual, mask, strict=True) if item.kind == "image"]
            plans.append(p.plan.only([images[k] for k in range(len(p.plan.data))]) if images else p.plan)
        pixels = render_pixels(plans, self.image_config, self.normalize, self.decoder, self.limits.max_decode_pixels)
        return [
            self._request(p, self._pixel_values(p, px, mask), None if skip_decoding is None else mask)
            for p, px, mask in zip(pending, pixels, decoded, strict=True)
        ]

    def _pixel_values(self, pending: _Pending, image_rows: torch.Tensor, decoded: tuple[bool, ...]) -> torch.Tensor:
        """The rows of the decoded images (rendered already, in order) and videos (rendered here), in prompt order."""
        videos = [
            pending.videos[k]
            for item, k, d in zip(pending.visual, pending.order, decoded, strict=True)
            if item.kind == "video" and d
        ]
        if not videos:
            return image_rows
        config = self.video_config
        assert config is not None and self.video_normalize is not None
        out = empty_rows(videos, config.pixels.patch_dim, self.device)
        first = 0
        for video in videos:
            render_video(
                video, config, self.video_normalize, out[first : first + video.num_patches], self.video_decoder
            )
            first += video.num_patches
        if not len(image_rows):
            return out
        parts, image_first, video_first = [], 0, 0
        for item, d in zip(pending.visual, decoded, strict=True):
            if not d:
                continue
            patches = int(np.prod(item.grid_thw))
            if item.kind == "image":
                parts.append(image_rows[image_first : image_first + patches])
                image_first += patches
            else:
                parts.append(out[video_first : video_first + patches])
                video_first += patches
        return torch.cat(parts)

    def _request(self, pending: _Pending, pixel_values: torch.Tensor, decoded: tuple[bool, ...] | None) -> Request:
        info = self.info
        merge = self.image_config.merge_size
        visual_ids = (info.image_token_id, info.video_token_id)
        # Each temporal patch of a video is placed as an image of one frame (get_rope_index splits video grids).
        position_grids = np.array(
            [
                [1, h, w] if item.kind == "video" else item.grid_thw
                for item in pending.visual
                for h, w in [item.grid_thw[1:]]
                for _ in range(item.grid_thw[0] if item.kind == "video" else 1)
            ],
            dtype=np.int64,
        ).reshape(-1, 3)
        positions, delta = rope_index(pending.input_ids, position_grids, visual_ids, merge)
        request = Request(
            input_ids=pending.input_ids,
            attention_mask=np.ones_like(pending.input_ids),
            pixel_values=pixel_values,
            image_grid_thw=pending.plan.image_grid_thw,
            vision_inputs={},
            engine_input_ids=fake_prompt_ids(pending.input_ids, visual_ids, info.text.vocab_size, info.deepstack_count),
            position_ids=positions,
            mrope_position_delta=delta,
            rotary_cos_sin=mrope_cos_sin(positions, self._inv_freq, self._pair_axes),
            prompt_table_extra_ids=prompt_table_extra_ids(
                pending.input_ids,
                visual_ids,
                [item.digest for item in pending.visual],
                np.array([item.grid_thw for item in pending.visual], dtype=np.int64).reshape(-1, 3),
                merge,
            ),
            deepstack_count=info.deepstack_count,
            headers=pending.plan.headers,
            visual=pending.visual,
            decoded=decoded,
            video_grid_thw=np.array([v.grid_thw for v in pending.videos], dtype=np.int64).reshape(-1, 3),
            video_timestamps=tuple(v.timestamps for v in pending.videos),
        )
        grid = request.vision_grid_thw
        metadata = vision_metadata(grid, merge, info.vision.num_grid_per_side) if len(grid) else {}
        return dataclasses.replace(request, vision_inputs=metadata)


def _video_content(plan: VideoPlan) -> tuple[bytes | memoryview, ...]:
    """What a video's digest hashes besides its grid: its bytes, or its decoded frames and their times."""
    if isinstance(plan.source, DecodedVideo):
        frames = np.ascontiguousarray(plan.source.frames)
        return frames.data.cast("B"), np.asarray(plan.source.timestamps, dtype=np.float64).tobytes()
    return (plan.source,)


def _make_video_decoder(name: VideoDecoderName, device: torch.device) -> VideoFrameDecoder | None:
    """NVDEC into device memory ("nvdec", or "auto" on CUDA when PyNvVideoCodec loads); None: FFmpeg (PyAV) on the
    host, frames uploaded to the device after decoding."""
    if name not in ("auto", "pyav", "nvdec"):
        raise Qwen3VLTrtError(f"video_decoder must be 'auto', 'pyav' or 'nvdec', got {name!r}")
    if name == "pyav" or (name == "auto" and device.type != "cuda"):
        return None
    if device.type != "cuda":
        raise Qwen3VLTrtError("the nvdec video decoder decodes into device memory; use device='cuda'")
    from .nvdec_decoder import NvdecVideoDecoder

    try:
        return NvdecVideoDecoder(device)
    except Qwen3VLTrtError as e:
        if name == "nvdec":
            raise
        # Images and text need no video decoder: serve them, and decode videos on the host.
        warnings.warn(f"videos are decoded on the host (FFmpeg), not by NVDEC: {e}", stacklevel=2)
        return None


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
