#!/usr/bin/env python3
"""The Triton deployment under load over gRPC against the same requests in one process: throughput,
latency and their ratios, and transformers `generate` on the same requests.

Without --url (the default) it makes a tiny checkpoint (or takes --model), builds it for the CPU
target (fp32, so transformers runs the same weights), writes its repository and serves it on a real
tritonserver. It measures, side by side in one run:

- one process: the same requests one at a time through LocalPipeline (preprocessing, the ONNX vision
  encoder and the reference LLM in this process, no server), the figure serving is held to;
- Triton over gRPC at each --concurrency level (one client per thread);
- the OpenAI gateway (`qwen3vl-trt openai` in its own process, the official `openai` client) in front of
  the same server at each level;
- the vision encoder's batches of 640x480 images per image beside one alone (bench_vision_batching.py);
- the ratios: served requests/s at the top level / one process's (goal >= 2), p50 latency at
  concurrency 1 / one process's (goal <= 1.10), and the gateway's p50 latency / gRPC's at each level
  (goal <= 1.05). One process, gRPC and the gateway at concurrency 1 take turns request by request, so
  noise on a shared machine hits them alike.

--batching-off adds a repository whose models execute one request at a time (the `llm` keeps its own
inflight batching either way, as the TensorRT-LLM backend does). With --url it measures that running
server only; one process and the on/off comparison then cannot be run, and transformers runs only when
--model names the served checkpoint.

The workload is a fixed cycle of mixed requests (text only, one image, two images of different sizes;
real JPEGs), greedy, --max-tokens each; a level reports requests/s, generated tokens/s and p50/p99
latency (send to last response). One untimed pass of the cycle warms each route first. Then the same
requests run through transformers `generate` one at a time in this process (fp32, greedy).

Every answer to a request must carry the same token ids in every run, on every route and at every
level (the gateway's, which carry text only, the same text as gRPC's): mismatches are listed and the
script exits with 1. Agreement with transformers is reported.

    .venv/bin/python scripts/bench_serving.py [--url HOST:PORT] [--model DIR] [--requests 32]
        [--max-tokens 16] [--concurrency 1 16] [--one-process-threads N] [--batching-off] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from qwen3vl_trt.common.limits import EngineLimits
from qwen3vl_trt.errors import Qwen3VLTrtError
from qwen3vl_trt.qa.tiny import synthetic_jpeg
from qwen3vl_trt.serving import interface
from qwen3vl_trt.serving.client import Client
from qwen3vl_trt.serving.repository.settings import RepositorySettings

BATCHED_MODELS = (
    interface.PREPROCESSING,
    interface.VISION_ENCODER,
    interface.POSTPROCESSING,
)  # under Triton's dynamic batcher
ONE_PROCESS = "one process"
GATEWAY = "OpenAI gateway"


@dataclass(frozen=True)
class Request:
    label: str
    prompt: str
    images: tuple[bytes, ...]

    def messages(self) -> list[dict]:
        """The chat the server makes of prompt and images (one user turn: the images, then the text)."""
        parts = [{"type": "image", "image": image} for image in self.images]
        return [{"role": "user", "content": [*parts, {"type": "text", "text": self.prompt}]}]


def workload() -> list[Request]:
    """The request cycle: image sizes (height x width) differ, so batches are ragged."""

    def photo(height: int, width: int, seed: int) -> bytes:
        return synthetic_jpeg(height, width, seed)

    return [
        Request("1 image 96x128", "Describe this picture.", (photo(96, 128, 1),)),
        Request("text only", "What is the capital of France?", ()),
        Request("2 images 64x64 + 160x96", "Compare the two images.", (photo(64, 64, 2), photo(160, 96, 3))),
        Request("1 image 128x128", "What colours do you see?", (photo(128, 128, 4),)),
        Request("text only, longer", "Tell me a short story about a lighthouse keeper and a storm.", ()),
        Request("2 images 32x48 + 96x160", "Which one is larger?", (photo(32, 48, 5), photo(96, 160, 6))),
    ]


@dataclass(frozen=True)
class Level:
    concurrency: int
    requests: int
    seconds: float
    tokens: int
    p50_ms: float
    p99_ms: float

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.seconds

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    def as_dict(self) -> dict:
        return {
            **asdict(self),
            "requests_per_s": round(self.requests_per_s, 3),
            "tokens_per_s": round(self.tokens_per_s, 2),
        }


def _level(concurrency: int, latencies: list[float], seconds: float, tokens: int) -> Level:
    p50, p99 = np.percentile(latencies, [50, 99]) * 1000
    return Level(concurrency, len(latencies), seconds, tokens, float(p50), float(p99))


@dataclass(frozen=True)
class Reply:
    """One answer: its generated token ids (None where the route returns only text: the OpenAI gateway),
    its text where the route is the server's (its postprocessing detokenizes), and how many tokens."""

    token_ids: list[int] | None
    text: str | None
    tokens: int


