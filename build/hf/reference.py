"""transformers as the reference for parity checks (CPU, fp32): the vision tower, the processor,
get_rope_index and the text rotary embedding.

Works with transformers 4.57.x and 5.x, whose signatures and return types differ.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from ..common.contracts import VISUAL_PREFIX
from .checkpoint import Checkpoint


def load_hf_vision_tower(ckpt: Checkpoint, tensors: dict[str, torch.Tensor] | None = None) -> nn.Module:
    """transformers' vision model for this checkpoint, fp32, with the checkpoint's visual weights."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(ckpt.path)
    VisionModel: type[nn.Module]
    if ckpt.info.model_type == "qwen3_vl_moe":
        from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import (
            Qwen3VLMoeVisionModel as VisionModel,
        )
    else:
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel as VisionModel
    model = VisionModel(config.vision_config).float().eval()
    if tensors is None:
        tensors = ckpt.load_tensors(ckpt.tensor_names(VISUAL_PREFIX))
    state = {name[len(VISUAL_PREFIX) :]: t.float() for name, t in tensors.items() if name.startswith(VISUAL_PREFIX)}
    model.load_state_dict(state, strict=True)
    return model


@torch.inference_mode()
def run_hf_vision_tower(
    model: nn.Module, pixel_values: np.ndarray | torch.Tensor, grid_thw: np.ndarray | torch.Tensor
) -> tuple[np.ndarray, np.ndarray]:
    """(image_embeds [M, D], deepstack_embeds [K, M, D]) as transformers computes them."""
    out = model(torch.as_tensor(pixel_values, dtype=torch.float32), grid_thw=torch.as_tensor(grid_thw))
    if isinstance(out, tuple):  # transformers 4.57
        merged, deepstack = out
    else:  # transformers 5.x
        merged, deepstack = out.pooler_output, out.deepstack_features
    return merged.float().numpy(), torch.stack(list(deepstack)).float().numpy()


def load_hf_processor(model_dir: str | os.PathLike[str], backend: str = "torchvision") -> Any:
    """transformers' Qwen3-VL processor with the given image backend ("torchvision", its default, or
    "pil"), under either major version (5.x takes backend=, 4.57 use_fast=)."""
    import transformers
    from transformers import AutoImageProcessor, AutoProcessor

    if backend not in ("torchvision", "pil"):
        raise ValueError(f"backend must be 'torchvision' or 'pil', got {backend!r}")
    processor = AutoProcessor.from_pretrained(model_dir)
    # The video processor has no PIL backend in 5.x, so only the image processor is swapped.
    if int(transformers.__version__.split(".")[0]) >= 5:
        processor.image_processor = AutoImageProcessor.from_pretrained(model_dir, backend=backend)
    else:
        processor.image_processor = AutoImageProcessor.from_pretrained(model_dir, use_fast=backend == "torchvision")
    return processor


def load_hf_text_model(model_dir: str | os.PathLike[str]) -> nn.Module:
    """transformers' Qwen3VLModel for this config (random weights: rope and positions need none)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    Model: type[nn.Module]
    if config.model_type == "qwen3_vl_moe":
        from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeModel as Model
    else:
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel as Model
    return Model(config).eval()


def _grid(grid_thw: np.ndarray | None) -> torch.Tensor | None:
    return None if grid_thw is None or len(grid_thw) == 0 else torch.as_tensor(grid_thw)


def _mm_token_type_ids(ids: torch.Tensor, image_token_id: int, video_token_id: int | None) -> torch.Tensor:
    """transformers 5.x's per-token modality: 0 text, 1 image, 2 video."""
    types = (ids == image_token_id).int()
    return types if video_token_id is None else types + 2 * (ids == video_token_id).int()


@torch.inference_mode()
def hf_rope_index(
    model: Any,
    input_ids: np.ndarray,
    image_grid_thw: np.ndarray | None,
    image_token_id: int,
    video_grid_thw: np.ndarray | None = None,
    video_token_id: int | None = None,
) -> tuple[np.ndarray, int]:
    """get_rope_index for one unpadded request: positions [3, L] and the delta."""
    ids = torch.as_tensor(input_ids, dtype=torch.long).reshape(1, -1)
    kwargs: dict[str, Any] = {
        "image_grid_thw": _grid(image_grid_thw),
        "video_grid_thw": _grid(video_grid_thw),
        "attention_mask": torch.ones_like(ids),
    }
    if "mm_token_type_ids" in inspect.signature(model.get_rope_index).parameters:  # transformers 5.x
        kwargs["mm_token_type_ids"] = _mm_token_type_ids(ids, image_token_id, video_token_id)
    positions, deltas = model.get_rope_index(ids, **kwargs)
    return positions[:, 0].numpy(), int(deltas.reshape(-1)[0])


