"""`serve`'s warm-up and its readiness endpoint on a real tritonserver (the CPU target), one deployment for the
module: /ready answers 503 while loading and warming up and 200 only after the warm-up, 503 again while tritonserver
is not ready (a model unloaded) and while stopping; /metrics names the build; the warm-up ran through every model
(the GPU target's model_warmup samples of the vision encoder too) but left no trace in the stages' metrics nor in
the visual cache; the first request after ready is timed against the next ten."""

from __future__ import annotations

import json
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient
from deployment import LIMITS, SERVE_SCRIPT, port_flags
from images import jpeg
from prometheus_client.parser import text_string_to_metric_families
from qwen3vl_trt.hf.checkpoint import parse_config, read_config
from qwen3vl_trt.preprocess import ImageProcessingConfig
from qwen3vl_trt.qa.ports import free_port
from qwen3vl_trt.serving import interface
from qwen3vl_trt.serving.client import Client
from qwen3vl_trt.serving.ports import free_ports
from qwen3vl_trt.serving.repository import model_config as serving_config
from qwen3vl_trt.serving.repository.writer import vision_warmup, write_warmup_files
from qwen3vl_trt.serving.server import warmup
from qwen3vl_trt.serving.server.readiness import GATEWAY_NOT_SERVING
from qwen3vl_trt.serving.stages import metrics as stage_metrics

pytestmark = [pytest.mark.slow, pytest.mark.server]

STAGES = (interface.PREPROCESSING, interface.VISION_ENCODER, interface.LLM, interface.POSTPROCESSING)


class Served:
    """`serve` of the repository in a subprocess, with its log lines and /ready answers recorded as they come."""

    def __init__(self, repo: Path, log: Path):
        self.repo, self.log, self.ports = repo, log, free_ports()
        self.ready_url = f"http://127.0.0.1:{self.ports.ready}"
        self.grpc_url = f"127.0.0.1:{self.ports.grpc}"
        self.metrics_url = f"http://127.0.0.1:{self.ports.metrics}/metrics"
        self.openai_url = f"http://127.0.0.1:{free_port()}"
        flags = ["--repo", str(repo), *port_flags(self.ports), "--visual-cache", "memory", "--stop-grace", "10"]
        flags += ["--openai-port", self.openai_url.rsplit(":", 1)[1]]
        self.first_chat: int | None = None  # the HTTP status of a chat request sent the moment /ready answered 200
        self.process = subprocess.Popen(
            [sys.executable, "-c", SERVE_SCRIPT, *flags], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.lines: list[tuple[float, str]] = []  # serve's output (tritonserver's log among it)
        self.answers: list[tuple[float, int, str]] = []  # (when, HTTP status, reason) of each /ready asked
        self._polling = True
        self._threads = [threading.Thread(target=f, daemon=True) for f in (self._read_output, self._poll_ready)]
        for thread in self._threads:
            thread.start()

    def _read_output(self) -> None:
        assert self.process.stdout is not None
        with self.log.open("w") as log:
            for line in self.process.stdout:
                self.lines.append((time.monotonic(), line.rstrip("\n")))
                log.write(line)

    def _poll_ready(self) -> None:
        while self._polling:
            status, body = ready_answer(self.ready_url)
            if status:
                self.answers.append((time.monotonic(), status, body.get("reason", "")))
            if status == 200 and self.first_chat is None:
                self.first_chat = chat_status(self.openai_url)
            time.sleep(0.05)

    def wait_for(self, condition, what: str, within: float = 180.0) -> None:
        deadline = time.monotonic() + within
        while not condition():
            assert self.process.poll() is None, f"serve exited before {what}:\n{self.output()[-3000:]}"
            assert time.monotonic() < deadline, f"waited {within:g} s for {what}:\n{self.output()[-3000:]}"
            time.sleep(0.1)

    def output(self) -> str:
        return "\n".join(line for _, line in self.lines)

    def first(self, predicate) -> float:
        return next(when for when, line in self.lines if predicate(line))

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=60)
        finally:
            self._polling = False
            for thread in self._threads:
                thread.join(timeout=10)


def ready_answer(url: str) -> tuple[int, dict]:
    """GET /ready: the status and JSON body; 0 when nothing answers."""
    try:
        with urllib.request.urlopen(f"{url}/ready", timeout=5) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
    except OSError:
        return 0, {}


# The stage requests of the chat request the module sends when /ready first answers 200, and its tokens at most.
FIRST_CHAT = {interface.PREPROCESSING: 1, interface.LLM: 1}
FIRST_CHAT_TOKENS = 2