class Answers:
    """The first token ids (and the first server text) seen for each request of the cycle; every later
    answer must equal them."""

    def __init__(self) -> None:
        self.first: dict[int, tuple[str, list[int]]] = {}
        self.first_text: dict[int, tuple[str, str]] = {}
        self.mismatches: list[dict] = []
        self._lock = threading.Lock()

    def check(self, run: str, index: int, reply: Reply) -> None:
        with self._lock:
            for first, got in ((self.first, reply.token_ids), (self.first_text, reply.text)):
                if got is None:
                    continue
                if index not in first:
                    first[index] = (run, got)
                elif got != first[index][1]:
                    seen_in, expected = first[index]
                    self.mismatches.append(
                        dict(request=index, run=run, got=got, expected=expected, first_seen_in=seen_in)
                    )


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


Send = Callable[[Request], Reply]
"""One request through one route, and its answer."""


class Route:
    """A way to serve the workload: `sender()` makes what one client thread sends with (one gRPC client
    each; another front end, e.g. an HTTP gateway, plugs in the same way); `close()` frees them."""

    def sender(self) -> Send:
        raise NotImplementedError

    def close(self) -> None:
        pass


class GrpcRoute(Route):
    """The Triton ensemble through this package's gRPC client."""

    def __init__(self, url: str, max_tokens: int):
        self.url, self.max_tokens = url, max_tokens
        self._clients: list[Client] = []

    def sender(self) -> Send:
        client = Client(self.url)
        self._clients.append(client)

        def send(request: Request) -> Reply:
            answer = client.generate(request.prompt, request.images, self.max_tokens)
            return Reply(answer.token_ids, answer.text, len(answer.token_ids))

        return send

    def close(self) -> None:
        for client in self._clients:
            client.close()
        self._clients.clear()


class OneProcessRoute(Route):
    """LocalPipeline: the deployment's chain in this process, one request at a time."""

    def __init__(self, model_dir: Path, build_dir: Path, max_tokens: int, threads: int | None = None):
        """threads: torch's and ONNX Runtime's intra-op threads (None: their defaults, all cores)."""
        import torch
        from qwen3vl_trt.runtime.local import LocalPipeline
        from qwen3vl_trt.runtime.sampling import SamplingParams

        if threads is not None:
            torch.set_num_threads(threads)
        self.pipeline = LocalPipeline(model_dir, build_dir, threads)
        self.sampling = SamplingParams(max_new_tokens=max_tokens, end_ids=self.pipeline.end_ids)

    def sender(self) -> Send:
        def send(request: Request) -> Reply:
            token_ids = self.pipeline.generate(request.messages(), self.sampling).token_ids
            return Reply(token_ids, None, len(token_ids))

        return send


