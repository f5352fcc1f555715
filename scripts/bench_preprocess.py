#!/usr/bin/env python3
"""Request preprocessing throughput: this package vs the transformers processor, side by side.

CPU mode (default) runs on one core (torch and nvImageCodec limited to one thread) and, for each
image size and each resize backend, checks that both produce the same pixel_values, then times a
whole request (decode, resize, normalize, patchify, tokens) interleaved run by run:

    ours (backend B) vs transformers' processor with backend B   (identical outputs)

transformers' default backend is torchvision; "pil" is its PIL backend (4.57's slow processor).

CUDA mode (`--device cuda`, for a GPU host) times batched requests: nvImageCodec decode into device
memory plus resize/patchify on the GPU, against this package's CPU path on the same JPEGs, and
reports the largest difference (the GPU's JPEG decoder may round differently from libjpeg).

    python scripts/bench_preprocess.py [--sizes 1280x720,1920x1080] [--repeats 15] [--device cuda --batch 8]
"""

from __future__ import annotations

import argparse
import io
import statistics
import tempfile
from pathlib import Path

import torch
from benchutil import time_interleaved

PROMPT = "<|vision_start|><|image_pad|><|vision_end|>Describe this picture."


def _sizes(text: str) -> list[tuple[int, int]]:
    try:
        return [(int(w), int(h)) for w, h in (s.lower().split("x") for s in text.split(","))]
    except ValueError:
        raise SystemExit(f"--sizes must look like 1280x720,1920x1080; got {text!r}") from None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="1280x720,1920x1080", help="JPEG sizes, WxH, comma separated")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--batch", type=int, default=8, help="images per batched request in --device cuda mode")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-preprocess-") as scratch:
        from qwen3vl_trt.qa.tiny import make_tiny_checkpoint

        model_dir = make_tiny_checkpoint(Path(scratch) / "ckpt")
        if args.device == "cpu":
            bench_cpu(model_dir, args)
        else:
            bench_cuda(model_dir, args)


def bench_cpu(model_dir: Path, args: argparse.Namespace) -> None:
    from PIL import Image, ImageOps
    from qwen3vl_trt.hf.reference import load_hf_processor
    from qwen3vl_trt.preprocess import Preprocessor, RequestLimits
    from qwen3vl_trt.qa.tiny import synthetic_jpeg

    torch.set_num_threads(1)
    # No serving cap: the comparison is against the processor's own limits.
    limits = RequestLimits(max_image_pixels=16_777_216)
    print(f"one CPU core; median of {args.repeats} interleaved runs per case; whole requests (decode included)")
    print(f"{'image':>10} {'backend':>12} {'ours img/s':>11} {'HF img/s':>9} {'ratio':>6} {'max |diff|':>11}")
    for width, height in _sizes(args.sizes):
        data = synthetic_jpeg(height, width, seed=1)
        for backend in ("torchvision", "pil"):
            ours = Preprocessor.from_pretrained(model_dir, resize_backend=backend, limits=limits)
            processor = load_hf_processor(model_dir, backend)

            def run_ours(ours=ours, data=data):
                return ours(prompt=PROMPT, images=[data]).pixel_values

            def run_hf(processor=processor, data=data):
                image = ImageOps.exif_transpose(Image.open(io.BytesIO(data)))
                return processor(text=[PROMPT], images=[image], return_tensors="pt")["pixel_values"]

            diff = (run_ours() - run_hf()).abs().max().item()
            t_ours, t_hf = (
                statistics.median(t) for t in time_interleaved([run_ours, run_hf], args.warmup, args.repeats)
            )
            print(
                f"{width}x{height:<5} {backend:>12} {1 / t_ours:11.1f} {1 / t_hf:9.1f} "
                f"{t_hf / t_ours:5.2f}x {diff:11.1e}"
            )


def bench_cuda(model_dir: Path, args: argparse.Namespace) -> None:
    from qwen3vl_trt.preprocess import Preprocessor, RequestLimits
    from qwen3vl_trt.qa.tiny import synthetic_jpeg

    if not torch.cuda.is_available():
        raise SystemExit("--device cuda needs a CUDA device")
    limits = RequestLimits(max_image_pixels=16_777_216, max_images=args.batch)
    gpu = Preprocessor.from_pretrained(model_dir, device="cuda", limits=limits)
    cpu = Preprocessor.from_pretrained(model_dir, device="cpu", limits=limits)
    prompt = "".join("<|vision_start|><|image_pad|><|vision_end|>" for _ in range(args.batch)) + "Compare."
    print(f"{torch.cuda.get_device_name()}; batches of {args.batch} images; median of {args.repeats} interleaved runs")
    print(f"{'image':>10} {'GPU img/s':>10} {'CPU img/s':>10} {'ratio':>6} {'max |diff|':>11} {'mean |diff|':>12}")
    for width, height in _sizes(args.sizes):
        images = [synthetic_jpeg(height, width, seed=i) for i in range(args.batch)]

        def run_gpu(images=images):
            pixels = gpu(prompt=prompt, images=images).pixel_values
            torch.cuda.synchronize()
            return pixels

        def run_cpu(images=images):
            return cpu(prompt=prompt, images=images).pixel_values

        diff = (run_gpu().cpu() - run_cpu()).abs()
        t_gpu, t_cpu = (statistics.median(t) for t in time_interleaved([run_gpu, run_cpu], args.warmup, args.repeats))
        n = args.batch
        print(
            f"{width}x{height:<5} {n / t_gpu:10.1f} {n / t_cpu:10.1f} {t_cpu / t_gpu:5.1f}x "
            f"{diff.max().item():11.1e} {diff.mean().item():12.1e}"
        )
    print(f"CPU path threads: {torch.get_num_threads()}")


if __name__ == "__main__":
    main()
