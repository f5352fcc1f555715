#!/usr/bin/env python3
"""Batch jobs beneath interactive traffic, measured on the CPU deployment (real tritonserver, gateway and Redis), in one
run, ratios side by side:

1. interactive alone: --clients clients each sending streamed chat requests one after another for --seconds: time to
   first token p50/p99;
2. the same interactive load while a batch of --lines lines runs: the interactive TTFT p99 against (1) (aim: at most
   1.25x), and the batch lines done meanwhile;
3. the batch alone (no interactive load) against a client loop sending the same lines, --runners at a time, to the
   interactive API: the batch's throughput over the loop's (aim: at least 0.8x);
4. short-first against FIFO at saturation: two gateways in front of the same deployment, --queue-order fifo and
   short-first, each letting --slots requests run at once, take the same --mix-requests streamed requests (one in four
   long: LONG_TOKENS output tokens, the rest SHORT_TOKENS), arriving at random (Poisson) at --load times the rate that
   the FIFO gateway serves the mix from clients that keep it full: mean time to first token short-first over FIFO
   (aim: at most 0.7x) and the long requests' p99 (at most 1.5x). (Clients that each wait for their last answer
   cannot show it: with a fixed number of them, the mean wait is theirs over the rate, whatever the order.)
5. lines grouped by image against the file's order: a batch of --group-lines lines asking about each of a fifth as
   many images five times, the questions in turn (lines that share an image far apart in the file), run by a gateway
   that groups lines by image (the default) and by one with --batch-file-order, each with images of its own: the
   visual cache's hits and misses, and the throughput grouped over file order. The deployment's visual cache holds
   --cache-mib MiB (default 1: fewer than the batch's 40 images' features), as a catalogue's would outgrow a
   GPU deployment's cache.

The first requests' answers must be equal in the batch and interactively (exit 1 otherwise).

    .venv/bin/python scripts/bench_batch.py [--seconds 30] [--clients 2] [--lines 200] [--runners 4]
        [--slots 4] [--load 1.5] [--ageing 2] [--mix-requests 400] [--group-lines 200] [--cache-mib 1]
        [--phases beneath,order,grouping] [--json]
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import dataclasses
import io
import json
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import openai
from benchutil import preset_repository
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families
from qwen3vl_trt.common.limits import EngineLimits
from qwen3vl_trt.qa.ports import free_port
from qwen3vl_trt.qa.redis_server import RedisServer
from qwen3vl_trt.serving.gateway.options import DEFAULT_GATEWAY_OPTIONS
from qwen3vl_trt.serving.ports import free_ports
from qwen3vl_trt.serving.repository.settings import RepositorySettings

MODEL = "bench"
MAX_TOKENS = 16
SHORT_TOKENS, LONG_TOKENS = 2, 64  # the short-first phase's output lengths


def _body(k: int) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": f"Tell me about the number {k}."}],
            "max_tokens": MAX_TOKENS, "temperature": 0}  # fmt: skip


@dataclasses.dataclass
class Deployment:
    client: openai.OpenAI
    repo: Path
    grpc_url: str
    ready_port: int
    metrics_url: str  # tritonserver's, with the stages' metrics
    redis_port: int  # the batch Redis (its database 0 is serve's gateway's)


@contextlib.contextmanager
def deployment(work: Path, runners: int, cache_mib: int) -> Iterator[Deployment]:
    """serve on the tiny preset's CPU build, its in-process visual cache within cache_mib (the text phases use none),
    with the Batch API on a Redis of its own."""
    settings = RepositorySettings(visual_cache_bytes=cache_mib << 20)
    repo = preset_repository(work, "tiny", EngineLimits(max_batch_size=16), settings)
    with RedisServer(work / "redis", policy="noeviction", appendonly=True) as redis:
        ports, port = free_ports(), free_port()
        command = ["serve", "--repo", str(repo), "--openai-port", str(port), "--grpc-port", str(ports.grpc),
                   "--http-port", str(ports.http), "--metrics-port", str(ports.metrics), "--ready-port",
                   str(ports.ready), "--served-model-name", MODEL, "--batch-redis", redis.url,
                   "--batch-dir", str(work / "files"), "--batch-runners", str(runners)]  # fmt: skip
        with _running(command, port, work / "serve.log") as client:
            yield Deployment(client, repo, f"127.0.0.1:{ports.grpc}", ports.ready,
                             f"http://127.0.0.1:{ports.metrics}/metrics", redis.port)  # fmt: skip


@contextlib.contextmanager
def gateway(work: Path, served: Deployment, name: str, *flags: str) -> Iterator[openai.OpenAI]:
    """`qwen3vl-trt openai FLAGS` in front of the deployment (its log openai-NAME.log)."""
    port = free_port()
    command = ["openai", "--repo", str(served.repo), "--triton-url", served.grpc_url, "--port", str(port),
               "--replica-ready-port", str(served.ready_port), "--served-model-name", MODEL, *flags]  # fmt: skip
    with _running(command, port, work / f"openai-{name}.log") as client:
        yield client


@contextlib.contextmanager
def _running(command: list[str], port: int, log_path: Path) -> Iterator[openai.OpenAI]:
    """`qwen3vl-trt COMMAND...` until its gateway on `port` is healthy; stopped on leaving."""
    log = open(log_path, "wb")  # noqa: SIM115 (closed below)
    process = subprocess.Popen([sys.executable, "-m", "qwen3vl_trt.cli", *command], stdout=log,
                               stderr=subprocess.STDOUT)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while not _healthy(url):
            if process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"{command[0]} did not come up; see {log_path}")
            time.sleep(0.5)
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
    finally:
        process.terminate()
        process.wait(60)
        log.close()


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def interactive(client: openai.OpenAI, clients: int, seconds: float) -> list[float]:
    """Streamed requests from `clients` clients for `seconds`: each one's time to first token."""
    ttfts: list[float] = []
    lock = threading.Lock()
    end = time.monotonic() + seconds

    def loop(c: int) -> None:
        k = 0
        while time.monotonic() < end:
            start = time.monotonic()
            stream = client.chat.completions.create(**_body(10_000 + 1000 * c + k), stream=True)
            first = None
            for chunk in stream:
                if first is None and chunk.choices and chunk.choices[0].delta.content:
                    first = time.monotonic() - start
            with lock:
                ttfts.append(first if first is not None else time.monotonic() - start)
            k += 1

    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(loop, range(clients)))
    return ttfts


