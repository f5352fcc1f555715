#!/usr/bin/env python3
"""What the serving plane around the LLM costs per CPU-second, beside the floor that Triton itself sets.

It makes a tiny checkpoint (or takes --model), builds it for the CPU target and writes two repositories:

- the plane: the deployment with its `llm` replaced by scripts/bench_plane_llm/paced_llm.cc, a Triton C++ backend
  (compiled here with g++) which decodes at a GPU's pace without computing (every --step-ms one step gives each
  request it holds its next token, as an inflight-batching engine does), so that what batching or coalescing saves
  is what a GPU's decode loop would let it save. Like the tensorrtllm backend it runs inside tritonserver's process
  and answers in its protocol, so the server's share per token is what it is on a GPU host; preprocessing, the
  vision encoder, the ensemble, the server and the gateway are what is measured;
- the floor: that same model alone, which clients call straight over gRPC (no other step), and for the
  gateway route the same behind scripts/bench_plane_relay.py (a bare ASGI app relaying each response as one
  server-sent event).

It counts the CPU time (user + system, psutil) of every process a request crosses: tritonserver, each python
stub by model, the gateway (`qwen3vl-trt openai` in its own process) or the relay. Workloads, each after an
untimed pass, at --concurrency:

- streamed text, --stream-tokens tokens a request, through gRPC (this package's Client, decoding the tokens
  ensemble's ids) and through the OpenAI gateway (the official client, stream on; again with
  --stream-interval-ms 0, every chunk written as it comes), on the plane and on the floor;
- image requests (one or two JPEGs of different sizes, --max-tokens tokens, not streamed), through gRPC and
  the gateway, with the visual cache off and the vision encoder's CPU time reported apart (a GPU host runs the
  encoder on the GPU);
- concurrency 1, streamed: time to first token and inter-token latency ((last - first) / (tokens - 1), as
  AIPerf reports it), plane beside floor;
- concurrency 1 on the same build with its real CPU llm, one process (LocalPipeline), gRPC and the gateway
  taking turns request by request: the latency goals (Triton / one process <= 1.10, gateway / gRPC <= 1.05).

It prints tokens and image requests per CPU-second, the floor's, the plane/floor ratio, each process's share
per streamed token and per image request, and the CPU cores a GPU host needs so that the plane keeps up with
one H200 decoding an 8B model (its published rate, 128-token outputs, every token streamed through the gateway
and every request carrying images like these).

    .venv/bin/python scripts/bench_plane.py [--model DIR] [--requests 96] [--concurrency 16]
        [--stream-tokens 64] [--max-tokens 16] [--step-ms 10] [--latency-requests 24] [--json]
        [--gateway-requests]

--gateway-requests measures only the gateway route's text and image requests (not streamed) per plane-CPU-second:
what the gateway and preprocessing spend on a request's prompt and media.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import psutil
from bench_serving import (
    ONE_PROCESS,
    Answers,
    GatewayRoute,
    GrpcRoute,
    Level,
    OneProcessRoute,
    Reply,
    Request,
    Route,
    Send,
    run_alternating,
    run_level,
    warm_up,
    workload,
)
from qwen3vl_trt.common.limits import EngineLimits
from qwen3vl_trt.decoding.detokenize import Detokenizer
from qwen3vl_trt.errors import Qwen3VLTrtError
from qwen3vl_trt.serving import interface
from qwen3vl_trt.serving.client import Client
from qwen3vl_trt.serving.repository import model_config as cfg

SCRIPTS = Path(__file__).parent
PACED_LLM = SCRIPTS / "bench_plane_llm" / "paced_llm.cc"
PACED_BACKEND = "bench_paced_llm"  # Triton loads libtriton_<backend>.so from the model's directory
RELAY = SCRIPTS / "bench_plane_relay.py"
STEP_MS_PARAMETER = "bench_step_ms"  # scripts/bench_plane_llm/paced_llm.cc reads it
GATEWAY_PROCESS, RELAY_PROCESS, TRITONSERVER = "gateway", "relay", "tritonserver"
PROFILES: dict[str, dict[str, list[tuple[str, float]]]] = {}  # by workload, by process (--profile)


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


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# -- CPU time per process ----------------------------------------------------------------------------------------


class Processes:
    """The processes a request crosses, by role: tritonserver, each python stub by its model's name, and the
    front end's process (the gateway or the relay) when one is added."""

    def __init__(self, server_pid: int):
        self.server_pid = server_pid
        self.extra: dict[str, int] = {}

    def add(self, role: str, pid: int) -> None:
        self.extra[role] = pid

    def _roles(self) -> Iterator[tuple[str, psutil.Process]]:
        server = psutil.Process(self.server_pid)
        yield TRITONSERVER, server
        for child in server.children(recursive=True):
            yield _stub_model(child) or TRITONSERVER, child
        for role, pid in self.extra.items():
            yield role, psutil.Process(pid)

    def python_pids(self) -> dict[str, int]:
        """The python processes (stubs and the front end), by role."""
        return {role: process.pid for role, process in self._roles() if role != TRITONSERVER}

    def cpu_seconds(self) -> dict[str, float]:
        totals: dict[str, float] = {}
        for role, process in self._roles():
            try:
                times = process.cpu_times()
            except psutil.NoSuchProcess:
                continue
            totals[role] = totals.get(role, 0.0) + times.user + times.system
        return totals


