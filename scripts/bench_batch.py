#!/usr/bin/env python3
"""Batch jobs beneath interactive traffic, measured on the CPU deployment (real tritonserver, gateway and Redis), in one
run, ratios side by side:

1. interactive alone: --clients clients each sending streamed chat requests one after another for --seconds: time to
   first token p50/p99;
2. the same interactive load while a batch of --lines lines runs: the interactive TTFT p99 against (1) (aim: at most
   1.25x), and the batch lines done meanwhile;
3. the batch alone (no interactive load) against a client loop sending the same lines, --runners at a time, to the
   interactive API: the batch's throughput over the loop's (aim: at least 0.8x).

The first requests' answers must be equal in the batch and interactively (exit 1 otherwise).

    .venv/bin/python scripts/bench_batch.py [--seconds 30] [--clients 2] [--lines 200] [--runners 4] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
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
from qwen3vl_trt.common.limits import EngineLimits
from qwen3vl_trt.qa.ports import free_port
from qwen3vl_trt.qa.redis_server import RedisServer
from qwen3vl_trt.serving.ports import free_ports

MODEL = "bench"
MAX_TOKENS = 16


def _body(k: int) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": f"Tell me about the number {k}."}],
            "max_tokens": MAX_TOKENS, "temperature": 0}  # fmt: skip


@contextlib.contextmanager
def deployment(work: Path, runners: int) -> Iterator[openai.OpenAI]:
    repo = preset_repository(work, "tiny", EngineLimits(max_batch_size=16))
    with RedisServer(work / "redis", policy="noeviction", appendonly=True) as redis:
        ports, port = free_ports(), free_port()
        command = [sys.executable, "-m", "qwen3vl_trt.cli", "serve", "--repo", str(repo), "--openai-port", str(port),
                   "--grpc-port", str(ports.grpc), "--http-port", str(ports.http), "--metrics-port", str(ports.metrics),
                   "--ready-port", str(ports.ready), "--served-model-name", MODEL, "--batch-redis", redis.url,
                   "--batch-dir", str(work / "files"), "--batch-runners", str(runners)]  # fmt: skip
        log = open(work / "serve.log", "wb")  # noqa: SIM115 (closed below)
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 600
            while not _healthy(url):
                if process.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"serve did not come up; see {work / 'serve.log'}")
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


def submit(client: openai.OpenAI, lines: int, tag: str) -> str:
    text = "".join(json.dumps({"custom_id": f"{tag}-{k}", "method": "POST", "url": "/v1/chat/completions",
                               "body": _body(k)}) + "\n" for k in range(lines))  # fmt: skip
    uploaded = client.files.create(file=(f"{tag}.jsonl", text.encode()), purpose="batch")
    return client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                 completion_window="24h").id  # fmt: skip


def wait(client: openai.OpenAI, batch_id: str) -> Any:
    while (batch := client.batches.retrieve(batch_id)).status not in ("completed", "failed", "expired", "cancelled"):
        time.sleep(0.2)
    return batch


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--clients", type=int, default=2)
    p.add_argument("--lines", type=int, default=200)
    p.add_argument("--runners", type=int, default=4)
    p.add_argument("--workdir", type=Path)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    with contextlib.ExitStack() as stack:
        work = args.workdir or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-batch-")))
        client = stack.enter_context(deployment(work, args.runners))
        interactive(client, args.clients, 3.0)  # untimed: every stage's first runs

        alone = interactive(client, args.clients, args.seconds)
        batch_id = submit(client, args.lines * 10, "beneath")  # more than the interactive phase can finish
        beneath = interactive(client, args.clients, args.seconds)
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
        "ttft_beneath_p50_ms": float(np.percentile(beneath, 50) * 1000),
        "ttft_beneath_p99_ms": float(np.percentile(beneath, 99) * 1000),
        "interactive_requests": [len(alone), len(beneath)],
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
          f"{figures['ttft_beneath_p99_ms']:7.1f} ms ({len(beneath)} requests; {done_beneath} batch lines "
          "done)")  # fmt: skip
    print(f"  batch alone {figures['batch_lines_per_s']:.1f} lines/s, a client loop of {args.runners} "
          f"{figures['loop_lines_per_s']:.1f} lines/s ({args.lines} lines)")  # fmt: skip
    print(f"\nbatch beneath / alone ({args.clients} clients, {args.seconds:g} s): interactive TTFT p99 "
          f"{ratios['ttft_p99_beneath_over_alone']:.2f}x; batch / client loop throughput "
          f"{ratios['batch_over_loop_throughput']:.2f}x")  # fmt: skip
    if not same:
        print("MISMATCH: batch answers differ from the interactive ones")
    if args.json:
        print(json.dumps({"figures": figures, "ratios": ratios}, indent=2))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
