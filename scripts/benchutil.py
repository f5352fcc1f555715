"""Shared by the benchmark scripts: side-by-side timing in one process, and a preset's CPU-target build."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


def time_interleaved(fns: Sequence[Callable[[], object]], warmup: int, repeats: int) -> list[list[float]]:
    """Alternates the candidates run by run, so machine noise hits all of them alike; seconds per run."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, samples in zip(fns, times, strict=True):
            start = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - start)
    return times


def preset_repository(work: Path, preset: str, limits: Any, settings: Any = None) -> Path:
    """The Triton repository of a random `preset` checkpoint (qa.tiny) built for the CPU target with an fp32 LLM and
    `limits` (EngineLimits) under `work`, both kept there and reused when present."""
    from qwen3vl_trt.pipeline.build import BuildOptions, build
    from qwen3vl_trt.qa.tiny import make_tiny_checkpoint

    model_dir, build_dir = work / f"ckpt-{preset}", work / f"build-{preset}"
    if not model_dir.exists():
        print(f"making a random {preset} checkpoint in {model_dir}", file=sys.stderr, flush=True)
        make_tiny_checkpoint(model_dir, preset=preset, shard_mb=1024)
    if not (build_dir / "triton_repo").exists():
        print(f"building it for the CPU target in {build_dir}", file=sys.stderr, flush=True)
        options = BuildOptions(llm_dtype="fp32", limits=limits)
        build(model_dir, build_dir, options, target="cpu", settings=settings, log=lambda *_: None)
    return build_dir / "triton_repo"
