#!/usr/bin/env python
"""A new replica's start, CPU target on a real tritonserver: time from nothing to its first answered request on a
build-cache miss and on a hit, and the first request's latency after ready against the median of the next ten,
with warm-up before ready and without (`serve --no-warmup`), side by side in one run.

Each replica is what a pod runs: `qwen3vl-trt build --cache` (its init container), then `qwen3vl-trt serve`,
polled at serve's own GET /ready; then an image request (its own image: no visual-cache hit), and ten more of the
same size, each a different image. The checkpoint is the 2b-vision preset (the released 2B vision tower).

    .venv/bin/python scripts/bench_replica_start.py [--preset 2b-vision] [--max-tokens 16] [--keep DIR]
"""

from __future__ import annotations

import argparse
import io
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
from PIL import Image
from qwen3vl_trt.serving.client import Client
from qwen3vl_trt.serving.ports import free_ports


def _cli(*args: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "qwen3vl_trt.cli", *args], **kwargs)


def _image(seed: int, side: int = 448) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="JPEG", quality=90)
    return out.getvalue()


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def replica(ckpt: Path, cache: Path, output: Path, log: Path, warmup: bool, max_tokens: int, seed: int) -> dict:
    """One replica from nothing: build --cache, serve, ready, eleven requests. Its timings (seconds)."""
    start = time.perf_counter()
    with open(log, "wb") as out:
        built = _cli("build", "--model", str(ckpt), "--output", str(output), "--cache", str(cache), stdout=out)
        if built.wait() != 0:
            raise SystemExit(f"build failed: see {log}")
        build_s = time.perf_counter() - start
        ports = free_ports()
        ready_port = ports.ready
        args = ["serve", "--repo", str(output / "triton_repo"), "--grpc-port", str(ports.grpc)]
        args += ["--http-port", str(ports.http), "--metrics-port", str(ports.metrics), "--ready-port", str(ready_port)]
        server = _cli(*args, *([] if warmup else ["--no-warmup"]), stdout=out, stderr=subprocess.STDOUT)
        try:
            while not _ready(f"http://127.0.0.1:{ready_port}/ready"):
                if server.poll() is not None:
                    raise SystemExit(f"serve exited with {server.returncode}: see {log}")
                time.sleep(0.2)
            ready_s = time.perf_counter() - start
            client = Client(f"127.0.0.1:{ports.grpc}")
            latencies = []
            for i in range(11):
                sent = time.perf_counter()
                client.generate("Describe the picture.", [_image(seed * 100 + i)], max_tokens, temperature=0.0)
                latencies.append(time.perf_counter() - sent)
                if i == 0:
                    first_answer_s = time.perf_counter() - start
            client.close()
        finally:
            server.terminate()
            server.wait(timeout=120)
    return {
        "build_s": build_s,
        "ready_s": ready_s,
        "first_answer_s": first_answer_s,
        "first_s": latencies[0],
        "median_next_s": statistics.median(latencies[1:]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="2b-vision")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--keep", type=Path, help="keep the checkpoint, cache, builds and logs here")
    args = parser.parse_args()
    work = args.keep or Path(tempfile.mkdtemp(prefix="bench-replica-start-"))
    try:
        ckpt, cache = work / "checkpoint", work / "cache"
        made = _cli("make-tiny", "--preset", args.preset, "--output", str(ckpt), stdout=subprocess.DEVNULL)
        if made.wait() != 0:
            raise SystemExit("make-tiny failed")
        runs = {}
        for seed, (name, warmup) in enumerate([("miss", True), ("hit", True), ("hit, no warm-up", False)]):
            slug = name.replace(", ", "-").replace(" ", "-")
            runs[name] = replica(
                ckpt, cache, work / f"replica-{slug}", work / f"replica-{slug}.log", warmup, args.max_tokens, seed
            )
        print(f"a new replica, {args.preset} checkpoint, CPU target (tritonserver), {args.max_tokens}-token answers")
        print(f"{'':18} {'build':>8} {'ready':>8} {'1st answer':>11} {'1st req':>8} {'median 2-11':>12} {'ratio':>6}")
        for name, r in runs.items():
            ratio = r["first_s"] / r["median_next_s"]
            print(
                f"{name:18} {r['build_s']:7.1f}s {r['ready_s']:7.1f}s {r['first_answer_s']:10.1f}s "
                f"{r['first_s']:7.2f}s {r['median_next_s']:11.2f}s {ratio:6.2f}"
            )
        hit, miss = runs["hit"]["first_answer_s"], runs["miss"]["first_answer_s"]
        print(f"time to the first answer, hit / miss: {hit / miss:.2f}")
        warm = runs["hit"]["first_s"] / runs["hit"]["median_next_s"]
        cold = runs["hit, no warm-up"]["first_s"] / runs["hit, no warm-up"]["median_next_s"]
        print(f"first request / median of the next ten: {warm:.2f} with warm-up (aim <= 1.5), {cold:.2f} without")
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
