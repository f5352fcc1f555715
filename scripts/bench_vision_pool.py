#!/usr/bin/env python3
"""The vision pool's isolation: text-only time to first token and image-request throughput under a mixed load, the
colocated deployment against the split one, side by side in one run on real tritonservers (the CPU target).

The model has the real 2B vision tower (`--preset 2b-vision`; a tiny language model behind it), so an image costs
what it would to decode and encode. Colocated: one replica on every core this process may use. Split: the replica
pinned to the first core and one pool member (`serve --role vision`'s models) to the second, the replica a language
replica (`serve --role language`'s models and configs: no vision encoder) with the member as its vision pool. The
visual cache is off in both, so every image is encoded.

The load, the same for both: --image-clients clients each sending, one after another, requests of --images images
(photos of mixed sizes, never the same twice), and text-only requests sent at --text-rate per second (an open loop:
each on a thread of its own), for --seconds. It prints, per deployment: the text requests' TTFT p50 and p99 (send to
first streamed response), image requests per second; then the split's ratios to the colocated. The first
--check requests of each kind carry the same contents in both deployments and must get the same tokens (exit 1
otherwise).

    .venv/bin/python scripts/bench_vision_pool.py [--seconds 60] [--image-clients 2] [--images 3]
        [--text-rate 2] [--preset 2b-vision] [--workdir DIR] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from benchutil import preset_repository
from qwen3vl_trt.common.limits import EngineLimits
from qwen3vl_trt.qa.tiny import synthetic_jpeg
from qwen3vl_trt.serving.client import Client
from qwen3vl_trt.serving.server.tritonserver import TritonServer

SIZES = ((256, 256), (320, 320), (384, 384), (256, 512), (448, 448))  # photos of 64 to 256 visual tokens
TEXT = "Name three colours."
IMAGE_PROMPT = "Describe these pictures."
MAX_TOKENS = 8


@dataclass(frozen=True)
class Figures:
    deployment: str
    text_requests: int
    text_ttft_p50_ms: float
    text_ttft_p99_ms: float
    image_requests: int
    image_requests_per_s: float


@contextlib.contextmanager
def pinned(cores: set[int]) -> Iterator[None]:
    """This process on `cores` while the block runs: what it starts meanwhile (tritonserver, and its stubs, which
    it starts) keeps them."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def _start(repo: Path, log: Path, cores: set[int], **options: object) -> TritonServer:
    from qwen3vl_trt.serving.ports import free_ports

    with pinned(cores):
        server = TritonServer(repo, free_ports(), log_path=log, **options)  # type: ignore[arg-type]
        server.start()
    server.wait_ready()
    return server