def submit(client: openai.OpenAI, lines: int | list[dict[str, Any]], tag: str) -> str:
    """A batch of these bodies (a number: that many text lines) submitted; its id."""
    bodies = [_body(k) for k in range(lines)] if isinstance(lines, int) else lines
    text = "".join(json.dumps({"custom_id": f"{tag}-{k}", "method": "POST", "url": "/v1/chat/completions",
                               "body": body}) + "\n" for k, body in enumerate(bodies))  # fmt: skip
    uploaded = client.files.create(file=(f"{tag}.jsonl", text.encode()), purpose="batch")
    return client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                 completion_window="24h").id  # fmt: skip


def wait(client: openai.OpenAI, batch_id: str) -> Any:
    while (batch := client.batches.retrieve(batch_id)).status not in ("completed", "failed", "expired", "cancelled"):
        time.sleep(0.2)
    return batch


def _mixed_request(client: openai.OpenAI, k: int, long: bool, arrived: float) -> float:
    """One streamed request of the mix (min_tokens making its output its length): seconds from `arrived` (a
    time.monotonic()) to its first text."""
    tokens = LONG_TOKENS if long else SHORT_TOKENS
    body = {**_body(k), "max_tokens": tokens}
    stream = client.chat.completions.create(**body, stream=True, extra_body={"min_tokens": tokens})
    first = None
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.monotonic() - arrived
    return first if first is not None else time.monotonic() - arrived


def _is_long(k: int) -> bool:
    return k % 4 == 0  # one in four