def chat_status(url: str) -> int:
    body = {"model": "dense", "messages": [{"role": "user", "content": "Hi."}], "max_tokens": FIRST_CHAT_TOKENS}
    request = urllib.request.Request(f"{url}/v1/chat/completions", json.dumps(body).encode(), method="POST")
    request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status
    except urllib.error.HTTPError as e:
        return e.code


def samples(url: str) -> dict[tuple[str, frozenset], float]:
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value for f in text_string_to_metric_families(text) for s in f.samples
    }


@pytest.fixture(scope="module")
def served(cpu_repository, checkpoints, tmp_path_factory):
    """A copy of the CPU build's repository beside its manifest, its vision encoder given the GPU target's
    model_warmup samples (repository.writer.vision_warmup: Triton runs them on the python model at load)."""
    build = tmp_path_factory.mktemp("warmup") / "build"
    shutil.copytree(cpu_repository, build / "triton_repo")
    shutil.copy(cpu_repository.parent / "manifest.json", build / "manifest.json")
    vision = build / "triton_repo" / interface.VISION_ENCODER
    config = serving_config.read(vision)
    vision_warmup(config, LIMITS, parse_config(read_config(checkpoints["dense"])[1]).vision)
    serving_config.write(vision, config)
    write_warmup_files(vision, config)
    deployment = Served(build / "triton_repo", build.parent / "serve.log")
    try:
        deployment.wait_for(lambda: any(line.startswith("ready: ") for _, line in deployment.lines), "ready")
        # Each test sees the deployment after the chat request sent when /ready first answered 200 (FIRST_CHAT).
        deployment.wait_for(lambda: deployment.first_chat is not None, "the chat request sent at 200 on /ready", 60)
        yield deployment
    finally:
        deployment.stop()


def _report(capsys, lines: list[str]) -> None:
    with capsys.disabled():
        print("\n" + "\n".join(f"  warm-up: {line}" for line in lines))


def test_ready_only_after_the_warm_up_ran_through_every_model(served, capsys):
    steps = [line for _, line in served.lines if line.startswith("qwen3vl-trt: warm-up ")]
    assert len(steps) == 4 and [s.split(":")[1] for s in steps] == [" warm-up 1/4", " warm-up 2/4", " warm-up 3/4",
                                                                    " warm-up 4/4"]  # fmt: skip
    assert "JPEG" in steps[0] and "PNG" in steps[1] and "tokens generated" in steps[3]
    served.wait_for(lambda: served.answers and served.answers[-1][1] == 200, "200 on /ready", within=10)
    first_ready = next(when for when, status, _ in served.answers if status == 200)
    reasons = [reason for _, status, reason in served.answers if status == 503]
    assert "warming up" in reasons and set(reasons) <= {"loading", "warming up", GATEWAY_NOT_SERVING}, reasons
    assert served.first(lambda line: line.startswith("qwen3vl-trt: warmed up in ")) < first_ready
    assert all(status == 200 for when, status, _ in served.answers if when > first_ready)
    note = served.output().split("qwen3vl-trt: serving ")[1].splitlines()[0]
    assert "without the build cache" in note
    _report(capsys, [line.removeprefix("qwen3vl-trt: ") for line in steps] + [f"serving {note}"])


def test_a_chat_request_sent_the_moment_ready_answers_200_is_served(served):
    """serve --openai-port is ready once its gateway routes to it (its fleet probes the replica each second)."""
    assert served.first_chat == 200


def test_metrics_name_the_build_and_the_warm_up(served):
    metrics = samples(f"{served.ready_url}/metrics")
    build = {"key": "unknown", "source": "local", "target": "cpu", "gpu": "none"}  # a build without the cache
    assert metrics[("qwen3vl_serve_build_info", frozenset(build.items()))] == 1
    assert metrics[("qwen3vl_serve_ready", frozenset())] == 1
    assert metrics[("qwen3vl_serve_warmup_requests_total", frozenset())] == 4
    assert metrics[("qwen3vl_serve_warmup_seconds", frozenset())] > 0