@torch.inference_mode()
def hf_text_rotary(model: Any, position_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(cos, sin) [L, head_dim] that the transformers text model applies at these 3-D positions."""
    positions = torch.as_tensor(position_ids, dtype=torch.long).reshape(3, 1, -1)
    probe = torch.zeros(1, dtype=torch.float32)
    cos, sin = model.language_model.rotary_emb(probe, positions)
    return cos[0].numpy(), sin[0].numpy()


def hf_model_inputs(
    model: Any,
    input_ids: np.ndarray,
    image_token_id: int,
    pixel_values: torch.Tensor | None = None,
    image_grid_thw: np.ndarray | None = None,
    pixel_values_videos: torch.Tensor | None = None,
    video_grid_thw: np.ndarray | None = None,
    video_token_id: int | None = None,
) -> dict[str, Any]:
    """forward()/generate() inputs of Qwen3VLForConditionalGeneration for one unpadded request;
    transformers 5.x also wants the processor's mm_token_type_ids (1 at image tokens, 2 at video tokens)."""
    ids = torch.as_tensor(input_ids, dtype=torch.long).reshape(1, -1)
    inputs: dict[str, Any] = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if pixel_values is not None and image_grid_thw is not None and len(image_grid_thw):
        inputs |= {"pixel_values": pixel_values, "image_grid_thw": torch.as_tensor(image_grid_thw)}
    if pixel_values_videos is not None and video_grid_thw is not None and len(video_grid_thw):
        inputs |= {"pixel_values_videos": pixel_values_videos, "video_grid_thw": torch.as_tensor(video_grid_thw)}
    if len(inputs) > 2 and "mm_token_type_ids" in inspect.signature(model.forward).parameters:
        inputs["mm_token_type_ids"] = _mm_token_type_ids(ids, image_token_id, video_token_id)
    return inputs


def hf_request_inputs(
    model: Any, request: Any, image_token_id: int, video_token_id: int, input_ids: np.ndarray | None = None
) -> dict[str, Any]:
    """hf_model_inputs for one of our preprocessed requests (qwen3vl_trt.preprocess.Request), its images and
    videos in transformers' form; input_ids replaces the request's (its prompt and more, to score a sequence)."""
    return hf_model_inputs(
        model,
        request.input_ids if input_ids is None else input_ids,
        image_token_id,
        request.pixel_values_images,
        request.image_grid_thw,
        request.pixel_values_videos,
        request.video_grid_thw,
        video_token_id,
    )


def hf_greedy_log_softmax(
    model: Any, inputs: dict[str, Any], max_new_tokens: int, end_ids: Sequence[int]
) -> tuple[list[int], np.ndarray]:
    """transformers' greedy tokens for these model inputs (end ids dropped, as the server does) and the log-softmax of
    the model's own logits at each of them (generate's output_logits: before any logits processor), float32
    [tokens, vocab]: what top_logprobs reports."""
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=list(end_ids),
                             output_logits=True, return_dict_in_generate=True)  # fmt: skip
    generated = out.sequences[0, inputs["input_ids"].shape[1] :].tolist()
    rows = torch.log_softmax(torch.cat(out.logits).float(), dim=-1).numpy()
    kept = [i for i, t in enumerate(generated) if t not in end_ids]
    return [generated[i] for i in kept], rows[kept]


def hf_video_reference(processor: Any, text: str, path: str | os.PathLike[str], images: Sequence[Any] = ()) -> dict:
    """transformers' processor outputs (numpy) for a prompt text with one video file, decoded as transformers does
    with PyAV (video_utils.load_video, backend "pyav", the video processor's own sampling); a container that records
    no frame count (WebM), where that decoder fails, is decoded whole and sampled by the processor from its metadata.
    Input ids in the layout 4.57.3 writes (see released_video_layout)."""
    import av
    from transformers.video_utils import VideoMetadata, load_video

    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        counted, fps = int(stream.frames), float(stream.average_rate or 0)
        frames = None if counted else np.stack([f.to_ndarray(format="rgb24") for f in container.decode(stream)])
    if frames is None:
        frames, metadata = load_video(
            str(path),  # type: ignore[arg-type]  # a path or URL, as its docstring says
            backend="pyav",
            sample_indices_fn=processor.video_processor.sample_frames,
        )
        kwargs: dict[str, Any] = {"do_sample_frames": False}
    else:
        metadata = VideoMetadata(total_num_frames=len(frames), fps=fps)
        kwargs = {}
    out = processor(
        text=[text],
        images=list(images) or None,
        videos=[frames],
        video_metadata=[metadata],
        return_tensors="pt",
        **kwargs,
    )
    out = {k: v.numpy() for k, v in out.items()}
    out["input_ids"] = released_video_layout(out["input_ids"][0], processor.tokenizer)
    return out


def released_video_layout(input_ids: np.ndarray, tokenizer: Any) -> np.ndarray:
    """Ids in the layout transformers 4.57.3 writes: 5.x keeps the chat template's <|vision_start|> and
    <|vision_end|> around a video's timestamped frames (one more before the first timestamp and after the last);
    4.57.3, vLLM and the released model's processor replace the whole placeholder."""
    start, end = tokenizer.convert_tokens_to_ids("<|vision_start|>"), tokenizer.convert_tokens_to_ids("<|vision_end|>")
    pads = {tokenizer.convert_tokens_to_ids(t) for t in ("<|image_pad|>", "<|video_pad|>")}
    ids = np.asarray(input_ids).reshape(-1)
    keep = np.ones(ids.size, dtype=bool)
    for i in range(ids.size - 1):
        if ids[i] == start and ids[i + 1] not in pads and ids[i + 1] != start:
            keep[i] = False  # 5.x's outer start, before the first timestamp
        if ids[i] == end and ids[i + 1] == end:
            keep[i + 1] = False  # 5.x's outer end, after the last frame
    return ids[keep]
