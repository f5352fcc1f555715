#!/usr/bin/env python3
"""The visual-feature cache under reuse: throughput and time to first token with the cache off, in memory, and
on Redis shared by two replicas, side by side in one run on real tritonservers (the CPU target).

The model has the real 2B vision tower (`--preset 2b-vision`: 24 layers, hidden 1024; a tiny language model
behind it), so an image costs what it would to encode. Each concurrency level draws --requests requests of one
image each from a pool of --pool synthetic photos of mixed sizes: a request takes a photo not seen yet with
probability 1 - --reuse, otherwise one already seen, popular ones more often (zipf-like, weight rank^-1.1).
Every configuration serves the same sequence at a level; each level has a pool of its own, so every cache starts
cold (Redis is flushed between levels). Replicas take the requests in turn. Each server answers one request of
a photo outside the pools, untimed, before its first level.

It prints, per configuration and level: requests/s, p50/p99 time to first token (send to first streamed
response), the hit rate (preprocessing's qwen3vl_visual_cache_* metrics), images decoded; then the ratios to
cache off. Every configuration must answer each request with the same tokens (exit 1 otherwise).

    .venv/bin/python scripts/bench_cache.py [--requests 1000] [--pool 200] [--reuse 0.8] [--concurrency 1 16]
        [--preset 2b-vision] [--max-tokens 8] [--workdir DIR] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from benchutil import preset_repository
from qwen3vl_trt.common.limits import EngineLimits
from qwen3vl_trt.qa.tiny import synthetic_jpeg
from qwen3vl_trt.serving import interface
from qwen3vl_trt.serving.client import Client
from qwen3vl_trt.serving.server.tritonserver import TritonServer
from qwen3vl_trt.serving.stages import metrics as stage_metrics

PROMPT = "Describe this picture."
# Photo sizes (height, width): from the processor's minimum (256 patches) to 4x that.
SIZES = ((256, 256), (256, 384), (384, 256), (320, 320), (384, 384), (256, 512), (448, 448), (512, 512))
ZIPF_EXPONENT = 1.1
OFF, MEMORY, REDIS = "cache off", "in memory", "Redis, 2 replicas"


def draw(requests: int, pool: int, reuse: float, seed: int) -> list[int]:
    """Which pool photo each request takes: a new one with probability 1 - reuse (while any are left), else one
    already seen by zipf-like popularity (the first seen most popular)."""
    rng = np.random.default_rng(seed)
    sequence: list[int] = []
    seen: list[int] = []
    for _ in range(requests):
        if not seen or (len(seen) < pool and rng.random() >= reuse):
            seen.append(len(seen))
            sequence.append(seen[-1])
        else:
            weights = np.arange(1, len(seen) + 1, dtype=np.float64) ** -ZIPF_EXPONENT
            sequence.append(int(rng.choice(len(seen), p=weights / weights.sum())))
    return sequence


def photo_pool(size: int, seed: int) -> list[bytes]:
    """Synthetic photos of sizes drawn at random from SIZES: popularity (a photo's place in the pool) and cost
    independent."""
    rng = np.random.default_rng(seed)
    return [synthetic_jpeg(*SIZES[rng.integers(len(SIZES))], seed=1000 * seed + i) for i in range(size)]


@dataclass(frozen=True)
class Level:
    config: str
    concurrency: int
    requests: int
    seconds: float
    requests_per_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    hit_rate: float
    images_decoded: int


def _one(url: str, image: bytes, max_tokens: int) -> tuple[float, list[int]]:
    client = Client(url, timeout_s=600)
    try:
        started = time.perf_counter()
        first = None
        tokens: list[int] = []
        for piece in client.stream(PROMPT, [image], max_tokens, stream=True):
            first = first if first is not None else time.perf_counter() - started
            tokens.extend(piece.token_ids)
        assert first is not None
        return first, tokens
    finally:
        client.close()


def run_level(
    config: str, servers: Sequence[TritonServer], images: list[bytes], concurrency: int, max_tokens: int
) -> tuple[Level, list[list[int]]]:
    def counted() -> dict[str, float]:
        totals: dict[str, float] = {}
        for server in servers:
            for (name, model), value in stage_metrics.read(server.metrics_url).items():
                if model == interface.PREPROCESSING:
                    totals[name] = totals.get(name, 0.0) + value
        return totals

    before = counted()
    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        done = list(pool.map(lambda i: _one(servers[i % len(servers)].url, images[i], max_tokens), range(len(images))))
    seconds = time.perf_counter() - started
    after = counted()

    def delta(metric: stage_metrics.Metric) -> float:
        return after.get(metric.name, 0.0) - before.get(metric.name, 0.0)

    hits, misses = delta(stage_metrics.VISUAL_CACHE_HITS), delta(stage_metrics.VISUAL_CACHE_MISSES)
    ttft = np.array([first for first, _ in done]) * 1000
    level = Level(
        config,
        concurrency,
        len(images),
        round(seconds, 2),
        round(len(images) / seconds, 3),
        round(float(np.percentile(ttft, 50)), 1),
        round(float(np.percentile(ttft, 99)), 1),
        round(hits / (hits + misses), 3) if hits + misses else 0.0,
        int(delta(stage_metrics.IMAGES_DECODED)),
    )
    print(
        f"  {config:<18} c{concurrency:<3} {level.requests_per_s:7.2f} req/s  TTFT p50 {level.ttft_p50_ms:8.1f} ms"
        f"  p99 {level.ttft_p99_ms:8.1f} ms  hit rate {level.hit_rate:.2f}  decoded {level.images_decoded}",
        file=sys.stderr,
        flush=True,
    )
    return level, [tokens for _, tokens in done]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--pool", type=int, default=200)
    p.add_argument("--reuse", type=float, default=0.8)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    p.add_argument("--preset", default="2b-vision", choices=["tiny", "2b-vision", "8b-vision"])
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--max-batch-size", type=int, default=16)
    p.add_argument("--workdir", type=Path, help="keep the checkpoint and build here (reused when present)")
    p.add_argument("--json", action="store_true", help="print the figures as JSON on stdout")
    args = p.parse_args(argv)

    from qwen3vl_trt.qa.redis_server import RedisServer
    from qwen3vl_trt.serving.ports import free_ports

    with ExitStack() as stack:
        work = args.workdir or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-cache-")))
        repo = preset_repository(work, args.preset, EngineLimits(max_batch_size=args.max_batch_size))

        pools = {c: photo_pool(args.pool, seed=c) for c in args.concurrency}
        sequences = {c: draw(args.requests, args.pool, args.reuse, seed=c) for c in args.concurrency}
        levels: list[Level] = []
        answers: dict[tuple[str, int], list[list[int]]] = {}

        def serve(config: str, servers: list[TritonServer], redis: RedisServer | None = None) -> None:
            for c in args.concurrency:
                if redis is not None:
                    client = redis.client()
                    client.flushall()
                    client.close()
                images = [pools[c][i] for i in sequences[c]]
                level, tokens = run_level(config, servers, images, c, args.max_tokens)
                levels.append(level)
                answers[(config, c)] = tokens

        def start(name: str, visual_cache: str) -> TritonServer:
            print(f"{name}: starting tritonserver", file=sys.stderr, flush=True)
            server = TritonServer(repo, free_ports(), log_path=work / f"{name}.log", visual_cache=visual_cache)
            server.start()
            server.wait_ready()
            _one(server.url, synthetic_jpeg(*SIZES[0], seed=999_999), args.max_tokens)  # untimed: warms each stage
            return server

        for config, cache in ((OFF, "off"), (MEMORY, "memory")):
            server = start(config.replace(" ", "-"), cache)
            try:
                serve(config, [server])
            finally:
                server.stop()
        redis = RedisServer(work / "redis", maxmemory_bytes=4 << 30).start()
        replicas: list[TritonServer] = []
        try:
            replicas = [start(f"replica{i}", redis.url) for i in range(2)]
            serve(REDIS, replicas, redis)
        finally:
            for replica in replicas:
                replica.stop()
            redis.stop()

    mismatched = [
        (config, c, i)
        for (config, c), tokens in answers.items()
        for i, (ours, reference) in enumerate(zip(tokens, answers[(OFF, c)], strict=True))
        if ours != reference
    ]
    by = {(level.config, level.concurrency): level for level in levels}
    ratios = {}
    print(f"\n{args.requests} requests at {args.reuse:.0%} reuse of a pool of {args.pool} ({args.preset}):")
    for c in args.concurrency:
        off = by[(OFF, c)]
        for config in (MEMORY, REDIS):
            on = by[(config, c)]
            ratios[f"{config}, c{c}"] = figures = {
                "throughput": round(on.requests_per_s / off.requests_per_s, 2),
                "ttft_p50": round(on.ttft_p50_ms / off.ttft_p50_ms, 2),
                "ttft_p99": round(on.ttft_p99_ms / off.ttft_p99_ms, 2),
                "hit_rate": on.hit_rate,
            }
            print(
                f"  {config:<18} c{c:<3} throughput {figures['throughput']:5.2f}x cache off, TTFT p50 "
                f"{figures['ttft_p50']:.2f}x, p99 {figures['ttft_p99']:.2f}x, hit rate {on.hit_rate:.2f}"
            )
    if mismatched:
        print(f"MISMATCH: {len(mismatched)} answers differ from cache off: {mismatched[:10]}")
    if args.json:
        print(json.dumps({"levels": [asdict(level) for level in levels], "ratios": ratios}, indent=2))
    return 1 if mismatched else 0


if __name__ == "__main__":
    sys.exit(main())