def capacity(client: openai.OpenAI, clients: int, requests: int) -> float:
    """Requests of the mix per second that `clients` clients, each sending the next as soon as its last is answered,
    get through."""
    start = time.monotonic()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(lambda k: _mixed_request(client, k, _is_long(k), time.monotonic()), range(requests)))
    return requests / (time.monotonic() - start)


def mixed(client: openai.OpenAI, rate: float, requests: int) -> dict[str, list[float]]:
    """`requests` requests of the mix arriving at `rate` a second on average (Poisson, the same schedule for every
    call): each one's time to first token from its arrival, by kind."""
    rng = np.random.default_rng(0)
    offsets = np.cumsum(rng.exponential(1 / rate, requests))
    with ThreadPoolExecutor(256) as pool:
        start = time.monotonic()
        futures = []
        for k, offset in enumerate(offsets):
            time.sleep(max(0.0, start + offset - time.monotonic()))
            futures.append(pool.submit(_mixed_request, client, k, _is_long(k), start + offset))
        ttfts = [future.result() for future in futures]
    return {"short": [t for k, t in enumerate(ttfts) if not _is_long(k)],
            "long": [t for k, t in enumerate(ttfts) if _is_long(k)]}  # fmt: skip


def beneath(client: openai.OpenAI, args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, float], bool]:
    """Phases 1 to 3: figures, ratios, and whether the batch's answers equal the interactive ones."""
    alone = interactive(client, args.clients, args.seconds)
    batch_id = submit(client, args.lines * 10, "beneath")  # more than the interactive phase can finish
    under = interactive(client, args.clients, args.seconds)
    counts = client.batches.retrieve(batch_id).request_counts
    done_beneath = counts.completed if counts is not None else 0
    client.batches.cancel(batch_id)
    wait(client, batch_id)

    start = time.monotonic()
    batch = wait(client, submit(client, args.lines, "alone"))
    batch_s = time.monotonic() - start
    start = time.monotonic()
    with ThreadPoolExecutor(args.runners) as pool:
        answers = list(pool.map(lambda k: client.chat.completions.create(**_body(k)), range(args.lines)))
    loop_s = time.monotonic() - start
    outputs = [json.loads(line) for line in client.files.content(batch.output_file_id).text.splitlines()]
    same = all(o["response"]["body"]["choices"][0]["message"]["content"] == a.choices[0].message.content
               for o, a in zip(outputs, answers, strict=True))  # fmt: skip
    figures = {
        "ttft_alone_p50_ms": float(np.percentile(alone, 50) * 1000),
        "ttft_alone_p99_ms": float(np.percentile(alone, 99) * 1000),
        "ttft_beneath_p50_ms": float(np.percentile(under, 50) * 1000),
        "ttft_beneath_p99_ms": float(np.percentile(under, 99) * 1000),
        "interactive_requests": [len(alone), len(under)],
        "batch_lines_done_beneath": done_beneath,
        "batch_lines_per_s": args.lines / batch_s,
        "loop_lines_per_s": args.lines / loop_s,
    }
    ratios = {
        "ttft_p99_beneath_over_alone": round(figures["ttft_beneath_p99_ms"] / figures["ttft_alone_p99_ms"], 2),
        "batch_over_loop_throughput": round(figures["batch_lines_per_s"] / figures["loop_lines_per_s"], 2),
    }
    print(f"  interactive alone    TTFT p50 {figures['ttft_alone_p50_ms']:7.1f} ms  p99 "
          f"{figures['ttft_alone_p99_ms']:7.1f} ms ({len(alone)} requests)")  # fmt: skip
    print(f"  with a batch beneath TTFT p50 {figures['ttft_beneath_p50_ms']:7.1f} ms  p99 "
          f"{figures['ttft_beneath_p99_ms']:7.1f} ms ({len(under)} requests; {done_beneath} batch lines "
          "done)")  # fmt: skip
    print(f"  batch alone {figures['batch_lines_per_s']:.1f} lines/s, a client loop of {args.runners} "
          f"{figures['loop_lines_per_s']:.1f} lines/s ({args.lines} lines)")  # fmt: skip
    print(f"batch beneath / alone ({args.clients} clients, {args.seconds:g} s): interactive TTFT p99 "
          f"{ratios['ttft_p99_beneath_over_alone']:.2f}x; batch / client loop throughput "
          f"{ratios['batch_over_loop_throughput']:.2f}x\n")  # fmt: skip
    return figures, ratios, same


