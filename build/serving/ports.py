"""Where a deployment's endpoints listen, and the OpenAI gateway's user-facing options: plain values that the
launcher, the gateway and the command line share (no module here imports another serving module)."""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class ServerPorts:
    """tritonserver's three endpoints, and `serve`'s own readiness endpoint (serving.server.readiness)."""

    grpc: int = 8001
    http: int = 8000
    metrics: int = 8002
    ready: int = 8003


# The gateway's defaults where GatewayOptions leaves a bound to it (gateway.settings.GatewaySettings.resolve).
DEFAULT_REQUEST_TIMEOUT_S = 600.0
# A streamed answer's chunks after its first text are written together at most this often: one socket write and one
# pass through the HTTP stack for several tokens, which a GPU decoding 8B at 10 ms a step makes two or three; the first
# text and the end are never held (scripts/bench_plane.py measures the CPU saved and the latency it adds).
DEFAULT_STREAM_INTERVAL_MS = 20.0
DEFAULT_MAX_QUEUE_WAIT_S = 30.0
DEFAULT_REMOTE_MEDIA_TIMEOUT_S = 10.0  # for each http(s) image or video a request names
# Besides its images, a request's body holds text, which the prompt's token limit bounds far below this.
BODY_SLACK_BYTES = 4 * 2**20
# The default body cap at most: several camera photos as base64 data URLs fit (a 12 MP JPEG is ~5 MB, ~7 MB
# as base64); the limits' worst case (max_images images of max_image_bytes each) is over a gigabyte, and
# parsing a body takes several times its size in memory. --max-request-bytes raises it.
DEFAULT_MAX_REQUEST_BYTES = 32 * 2**20


@dataclass(frozen=True)
class GatewayOptions:
    """served_model_name: the `model` clients ask for (None: the checkpoint's folder name).
    allow_remote_media: fetch http(s) image and video URLs in messages (else only data: URLs).

    Back-pressure and bounds; None takes the default the deployment's limits imply (see GatewaySettings):
    max_concurrent_requests: chat requests served at once. max_queued_requests: more that wait for a slot,
    each at most max_queue_wait_s; beyond, requests are refused at once (429 with Retry-After).
    max_request_bytes: a larger request body is refused (413) before it is read. request_timeout_s: a
    request still generating after it ends with an error and is cancelled on the server. reasoning_parser
    (REASONING_PARSERS): whether answers are split into reasoning_content and content; auto: when the checkpoint's
    template opens a reasoning block (the Thinking checkpoints'). stream_interval_ms: a streamed answer's chunks after
    its first text go out together at most this often (each chunk as it is; 0: each as it comes).

    Who may call it (gateway.auth): api_keys and the keys of api_key_files (one a line), which /v1/* and, unless
    open_metrics, /metrics require as `Authorization: Bearer <key>`; none: the API is open. Keys never appear in
    the options' repr."""

    served_model_name: str | None = None
    allow_remote_media: bool = False
    max_concurrent_requests: int | None = None
    max_queued_requests: int | None = None
    max_queue_wait_s: float | None = None
    max_request_bytes: int | None = None
    request_timeout_s: float | None = None
    reasoning_parser: str = "auto"
    stream_interval_ms: float | None = None
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    api_key_files: tuple[Path, ...] = ()
    open_metrics: bool = False


# Splitting a Thinking checkpoint's <think>...</think> into reasoning_content: auto (from the chat template), qwen3
# (always: vLLM's parser of that name), none (the text as generated).
REASONING_PARSERS = ("auto", "qwen3", "none")

# How often the gateway resolves the names of a fleet's replicas again (scaled out or in).
DEFAULT_TRITON_REFRESH_S = 10.0
DEFAULT_PORTS = ServerPorts()
NO_GATEWAY_OPTIONS = GatewayOptions()
# Where `openai` listens unless told otherwise (`serve` runs the gateway only with --openai-port).
DEFAULT_OPENAI_PORT = 9000


def host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


# A deployment on this host, as clients reach it by default.
LOCAL_TRITON_URL = host_port("127.0.0.1", DEFAULT_PORTS.grpc)


def free_ports() -> ServerPorts:
    """A deployment's ports, each free on loopback now (tests run several servers side by side)."""
    sockets = [socket.socket() for _ in range(4)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        grpc, http, metrics, ready = (s.getsockname()[1] for s in sockets)
    finally:
        for s in sockets:
            s.close()
    return ServerPorts(grpc=grpc, http=http, metrics=metrics, ready=ready)


# serve's: how long every model may take to load (a large LLM engine takes minutes), and the grace between SIGTERM
# and SIGKILL for the requests in flight (tritonserver's own default).
READY_TIMEOUT_S = 300.0
STOP_GRACE_S = 30.0
