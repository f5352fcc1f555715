"""`serve`'s own readiness endpoint, in the serve process: whether this replica should get traffic, and serve's
metrics, on a port of its own (--ready-port, beside tritonserver's three).

    GET /ready     200 {"ready": true, ...} once the warm-up (server.warmup) has run and while tritonserver reports
                   ready; else 503 with the reason: "loading", "warming up", "tritonserver not ready", "stopping",
                   or what the replica needs besides (a language replica: "no vision pool member ready")
    GET /started   200 {"started": true, ...} once the warm-up has run and while tritonserver reports ready, whatever
                   the replica needs besides (a startup probe's: a pool that is down restarts no replica)
    GET /metrics   Prometheus text of serve's own registry: qwen3vl_serve_ready, qwen3vl_serve_warmup_seconds,
                   qwen3vl_serve_warmup_requests_total, qwen3vl_serve_build_info{key, source, target, gpu}

tritonserver's own /v2/health/ready turns ready once the models are loaded, before serve has warmed them up, and
serve cannot hold it back: Kubernetes probes and the gateway's fleet (gateway.fleet.ServeProbe) ask this instead.
A small stdlib HTTP server on a daemon thread: probes and scrapes are a few requests a second at most.
"""

from __future__ import annotations

import json
import math
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Info, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from ...common.manifest import BuildManifest
from ...errors import Qwen3VLTrtError, ServingError
from ..interface import LLM
from ..ports import host_port
from ..repository import model_config as serving_config

LOADING, WARMING_UP, READY, NOT_READY, STOPPING = "loading", "warming up", "ready", "tritonserver not ready", "stopping"
GATEWAY_NOT_SERVING = "its OpenAI gateway does not route to it yet"
# tritonserver's answer is asked at most this often (probes from the kubelet, the gateway and scrapers add up) ...
TRITON_ANSWER_S = 1.0
# ... and waited for this long: a server that does not answer so soon is not ready for traffic either.
TRITON_PROBE_TIMEOUT_S = 1.0


@dataclass(frozen=True)
class BuildInfo:
    """What this replica serves, from the build manifest beside the repository (manifest.BuildManifest): the build
    key and how the artifacts were obtained (local: built without the build cache, built: built and published to
    it, pulled: from it), the target the repository runs (its llm's backend) and the GPU the build is for; `note`
    says it in a sentence for serve's log."""

    key: str
    source: str
    target: str
    gpu: str
    note: str

    @classmethod
    def of_repository(cls, repo: Path) -> BuildInfo:
        llm = Path(repo) / LLM
        target = "unknown"
        if (llm / serving_config.CONFIG_FILE).is_file():
            target = "gpu" if serving_config.read(llm).backend == "tensorrtllm" else "cpu"
        try:
            manifest = BuildManifest.of_repository(repo)
        except Qwen3VLTrtError as e:  # a manifest of another version: the repository itself was checked already
            return cls("unknown", "local", target, _gpu(None, target), f"serving {repo} (its build manifest: {e})")
        if manifest is None:
            note = f"serving {repo} (no build manifest beside it, as write-repo writes a repository elsewhere)"
            return cls("unknown", "local", target, _gpu(None, target), note)
        cache = manifest.cache
        if cache is None:
            note = f"serving the build {Path(repo).parent} (artifacts built there without the build cache)"
            return cls("unknown", "local", target, _gpu(None, target), note)
        if cache.source == "pulled":
            waited = f", after waiting {cache.wait_s:.1f} s for another builder" if cache.wait_s else ""
            how = f"pulled from the build cache {cache.entry}, {cache.pull_s:.1f} s{waited}"
        else:
            took = f" in {cache.build_s:.0f} s" if cache.build_s is not None else ""
            how = f"built here{took} and published to the build cache {cache.entry}"
        refused = f"; the entry found first was refused: {cache.refused}" if cache.refused else ""
        note = f"serving build key {cache.key} (artifacts {how}{refused})"
        return cls(cache.key, cache.source, target, _gpu(cache.parts.get("gpu"), target), note)

    def labels(self) -> dict[str, str]:
        return {"key": self.key, "source": self.source, "target": self.target, "gpu": self.gpu}


def _gpu(gpu: str | None, target: str) -> str:
    return gpu or ("none" if target == "cpu" else "unknown")