def test_the_warm_up_left_no_trace_in_the_stage_metrics_nor_the_visual_cache(served):
    """Nothing but Triton's own statistics counts the warm-up; its images were not kept: a request with the first of
    them misses the cache, and hits it when sent again."""
    before = stage_metrics.read(served.metrics_url)
    for model in STAGES:  # FIRST_CHAT, text only, went through the tokens ensemble: preprocessing and llm
        assert before[(stage_metrics.REQUESTS.name, model)] == FIRST_CHAT.get(model, 0), model
    for metric in (*stage_metrics.VISUAL_CACHE, stage_metrics.IMAGES_DECODED, stage_metrics.PATCHES_ENCODED):
        assert before.get((metric.name, metric_model(metric)), 0) == 0, metric.name
    assert 0 < before[(stage_metrics.TOKENS_GENERATED.name, interface.LLM)] <= FIRST_CHAT_TOKENS
    success = {
        dict(labels).get("model"): value
        for (name, labels), value in samples(served.metrics_url).items()
        if name.startswith("nv_inference_request_success")
    }
    assert success[interface.ENSEMBLE] == 4, success  # Triton's own counts do count the warm-up

    image = warmup.plan(served.repo)[0].images[0]
    client = Client(served.grpc_url, timeout_s=120)
    try:
        client.generate("What is in the picture?", [image], max_tokens=1)
        once = stage_metrics.read(served.metrics_url)
        client.generate("What is in the picture?", [image], max_tokens=1)
        twice = stage_metrics.read(served.metrics_url)
    finally:
        client.close()

    def counted(samples: dict, metric: stage_metrics.Metric) -> float:
        return samples[(metric.name, metric_model(metric))]

    assert (counted(once, stage_metrics.VISUAL_CACHE_MISSES), counted(once, stage_metrics.VISUAL_CACHE_HITS)) == (1, 0)
    assert counted(twice, stage_metrics.VISUAL_CACHE_HITS) == 1
    # One vision encoder request, counted: its model_warmup samples were its first requests, and were not.
    assert twice[(stage_metrics.REQUESTS.name, interface.VISION_ENCODER)] == 1
    assert twice[(stage_metrics.REQUESTS.name, interface.PREPROCESSING)] == 2 + FIRST_CHAT[interface.PREPROCESSING]


def metric_model(metric: stage_metrics.Metric) -> str:
    return interface.PREPROCESSING if metric in stage_metrics.PREPROCESSING else interface.VISION_ENCODER


def test_the_first_request_after_ready_against_the_next_ten(served, checkpoints, capsys):
    """Printed, not asserted: the first request of real clients after ready, against the median of the next ten
    (each with an image of its own, the warm-up's middle size, so every one decodes and encodes)."""
    resizing = warmup.Resizing.of_checkpoint(checkpoints["dense"])  # serve's reading, without torch ...
    processor = ImageProcessingConfig.from_pretrained(checkpoints["dense"])  # ... is preprocessing's
    assert (resizing.factor, resizing.min_pixels, resizing.max_pixels) == (
        processor.factor,
        processor.min_pixels,
        processor.max_pixels,
    )
    side = resizing.sides(LIMITS)[1] * resizing.factor
    client = Client(served.grpc_url, timeout_s=120)
    seconds = []
    try:
        for seed in range(11):
            started = time.perf_counter()
            client.generate("Describe the picture.", [jpeg(side, side, seed=100 + seed)], max_tokens=4)
            seconds.append(time.perf_counter() - started)
    finally:
        client.close()
    median = statistics.median(seconds[1:])
    _report(capsys, [f"first request after ready {seconds[0]:.3f} s, median of the next ten {median:.3f} s "
                     f"(ratio {seconds[0] / median:.2f}; {side}x{side} JPEG, 4 tokens)"])  # fmt: skip


def test_not_ready_while_tritonserver_is_not_nor_while_stopping(served):
    """A model unloaded through the repository API makes tritonserver not ready (--strict-readiness): /ready says so
    within its one-second cache, and 200 again once the supervisor has loaded it back; a stop answers 503."""
    grpc = grpcclient.InferenceServerClient(served.grpc_url)
    try:
        unloaded = time.monotonic()
        grpc.unload_model(interface.POSTPROCESSING)
    finally:
        grpc.close()

    def since(moment: float, status: int, reason: str = "") -> bool:
        return any(w > moment and s == status and (not reason or r == reason) for w, s, r in served.answers)

    served.wait_for(lambda: since(unloaded, 503, "tritonserver not ready"), "503 after the unload", within=10)
    not_ready = next(w for w, s, _ in served.answers if w > unloaded and s == 503)
    served.wait_for(lambda: since(not_ready, 200), "200 after the supervisor's reload", within=60)
    stopped = time.monotonic()
    served.process.send_signal(signal.SIGTERM)
    served.wait_for(lambda: since(stopped, 503, "stopping"), "503 while stopping", within=10)
    assert served.stop() == 0