class GatewayRoute(Route):
    """The OpenAI-compatible gateway, run as `qwen3vl-trt openai` in its own process in front of the server
    (as `serve --openai-port` runs it beside tritonserver), called over HTTP with the official client."""

    def __init__(self, triton_url: str, repo: Path, max_tokens: int, log_path: Path, options: Sequence[str] = ()):
        """options: more of `qwen3vl-trt openai`'s options."""
        import subprocess
        import urllib.request

        from qwen3vl_trt.serving.ports import free_ports

        self.max_tokens = max_tokens
        port = free_ports().http
        self.url = f"http://127.0.0.1:{port}"
        self._log = open(log_path, "wb")
        command = [sys.executable, "-m", "qwen3vl_trt.cli", "openai", "--repo", str(repo)]
        command += ["--triton-url", triton_url, "--port", str(port), "--served-model-name", "bench"]
        command += ["--replica-ready-port", "0", *options]  # a plain tritonserver: its own readiness over gRPC
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as health:
                    if health.status == 200:
                        break
            except OSError:  # not listening yet, or 503 while the server is not ready
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise Qwen3VLTrtError(f"the gateway did not come up; see {log_path}")
            time.sleep(0.2)

    def sender(self) -> Send:
        import base64

        import openai

        client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=600)

        def send(request: Request) -> Reply:
            parts: list[dict] = [
                {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64," + base64.b64encode(i).decode()}}
                for i in request.images
            ]
            parts.append({"type": "text", "text": request.prompt})
            answer = client.chat.completions.create(
                model="bench",
                messages=[{"role": "user", "content": parts}],  # type: ignore[misc, list-item]
                max_tokens=self.max_tokens,
                temperature=0,  # greedy
            )
            assert answer.usage is not None
            return Reply(None, answer.choices[0].message.content or "", answer.usage.completion_tokens)

        return send

    def close(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)
        self._log.close()


def warm_up(route: Route, name: str, requests: list[Request], answers: Answers) -> None:
    """One untimed pass of the cycle (its answers are checked too)."""
    send = route.sender()
    for index, request in enumerate(requests):
        answers.check(f"{name} warm-up", index, send(request))


def run_level(route: Route, run: str, requests: list[Request], concurrency: int, count: int, answers: Answers) -> Level:
    """`count` requests taken from the cycle in order by `concurrency` threads, one sender each."""
    next_index = iter(range(count))
    lock = threading.Lock()
    senders = [route.sender() for _ in range(concurrency)]

    def worker(send: Send) -> list[tuple[float, int]]:
        done: list[tuple[float, int]] = []
        while True:
            with lock:
                n = next(next_index, None)
            if n is None:
                return done
            start = time.perf_counter()
            reply = send(requests[n % len(requests)])
            done.append((time.perf_counter() - start, reply.tokens))
            answers.check(run, n % len(requests), reply)

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = [item for items in pool.map(worker, senders) for item in items]
    seconds = time.perf_counter() - start
    return _level(concurrency, [r[0] for r in results], seconds, sum(r[1] for r in results))


def run_alternating(
    routes: dict[str, Route], requests: list[Request], count: int, answers: Answers
) -> dict[str, Level]:
    """Each route at concurrency 1, taking turns request by request (the same request on each in turn),
    so that the machine's noise hits every route alike."""
    senders = {name: route.sender() for name, route in routes.items()}
    latencies: dict[str, list[float]] = {name: [] for name in routes}
    tokens = dict.fromkeys(routes, 0)
    for n in range(count):
        request = requests[n % len(requests)]
        for name, send in senders.items():
            start = time.perf_counter()
            reply = send(request)
            latencies[name].append(time.perf_counter() - start)
            tokens[name] += reply.tokens
            answers.check(f"{name} concurrency 1", n % len(requests), reply)
    return {name: _level(1, latencies[name], sum(latencies[name]), tokens[name]) for name in routes}


def measure_levels(
    routes: dict[str, Route],
    requests: list[Request],
    args: argparse.Namespace,
    answers: Answers,
    baseline: tuple[str, Route] | None = None,
) -> tuple[dict[str, list[Level]], Level | None]:
    """Every concurrency level of each route, after an untimed pass of the cycle. Concurrency 1 alternates
    the routes (and the baseline, a name and a route, when given) request by request; the baseline's level
    comes back too."""
    for name, route in routes.items():
        warm_up(route, name, requests, answers)
    levels: dict[str, list[Level]] = {name: [] for name in routes}
    base: Level | None = None
    for concurrency in args.concurrency:
        _log(f"  {', '.join(routes)}: concurrency {concurrency}, {args.requests} requests each")
        if concurrency == 1:
            taking_turns = {**dict([baseline] if baseline else []), **routes}
            both = run_alternating(taking_turns, requests, args.requests, answers)
            base = both[baseline[0]] if baseline else None
            for name in routes:
                levels[name].append(both[name])
        else:
            for name, route in routes.items():
                run = f"{name} concurrency {concurrency}"
                levels[name].append(run_level(route, run, requests, concurrency, args.requests, answers))
    if baseline is not None and base is None:  # no concurrency-1 level: the baseline alone
        base = run_level(baseline[1], f"{baseline[0]} concurrency 1", requests, 1, args.requests, answers)
    return levels, base


def bench_server(
    url: str,
    name: str,
    requests: list[Request],
    args: argparse.Namespace,
    answers: Answers,
    baseline: tuple[str, Route] | None = None,
    gateway: GatewayRoute | None = None,
) -> tuple[dict, Level | None]:
    """Every concurrency level against one server over gRPC (and through the gateway, and the baseline beside
    them, when given)."""
    route = GrpcRoute(url, args.max_tokens)
    routes: dict[str, Route] = {name: route, **({GATEWAY: gateway} if gateway else {})}
    levels, base = measure_levels(routes, requests, args, answers, baseline)
    route.close()
    warm = Client(url)
    largest = {model: _largest_batch(warm, model) for model in BATCHED_MODELS}
    warm.close()
    result = {"levels": levels[name], "largest_batch": largest}
    if gateway is not None:
        result["gateway_levels"] = levels[GATEWAY]
    return result, base


def _largest_batch(client: Client, model: str) -> int:
    """The largest batch the model executed, from the server's statistics."""
    stats = client.grpc.get_inference_statistics(model_name=model, as_json=True)["model_stats"][0]
    return max((int(b["batch_size"]) for b in stats.get("batch_stats", [])), default=0)


def bench_transformers(
    model_dir: Path, requests: list[Request], args: argparse.Namespace
) -> tuple[Level, list[list[int]]]:
    """The same requests one at a time through transformers' greedy generate; also its token ids per request."""
    import torch
    from qwen3vl_trt.hf.checkpoint import generation_end_ids
    from qwen3vl_trt.hf.reference import hf_model_inputs
    from qwen3vl_trt.preprocess import Preprocessor
    from transformers import AutoModelForImageTextToText
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    pre = Preprocessor.from_pretrained(model_dir)
    end_ids = list(generation_end_ids(model_dir))
    ends = {"eos_token_id": end_ids, "pad_token_id": end_ids[0]} if end_ids else {}

    def generate(request: Request) -> list[int]:
        r = pre(request.messages())
        inputs = hf_model_inputs(model, r.input_ids, pre.info.image_token_id, r.pixel_values, r.image_grid_thw)
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=args.max_tokens, do_sample=False, **ends)
        # The server leaves the end ids out of its answers; so do these.
        return [t for t in out[0, inputs["input_ids"].shape[1] :].tolist() if t not in end_ids]

    expected = [generate(request) for request in requests]  # also the warm-up
    latencies, tokens = [], 0
    start = time.perf_counter()
    for n in range(args.requests):
        begin = time.perf_counter()
        tokens += len(generate(requests[n % len(requests)]))
        latencies.append(time.perf_counter() - begin)
    return _level(1, latencies, time.perf_counter() - start, tokens), expected


