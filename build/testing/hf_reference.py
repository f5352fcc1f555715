"""transformers as the reference for parity checks (CPU, fp32): the vision tower, the processor,
get_rope_index and the text rotary embedding.

Works with transformers 4.57.x and 5.x, whose signatures and return types differ.
"""

from __future__ import annotations

import inspect
import os
from typing import Any

import numpy as np
import torch
from torch import nn

from ..checkpoint import Checkpoint
from ..contracts import VISUAL_PREFIX


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


@torch.inference_mode()
def hf_rope_index(
    model: Any, input_ids: np.ndarray, image_grid_thw: np.ndarray | None, image_token_id: int
) -> tuple[np.ndarray, int]:
    """get_rope_index for one unpadded request: positions [3, L] and the delta."""
    ids = torch.as_tensor(input_ids, dtype=torch.long).reshape(1, -1)
    grid = None if image_grid_thw is None or len(image_grid_thw) == 0 else torch.as_tensor(image_grid_thw)
    kwargs: dict[str, Any] = {"image_grid_thw": grid, "attention_mask": torch.ones_like(ids)}
    if "mm_token_type_ids" in inspect.signature(model.get_rope_index).parameters:  # transformers 5.x
        kwargs["mm_token_type_ids"] = (ids == image_token_id).int()
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
) -> dict[str, Any]:
    """forward()/generate() inputs of Qwen3VLForConditionalGeneration for one unpadded request;
    transformers 5.x also wants the processor's mm_token_type_ids (1 at image tokens)."""
    ids = torch.as_tensor(input_ids, dtype=torch.long).reshape(1, -1)
    inputs: dict[str, Any] = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if pixel_values is not None and image_grid_thw is not None and len(image_grid_thw):
        inputs |= {"pixel_values": pixel_values, "image_grid_thw": torch.as_tensor(image_grid_thw)}
        if "mm_token_type_ids" in inspect.signature(model.forward).parameters:
            inputs["mm_token_type_ids"] = (ids == image_token_id).int()
    return inputs