def _stub_model(process: psutil.Process) -> str | None:
    """A python stub's model: its command line names the model's model.py (REPO/MODEL/VERSION/model.py)."""
    try:
        command = process.cmdline()
    except psutil.Error:
        return None
    for part in command:
        if part.endswith("/model.py"):
            return Path(part).parent.parent.name
    return None


@dataclass
class Workload:
    name: str
    level: Level
    cpu: dict[str, float]  # CPU seconds by process role over the timed requests
    streamed_tokens: int = 0
    requests: int = 0
    apart: tuple[str, ...] = ()  # roles whose time is reported apart (the vision encoder)

    @property
    def plane_cpu_seconds(self) -> float:
        return sum(seconds for role, seconds in self.cpu.items() if role not in self.apart)

    def per_cpu_second(self) -> float:
        count = self.streamed_tokens or self.requests
        return count / self.plane_cpu_seconds

    def per_item_us(self) -> dict[str, float]:
        """Each process's CPU microseconds per streamed token (or per request)."""
        count = self.streamed_tokens or self.requests
        return {role: seconds / count * 1e6 for role, seconds in sorted(self.cpu.items())}

    def as_dict(self) -> dict:
        return {
            "name": self.name,
            "level": self.level.as_dict(),
            "cpu_seconds": self.cpu,
            "plane_cpu_seconds": self.plane_cpu_seconds,
            "streamed_tokens": self.streamed_tokens,
            "requests": self.requests,
            "per_cpu_second": self.per_cpu_second(),
            "per_item_us": self.per_item_us(),
            "apart": list(self.apart),
        }


# -- routes ------------------------------------------------------------------------------------------------------


class Timings:
    """Time to first token and inter-token latency of each streamed request a route sends."""

    def __init__(self) -> None:
        self.ttft_ms: list[float] = []
        self.itl_ms: list[float] = []
        self._lock = threading.Lock()

    def record(self, started: float, first: float | None, last: float | None, tokens: int) -> None:
        if first is None or last is None:
            return
        with self._lock:
            self.ttft_ms.append((first - started) * 1000)
            if tokens > 1:
                self.itl_ms.append((last - first) / (tokens - 1) * 1000)

    def take(self) -> tuple[list[float], list[float]]:
        with self._lock:
            taken = (self.ttft_ms, self.itl_ms)
            self.ttft_ms, self.itl_ms = [], []
        return taken


class StreamedGrpc(GrpcRoute):
    """Streamed requests through this package's gRPC client, which decodes the tokens ensemble's responses as
    they arrive (the served checkpoint's detokenizer)."""

    def __init__(self, url: str, max_tokens: int, detokenizer: Detokenizer):
        super().__init__(url, max_tokens)
        self.detokenizer = detokenizer
        self.timings = Timings()

    def sender(self) -> Send:
        client = Client(self.url, detokenizer=self.detokenizer)
        self._clients.append(client)

        def send(request: Request) -> Reply:
            started = time.perf_counter()
            first = last = None
            pieces = []
            for piece in client.stream(request.prompt, request.images, self.max_tokens, stream=True):
                if piece.token_ids:
                    last = time.perf_counter()
                    first = first or last
                pieces.append(piece)
            answer = type(pieces[0]).joined(pieces)
            self.timings.record(started, first, last, len(answer.token_ids))
            return Reply(answer.token_ids, answer.text, len(answer.token_ids))

        return send