def bench_own_servers(
    model_dir: Path, scratch: Path, requests: list[Request], args: argparse.Namespace, answers: Answers
) -> tuple[dict, Level]:
    """Builds `model_dir` for the CPU target and benchmarks its server with the default settings (and
    with dynamic batching off, when asked) beside the same requests in one process; the one-process level."""
    from qwen3vl_trt.pipeline.build import BuildOptions, build
    from qwen3vl_trt.serving.ports import free_ports
    from qwen3vl_trt.serving.repository.writer import write_repository
    from qwen3vl_trt.serving.server.tritonserver import TritonServer

    _log(f"building {model_dir} for the CPU target in {scratch}")
    limits = EngineLimits(max_batch_size=args.max_batch_size)
    build(
        model_dir, scratch / "build", BuildOptions(llm_dtype="fp32", limits=limits), target="cpu", log=lambda *_: None
    )
    one_process = OneProcessRoute(model_dir, scratch / "build", args.max_tokens, args.one_process_threads)
    warm_up(one_process, ONE_PROCESS, requests, answers)
    # Without the visual cache: the workload's cycle repeats its images, which the cache would answer from memory
    # (scripts/bench_cache.py measures that); here every image is decoded and encoded, as in one process.
    settings = {"batching on": RepositorySettings(max_queue_delay_us=args.queue_delay_us, visual_cache="off")}
    if args.batching_off:
        settings["batching off"] = RepositorySettings(dynamic_batching=False, visual_cache="off")
    servers: dict[str, dict] = {}
    local: Level | None = None
    for name, setting in settings.items():
        repo = write_repository(scratch / "build", scratch / name.replace(" ", "-"), "cpu", settings=setting)
        _log(f"{name}: starting tritonserver on {repo}")
        with TritonServer(repo, free_ports(), log_path=scratch / f"{repo.name}.log") as server:
            first = local is None
            baseline = (ONE_PROCESS, one_process) if first else None
            gateway = GatewayRoute(server.url, repo, args.max_tokens, scratch / "gateway.log") if first else None
            try:
                servers[name], base = bench_server(server.url, name, requests, args, answers, baseline, gateway)
            finally:
                if gateway is not None:
                    gateway.close()
            local = local or base
    assert local is not None
    return servers, local


