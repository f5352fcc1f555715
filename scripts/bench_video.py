#!/usr/bin/env python3
"""Video preprocessing throughput: this package vs transformers, side by side, on the same clips.

For each clip (30 s of 720p H.264 at 30 fps by default, encoded here with FFmpeg: x264's default keyframe interval and
a 2 s one, as cameras and phones write them), checks that both give identical pixel_values_videos and grids, then
times a whole request, interleaved run by run:

    ours: the container's index, the sampled frames decoded (PyAV), resized, normalized and patchified
    transformers: video_utils.load_video(backend="pyav") with the video processor's sampling, then the processor
                  (the same decoder library, FFmpeg through PyAV, on the same machine and threads)

and prints the ratio and frames per second (sampled frames, and frames of the clip covered).

    python scripts/bench_video.py [--seconds 30 --size 1280x720 --fps 30] [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch
from benchutil import time_interleaved

PROMPT = "<|vision_start|><|video_pad|><|vision_end|>What happens in this video?"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--size", default="1280x720", help="WxH")
    p.add_argument("--fps", type=float, default=30.0)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--warmup", type=int, default=1)
    args = p.parse_args()
    width, height = (int(v) for v in args.size.lower().split("x"))
    from qwen3vl_trt.common.limits import RequestLimits
    from qwen3vl_trt.hf.reference import load_hf_processor
    from qwen3vl_trt.preprocess import Preprocessor
    from qwen3vl_trt.qa.tiny import make_tiny_checkpoint, synthetic_video
    from transformers.video_utils import load_video

    frames = round(args.seconds * args.fps)
    clips = {
        "x264 default GOP (250)": {"preset": "veryfast"},
        "2 s GOP": {"preset": "veryfast", "g": str(round(2 * args.fps))},
    }
    with tempfile.TemporaryDirectory(prefix="bench-video-") as scratch:
        model_dir = make_tiny_checkpoint(Path(scratch) / "ckpt")
        # No serving caps: the comparison is against the processor's own budget (24 MP per video).
        unlimited = RequestLimits(max_video_pixels=2**31 - 1, max_visual_tokens=2**31 - 1, max_prompt_tokens=2**31 - 1)
        ours = Preprocessor.from_pretrained(model_dir, limits=unlimited)
        processor = load_hf_processor(model_dir)
        print(
            f"{frames} frames of {width}x{height} at {args.fps:g} fps ({args.seconds:g} s), H.264 (libx264 veryfast); "
            f"{torch.get_num_threads()} torch threads; median of {args.repeats} interleaved runs; whole requests"
        )
        print(
            f"{'clip':>24} {'sampled':>8} {'ours s':>7} {'HF s':>6} {'ratio':>6} {'ours fr/s':>10} {'HF fr/s':>8} "
            f"{'clip fr/s':>10} {'max |diff|':>11}"
        )
        for name, options in clips.items():
            data = synthetic_video(frames, height, width, args.fps, options=options)
            path = Path(scratch) / "clip.mp4"
            path.write_bytes(data)

            def run_ours(data=data):
                request = ours(prompt=PROMPT, videos=[data])
                return request.pixel_values, request.video_grid_thw

            def run_hf(path=path):
                video, metadata = load_video(
                    str(path), backend="pyav", sample_indices_fn=processor.video_processor.sample_frames
                )
                out = processor(
                    text=[PROMPT],
                    videos=[video],
                    video_metadata=[metadata],
                    do_sample_frames=False,
                    return_tensors="pt",
                )
                return out["pixel_values_videos"], out["video_grid_thw"].numpy()

            (mine, grid), (theirs, hf_grid) = run_ours(), run_hf()
            if mine.shape != theirs.shape or (grid != hf_grid).any():
                raise SystemExit(f"{name}: outputs differ in shape: {list(mine.shape)} vs {list(theirs.shape)}")
            diff = (mine - theirs).abs().max().item()
            t_ours, t_hf = (
                statistics.median(t) for t in time_interleaved([run_ours, run_hf], args.warmup, args.repeats)
            )
            sampled = int(grid[0, 0]) * 2
            print(
                f"{name:>24} {sampled:8d} {t_ours:7.2f} {t_hf:6.2f} {t_hf / t_ours:5.2f}x {sampled / t_ours:10.1f} "
                f"{sampled / t_hf:8.1f} {frames / t_ours:10.0f} {diff:11.1e}"
            )


if __name__ == "__main__":
    main()
