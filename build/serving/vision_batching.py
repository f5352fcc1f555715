"""The `vision_encoder` model: the patches of every request in a batch run together, ragged (their
patches concatenated, never padded), and the outputs go back to each request exactly.

The portable graph attends densely over all patches of a run (a block-diagonal N x N mask), so its
memory grows with the square of the run's patches: a batch is cut, at image boundaries, into runs
whose attention scores fit `attention_budget_bytes`; a single image larger than that runs alone.
Each request gets its prompt table (contracts.PROMPT_EMBEDDING_TABLE) in the LLM's dtype; a request
without images gets one zero row, which no id addresses, so every request carries a table.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import InputError
from ..llm.inputs import interleave_prompt_table
from ..vision.runner import VisionEncoder
from . import interface as io

# Tensors of a run's attention per layer and head: the scores, the mask and the softmax.
_ATTENTION_COPIES = 3


@dataclass(frozen=True)
class _Image:
    request: int
    patches: slice  # of the request's patch rows
    tokens: int


def plan_runs(patches_per_image: Sequence[int], heads: int, budget_bytes: int) -> list[list[int]]:
    """Consecutive image indices per run: each run's fp32 attention (heads x N^2, a few copies) stays
    within the budget unless it is a single image."""
    runs: list[list[int]] = []
    size = 0
    for i, n in enumerate(patches_per_image):
        if runs and _ATTENTION_COPIES * 4 * heads * (size + n) ** 2 <= budget_bytes:
            runs[-1].append(i)
            size += n
        else:
            runs.append([i])
            size = n
    return runs


class VisionBatching:
    def __init__(self, vision_dir: str | Path, llm_dtype: torch.dtype, hidden_size: int, attention_budget_bytes: int):
        self.encoder = VisionEncoder(vision_dir)
        sidecar = self.encoder.sidecar
        self.heads = int(sidecar.raw["num_heads"])
        self.merge = sidecar.spatial_merge_size
        self.llm_dtype, self.hidden_size = llm_dtype, hidden_size
        self.budget = attention_budget_bytes
        self.runs = 0  # ONNX Runtime runs so far (the tests read it)

    def warm_up(self) -> None:
        """One small run, so the first request does not pay ONNX Runtime's initialization."""
        side = 2 * self.merge
        grid = np.array([[1, side, side]])
        pixels = np.zeros((side * side, self.encoder.sidecar.patch_dim), np.float32)
        self.encoder.run(self.encoder.inputs_for(pixels, grid))

    def execute(self, requests: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        images: list[_Image] = []
        for r, inputs in enumerate(requests):
            start = 0
            for t, h, w in np.asarray(inputs[io.IMAGE_GRID_THW.name]).reshape(-1, 3):
                n = int(t * h * w)
                images.append(_Image(r, slice(start, start + n), n // self.merge**2))
                start += n
        embeds: list[np.ndarray] = []
        deepstack: list[np.ndarray] = []
        for run in plan_runs([im.patches.stop - im.patches.start for im in images], self.heads, self.budget):
            feeds = {
                name: np.concatenate([_host(requests[images[i].request][name])[images[i].patches] for i in run])
                for name in _PER_PATCH
            }
            feeds[io.VISION_PIXELS.name] = feeds[io.VISION_PIXELS.name].astype(np.float32, copy=False)
            image_embeds, deepstack_embeds = self.encoder.run(feeds)
            self.runs += 1
            embeds.append(image_embeds)
            deepstack.append(deepstack_embeds)
        all_embeds = torch.from_numpy(np.concatenate(embeds)) if embeds else None
        all_deepstack = torch.from_numpy(np.concatenate(deepstack, axis=1)) if deepstack else None
        outputs = []
        first = 0
        for r, inputs in enumerate(requests):
            tokens = sum(im.tokens for im in images if im.request == r)
            expected = int(np.asarray(inputs[io.VISUAL_TOKEN_COUNT.name]).reshape(-1)[0])
            if tokens != expected:
                raise InputError(f"request {r}: its image grids give {tokens} visual tokens, the prompt has {expected}")
            if tokens and all_embeds is not None and all_deepstack is not None:
                span = slice(first, first + tokens)
                table = interleave_prompt_table(all_embeds[span], all_deepstack[:, span]).to(self.llm_dtype)
            else:
                table = torch.zeros((1, self.hidden_size), dtype=self.llm_dtype)
            first += tokens
            outputs.append({io.PROMPT_TABLE.name: table.contiguous()})
        return outputs


def _host(x: Any) -> np.ndarray:
    """ONNX Runtime's CPU provider reads host arrays (pixels arrive in device memory on the GPU target)."""
    return x.cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


_PER_PATCH = (
    io.VISION_PIXELS.name,
    io.VISION_POS_EMBED_IDX.name,
    io.VISION_POS_EMBED_W.name,
    io.VISION_ROTARY_POS.name,
    io.VISION_SEGMENT_START.name,
)
