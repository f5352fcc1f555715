"""The `vision_encoder` model: the images of a batch of requests are encoded in runs, each run
their patches concatenated (ragged, never padded), and the outputs go back to each request exactly.

With ONNX Runtime (the CPU target, and GPU hosts without a vision engine) the portable graph attends
densely over all patches of a run (a block-diagonal N x N mask), so a run's time and memory grow with
the square of its patches: joining two images of n1 and n2 patches saves one run's fixed cost but adds
2 * n1 * n2 patch pairs of attention. Images join a run only where that pays (RunCost, measured on the
graph at warm-up), and only while the run's attention scores fit `attention_budget_bytes`; small
images share runs, large ones run alone. With the TensorRT vision engine (the GPU target; its
attention is the varlen plugin, linear in the run's images) the batch runs in order, cut only to the
engine's profile: at most its max patches and max images each, on the device, inputs and outputs
never leaving it.
Each request gets its prompt table (contracts.PROMPT_EMBEDDING_TABLE) in the LLM's dtype; a request
without images gets one zero row, which no id addresses, so every request carries a table.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from itertools import combinations
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ...errors import InputError
from ...llm.inputs import interleave_prompt_table
from ...vision.metadata import vision_metadata
from ...vision.onnx_runner import OnnxVisionRunner, VisionSidecar
from .. import interface

# Tensors of a run's attention per layer and head: the scores, the mask and the softmax.
_ATTENTION_COPIES = 3

# Square grids, in merge blocks per side, timed to measure a RunCost: 4 to 1024 patches at merge 2,
# from where the fixed cost dominates to where attention does.
_CALIBRATION_SIDES = (1, 2, 4, 8, 16)


@dataclass(frozen=True)
class _Image:
    request: int
    patches: slice  # of the request's patch rows
    tokens: int
    segments: int  # attention segments: one per temporal patch

    @property
    def size(self) -> int:
        return self.patches.stop - self.patches.start


# Called after each encoder run: its images, its patches, and its seconds (None where the run is only
# enqueued on a CUDA stream, so the host's clock does not see it end).
RunObserver = Callable[[int, int, float | None], None]


@dataclass(frozen=True)
class RunCost:
    """Seconds one run of the portable graph takes for n patches: fixed_s + per_patch_s * n +
    per_pair_s * n**2 (the dense attention over the run is the n**2 term)."""

    fixed_s: float
    per_patch_s: float
    per_pair_s: float

    def seconds(self, patches: int) -> float:
        return self.fixed_s + self.per_patch_s * patches + self.per_pair_s * patches**2

    def join_pays(self, run_patches: int, image_patches: int) -> bool:
        """Whether an image joining a run costs no more than running it alone: together minus apart is
        2 * per_pair_s * run_patches * image_patches (the cross attention) - fixed_s (the run saved)."""
        return 2 * self.per_pair_s * run_patches * image_patches <= self.fixed_s

    @classmethod
    def fit(cls, patches: Sequence[int], seconds: Sequence[float]) -> RunCost:
        """The least-squares fit of relative errors (times span orders of magnitude; absolute errors would
        leave the fixed cost to the noise of the largest run) with no term negative (more patches never
        make a run cheaper): of the fits over each subset of the three terms, the closest whose
        coefficients are all >= 0."""
        n = np.asarray(patches, dtype=np.float64)
        # Each row divided by its time: the fit's residuals are then relative errors (its target, 1).
        columns = np.stack([np.ones_like(n), n, n**2], axis=1) / np.asarray(seconds, dtype=np.float64)[:, None]
        target = np.ones(len(n))
        best: tuple[float, np.ndarray] | None = None
        for k in (1, 2, 3):
            for terms in combinations(range(3), k):
                solution = np.linalg.lstsq(columns[:, terms], target, rcond=None)[0]
                if (solution < 0).any():
                    continue
                coefficients = np.zeros(3)
                coefficients[list(terms)] = solution
                residual = float(np.sum((columns @ coefficients - target) ** 2))
                if best is None or residual < best[0]:
                    best = (residual, coefficients)
        assert best is not None  # the fixed term alone fits any non-negative times
        return cls(*(float(c) for c in best[1]))


# Before a cost is measured, every image runs alone: never slower than running apart.
ALONE = RunCost(fixed_s=0.0, per_patch_s=0.0, per_pair_s=1.0)


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


def plan_runs_by_cost(patches_per_image: Sequence[int], cost: RunCost, max_run_patches: int) -> list[list[int]]:
    """Image indices per run for a graph whose attention is dense over the run: taken smallest first, an
    image joins the latest run while cost.join_pays and the grown run stays within max_run_patches (the
    memory limit), else it opens a run; one over max_run_patches runs alone. Each step costs no more
    than running the image apart, so no run costs more than its images run one by one. Each run lists
    its images in batch order; runs come in the order of their first images."""
    order = sorted(range(len(patches_per_image)), key=lambda i: (patches_per_image[i], i))
    runs: list[list[int]] = []
    size = 0
    for i in order:
        n = patches_per_image[i]
        if runs and size + n <= max_run_patches and cost.join_pays(size, n):
            runs[-1].append(i)
            size += n
        else:
            runs.append([i])
            size = n
    return sorted(sorted(run) for run in runs)


class _OnnxRuntimeRuns:
    """The exported graph in ONNX Runtime, on host arrays."""

    synchronous = True

    def __init__(
        self, vision_dir: str | Path, attention_budget_bytes: int, cost: RunCost, intra_op_threads: int | None = None
    ):
        self.encoder = OnnxVisionRunner(vision_dir, intra_op_threads)
        heads = self.encoder.sidecar.num_heads
        # The largest run whose attention tensors fit the budget: _ATTENTION_COPIES fp32 [heads, N, N].
        self.max_run_patches = math.isqrt(attention_budget_bytes // (_ATTENTION_COPIES * 4 * heads))
        self.cost = cost

    def plan(self, images: Sequence[_Image]) -> list[list[int]]:
        return plan_runs_by_cost([im.size for im in images], self.cost, self.max_run_patches)

    def run(self, feeds: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        host = {name: tensor.cpu().numpy() for name, tensor in feeds.items()}
        host[interface.VISION_PIXELS.name] = host[interface.VISION_PIXELS.name].astype(np.float32, copy=False)
        image_embeds, deepstack_embeds = self.encoder.run(host)
        return torch.from_numpy(image_embeds), torch.from_numpy(deepstack_embeds)


class _EngineRuns:
    """The TensorRT vision engine (GPU hosts), on the model's current CUDA stream."""

    synchronous = False  # run() enqueues the engine and returns

    def __init__(self, engine_dir: str | Path, device: int):
        from ...vision.trt_runner import VisionEngine

        self.engine = VisionEngine(engine_dir, device)

    def fits(self, patches: int, segments: int) -> bool:
        return patches <= self.engine.sidecar.max_patches and segments <= self.engine.sidecar.max_images

    def plan(self, images: Sequence[_Image]) -> list[list[int]]:
        # The varlen plugin's work is linear in the run's images: the larger the run, the better.
        return plan_runs([im.size for im in images], self.fits, [im.segments for im in images])

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
        run_cost: RunCost | None = None,
        on_run: RunObserver | None = None,
        intra_op_threads: int | None = None,
    ):
        """engine_dir: a build-vision-engine output to run instead of the ONNX export (GPU hosts).
        run_cost: how ONNX Runtime runs are joined; None measures it at warm_up (until then each image
        runs alone). on_run: told of every encoder run. intra_op_threads: ONNX Runtime's threads (None:
        its default, one per physical core)."""
        self.backend: _OnnxRuntimeRuns | _EngineRuns = (
            _EngineRuns(engine_dir, device)
            if engine_dir
            else _OnnxRuntimeRuns(vision_dir, attention_budget_bytes, run_cost or ALONE, intra_op_threads)
        )
        self.measure_cost_at_warm_up = run_cost is None
        self.on_run = on_run
        sidecar = VisionSidecar.load(vision_dir)
        self.merge = sidecar.spatial_merge_size
        self.patch_dim = sidecar.patch_dim
        self.num_grid_per_side = sidecar.num_grid_per_side
        self.llm_dtype, self.hidden_size = llm_dtype, hidden_size

    @property
    def run_cost(self) -> RunCost | None:
        """The cost ONNX Runtime runs are planned by; None with the engine, whose profile cuts its runs."""
        return self.backend.cost if isinstance(self.backend, _OnnxRuntimeRuns) else None

    def warm_up(self) -> None:
        """One small run, so the first request does not pay the encoder's initialization; with ONNX
        Runtime and no run_cost given, then measures the RunCost its runs are planned by."""
        self.backend.run(self._blank_feeds(2))
        if isinstance(self.backend, _OnnxRuntimeRuns) and self.measure_cost_at_warm_up:
            self.backend.cost = self.measure_run_cost()

    def measure_run_cost(self, repeats: int = 3, enough_s: float = 1.0) -> RunCost:
        """The RunCost fitted to this machine's times of square blank runs (_CALIBRATION_SIDES within the
        memory limit), each size the fastest of up to `repeats` after an untimed one; a size stops
        repeating once its timed runs took enough_s (a large model's large runs, whose noise is small
        beside them). Every size runs: the largest are where the attention term shows."""
        assert isinstance(self.backend, _OnnxRuntimeRuns), "the engine's runs are planned by its profile"
        patches: list[int] = []
        seconds: list[float] = []
        for side in _CALIBRATION_SIDES:
            if (side * self.merge) ** 2 > self.backend.max_run_patches:
                break
            feeds = self._blank_feeds(side)
            self.backend.run(feeds)
            times: list[float] = []
            while len(times) < repeats and sum(times) < enough_s:
                start = time.perf_counter()
                self.backend.run(feeds)
                times.append(time.perf_counter() - start)
            patches.append((side * self.merge) ** 2)
            seconds.append(min(times))
        return RunCost.fit(patches, seconds) if patches else ALONE

    def _blank_feeds(self, side: int) -> dict[str, torch.Tensor]:
        """Per-patch inputs of one image of side x side merge blocks (random pixels: timing sees real values)."""
        rows = side * self.merge
        feeds = vision_metadata(np.array([[1, rows, rows]]), self.merge, self.num_grid_per_side)
        pixels = np.random.default_rng(0).uniform(-1, 1, (rows * rows, self.patch_dim)).astype(np.float32)
        feeds[interface.VISION_PIXELS.name] = pixels
        return {name: torch.as_tensor(value) for name, value in feeds.items()}

    def execute(self, requests: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        images: list[_Image] = []
        for r, inputs in enumerate(requests):
            start = 0
            for t, h, w in np.asarray(inputs[interface.IMAGE_GRID_THW.name]).reshape(-1, 3):
                n = int(t * h * w)
                images.append(_Image(r, slice(start, start + n), n // self.merge**2, int(t)))
                start += n
        # Each image's rows of the encoder's outputs: image_embeds [tokens, D], deepstack_embeds [K, tokens, D].
        embeds: list[torch.Tensor] = [torch.empty(0)] * len(images)
        deepstack: list[torch.Tensor] = [torch.empty(0)] * len(images)
        for run in self.backend.plan(images):
            feeds = {
                name: torch.cat([torch.as_tensor(requests[images[i].request][name])[images[i].patches] for i in run])
                for name in _PER_PATCH
            }
            began = time.perf_counter()
            image_embeds, deepstack_embeds = self.backend.run(feeds)
            if self.on_run is not None:
                took = time.perf_counter() - began if self.backend.synchronous else None
                self.on_run(len(run), sum(images[i].size for i in run), took)
            first = 0
            for i in run:
                rows = slice(first, first + images[i].tokens)
                embeds[i], deepstack[i] = image_embeds[rows], deepstack_embeds[:, rows]
                first += images[i].tokens
        outputs = []
        for r, inputs in enumerate(requests):
            mine = [i for i, im in enumerate(images) if im.request == r]
            tokens = sum(images[i].tokens for i in mine)
            expected = int(np.asarray(inputs[interface.VISUAL_TOKEN_COUNT.name]).reshape(-1)[0])
            if tokens != expected:
                raise InputError(f"request {r}: its image grids give {tokens} visual tokens, the prompt has {expected}")
            if tokens:
                table = interleave_prompt_table(
                    torch.cat([embeds[i] for i in mine]), torch.cat([deepstack[i] for i in mine], dim=1)
                ).to(self.llm_dtype)
            else:
                device = embeds[0].device if embeds else None
                table = torch.zeros((1, self.hidden_size), dtype=self.llm_dtype, device=device)
            outputs.append({interface.PROMPT_TABLE.name: table.contiguous()})
        return outputs


_PER_PATCH = (
    interface.VISION_PIXELS.name,
    interface.VISION_POS_EMBED_IDX.name,
    interface.VISION_POS_EMBED_W.name,
    interface.VISION_ROTARY_POS.name,
    interface.VISION_SEGMENT_START.name,
)
