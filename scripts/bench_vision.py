#!/usr/bin/env python3
"""ONNX Runtime vs transformers eager on a real Qwen3-VL vision tower shape, side by side.

Builds a random-weight checkpoint with the released 2B/4B tower (24 layers, hidden 1024, 16 heads;
`--preset 8b-vision` for 8B and up), exports it, then times both on the same inputs in this process
with the same thread count and prints the speed ratio. Weights are random; speed does not depend
on their values.

    python scripts/bench_vision.py [--patches 1024] [--repeats 5] [--threads N] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from benchutil import time_interleaved


def _grid_for(patches: int) -> np.ndarray:
    side = int(round(patches**0.5))
    if side * side != patches or side % 2:
        sys.exit(f"--patches must be the square of an even number (e.g. 1024 = 32 x 32), got {patches}")
    return np.array([[1, side, side]])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="2b-vision", choices=["2b-vision", "8b-vision"])
    p.add_argument("--patches", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--workdir", type=Path, help="keeps the checkpoint and export for reruns (default: temp dir)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-vision-") as scratch:
        run(args, args.workdir or Path(scratch))


def run(args: argparse.Namespace, workdir: Path) -> None:
    from qwen3vl_trt.hf.checkpoint import Checkpoint
    from qwen3vl_trt.hf.reference import load_hf_vision_tower, run_hf_vision_tower
    from qwen3vl_trt.qa.tiny import make_tiny_checkpoint
    from qwen3vl_trt.vision import OnnxVisionRunner
    from qwen3vl_trt.vision.export import export_vision, parity_errors

    model_dir, onnx_dir = workdir / f"ckpt-{args.preset}", workdir / f"vision-{args.preset}-fp32"
    if not model_dir.exists():
        print(f"making a random {args.preset} checkpoint in {model_dir}")
        make_tiny_checkpoint(model_dir, preset=args.preset, shard_mb=1024)
    if not onnx_dir.exists():
        export_vision(model_dir, onnx_dir, dtype="fp32")

    torch.set_num_threads(args.threads)
    ckpt = Checkpoint(model_dir)
    cfg = ckpt.info.vision
    reference = load_hf_vision_tower(ckpt)
    encoder = OnnxVisionRunner(onnx_dir, intra_op_threads=args.threads)
    grid = _grid_for(args.patches)
    pixels = np.random.default_rng(0).uniform(-1, 1, (args.patches, cfg.patch_dim)).astype(np.float32)
    feeds = encoder.inputs_for(pixels, grid)

    ours, theirs = encoder.run(feeds), run_hf_vision_tower(reference, pixels, grid)
    rel = max(parity_errors(ours[0], theirs[0])[1], parity_errors(ours[1], theirs[1])[1])

    attn = getattr(reference.config, "_attn_implementation", "default")
    eager, ort = time_interleaved(
        [lambda: run_hf_vision_tower(reference, pixels, grid), lambda: encoder.run(feeds)], args.warmup, args.repeats
    )
    eager_ms, ort_ms = statistics.median(eager) * 1e3, statistics.median(ort) * 1e3
    print(
        f"vision tower {args.preset}: {cfg.depth} layers, hidden {cfg.hidden_size}, {cfg.num_heads} heads; "
        f"{args.patches} patches (grid {grid[0].tolist()}), fp32, {args.threads} threads"
    )
    print(f"  parity: max relative error {rel:.2e}")
    print(f"  transformers eager (attn {attn}): median {eager_ms:.1f} ms over {args.repeats} runs")
    print(f"  ONNX Runtime CPU:                  median {ort_ms:.1f} ms over {args.repeats} runs")
    print(f"  speed ratio ORT / eager: {eager_ms / ort_ms:.2f}x")


if __name__ == "__main__":
    main()