def _levels_table(name: str, result: dict) -> list[str]:
    widths = (11, 10, 8, 7, 7)

    def row(*cells: str) -> str:
        return "  " + "  ".join(f"{cell:>{width}}" for cell, width in zip(cells, widths, strict=True))

    lines = []
    for title, levels in ((name, result["levels"]), (f"{name}, {GATEWAY}", result.get("gateway_levels"))):
        if levels is None:
            continue
        lines += [f"{title}:", row("concurrency", "requests/s", "tokens/s", "p50 ms", "p99 ms")]
        lines += [
            row(
                str(lv.concurrency),
                f"{lv.requests_per_s:.2f}",
                f"{lv.tokens_per_s:.1f}",
                f"{lv.p50_ms:.0f}",
                f"{lv.p99_ms:.0f}",
            )
            for lv in levels
        ]
    lines.append("  largest batch executed: " + ", ".join(f"{m} {b}" for m, b in result["largest_batch"].items()))
    return lines


GATEWAY_GOAL = 1.05
VISION_GOAL = 1.10


def gateway_ratios(result: dict) -> dict[int, dict[str, float]]:
    """The gateway against gRPC at each concurrency: p50 latency and requests/s (goal: latency <= 1.05x)."""
    grpc = {lv.concurrency: lv for lv in result["levels"]}
    return {
        lv.concurrency: {
            "p50_latency": lv.p50_ms / grpc[lv.concurrency].p50_ms,
            "requests_per_s": lv.requests_per_s / grpc[lv.concurrency].requests_per_s,
        }
        for lv in result.get("gateway_levels", [])
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="gRPC HOST:PORT of a running qwen3vl-trt server (default: build and serve here)")
    p.add_argument("--model", type=Path, help="checkpoint (default: a tiny random one); with --url, the served one")
    p.add_argument("--requests", type=int, default=32, help="requests per concurrency level")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    p.add_argument("--max-batch-size", type=int, default=EngineLimits().max_batch_size, help="of the build")
    p.add_argument(
        "--queue-delay-us",
        type=int,
        default=RepositorySettings().max_queue_delay_us,
        help="dynamic batchers' queue delay of the batching-on repository",
    )
    p.add_argument(
        "--one-process-threads",
        type=int,
        help="intra-op threads of the one-process run (default: torch's and ONNX Runtime's, all cores)",
    )
    p.add_argument("--batching-off", action="store_true", help="also serve with dynamic batching off (no --url)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")
    args = p.parse_args()
    if args.requests < 1 or min(args.concurrency) < 1:
        p.error("--requests and --concurrency must be positive")
    try:
        sys.exit(run(args))
    except Qwen3VLTrtError as e:
        sys.exit(f"error: {e}")