class Readiness:
    """The replica's readiness: its phase (loading, warming up, ready, stopping) as serve moves it on, and while
    ready, tritonserver's own answer (`triton_ready`, asked at most every TRITON_ANSWER_S). `server` names the
    tritonserver process now (its pid): one the supervisor started again since the warm-up is not warm."""

    def __init__(
        self,
        triton_ready: Callable[[], bool],
        server: Callable[[], int] = lambda: 0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._triton_ready = triton_ready
        self._server = server
        self._clock = clock
        self._phase = LOADING
        self._warmed: int | None = None
        self._lock = threading.Lock()  # one probe at a time; the others take its answer
        self._answered_at = -math.inf
        self._answer = False
        self._serving: Callable[[], bool] | None = None
        self._needs: list[Callable[[], str | None]] = []

    @property
    def phase(self) -> str:
        return self._phase

    def warming_up(self) -> None:
        if self._phase != STOPPING:
            self._phase = WARMING_UP

    def warmed(self, server: int) -> None:
        """The warm-up of tritonserver process `server` has run."""
        self._warmed = server
        if self._phase != STOPPING:
            self._phase = READY

    def stopping(self) -> None:
        self._phase = STOPPING

    def needs(self, missing: Callable[[], str | None]) -> None:
        """The replica serves only while `missing` answers None too (a language replica's vision pool); else what it
        answers is the reason /ready gives."""
        self._needs.append(missing)

    def also_requires(self, serving: Callable[[], bool]) -> None:
        """Ready only while `serving` says so too: serve's own gateway routes to this replica (its fleet takes the
        replica's readiness, replica_ready, on its next probe), so that a request sent once /ready answers 200 is
        served, through either endpoint."""
        self._serving = serving

    def state(self) -> tuple[bool, str]:
        """Whether the replica is ready, and why not."""
        ready, why = self.replica_state()
        if ready and self._serving is not None and not self._serving():
            return False, GATEWAY_NOT_SERVING
        return ready, why

    def replica_ready(self) -> bool:
        return self.replica_state()[0]

    def replica_state(self, needs: bool = True) -> tuple[bool, str]:
        """Whether tritonserver is ready and warmed up (and has what the replica needs besides: `needs`), and why
        not."""
        phase = self._phase
        if phase != READY:
            return False, phase
        if not self._triton_answer():
            return False, NOT_READY
        if self._server() != self._warmed:  # started again, and ready: serve is warming it up (or soon)
            return False, WARMING_UP
        for missing in self._needs if needs else ():
            if (why := missing()) is not None:
                return False, why
        return True, READY

    def is_ready(self) -> bool:
        return self.state()[0]

    def _triton_answer(self) -> bool:
        with self._lock:
            if self._clock() - self._answered_at >= TRITON_ANSWER_S:
                self._answer = self._triton_ready()
                self._answered_at = self._clock()
            return self._answer


class ServeMetrics:
    """serve's own metrics, in a registry of their own."""

    def __init__(self, readiness: Readiness, build: BuildInfo):
        self.registry = CollectorRegistry()
        ready = Gauge(
            "qwen3vl_serve_ready",
            "1 while this replica is ready: warmed up and tritonserver ready",
            registry=self.registry,
        )
        ready.set_function(lambda: float(readiness.is_ready()))
        self.warmup_seconds = Gauge(
            "qwen3vl_serve_warmup_seconds", "Seconds the last warm-up took", registry=self.registry
        )
        self.warmup_requests = Counter(
            "qwen3vl_serve_warmup_requests",
            "Warm-up requests answered (Triton's nv_inference_* counts count them too)",
            registry=self.registry,
        )
        info = Info(
            "qwen3vl_serve_build",
            "The build this replica serves: its build key, how its artifacts were obtained, its target and GPU",
            registry=self.registry,
        )
        info.info(build.labels())

    def text(self) -> bytes:
        return generate_latest(self.registry)


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], readiness: Readiness, metrics: ServeMetrics, build: BuildInfo):
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.readiness, self.metrics, self.build = readiness, metrics, build
        super().__init__(address, _Handler)


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        path = self.path.partition("?")[0]
        if path in ("/ready", "/started"):
            started = path == "/started"
            readiness = self.server.readiness
            ready, reason = readiness.replica_state(needs=False) if started else readiness.state()
            key = "started" if started else "ready"
            body = {key: ready, **({} if ready else {"reason": reason}), "build_key": self.server.build.key}
            self._send(200 if ready else 503, json.dumps(body).encode(), "application/json")
        elif path == "/metrics":
            self._send(200, self.server.metrics.text(), CONTENT_TYPE_LATEST)
        else:
            self._send(404, b'{"error": "not found: GET /ready, /started or /metrics"}', "application/json")

    def _send(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (http.server's name)
        pass  # a probe every few seconds would fill serve's log


class ReadinessServer:
    """GET /ready and /metrics on address:port, served from a daemon thread."""

    def __init__(self, readiness: Readiness, metrics: ServeMetrics, build: BuildInfo, address: str, port: int):
        self.url = f"http://{host_port(address, port)}"
        try:
            self._server = _Server((address, port), readiness, metrics, build)
        except OSError as e:
            raise ServingError(f"the readiness endpoint cannot listen on {host_port(address, port)}: {e}") from None
        self._thread = threading.Thread(target=self._server.serve_forever, name="serve-readiness", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        if self._thread.is_alive():
            self._server.shutdown()
        self._server.server_close()
