#!/usr/bin/env python3
"""Vision TensorRT engines from plugin exports against ONNX Runtime, on a GPU host with TensorRT.

For tiny random-weight towers of head_dim 64 and 72: exports the portable fp32 graph (the reference, run by ONNX
Runtime) and the plugin graph in each dtype, builds each plugin export's engine (a second build reuses the first's
timing cache), then runs mixed image batches through the engine (one concatenated run, split per request) and
through ONNX Runtime, and prints the relative error and the engine's time per batch. Exits 1 on an error over the
dtype's tolerance.

    python scripts/vision_engine_check.py [--dtype fp16 bf16] [--workdir DIR] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from qwen3vl_trt.qa.tiny import make_tiny_checkpoint
from qwen3vl_trt.vision import OnnxVisionRunner
from qwen3vl_trt.vision.engine import VisionEngineProfile, build_vision_engine
from qwen3vl_trt.vision.export import export_vision, parity_errors
from qwen3vl_trt.vision.trt_runner import VisionEngine

TOWERS = {"hd64": None, "hd72": {"hidden_size": 144, "num_heads": 2, "intermediate_size": 288}}
# Relative error of a reduced-precision engine against the fp32 graph (tests hold the fp16 ONNX to 1e-2).
TOLERANCE = {"fp16": 1e-2, "bf16": 4e-2}
# Requests of one batch: mixed sizes, a non-square grid, the smallest grid and a video (two frame pairs).
REQUESTS = ([[1, 16, 24]], [[1, 2, 2], [1, 32, 16]], [[2, 8, 8], [1, 12, 6]])
PROFILE = VisionEngineProfile(min_patches=4, opt_patches=1024, max_patches=8192, max_images=16)


def check_tower(name: str, overrides: dict | None, dtypes: list[str], work: Path) -> list[dict]:
    model = make_tiny_checkpoint(work / name, vision_overrides=overrides, force=True)
    portable = OnnxVisionRunner(export_vision(model, work / f"{name}-portable", force=True).output_dir)
    rng = np.random.default_rng(0)
    feeds = []
    for grids in REQUESTS:
        grid = np.array(grids)
        pixels = rng.uniform(-1, 1, (int(np.prod(grid, axis=1).sum()), 1536)).astype(np.float32)
        feeds.append(portable.inputs_for(pixels, grid))
    expected = [portable.run(f) for f in feeds]
    rows = []
    for dtype in dtypes:
        onnx_dir = export_vision(model, work / f"{name}-plugin-{dtype}", dtype=dtype, variant="plugin", force=True)
        engine_dir = work / f"{name}-engine-{dtype}"
        seconds = []
        for _ in range(2):  # the second build reuses the timing cache the first wrote
            start = time.perf_counter()
            build_vision_engine(onnx_dir.output_dir, engine_dir, PROFILE, dtype=dtype, force=True)
            seconds.append(time.perf_counter() - start)
        engine = VisionEngine(engine_dir)
        stream = torch.cuda.Stream()
        outputs = engine.encode_requests([{k: torch.from_numpy(v) for k, v in f.items()} for f in feeds], stream)
        stream.synchronize()
        errors = [
            parity_errors(ours.float().cpu().numpy(), theirs)[1]
            for (image, deepstack), (ref_image, ref_deepstack) in zip(outputs, expected, strict=True)
            for ours, theirs in ((image, ref_image), (deepstack, ref_deepstack))
        ]
        batch = {k: torch.from_numpy(np.concatenate([f[k] for f in feeds])).cuda() for k in feeds[0]}
        times = []
        for _ in range(20):
            torch.cuda.synchronize()
            start = time.perf_counter()
            engine.run(batch, stream)
            stream.synchronize()
            times.append(time.perf_counter() - start)
        rows.append(
            {
                "tower": name,
                "dtype": dtype,
                "max_rel_error": max(errors),
                "tolerance": TOLERANCE[dtype],
                "patches": int(batch["segment_start"].shape[0]),
                "engine_ms": 1e3 * statistics.median(times),
                "build_s": seconds,
            }
        )
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", nargs="+", default=list(TOLERANCE), choices=list(TOLERANCE))
    p.add_argument("--workdir", type=Path, help="keeps checkpoints, exports and engines (default: a temp dir)")
    p.add_argument("--json", type=Path, help="also write the rows to this file")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = args.workdir or Path(tmp)
        rows = [row for name, overrides in TOWERS.items() for row in check_tower(name, overrides, args.dtype, work)]
    print(f"{'tower':>6} {'dtype':>5} {'patches':>7} | {'rel error':>9} {'tolerance':>9} | {'engine ms':>9} | builds s")
    for r in rows:
        builds = " then ".join(f"{s:.1f}" for s in r["build_s"])
        print(
            f"{r['tower']:>6} {r['dtype']:>5} {r['patches']:>7} | {r['max_rel_error']:9.2e} {r['tolerance']:9.0e} | "
            f"{r['engine_ms']:9.3f} | {builds} (timing cache reused)"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    failed = [r for r in rows if r["max_rel_error"] > r["tolerance"]]
    for r in failed:
        print(f"FAIL: {r['tower']} {r['dtype']} engine differs from ONNX Runtime by {r['max_rel_error']:.2e}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