def run(args: argparse.Namespace) -> int:
    requests = workload()
    answers = Answers()
    local: Level | None = None
    with tempfile.TemporaryDirectory(prefix="bench-serving-") as tmp:
        scratch = Path(tmp)
        model_dir = args.model
        if args.url:
            probe = Client(args.url)
            ready = probe.is_ready()
            probe.close()
            if not ready:
                raise Qwen3VLTrtError(f"no ready qwen3vl-trt server at {args.url}; start one with `qwen3vl-trt serve`")
            servers = {args.url: bench_server(args.url, args.url, requests, args, answers)[0]}
        else:
            if model_dir is None:
                from qwen3vl_trt.qa.tiny import make_tiny_checkpoint

                model_dir = make_tiny_checkpoint(scratch / "checkpoint")
            servers, local = bench_own_servers(model_dir, scratch, requests, args, answers)
        hf: Level | None = None
        expected: list[list[int]] | None = None
        if model_dir is not None:
            _log(f"transformers generate: {args.requests} requests one at a time")
            hf, expected = bench_transformers(model_dir, requests, args)
        vision = None
        if not args.url:
            from bench_vision_batching import vision_batching_figures

            _log("the vision encoder's batches, per image, beside one image alone")
            vision = vision_batching_figures(model_dir, scratch / "build" / "vision")
    report(args, requests, servers, local, hf, expected, answers, vision)
    return 1 if answers.mismatches else 0


@dataclass(frozen=True)
class Goals:
    """Served against one process: requests/s at the top concurrency / one process's (goal >= 2) and
    p50 latency at concurrency 1 / one process's (goal <= 1.10)."""

    throughput_ratio: float | None
    latency_ratio: float | None

    THROUGHPUT_GOAL = 2.0
    LATENCY_GOAL = 1.10

    @classmethod
    def of(cls, levels: list[Level], local: Level | None) -> Goals:
        if local is None:
            return cls(None, None)
        top = max(levels, key=lambda lv: lv.concurrency)
        c1 = next((lv for lv in levels if lv.concurrency == 1), None)
        return cls(
            top.requests_per_s / local.requests_per_s,
            c1.p50_ms / local.p50_ms if c1 is not None else None,
        )

    def lines(self, name: str, top: int) -> list[str]:
        def verdict(ok: bool) -> str:
            return "meets the goal" if ok else "misses the goal"

        lines = []
        if self.throughput_ratio is not None:
            ok = self.throughput_ratio >= self.THROUGHPUT_GOAL
            lines.append(
                f"{name} at concurrency {top} / one process, requests/s: {self.throughput_ratio:.2f}x "
                f"(goal >= {self.THROUGHPUT_GOAL:g}: {verdict(ok)})"
            )
        if self.latency_ratio is not None:
            ok = self.latency_ratio <= self.LATENCY_GOAL
            lines.append(
                f"{name} at concurrency 1 / one process, p50 latency: {self.latency_ratio:.2f}x "
                f"(goal <= {self.LATENCY_GOAL:.2f}: {verdict(ok)})"
            )
        return lines