def ordered(work: Path, served: Deployment, args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, float]]:
    """Phase 4: the same mixed load through a FIFO gateway and a short-first one."""
    ttfts = {}
    rate = 0.0
    for order in ("fifo", "short-first"):
        flags = ["--max-concurrent-requests", str(args.slots), "--queue-order", order]
        with gateway(work, served, order, *flags, "--queue-ageing", str(args.ageing)) as client:
            capacity(client, args.slots, 4 * args.slots)  # untimed: each gateway's first requests
            if not rate:  # the deployment's rate for the mix through `slots` slots, from 3x that many clients
                rate = args.load * capacity(client, 3 * args.slots, args.mix_requests // 2)
            ttfts[order] = mixed(client, rate, args.mix_requests)
    figures: dict[str, Any] = {"rate_per_s": rate}
    for order, kinds in ttfts.items():
        every = kinds["short"] + kinds["long"]
        figures[order] = {
            "ttft_mean_ms": float(np.mean(every) * 1000),
            "ttft_short_mean_ms": float(np.mean(kinds["short"]) * 1000),
            "ttft_long_mean_ms": float(np.mean(kinds["long"]) * 1000),
            "ttft_long_p99_ms": float(np.percentile(kinds["long"], 99) * 1000),
            "requests": [len(kinds["short"]), len(kinds["long"])],
        }
    fifo, short = figures["fifo"], figures["short-first"]
    ratios = {
        "ttft_mean_short_first_over_fifo": round(short["ttft_mean_ms"] / fifo["ttft_mean_ms"], 2),
        "ttft_long_p99_short_first_over_fifo": round(short["ttft_long_p99_ms"] / fifo["ttft_long_p99_ms"], 2),
    }
    for order in ttfts:
        f = figures[order]
        print(f"  {order:<11} TTFT mean {f['ttft_mean_ms']:7.1f} ms (short {f['ttft_short_mean_ms']:7.1f} ms, long "
              f"{f['ttft_long_mean_ms']:7.1f} ms), long p99 {f['ttft_long_p99_ms']:7.1f} ms")  # fmt: skip
    print(f"short-first / fifo ({args.mix_requests} requests, one in four long, arriving at {rate:.1f}/s: "
          f"{args.load:g}x what {args.slots} slots serve): mean TTFT {ratios['ttft_mean_short_first_over_fifo']:.2f}x; "
          f"long requests' TTFT p99 {ratios['ttft_long_p99_short_first_over_fifo']:.2f}x\n")  # fmt: skip
    return figures, ratios


def _image_url(k: int) -> str:
    """A JPEG data URL of its own for each k."""
    rng = np.random.default_rng(k)
    pixels = np.repeat(np.repeat(rng.integers(0, 256, (28, 28, 3), dtype=np.uint8), 8, 0), 8, 1)  # 224 x 224
    jpeg = io.BytesIO()
    Image.fromarray(pixels).save(jpeg, "JPEG", quality=90)
    return "data:image/jpeg;base64," + base64.b64encode(jpeg.getvalue()).decode()


def _cache_counts(metrics_url: str) -> dict[str, float]:
    with urllib.request.urlopen(metrics_url, timeout=10) as response:
        text = response.read().decode()
    counts = {"hits": 0.0, "misses": 0.0}
    for family in text_string_to_metric_families(text):
        for kind in counts:
            if family.name == f"qwen3vl_visual_cache_{kind}":
                counts[kind] += sum(sample.value for sample in family.samples if sample.name.endswith("_total"))
    return counts


def grouping(work: Path, served: Deployment, args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, float]]:
    """Phase 5: a batch whose images recur (each of --group-lines / 5 images asked about 5 times, the questions in
    turn, so the lines that share an image are far apart in the file), run by a gateway that groups lines by image
    and by one that runs them in the file's order, each with its own images: the visual cache's hits and misses,
    and lines a second."""
    images = max(1, args.group_lines // 5)
    figures: dict[str, Any] = {}
    for variant, (db, flags) in {"grouped": (1, ()), "file_order": (2, ("--batch-file-order",))}.items():
        seed = 100_000 * db
        urls = [_image_url(seed + i) for i in range(images)]
        lines = [{"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": urls[k % images]}},
            {"type": "text", "text": f"Question {k // images} about this picture."}]}]}
            for k in range(args.group_lines)]  # fmt: skip
        batches = ("--batch-redis", f"redis://127.0.0.1:{served.redis_port}/{db}", "--batch-dir",
                   str(work / f"files-{variant}"), "--batch-runners", str(args.runners))  # fmt: skip
        with gateway(work, served, variant, *batches, *flags) as client:
            before = _cache_counts(served.metrics_url)
            start = time.monotonic()
            batch = wait(client, submit(client, lines, variant))
            seconds = time.monotonic() - start
            after = _cache_counts(served.metrics_url)
        counts = batch.request_counts
        figures[variant] = {
            "lines_per_s": args.group_lines / seconds,
            "cache_hits": after["hits"] - before["hits"],
            "cache_misses": after["misses"] - before["misses"],
            "completed": counts.completed if counts is not None else 0,
        }
    ratios = {
        "grouped_over_file_order_throughput": round(
            figures["grouped"]["lines_per_s"] / figures["file_order"]["lines_per_s"], 2
        )
    }
    for variant, f in figures.items():
        print(f"  {variant:<10} {f['lines_per_s']:5.1f} lines/s, visual cache {f['cache_hits']:.0f} hits "
              f"{f['cache_misses']:.0f} misses ({f['completed']} of {args.group_lines} lines completed)")  # fmt: skip
    print(f"grouped by image / file order ({args.group_lines} lines, {images} images, {args.runners} runners): "
          f"throughput {ratios['grouped_over_file_order_throughput']:.2f}x\n")  # fmt: skip
    return figures, ratios


