"""The `vision_encoder` model: the patches of every request in a batch run together, ragged (their
patches concatenated, never padded), and the outputs go back to each request exactly.

With ONNX Runtime (the CPU target, and GPU hosts without a vision engine) the portable graph attends
densely over all patches of a run (a block-diagonal N x N mask), so its memory grows with the square
of the run's patches: a batch is cut, at image boundaries, into runs whose attention scores fit
`attention_budget_bytes`; a single image larger than that runs alone. With the TensorRT vision engine
(the GPU target; its attention is the varlen plugin) runs are cut to the engine's profile: at most its
max patches and max images each, on the device, inputs and outputs never leaving it.
Each request gets its prompt table (contracts.PROMPT_EMBEDDING_TABLE) in the LLM's dtype; a request
without images gets one zero row, which no id addresses, so every request carries a table.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import InputError
from ..llm.inputs import interleave_prompt_table
from ..vision.metadata import vision_metadata
from ..vision.runner import VisionEncoder, VisionSidecar
from . import interface

# Tensors of a run's attention per layer and head: the scores, the mask and the softmax.
_ATTENTION_COPIES = 3


@dataclass(frozen=True)
class _Image:
    request: int
    patches: slice  # of the request's patch rows
    tokens: int
    segments: int  # attention segments: one per temporal patch


def plan_runs(
    patches_per_image: Sequence[int], fits: Callable[[int, int], bool], segments_per_image: Sequence[int] | None = None
) -> list[list[int]]:
    """Consecutive image indices per run: an image joins the run before it while fits(patches, segments)
    holds for the grown run; an image that fits nowhere runs alone. Segments are the attention segments
    (one per temporal patch, so a video frame pair each; default one per image)."""
    segments_per_image = segments_per_image or [1] * len(patches_per_image)
    runs: list[list[int]] = []
    size = segments = 0
    for i, (n, k) in enumerate(zip(patches_per_image, segments_per_image, strict=True)):
        if runs and fits(size + n, segments + k):
            runs[-1].append(i)
            size, segments = size + n, segments + k
        else:
            runs.append([i])
            size, segments = n, k
    return runs


class _OnnxRuntimeRuns:
    """The exported graph in ONNX Runtime, on host arrays."""

    def __init__(self, vision_dir: str | Path, attention_budget_bytes: int, intra_op_threads: int | None = None):
        self.encoder = VisionEncoder(vision_dir, intra_op_threads)
        self.heads = int(self.encoder.sidecar.raw["num_heads"])
        self.budget = attention_budget_bytes

    def fits(self, patches: int, _segments: int) -> bool:
        return _ATTENTION_COPIES * 4 * self.heads * patches**2 <= self.budget

    def run(self, feeds: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        host = {name: tensor.cpu().numpy() for name, tensor in feeds.items()}
        host[interface.VISION_PIXELS.name] = host[interface.VISION_PIXELS.name].astype(np.float32, copy=False)
        image_embeds, deepstack_embeds = self.encoder.run(host)
        return torch.from_numpy(image_embeds), torch.from_numpy(deepstack_embeds)


class _EngineRuns:
    """The TensorRT vision engine (GPU hosts), on the model's current CUDA stream."""

    def __init__(self, engine_dir: str | Path, device: int):
        from ..vision.engine_runner import VisionEngine

        self.engine = VisionEngine(engine_dir, device)

    def fits(self, patches: int, segments: int) -> bool:
        return patches <= self.engine.sidecar.max_patches and segments <= self.engine.sidecar.max_images

    def run(self, feeds: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return self.engine.run(feeds)  # refuses a run over the profile (a single image too large for it)


class VisionBatching:
    def __init__(
        self,
        vision_dir: str | Path,
        llm_dtype: torch.dtype,
        hidden_size: int,
        attention_budget_bytes: int,
        engine_dir: str | Path | None = None,
        device: int = 0,
        intra_op_threads: int | None = None,
    ):
        """engine_dir: a build-vision-engine output to run instead of the ONNX export (GPU hosts);
        intra_op_threads: ONNX Runtime's threads (None: its default, one per physical core)."""
        self.backend: _OnnxRuntimeRuns | _EngineRuns = (
            _EngineRuns(engine_dir, device)
            if engine_dir
            else _OnnxRuntimeRuns(vision_dir, attention_budget_bytes, intra_op_threads)
        )
        sidecar = VisionSidecar.load(vision_dir)
        self.merge = sidecar.spatial_merge_size
        self.patch_dim = sidecar.patch_dim
        self.num_grid_per_side = sidecar.num_grid_per_side
        self.llm_dtype, self.hidden_size = llm_dtype, hidden_size
        self.runs = 0  # encoder runs so far (the tests read it)

    def warm_up(self) -> None:
        """One small run, so the first request does not pay the encoder's initialization."""
        side = 2 * self.merge
        grid = np.array([[1, side, side]])
        feeds = vision_metadata(grid, self.merge, self.num_grid_per_side)
        feeds[interface.VISION_PIXELS.name] = np.zeros((side * side, self.patch_dim), np.float32)
        self.backend.run({name: torch.as_tensor(value) for name, value in feeds.items()})

    def execute(self, requests: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        images: list[_Image] = []
        for r, inputs in enumerate(requests):
            start = 0
            for t, h, w in np.asarray(inputs[interface.IMAGE_GRID_THW.name]).reshape(-1, 3):
                n = int(t * h * w)
                images.append(_Image(r, slice(start, start + n), n // self.merge**2, int(t)))
                start += n
        embeds: list[torch.Tensor] = []
        deepstack: list[torch.Tensor] = []
        patches = [im.patches.stop - im.patches.start for im in images]
        for run in plan_runs(patches, self.backend.fits, [im.segments for im in images]):
            feeds = {
                name: torch.cat([torch.as_tensor(requests[images[i].request][name])[images[i].patches] for i in run])
                for name in _PER_PATCH
            }
            image_embeds, deepstack_embeds = self.backend.run(feeds)
            self.runs += 1
            embeds.append(image_embeds)
            deepstack.append(deepstack_embeds)
        all_embeds = torch.cat(embeds) if embeds else None
        all_deepstack = torch.cat(deepstack, dim=1) if deepstack else None
        outputs = []
        first = 0
        for r, inputs in enumerate(requests):
            tokens = sum(im.tokens for im in images if im.request == r)
            expected = int(np.asarray(inputs[interface.VISUAL_TOKEN_COUNT.name]).reshape(-1)[0])
            if tokens != expected:
                raise InputError(f"request {r}: its image grids give {tokens} visual tokens, the prompt has {expected}")
            if tokens and all_embeds is not None and all_deepstack is not None:
                span = slice(first, first + tokens)
                table = interleave_prompt_table(all_embeds[span], all_deepstack[:, span]).to(self.llm_dtype)
            else:
                device = all_embeds.device if all_embeds is not None else None
                table = torch.zeros((1, self.hidden_size), dtype=self.llm_dtype, device=device)
            first += tokens
            outputs.append({interface.PROMPT_TABLE.name: table.contiguous()})
        return outputs


_PER_PATCH = (
    interface.VISION_PIXELS.name,
    interface.VISION_POS_EMBED_IDX.name,
    interface.VISION_POS_EMBED_W.name,
    interface.VISION_ROTARY_POS.name,
    interface.VISION_SEGMENT_START.name,
)