def report(
    args: argparse.Namespace,
    requests: list[Request],
    servers: dict,
    local: Level | None,
    hf: Level | None,
    expected: list[list[int]] | None,
    answers: Answers,
    vision: dict | None = None,
) -> None:
    top = max(args.concurrency)

    def at_top(result: dict) -> Level:
        return next(lv for lv in result["levels"] if lv.concurrency == top)

    on, off = servers.get("batching on"), servers.get("batching off")
    batching_ratio = at_top(on).requests_per_s / at_top(off).requests_per_s if on and off else None
    first_name, first = next(iter(servers.items()))
    goals = Goals.of(first["levels"], local)
    hf_ratio = at_top(first).requests_per_s / hf.requests_per_s if hf else None
    agree = None
    if expected is not None:
        agree = sum(answers.first[i][1] == tokens for i, tokens in enumerate(expected))
    if args.json:
        print(
            json.dumps(
                {
                    "max_tokens": args.max_tokens,
                    "requests_per_level": args.requests,
                    "workload": [r.label for r in requests],
                    "one_process": local.as_dict() if local else None,
                    "servers": {
                        name: {**result, "levels": [lv.as_dict() for lv in result["levels"]]}
                        for name, result in servers.items()
                    },
                    "served_over_one_process": asdict(goals),
                    "gateway_over_grpc": gateway_ratios(first),
                    "batching_on_over_off": batching_ratio,
                    "transformers": hf.as_dict() if hf else None,
                    "server_over_transformers": hf_ratio,
                    "equal_to_transformers": agree,
                    "vision_batching": vision,
                    "mismatches": answers.mismatches,
                },
                indent=2,
            )
        )
        return
    print(
        f"{args.requests} requests per level, cycling through {len(requests)}: "
        f"{'; '.join(r.label for r in requests)}; greedy, max_tokens {args.max_tokens}"
    )
    if local is not None:
        print(
            f"{ONE_PROCESS} (LocalPipeline, one request at a time): {local.requests_per_s:.2f} requests/s, "
            f"{local.tokens_per_s:.1f} tokens/s, p50 {local.p50_ms:.0f} ms, p99 {local.p99_ms:.0f} ms"
        )
    for name, result in servers.items():
        print("\n".join(_levels_table(name, result)))
    if local is not None:
        print("\n".join(goals.lines(first_name, top)))
    else:
        print(f"{ONE_PROCESS}: not run against a running server (run without --url to compare)")
    for concurrency, ratio in gateway_ratios(first).items():
        verdict = "meets" if ratio["p50_latency"] <= GATEWAY_GOAL else "misses"
        print(
            f"{GATEWAY} / gRPC at concurrency {concurrency}: p50 latency {ratio['p50_latency']:.2f}x "
            f"(goal <= {GATEWAY_GOAL:.2f}: {verdict} the goal), requests/s {ratio['requests_per_s']:.2f}x"
        )
    if batching_ratio is not None:
        print(f"dynamic batching on / off, requests/s at concurrency {top}: {batching_ratio:.2f}x")
    if hf is not None:
        print(
            f"transformers generate, one request at a time: {hf.requests_per_s:.2f} requests/s, "
            f"{hf.tokens_per_s:.1f} tokens/s, p50 {hf.p50_ms:.0f} ms, p99 {hf.p99_ms:.0f} ms"
        )
        print(f"{first_name} at concurrency {top} / transformers, requests/s: {hf_ratio:.2f}x")
        print(f"server token ids equal transformers' for {agree} of {len(requests)} requests")
    else:
        print("transformers generate: not run (pass --model with the checkpoint the server serves)")
    if vision is not None:
        ratios = vision["ratios"]
        print(
            f"vision encoder per image, batched / alone ({vision['patches']['large']} patches each): 2 images "
            f"{ratios['2 large, planned / alone']:.2f}x, 4 images {ratios['4 large, planned / alone']:.2f}x "
            f"(goal <= {VISION_GOAL:.2f}); all in one run as before: {ratios['2 large, joined / alone']:.2f}x, "
            f"{ratios['4 large, joined / alone']:.2f}x"
        )
    runs = "every run" if not answers.mismatches else f"{len(answers.mismatches)} mismatching answers:"
    print(f"same token ids for each request in {runs}")
    for m in answers.mismatches:
        print(f"  request {m['request']} in {m['run']}: {m['got']!r} != {m['expected']!r} ({m['first_seen_in']})")


if __name__ == "__main__":
    main()
