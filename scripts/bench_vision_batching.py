#!/usr/bin/env python3
"""The vision_encoder's batching on ONNX Runtime: per-image encoder time of images batched vs alone.

Makes a tiny checkpoint (or takes --model) and exports its vision encoder (fp32, the CPU target's
graph), preprocesses real JPEGs with the serving preprocessing, and times `VisionBatching.execute`
on, side by side in one run (interleaved, so machine noise hits all alike):

  - one 640x480 image alone; 2 and 4 such images as one batch (one request each);
  - a mixed batch of small images (32x32 to 96x64), and the same images each alone.

Batches run as planned by the RunCost measured at warm-up (the serving default), and, for
comparison, as one run each ("joined": every image of the batch concatenated, the planning before
costs were measured). Each figure is per image; ratios are batched / alone (the goal: <= 1.1).

    .venv/bin/python scripts/bench_vision_batching.py [--model DIR] [--repeats 5] [--json]

Another benchmark can call vision_batching_figures(model_dir, vision_dir) for the same figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from benchutil import time_interleaved
from qwen3vl_trt.common.limits import EngineLimits
from qwen3vl_trt.qa.tiny import synthetic_jpeg
from qwen3vl_trt.serving import interface
from qwen3vl_trt.serving.repository.settings import RepositorySettings
from qwen3vl_trt.serving.request import GenerationRequest
from qwen3vl_trt.serving.stages.preprocessing import Preprocessing
from qwen3vl_trt.serving.stages.vision_batching import RunCost, VisionBatching

LARGE = (480, 640)  # height, width
SMALL = [(32, 32), (64, 48), (48, 64), (32, 64), (64, 64), (96, 64), (64, 96), (48, 48)]
# Every image of a batch in one run (up to the memory limit): joining always pays under this cost.
JOINED = RunCost(fixed_s=1.0, per_patch_s=0.0, per_pair_s=0.0)


def _vision_requests(model_dir: Path, sizes: list[tuple[int, int]], seed: int) -> list[dict[str, Any]]:
    """The vision_encoder's inputs for each image alone, as the served preprocessing makes them (it joins a
    batch's images into one vision request; here the planner's cases are made of these)."""
    limits = EngineLimits(
        max_batch_size=len(sizes), max_input_len=4096, max_seq_len=8192, max_num_tokens=8192, max_visual_tokens=4096
    )
    pre = Preprocessing(model_dir, limits, torch.float32, 1)  # the table's width is not used here
    inputs = [
        GenerationRequest(
            prompt="Describe this picture.", max_tokens=1, images=(synthetic_jpeg(h, w, seed + i),)
        ).named_inputs()
        for i, (h, w) in enumerate(sizes)
    ]
    requests = []
    for outcome in pre.execute(inputs):
        if isinstance(outcome, Exception):
            raise outcome
        requests.append(pre.vision_request(outcome.to_encode))
    return requests


def vision_batching_figures(model_dir: Path, vision_dir: Path, repeats: int = 5, warmup: int = 1) -> dict[str, Any]:
    """Per-image milliseconds (median of `repeats`) of each case, the runs each batch was cut into, the
    measured RunCost, and the batched / alone ratios."""
    hidden = 1  # only the prompt table's placeholder row of a text-only request has this width: none here
    budget = RepositorySettings().attention_budget_bytes
    planned = VisionBatching(vision_dir, torch.float32, hidden, budget)
    planned.warm_up()  # measures the RunCost, as the served model does
    joined = VisionBatching(vision_dir, torch.float32, hidden, budget, run_cost=JOINED)
    joined.warm_up()

    large = _vision_requests(model_dir, [LARGE] * 4, seed=0)
    small = _vision_requests(model_dir, SMALL, seed=10)
    cases = {
        "large alone": (planned, [large[:1]]),
        "2 large, planned": (planned, [large[:2]]),
        "4 large, planned": (planned, [large]),
        "2 large, joined": (joined, [large[:2]]),
        "4 large, joined": (joined, [large]),
        "small each alone": (planned, [[r] for r in small]),
        "small, planned": (planned, [small]),
        "small, joined": (joined, [small]),
    }
    runs: dict[str, list[int]] = {}  # images of each run of a case's last repeat

    def case(name: str) -> Callable[[], None]:
        batching, batches = cases[name]

        def run() -> None:
            runs[name] = []
            batching.on_run = lambda images, _patches, _seconds: runs[name].append(images)
            for batch in batches:
                batching.execute(batch)

        return run

    times = time_interleaved([case(name) for name in cases], warmup, repeats)
    per_image_ms = {
        name: 1000 * statistics.median(samples) / sum(len(batch) for batch in cases[name][1])
        for name, samples in zip(cases, times, strict=True)
    }
    alone = per_image_ms["large alone"]
    cost = planned.run_cost
    return {
        "per_image_ms": per_image_ms,
        "ratios": {
            "2 large, planned / alone": per_image_ms["2 large, planned"] / alone,
            "4 large, planned / alone": per_image_ms["4 large, planned"] / alone,
            "2 large, joined / alone": per_image_ms["2 large, joined"] / alone,
            "4 large, joined / alone": per_image_ms["4 large, joined"] / alone,
            "small, planned / each alone": per_image_ms["small, planned"] / per_image_ms["small each alone"],
            "small, joined / each alone": per_image_ms["small, joined"] / per_image_ms["small each alone"],
        },
        "images per run": runs,
        "patches": {
            "large": int(large[0][interface.VISION_PIXELS.name].shape[0]),
            "small": [int(r[interface.VISION_PIXELS.name].shape[0]) for r in small],
        },
        "run_cost": None if cost is None else vars(cost),
    }


def _print(figures: dict[str, Any]) -> None:
    print(
        f"patches: one {LARGE[1]}x{LARGE[0]} image {figures['patches']['large']}, small {figures['patches']['small']}"
    )
    cost = figures["run_cost"]
    if cost:
        print(
            f"measured run cost: {1000 * cost['fixed_s']:.2f} ms + {1e6 * cost['per_patch_s']:.2f} us/patch "
            f"+ {1e9 * cost['per_pair_s']:.3f} ns/patch^2"
        )
    print(f"{'case':<22}{'ms / image':>12}  images per run")
    for name, ms in figures["per_image_ms"].items():
        print(f"{name:<22}{ms:>12.2f}  {figures['images per run'].get(name)}")
    for name, ratio in figures["ratios"].items():
        print(f"{name:<32}{ratio:>6.2f}x")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, help="a Qwen3-VL checkpoint (default: a tiny random one)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = p.parse_args()
    from qwen3vl_trt.qa.tiny import make_tiny_checkpoint
    from qwen3vl_trt.vision.export import export_vision

    with tempfile.TemporaryDirectory(prefix="bench-vision-batching-") as scratch:
        model_dir = args.model or make_tiny_checkpoint(Path(scratch) / "ckpt")
        vision_dir = export_vision(model_dir, Path(scratch) / "vision", dtype="fp32", log=lambda *_: None).output_dir
        figures = vision_batching_figures(model_dir, vision_dir, args.repeats, args.warmup)
    if args.json:
        print(json.dumps(figures, indent=2))
    else:
        _print(figures)


if __name__ == "__main__":
    main()
