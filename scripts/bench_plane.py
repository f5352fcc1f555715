#!/usr/bin/env python3
"""What the serving plane around the LLM sustains per CPU core: the CPU deployment with an `llm` that
answers instantly, so preprocessing, the vision encoder's batching, postprocessing and the server are
all that is measured.

It makes a tiny checkpoint (or takes --model), builds it for the CPU target, writes its repository and
replaces the `llm` model's code in that copy with scripts/bench_plane_llm/model.py (N token ids at
once per request, in the llm's decoupled protocol). Two workloads run at --concurrency, each after an
untimed pass:

- streamed text: text-only requests with stream on, --stream-tokens tokens each: one response per
  token goes through postprocessing and back to the client (the per-token cost);
- images: the image requests of scripts/bench_serving.py's cycle (one or two JPEGs of different sizes),
  --max-tokens tokens each, stream off (the per-request cost of decoding, preprocessing and encoding).

The server's CPU time (tritonserver and its python stubs, from psutil) over each workload gives the
plane's work per streamed token and per image request, on however many cores it had: the figures are
per CPU-second, i.e. per core kept busy. Beside them: a published decode rate of one H200 for an 8B
model (NVIDIA's TensorRT-LLM performance overview) and the CPU cores a GPU host needs so that the
plane keeps up with it (streamed tokens plus the image requests those tokens belong to, at the
published output length).

    .venv/bin/python scripts/bench_plane.py [--model DIR] [--requests 96] [--concurrency 16]
        [--stream-tokens 64] [--max-tokens 16] [--json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil
from bench_serving import Answers, GrpcRoute, Level, Reply, Request, Send, run_level, warm_up, workload
from qwen3vl_trt.errors import Qwen3VLTrtError
from qwen3vl_trt.limits import EngineLimits
from qwen3vl_trt.serving import interface
from qwen3vl_trt.serving.client import Client

INSTANT_LLM = Path(__file__).parent / "bench_plane_llm" / "model.py"


@dataclass(frozen=True)
class PublishedDecode:
    """One GPU's published output tokens/s for a model class, and where it comes from."""

    tokens_per_s: float
    output_length: int  # tokens per request in that measurement
    what: str
    source: str


# Qwen3-VL-8B's language model is a dense 8B decoder; NVIDIA publishes no Qwen3-VL figure, and the
# nearest published one is Llama 3.1 8B: H200 TP1, FP8, ISL/OSL 128/128, total output throughput.
H200_8B = PublishedDecode(
    tokens_per_s=27_911,
    output_length=128,
    what="Llama 3.1 8B FP8 (nvidia/Llama-3.1-8B-Instruct-FP8), one H200 SXM, TP1, ISL/OSL 128/128",
    source=(
        "NVIDIA TensorRT-LLM performance overview, docs/source/performance/perf-overview.md "
        "(release 1.0; https://nvidia.github.io/TensorRT-LLM/performance/perf-overview.html), "
        "table 'Llama 3.1 8B', trtllm-bench throughput, PyTorch backend"
    ),
)


@dataclass(frozen=True)
class Workload:
    name: str
    level: Level
    cpu_seconds: float  # the server's, over the timed level
    streamed_tokens: int
    image_requests: int

    def per_cpu_second(self, count: int) -> float:
        return count / self.cpu_seconds


def server_cpu_seconds(pid: int) -> float:
    """User + system CPU time of the server and all its python stubs so far."""
    total = 0.0
    for process in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]:
        try:
            times = process.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


class StreamingRoute(GrpcRoute):
    """Requests with stream on: each token comes back in its own response."""

    def sender(self) -> Send:
        client = Client(self.url)
        self._clients.append(client)

        def send(request: Request) -> Reply:
            answer = client.generate(request.prompt, request.images, self.max_tokens, stream=True)
            return Reply(answer.token_ids, answer.text, len(answer.token_ids))

        return send


def measure(
    name: str, route: GrpcRoute, pid: int, requests: list[Request], args: argparse.Namespace, streamed: bool
) -> Workload:
    answers = Answers()
    warm_up(route, name, requests, answers)
    before = server_cpu_seconds(pid)
    level = run_level(route, name, requests, args.concurrency, args.requests, answers)
    cpu = server_cpu_seconds(pid) - before
    if answers.mismatches:
        raise Qwen3VLTrtError(f"{name}: answers differ between runs: {answers.mismatches[:3]}")
    images = 0 if streamed else level.requests
    return Workload(name, level, cpu, level.tokens if streamed else 0, images)


