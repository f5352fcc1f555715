"""The transformers vision tower as the reference for parity checks (CPU, fp32).

Works with transformers 4.57.x (forward returns a tuple) and 5.x (returns a ModelOutput).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from .checkpoint import Checkpoint
from .contracts import VISUAL_PREFIX


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