def _photos(seed: int, count: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [synthetic_jpeg(*SIZES[rng.integers(len(SIZES))], seed=seed * 100_000 + i) for i in range(count)]


def _ttft(url: str, prompt: str, images: list[bytes]) -> tuple[float, list[int]]:
    client = Client(url, timeout_s=600)
    try:
        started, first, tokens = time.perf_counter(), None, []
        for piece in client.stream(prompt, images, MAX_TOKENS, stream=True):
            first = first if first is not None else time.perf_counter() - started
            tokens.extend(piece.token_ids)
        assert first is not None
        return first, tokens
    finally:
        client.close()


def run(name: str, url: str, args: argparse.Namespace) -> tuple[Figures, dict[str, list[list[int]]]]:
    """The mixed load against one deployment for args.seconds."""
    stop = time.monotonic() + args.seconds
    text_ttfts: list[float] = []
    answers: dict[str, list[list[int]]] = {"text": [], "image": []}
    image_done = [0]
    lock = threading.Lock()

    def images_client(k: int) -> None:
        n = 0
        while time.monotonic() < stop:
            photos = _photos(1 + k * 10_000 + n, args.images)  # a client's n-th request: the same in each run
            _, tokens = _ttft(url, IMAGE_PROMPT, photos)
            with lock:
                image_done[0] += 1
                if k == 0 and n < args.check:
                    answers["image"].append(tokens)
            n += 1

    def text_request(n: int) -> None:
        first, tokens = _ttft(url, f"{TEXT} ({n})", [])
        with lock:
            text_ttfts.append(first)
            if n < args.check:
                answers["text"].append(tokens)

    started = time.monotonic()
    clients = [threading.Thread(target=images_client, args=(k,)) for k in range(args.image_clients)]
    for thread in clients:
        thread.start()
    texts: list[threading.Thread] = []
    n = 0
    while time.monotonic() < stop:
        texts.append(threading.Thread(target=text_request, args=(n,)))
        texts[-1].start()
        n += 1
        time.sleep(max(0.0, started + n / args.text_rate - time.monotonic()))
    for thread in [*clients, *texts]:
        thread.join()
    elapsed = time.monotonic() - started
    ttft = np.array(text_ttfts) * 1000
    figures = Figures(
        name,
        len(text_ttfts),
        round(float(np.percentile(ttft, 50)), 1),
        round(float(np.percentile(ttft, 99)), 1),
        image_done[0],
        round(image_done[0] / elapsed, 3),
    )
    print(
        f"  {name:<10} text TTFT p50 {figures.text_ttft_p50_ms:8.1f} ms  p99 {figures.text_ttft_p99_ms:8.1f} ms "
        f"({figures.text_requests} requests); {figures.image_requests_per_s:.3f} image requests/s "
        f"({figures.image_requests})",
        file=sys.stderr,
        flush=True,
    )
    return figures, answers


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--image-clients", type=int, default=2)
    p.add_argument("--images", type=int, default=3)
    p.add_argument("--text-rate", type=float, default=2.0)
    p.add_argument("--check", type=int, default=4, help="requests of each kind whose tokens must match")
    p.add_argument("--preset", default="2b-vision", choices=["tiny", "2b-vision", "8b-vision"])
    p.add_argument("--workdir", type=Path, help="keep the checkpoint and build here (reused when present)")
    p.add_argument("--json", action="store_true", help="print the figures as JSON on stdout")
    args = p.parse_args(argv)

    from qwen3vl_trt.serving.repository.settings import RepositorySettings
    from qwen3vl_trt.serving.server.serve import LANGUAGE_ROLE, VISION_MODELS, role_config, role_models

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        p.error("the split needs two cores: one for the replica, one for the pool")
    with contextlib.ExitStack() as stack:
        work = args.workdir or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-vision-pool-")))
        settings = RepositorySettings(visual_cache="off")
        repo = preset_repository(work, args.preset, EngineLimits(max_batch_size=16), settings)
        results: list[Figures] = []
        answers: dict[str, dict[str, list[list[int]]]] = {}

        print("colocated: one replica on every core", file=sys.stderr, flush=True)
        server = _start(repo, work / "colocated.log", set(cores))
        try:
            _ttft(server.url, IMAGE_PROMPT, _photos(999, args.images))  # untimed: each stage's first run
            figures, answers["colocated"] = run("colocated", server.url, args)
            results.append(figures)
        finally:
            server.stop()

        print(f"split: the replica on core {cores[0]}, the pool on core {cores[1]}", file=sys.stderr, flush=True)
        member = _start(repo, work / "pool.log", {cores[1]}, models=VISION_MODELS)
        try:
            language = {"models": role_models(repo, LANGUAGE_ROLE), "config_name": role_config(LANGUAGE_ROLE)}
            replica = _start(repo, work / "replica.log", {cores[0]}, vision_pool=member.url, **language)
            try:
                _ttft(replica.url, IMAGE_PROMPT, _photos(999, args.images))
                figures, answers["split"] = run("split", replica.url, args)
                results.append(figures)
            finally:
                replica.stop()
        finally:
            member.stop()

    colocated, split = results
    ratios = {
        "text_ttft_p50": round(split.text_ttft_p50_ms / colocated.text_ttft_p50_ms, 2),
        "text_ttft_p99": round(split.text_ttft_p99_ms / colocated.text_ttft_p99_ms, 2),
        "image_throughput": round(split.image_requests_per_s / colocated.image_requests_per_s, 2),
    }
    print(
        f"\nsplit / colocated ({args.preset}, {args.image_clients} clients of {args.images} images, text at "
        f"{args.text_rate:g}/s, {args.seconds:g} s): text TTFT p50 {ratios['text_ttft_p50']:.2f}x, "
        f"p99 {ratios['text_ttft_p99']:.2f}x; image throughput {ratios['image_throughput']:.2f}x"
    )
    mismatched = [
        kind
        for kind in ("text", "image")
        for ours, theirs in zip(answers["split"][kind], answers["colocated"][kind], strict=False)
        if ours != theirs
    ]
    if mismatched:
        print(f"MISMATCH: {len(mismatched)} answers differ between the deployments ({', '.join(mismatched)})")
    if args.json:
        print(json.dumps({"deployments": [asdict(r) for r in results], "ratios": ratios}, indent=2))
    return 1 if mismatched else 0


if __name__ == "__main__":
    sys.exit(main())