def bench(model_dir: Path, scratch: Path, args: argparse.Namespace) -> tuple[Workload, Workload, int]:
    from qwen3vl_trt.pipeline import build
    from qwen3vl_trt.serving.ports import free_ports
    from qwen3vl_trt.serving.repository.writer import RepositorySettings, write_repository
    from qwen3vl_trt.serving.server.serve import TritonServer

    print(f"building {model_dir} for the CPU target in {scratch}", file=sys.stderr, flush=True)
    limits = EngineLimits(max_batch_size=args.max_batch_size)
    build(model_dir, scratch / "build", llm_dtype="fp32", limits=limits, target="cpu", log=lambda *_: None)
    # Without the visual cache: every image request is decoded and encoded (the cycle repeats its images).
    settings = RepositorySettings(visual_cache="off")
    repo = write_repository(scratch / "build", scratch / "plane-repo", "cpu", settings=settings, log=lambda *_: None)
    shutil.copyfile(INSTANT_LLM, repo / interface.LLM / "1" / "model.py")
    cycle = workload()
    text = [r for r in cycle if not r.images]
    images = [r for r in cycle if r.images]
    with TritonServer(repo, free_ports(), log_path=scratch / "server.log") as server:
        cores = len(psutil.Process(server.pid).cpu_affinity() or [])
        streamed = measure(
            "streamed text", StreamingRoute(server.url, args.stream_tokens), server.pid, text, args, streamed=True
        )
        encoded = measure("images", GrpcRoute(server.url, args.max_tokens), server.pid, images, args, streamed=False)
    return streamed, encoded, cores


def cores_needed(streamed: Workload, encoded: Workload, gpu: PublishedDecode) -> float:
    """CPU cores that keep up with the GPU's decode rate: its tokens streamed, and one image request per
    output_length tokens (every request carrying images: the costly case)."""
    per_token = streamed.cpu_seconds / streamed.streamed_tokens
    per_image_request = encoded.cpu_seconds / encoded.image_requests
    return gpu.tokens_per_s * per_token + gpu.tokens_per_s / gpu.output_length * per_image_request


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, help="checkpoint (default: a tiny random one)")
    p.add_argument("--requests", type=int, default=96, help="requests per workload")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--stream-tokens", type=int, default=64, help="tokens per streamed text request")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens per image request")
    p.add_argument("--max-batch-size", type=int, default=EngineLimits().max_batch_size, help="of the build")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = p.parse_args()
    if min(args.requests, args.concurrency, args.stream_tokens, args.max_tokens) < 1:
        p.error("--requests, --concurrency, --stream-tokens and --max-tokens must be positive")
    try:
        with tempfile.TemporaryDirectory(prefix="bench-plane-") as tmp:
            scratch = Path(tmp)
            model_dir = args.model
            if model_dir is None:
                from qwen3vl_trt.testing.tiny import make_tiny_checkpoint

                model_dir = make_tiny_checkpoint(scratch / "checkpoint")
            streamed, encoded, cores = bench(model_dir, scratch, args)
    except Qwen3VLTrtError as e:
        sys.exit(f"error: {e}")
    report(args, streamed, encoded, cores)


def report(args: argparse.Namespace, streamed: Workload, encoded: Workload, cores: int) -> None:
    tokens_per_core = streamed.per_cpu_second(streamed.streamed_tokens)
    images_per_core = encoded.per_cpu_second(encoded.image_requests)
    needed = cores_needed(streamed, encoded, H200_8B)
    if args.json:
        print(
            json.dumps(
                {
                    "server_cores": cores,
                    "concurrency": args.concurrency,
                    "streamed_text": {**asdict(streamed), "level": streamed.level.as_dict()},
                    "images": {**asdict(encoded), "level": encoded.level.as_dict()},
                    "streamed_tokens_per_cpu_second": tokens_per_core,
                    "image_requests_per_cpu_second": images_per_core,
                    "gpu": asdict(H200_8B),
                    "cores_needed": needed,
                },
                indent=2,
            )
        )
        return
    print(f"the plane with an instant llm, concurrency {args.concurrency}, on a server with {cores} cores:")
    s, e = streamed.level, encoded.level
    print(
        f"  streamed text ({args.stream_tokens} tokens a request): {s.tokens_per_s:.0f} tokens/s, "
        f"{s.requests_per_s:.1f} requests/s, p50 {s.p50_ms:.0f} ms; server CPU {streamed.cpu_seconds:.1f} s "
        f"-> {tokens_per_core:.0f} streamed tokens per CPU-second"
    )
    print(
        f"  images (1-2 JPEGs, {args.max_tokens} tokens a request, not streamed): {e.requests_per_s:.1f} requests/s, "
        f"p50 {e.p50_ms:.0f} ms; server CPU {encoded.cpu_seconds:.1f} s "
        f"-> {images_per_core:.1f} image requests per CPU-second"
    )
    print(f"one GPU decodes {H200_8B.tokens_per_s:,.0f} output tokens/s: {H200_8B.what}")
    print(f"  source: {H200_8B.source}")
    print(
        f"cores a GPU host needs so that the plane keeps up (every token streamed, every "
        f"{H200_8B.output_length}-token request with images like these): {needed:.1f}"
    )
    print(
        "  (the image figure includes the vision encoder on ONNX Runtime, which a GPU host runs on the GPU with "
        "TensorRT, and the tiny checkpoint's encoder: pass --model for a real checkpoint's preprocessing cost)"
    )


if __name__ == "__main__":
    main()