class FloorGrpc(Route):
    """The floor over gRPC: streamed requests straight to the paced `llm` (tritonclient's own stream)."""

    def __init__(self, url: str, max_tokens: int):
        self.url, self.max_tokens = url, max_tokens
        self.timings = Timings()
        self._clients: list = []

    def sender(self) -> Send:
        import queue

        import tritonclient.grpc as grpcclient
        from bench_plane_relay import llm_inputs

        client = grpcclient.InferenceServerClient(self.url)
        self._clients.append(client)

        def send(_request: Request) -> Reply:
            responses: queue.Queue = queue.Queue()
            started = time.perf_counter()
            client.start_stream(callback=lambda result, error: responses.put((time.perf_counter(), result, error)))
            ids: list[int] = []
            first = last = None
            try:
                client.async_stream_infer(interface.LLM, llm_inputs(self.max_tokens), enable_empty_final_response=True)
                while True:
                    at, result, error = responses.get(timeout=120)
                    if error is not None:
                        raise Qwen3VLTrtError(f"floor: {error}")
                    got = result.as_numpy(interface.LLM_OUTPUT_IDS.name)
                    if got is not None:
                        ids += got.reshape(-1).tolist()
                        first, last = first or at, at
                    final = result.get_response().parameters.get("triton_final_response")
                    if final is not None and final.bool_param:
                        break
            finally:
                client.stop_stream()
            self.timings.record(started, first, last, len(ids))
            return Reply(ids, None, len(ids))

        return send

    def close(self) -> None:
        for client in self._clients:
            client.close()


class PlaneGateway(GatewayRoute):
    """The OpenAI gateway in its own process (bench_serving's), streamed (chunks as they come, usage at the end)
    or not (images)."""

    streaming = True

    def __init__(self, triton_url: str, repo: Path, max_tokens: int, log_path: Path, options: Sequence[str] = ()):
        super().__init__(triton_url, repo, max_tokens, log_path, options)
        self.timings = Timings()

    def sender(self) -> Send:
        if not self.streaming:
            return super().sender()
        import openai

        client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=600)

        def send(request: Request) -> Reply:
            started = time.perf_counter()
            first = last = None
            text, tokens = [], 0
            stream = client.chat.completions.create(
                model="bench",
                messages=[{"role": "user", "content": request.prompt}],
                max_tokens=self.max_tokens,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
            for chunk in stream:
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
                for choice in chunk.choices:
                    if choice.delta.content:
                        last = time.perf_counter()
                        first = first or last
                        text.append(choice.delta.content)
            self.timings.record(started, first, last, tokens)
            return Reply(None, "".join(text), tokens)

        return send


class FloorRelay(Route):
    """The floor behind the gateway: scripts/bench_plane_relay.py in its own process, read with httpx."""

    def __init__(self, triton_url: str, max_tokens: int, log_path: Path):
        from qwen3vl_trt.serving.ports import free_ports

        self.max_tokens = max_tokens
        port = free_ports().http
        self.url = f"http://127.0.0.1:{port}"
        self.timings = Timings()
        self._log = open(log_path, "wb")
        command = [sys.executable, str(RELAY), triton_url, str(port)]
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT)
        _wait_http(self.url, self.process, log_path)

    def sender(self) -> Send:
        import httpx

        client = httpx.Client(timeout=600)

        def send(_request: Request) -> Reply:
            started = time.perf_counter()
            first = last = None
            ids: list[int] = []
            with client.stream("POST", self.url, json={"max_tokens": self.max_tokens}) as answer:
                for line in answer.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    last = time.perf_counter()
                    first = first or last
                    ids += json.loads(line[6:])["ids"]
            self.timings.record(started, first, last, len(ids))
            return Reply(ids, None, len(ids))

        return send

    def close(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)
        self._log.close()