PHASES = ("beneath", "order", "grouping")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--clients", type=int, default=2)
    p.add_argument("--lines", type=int, default=200)
    p.add_argument("--runners", type=int, default=4)
    p.add_argument("--slots", type=int, default=4)
    p.add_argument("--load", type=float, default=1.5)
    p.add_argument("--ageing", type=float, default=DEFAULT_GATEWAY_OPTIONS.queue_ageing)
    p.add_argument("--mix-requests", type=int, default=400)
    p.add_argument("--group-lines", type=int, default=200)
    p.add_argument("--cache-mib", type=int, default=1, help="the visual cache's budget (default: %(default)s MiB)")
    p.add_argument("--phases", default=",".join(PHASES), help=f"which of {', '.join(PHASES)} to run (default: all)")
    p.add_argument("--workdir", type=Path)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    phases = args.phases.split(",")
    figures: dict[str, Any] = {}
    ratios: dict[str, float] = {}
    same = True
    with contextlib.ExitStack() as stack:
        work = args.workdir or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-batch-")))
        served = stack.enter_context(deployment(work, args.runners, args.cache_mib))
        interactive(served.client, args.clients, 3.0)  # untimed: every stage's first runs
        if "beneath" in phases:
            figures["beneath"], more, same = beneath(served.client, args)
            ratios.update(more)
        if "order" in phases:
            figures["order"], more = ordered(work, served, args)
            ratios.update(more)
        if "grouping" in phases:
            figures["grouping"], more = grouping(work, served, args)
            ratios.update(more)
    if not same:
        print("MISMATCH: batch answers differ from the interactive ones")
    if args.json:
        print(json.dumps({"figures": figures, "ratios": ratios}, indent=2))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