def _wait_http(url: str, process: subprocess.Popen, log_path: Path) -> None:
    deadline = time.monotonic() + 120
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            raise Qwen3VLTrtError(f"{url} did not come up; see {log_path}")
        time.sleep(0.2)


# -- measuring ---------------------------------------------------------------------------------------------------


class Profiles:
    """py-spy sampling profiles of every python process over one workload (all threads, idle ones left out), and
    each one's top functions by their own samples. py-spy needs ptrace (a container may need CAP_SYS_PTRACE)."""

    def __init__(self, directory: Path, workload: str, processes: Processes):
        self.files: dict[str, Path] = {}
        self._recorders: list[subprocess.Popen] = []
        py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
        tag = workload.replace(", ", "-").replace(" ", "-")
        for role, pid in processes.python_pids().items():
            out = directory / f"{tag}-{role}.txt"
            command = [py_spy, "record", "--nonblocking", "-r", "200", "-f", "raw", "-o", str(out), "-p", str(pid)]
            self._recorders.append(subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            self.files[role] = out

    def stop(self) -> dict[str, list[tuple[str, float]]]:
        for recorder in self._recorders:
            recorder.send_signal(signal.SIGINT)
        for recorder in self._recorders:
            recorder.wait(timeout=60)
        return {role: top_functions(path) for role, path in self.files.items() if path.exists()}


def top_functions(raw: Path, count: int = 8) -> list[tuple[str, float]]:
    """The functions with the most samples of their own in py-spy's raw (collapsed) stacks, and their share."""
    own: dict[str, int] = {}
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, samples = line.rpartition(" ")
        if not stack:
            continue
        leaf = re.sub(r":\d+\)$", ")", stack.rsplit(";", 1)[-1])
        own[leaf] = own.get(leaf, 0) + int(samples)
        total += int(samples)
    ranked = sorted(own.items(), key=lambda item: -item[1])[:count]
    return [(name, samples / total) for name, samples in ranked]


def measure(
    name: str,
    route: Route,
    processes: Processes,
    requests: list[Request],
    args: argparse.Namespace,
    *,
    streamed: bool,
    apart: tuple[str, ...] = (),
    front_end: bool = False,
) -> Workload:
    """One workload at --concurrency after an untimed pass, with the CPU time of every process it crosses (the front
    end's process only when `front_end`: a route straight over gRPC does not cross it) and their profiles, with
    --profile."""
    answers = Answers()
    warm_up(route, name, requests, answers)
    timings: Timings | None = getattr(route, "timings", None)
    if timings is not None:
        timings.take()
    _log(f"  {name}: {args.requests} requests at concurrency {args.concurrency}")
    profiles = Profiles(args.profile, name, processes) if args.profile else None
    before = processes.cpu_seconds()
    level = run_level(route, name, requests, args.concurrency, args.requests, answers)
    after = processes.cpu_seconds()
    if profiles is not None:
        PROFILES[name] = profiles.stop()
    if answers.mismatches:
        raise Qwen3VLTrtError(f"{name}: answers differ between runs: {answers.mismatches[:3]}")
    crossed = [role for role in after if front_end or role not in processes.extra]
    cpu = {role: after[role] - before.get(role, 0.0) for role in crossed}
    tokens = level.tokens if streamed else 0
    return Workload(name, level, cpu, tokens, 0 if streamed else level.requests, apart)


def concurrency_1(routes: dict[str, Route], requests: list[Request], count: int) -> dict[str, dict[str, float]]:
    """Streamed requests at concurrency 1, the routes taking turns: p50 time to first token and inter-token latency."""
    answers = Answers()
    for route in routes.values():
        timings: Timings = route.timings  # type: ignore[attr-defined]
        timings.take()
    run_alternating(routes, requests, count, answers)
    out = {}
    for name, route in routes.items():
        ttft, itl = route.timings.take()  # type: ignore[attr-defined]
        out[name] = {"ttft_p50_ms": float(np.median(ttft)), "itl_p50_ms": float(np.median(itl))}
    return out


@contextmanager
def _server(repo: Path, log_path: Path) -> Iterator:
    from qwen3vl_trt.serving.ports import free_ports
    from qwen3vl_trt.serving.server.tritonserver import TritonServer

    with TritonServer(repo, free_ports(), log_path=log_path) as server:
        yield server


def compile_paced_llm(scratch: Path) -> Path:
    """The paced stand-in's backend library, compiled with g++ (no headers needed: it declares the C API), with the
    llm's tensor names from the interface."""
    compiler = shutil.which("g++")
    if compiler is None:
        raise Qwen3VLTrtError("bench_plane.py compiles its llm stand-in (a Triton C++ backend) with g++: install g++")
    library = scratch / f"libtriton_{PACED_BACKEND}.so"
    names = {
        "INPUT_IDS": interface.INPUT_IDS,
        "REQUEST_OUTPUT_LEN": interface.REQUEST_OUTPUT_LEN,
        "STREAMING": interface.STREAMING,
        "EXCLUDE_INPUT": interface.EXCLUDE_INPUT,
        "STOP": interface.STOP,
        "OUTPUT_IDS": interface.LLM_OUTPUT_IDS,
        "SEQUENCE_LENGTH": interface.SEQUENCE_LENGTH,
    }
    defines = [f'-D{macro}="{tensor.name}"' for macro, tensor in names.items()] + [f'-DSTEP_MS="{STEP_MS_PARAMETER}"']
    command = [compiler, "-O2", "-std=c++17", "-shared", "-fPIC", *defines, "-o", str(library), str(PACED_LLM)]
    command.append("-lpthread")
    subprocess.run(command, check=True)
    return library


def paced(repo: Path, library: Path, step_ms: float) -> None:
    """Replaces the repository's llm with the paced stand-in, at step_ms per decode step."""
    llm = repo / interface.LLM
    for path in (llm / "1").iterdir():
        path.unlink()
    shutil.copyfile(library, llm / library.name)
    config = cfg.read(llm)
    config.backend = PACED_BACKEND
    cfg.parameters(config, {STEP_MS_PARAMETER: step_ms})
    cfg.write(llm, config)


def floor_repository(plane: Path, floor: Path) -> Path:
    """The paced llm alone in a repository of its own."""
    floor.mkdir()
    shutil.copytree(plane / interface.LLM, floor / interface.LLM)
    return floor


def bench(model_dir: Path, scratch: Path, args: argparse.Namespace) -> dict:
    from qwen3vl_trt.pipeline.build import BuildOptions, build
    from qwen3vl_trt.serving.repository.settings import RepositorySettings
    from qwen3vl_trt.serving.repository.writer import write_repository

    _log(f"building {model_dir} for the CPU target in {scratch}")
    limits = EngineLimits(max_batch_size=args.max_batch_size)
    build(
        model_dir, scratch / "build", BuildOptions(llm_dtype="fp32", limits=limits), target="cpu", log=lambda *_: None
    )
    # Without the visual cache: every image request is decoded and encoded (the cycle repeats its images).
    settings = RepositorySettings(visual_cache="off")
    served = write_repository(scratch / "build", scratch / "served", "cpu", settings=settings, log=lambda *_: None)
    plane = write_repository(scratch / "build", scratch / "plane", "cpu", settings=settings, log=lambda *_: None)
    paced(plane, compile_paced_llm(scratch), args.step_ms)
    floor = floor_repository(plane, scratch / "floor")
    cycle = workload()
    text = [r for r in cycle if not r.images]
    images = [r for r in cycle if r.images]
    result: dict = {"workloads": {}, "concurrency_1": {}}
    workloads = result["workloads"]

    if args.gateway_requests:
        _log("the plane: the deployment with the paced llm, requests through the gateway")
        with _server(plane, scratch / "plane.log") as server:
            processes = Processes(server.pid)
            result["server_cores"] = len(psutil.Process(server.pid).cpu_affinity() or [])
            gateway = PlaneGateway(server.url, plane, args.max_tokens, scratch / "gateway.log")
            gateway.streaming = False
            try:
                processes.add(GATEWAY_PROCESS, gateway.process.pid)
                workloads["text gateway"] = measure(
                    "plane, text, gateway", gateway, processes, text, args, streamed=False, front_end=True
                )
                workloads["images gateway"] = measure(
                    "plane, images, gateway", gateway, processes, images, args, streamed=False,
                    apart=(interface.VISION_ENCODER,), front_end=True,
                )  # fmt: skip
            finally:
                gateway.close()
        return result

    _log("the plane: the deployment with the paced llm")
    with _server(plane, scratch / "plane.log") as server:
        processes = Processes(server.pid)
        result["server_cores"] = len(psutil.Process(server.pid).cpu_affinity() or [])
        grpc_route = StreamedGrpc(server.url, args.stream_tokens, Detokenizer.from_model_dir(model_dir))
        gateway = PlaneGateway(server.url, plane, args.stream_tokens, scratch / "gateway.log")
        # The same gateway writing each chunk as it comes: what writing them together saves, and adds to latency.
        uncoalesced = PlaneGateway(
            server.url, plane, args.stream_tokens, scratch / "gateway-0.log", ["--stream-interval-ms", "0"]
        )
        try:
            processes.add(GATEWAY_PROCESS, gateway.process.pid)
            workloads["plane grpc"] = measure("plane, streamed, gRPC", grpc_route, processes, text, args, streamed=True)
            workloads["plane gateway"] = measure(
                "plane, streamed, gateway", gateway, processes, text, args, streamed=True, front_end=True
            )
            processes.add(GATEWAY_PROCESS, uncoalesced.process.pid)
            workloads["plane gateway, interval 0"] = measure(
                "plane, streamed, gateway, interval 0",
                uncoalesced,
                processes,
                text,
                args,
                streamed=True,
                front_end=True,
            )
            processes.add(GATEWAY_PROCESS, gateway.process.pid)
            if args.latency_requests:
                result["concurrency_1"]["plane"] = concurrency_1(
                    {"gRPC": grpc_route, "gateway": gateway, "gateway, interval 0": uncoalesced},
                    text,
                    args.latency_requests,
                )
            gateway.streaming, gateway.max_tokens = False, args.max_tokens
            image_grpc = GrpcRoute(server.url, args.max_tokens)
            vision = (interface.VISION_ENCODER,)
            workloads["images grpc"] = measure(
                "plane, images, gRPC", image_grpc, processes, images, args, streamed=False, apart=vision
            )
            workloads["images gateway"] = measure(
                "plane, images, gateway", gateway, processes, images, args, streamed=False, apart=vision, front_end=True
            )
            image_grpc.close()
        finally:
            grpc_route.close()
            gateway.close()
            uncoalesced.close()

    _log("the floor: the paced llm alone")
    with _server(floor, scratch / "floor.log") as server:
        processes = Processes(server.pid)
        floor_grpc = FloorGrpc(server.url, args.stream_tokens)
        relay = FloorRelay(server.url, args.stream_tokens, scratch / "relay.log")
        try:
            processes.add(RELAY_PROCESS, relay.process.pid)
            workloads["floor grpc"] = measure("floor, streamed, gRPC", floor_grpc, processes, text, args, streamed=True)
            workloads["floor gateway"] = measure(
                "floor, streamed, relay", relay, processes, text, args, streamed=True, front_end=True
            )
            if args.latency_requests:
                result["concurrency_1"]["floor"] = concurrency_1(
                    {"gRPC": floor_grpc, "gateway": relay}, text, args.latency_requests
                )
        finally:
            floor_grpc.close()
            relay.close()

    if args.latency_requests:
        _log("latency goals: the same build with its CPU llm, concurrency 1, routes taking turns")
        one_process = OneProcessRoute(model_dir, scratch / "build", args.max_tokens, 1)
        with _server(served, scratch / "served.log") as server:
            grpc_plain = GrpcRoute(server.url, args.max_tokens)
            gateway_plain = GatewayRoute(server.url, served, args.max_tokens, scratch / "gateway-served.log")
            try:
                routes: dict[str, Route] = {ONE_PROCESS: one_process, "gRPC": grpc_plain, "gateway": gateway_plain}
                answers = Answers()
                for name, route in routes.items():
                    warm_up(route, name, cycle, answers)
                levels = run_alternating(routes, cycle, args.latency_requests, answers)
                if answers.mismatches:
                    raise Qwen3VLTrtError(f"latency: answers differ between routes: {answers.mismatches[:3]}")
            finally:
                grpc_plain.close()
                gateway_plain.close()
        result["latency"] = {name: level.as_dict() for name, level in levels.items()}
    return result


# -- report ------------------------------------------------------------------------------------------------------


def cores_needed(gateway_tokens: Workload, gateway_images: Workload, gpu: PublishedDecode) -> float:
    """CPU cores that keep up with the GPU's decode rate: its tokens streamed through the gateway, and one image
    request per output_length tokens (every request carrying images: the costly case), the encoder apart."""
    per_token = gateway_tokens.plane_cpu_seconds / gateway_tokens.streamed_tokens
    per_image_request = gateway_images.plane_cpu_seconds / gateway_images.requests
    return gpu.tokens_per_s * per_token + gpu.tokens_per_s / gpu.output_length * per_image_request


def summary(w: dict[str, Workload], result: dict) -> dict:
    if "text gateway" in w:  # --gateway-requests
        return {name.replace(" ", "_") + "_per_cpu_s": workload.per_cpu_second() for name, workload in w.items()}
    out = {
        "grpc_tokens_per_cpu_s": w["plane grpc"].per_cpu_second(),
        "gateway_tokens_per_cpu_s": w["plane gateway"].per_cpu_second(),
        "floor_grpc_tokens_per_cpu_s": w["floor grpc"].per_cpu_second(),
        "floor_gateway_tokens_per_cpu_s": w["floor gateway"].per_cpu_second(),
        "images_grpc_per_cpu_s": w["images grpc"].per_cpu_second(),
        "images_gateway_per_cpu_s": w["images gateway"].per_cpu_second(),
        "cores_per_h200": cores_needed(w["plane gateway"], w["images gateway"], H200_8B),
        "gateway_interval_0_tokens_per_cpu_s": w["plane gateway, interval 0"].per_cpu_second(),
    }
    out["grpc_plane_over_floor"] = out["grpc_tokens_per_cpu_s"] / out["floor_grpc_tokens_per_cpu_s"]
    out["gateway_plane_over_floor"] = out["gateway_tokens_per_cpu_s"] / out["floor_gateway_tokens_per_cpu_s"]
    if "latency" in result:
        p50 = {name: level["p50_ms"] for name, level in result["latency"].items()}
        out["latency_p50_ms"] = p50
        out["triton_over_one_process"] = p50["gRPC"] / p50[ONE_PROCESS]
        out["gateway_over_grpc"] = p50["gateway"] / p50["gRPC"]
    return out


def report(args: argparse.Namespace, result: dict, workloads: dict[str, Workload]) -> None:
    s = result["summary"]
    if args.gateway_requests:
        _workload_table(args, result, workloads)
        print(
            f"requests per plane-CPU-second through the gateway (not streamed, {args.max_tokens} tokens each, vision "
            f"encoder apart): text {s['text_gateway_per_cpu_s']:.1f}, images {s['images_gateway_per_cpu_s']:.1f}"
        )
        return
    _workload_table(args, result, workloads)
    print(
        f"streamed tokens per CPU-second: gRPC {s['grpc_tokens_per_cpu_s']:.0f} "
        f"(floor {s['floor_grpc_tokens_per_cpu_s']:.0f}, "
        f"plane/floor {s['grpc_plane_over_floor']:.2f}); gateway {s['gateway_tokens_per_cpu_s']:.0f} "
        f"(floor {s['floor_gateway_tokens_per_cpu_s']:.0f}, plane/floor {s['gateway_plane_over_floor']:.2f})"
    )
    print(
        f"image requests per CPU-second, vision encoder apart: gRPC {s['images_grpc_per_cpu_s']:.1f}, "
        f"gateway {s['images_gateway_per_cpu_s']:.1f}"
    )
    for side, routes in result["concurrency_1"].items():
        cells = "; ".join(
            f"{name} first token {v['ttft_p50_ms']:.1f} ms, inter-token {v['itl_p50_ms']:.2f} ms"
            for name, v in routes.items()
        )
        print(f"concurrency 1, streamed, {side} (p50): {cells}")
    if "latency_p50_ms" in s:
        p50 = s["latency_p50_ms"]
        print(
            f"latency, CPU llm, concurrency 1 (p50): one process {p50[ONE_PROCESS]:.1f} ms, gRPC {p50['gRPC']:.1f} ms, "
            f"gateway {p50['gateway']:.1f} ms: Triton / one process {s['triton_over_one_process']:.2f} (goal <= 1.10), "
            f"gateway / gRPC {s['gateway_over_grpc']:.2f} (goal <= 1.05)"
        )
    for workload_name, roles in result.get("profiles", {}).items():
        for role, top in roles.items():
            print(f"profile, {workload_name}, {role}: " + "; ".join(f"{name} {share:.0%}" for name, share in top))
    print(f"one GPU decodes {H200_8B.tokens_per_s:,.0f} output tokens/s: {H200_8B.what}")
    print(f"  source: {H200_8B.source}")
    print(
        f"cores per H200 so that the plane keeps up (every token streamed through the gateway, every "
        f"{H200_8B.output_length}-token request with images like these, encoder on the GPU): {s['cores_per_h200']:.2f}"
    )


def _workload_table(args: argparse.Namespace, result: dict, workloads: dict[str, Workload]) -> None:
    print(
        f"the plane with a paced llm ({args.step_ms:g} ms a decode step), concurrency {args.concurrency}, "
        f"server on {result['server_cores']} cores; CPU of every process a request crosses"
    )
    print(f"{'workload':<38} {'items/s':>9} {'p50 ms':>8} {'CPU s':>7} {'per CPU-s':>10}   CPU us per item, by process")
    for w in workloads.values():
        level = w.level
        rate = level.tokens_per_s if w.streamed_tokens else level.requests_per_s
        shares = ", ".join(f"{role} {us:.0f}" for role, us in w.per_item_us().items() if us >= 0.5)
        apart = f" (apart: {', '.join(w.apart)})" if w.apart else ""
        print(
            f"{w.name:<38} {rate:>9.1f} {level.p50_ms:>8.0f} {w.plane_cpu_seconds:>7.2f} "
            f"{w.per_cpu_second():>10.0f}   {shares}{apart}"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, help="checkpoint (default: a tiny random one)")
    p.add_argument("--requests", type=int, default=96, help="requests per workload")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--stream-tokens", type=int, default=64, help="tokens per streamed text request")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens per image request")
    p.add_argument("--step-ms", type=float, default=10.0, help="the paced llm's time per decode step")
    p.add_argument(
        "--latency-requests", type=int, default=24, help="requests per route at concurrency 1 (0: no latency figures)"
    )
    p.add_argument("--max-batch-size", type=int, default=EngineLimits().max_batch_size, help="of the build")
    p.add_argument("--profile", type=Path, help="py-spy profiles of each python process per workload, into DIR")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument(
        "--gateway-requests",
        action="store_true",
        help="only the gateway route's text and image requests (not streamed, --max-tokens each) per CPU-second",
    )
    args = p.parse_args()
    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)
    if min(args.requests, args.concurrency, args.stream_tokens, args.max_tokens) < 1 or args.step_ms <= 0:
        p.error("--requests, --concurrency, --stream-tokens, --max-tokens and --step-ms must be positive")
    if args.latency_requests < 0:
        p.error("--latency-requests must not be negative")
    try:
        with tempfile.TemporaryDirectory(prefix="bench-plane-") as tmp:
            scratch = Path(tmp)
            model_dir = args.model
            if model_dir is None:
                from qwen3vl_trt.qa.tiny import make_tiny_checkpoint

                model_dir = make_tiny_checkpoint(scratch / "checkpoint")
            result = bench(model_dir, scratch, args)
    except Qwen3VLTrtError as e:
        sys.exit(f"error: {e}")
    workloads = result["workloads"]
    result["summary"] = summary(workloads, result)
    result["workloads"] = {name: w.as_dict() for name, w in workloads.items()}
    result["gpu"] = asdict(H200_8B)
    if PROFILES:
        result["profiles"] = PROFILES
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        report(args, result, workloads)


if __name__ == "__main__":
    main()
