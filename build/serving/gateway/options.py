"""The OpenAI gateway's options, each with its default, declared once: what `qwen3vl-trt openai` and
`serve --openai-port` take on the command line and tests pass directly. Plain values (no FastAPI, gRPC or
tritonclient), so the command line's --help stays light; gateway.settings adds the deployment's facts and resolves
the bounds left to its engine limits."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, get_args

from ...errors import ServingError

# Splitting a Thinking checkpoint's <think>...</think> into reasoning_content: auto (from the chat template), qwen3
# (always: vLLM's parser of that name), none (the text as generated).
REASONING_PARSERS = ("auto", "qwen3", "none")
# Besides its images, a request's body holds text, which the prompt's token limit bounds far below this.
BODY_SLACK_BYTES = 4 * 2**20
# The default body cap at most: several camera photos as base64 data URLs fit (a 12 MP JPEG is ~5 MB, ~7 MB
# as base64); the limits' worst case (max_images images of max_image_bytes each) is over a gigabyte, and
# parsing a body takes several times its size in memory. --max-request-bytes raises it.
MAX_DEFAULT_REQUEST_BYTES = 32 * 2**20
# Where `openai` listens unless told otherwise (`serve` runs the gateway only with --openai-port).
DEFAULT_OPENAI_PORT = 9000
# The interactive queue's orders (gateway.admission): short-first (least expected cost first, with ageing) or fifo.
QueueOrder = Literal["short-first", "fifo"]
QUEUE_ORDERS: tuple[QueueOrder, ...] = get_args(QueueOrder)
# The bodies of requests waiting for a slot, in all, by default at most (and at least one request's worth).
MAX_DEFAULT_QUEUED_BYTES = 2**30
# A batch input file at most, as OpenAI's Batch API takes ("up to 200 MB").
MAX_BATCH_FILE_BYTES = 200 * 2**20


@dataclass(frozen=True)
class GatewayOptions:
    """served_model_name: the `model` clients ask for (None: the checkpoint's folder name).
    allow_remote_media: fetch http(s) image and video URLs in messages (else only data: URLs), each within
    remote_media_timeout_s.

    Back-pressure and bounds; None takes what the deployment's engine limits imply (GatewaySettings):
    max_concurrent_requests: chat requests served at once. max_queued_requests: more held (their bodies read and
    planned first), each waiting at most max_queue_wait_s for its slot, their bodies max_queued_bytes in all; beyond,
    requests are refused at once (429 with Retry-After). queue_order (QUEUE_ORDERS): which waiting request a free slot
    goes to: short-first, the least expected cost (prompt plus output tokens), a request passed by later ones at most
    max_concurrent_requests + (queue_ageing - 1) x (the requests before it + 1) times; fifo, the first come.
    max_request_bytes: a larger request body is refused (413) before it is read. request_timeout_s: a
    request still generating after it ends with an error and is cancelled on the server. reasoning_parser
    (REASONING_PARSERS): whether answers are split into reasoning_content and content; auto: when the checkpoint's
    template opens a reasoning block (the Thinking checkpoints'). stream_interval_ms: a streamed answer's chunks after
    its first text go out together at most this often (each chunk as it is; 0: each as it comes): one socket write
    and one pass through the HTTP stack for several tokens, which a GPU decoding 8B at 10 ms a step makes two or
    three; the first text and the end are never held (scripts/bench_plane.py measures the CPU saved and the latency
    it adds).

    The replicas (gateway.fleet): names among them resolved again every triton_refresh_s (scaled out or in);
    each one's readiness asked of its serve on replica_ready_port (serve --ready-port), 0: of its tritonserver
    over gRPC (plain tritonservers).

    Who may call it (gateway.auth): api_keys and the keys of api_key_files (one a line), which /v1/* and, unless
    open_metrics, /metrics require as `Authorization: Bearer <key>`; none: the API is open. Keys never appear in
    the options' repr.

    Batches (gateway.batch, docs/batch.md), served when both batch_redis (a Redis of their own: append-only,
    noeviction) and batch_dir (a directory every gateway mounts) are given: batch_runners lines run at once here,
    taking at most batch_share of the request slots and only while no request waits; a work entry whose runner
    stopped holding it for batch_claim_s is another's; uploads up to max_batch_file_bytes; batch_group_images: lines
    that share their first image run together (else in the file's order, each line on its own: for comparison)."""

    served_model_name: str | None = None
    allow_remote_media: bool = False
    remote_media_timeout_s: float = 10.0
    max_concurrent_requests: int | None = None
    max_queued_requests: int | None = None
    max_queue_wait_s: float = 30.0
    max_queued_bytes: int | None = None
    queue_order: QueueOrder = "short-first"
    queue_ageing: float = 2.0
    max_request_bytes: int | None = None
    request_timeout_s: float = 600.0
    reasoning_parser: str = "auto"
    stream_interval_ms: float = 20.0
    triton_refresh_s: float = 10.0
    replica_ready_port: int = 0
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    api_key_files: tuple[Path, ...] = ()
    open_metrics: bool = False
    batch_redis: str | None = None
    batch_dir: Path | None = None
    batch_runners: int = 4
    batch_share: float = 0.5
    batch_claim_s: float = 60.0
    max_batch_file_bytes: int = MAX_BATCH_FILE_BYTES
    batch_group_images: bool = True

    def __post_init__(self) -> None:
        if self.queue_order not in QUEUE_ORDERS:
            raise ServingError(f"the queue order {self.queue_order!r} is none of {', '.join(QUEUE_ORDERS)}")
        if not 1 <= self.queue_ageing < math.inf:
            raise ServingError(f"queue ageing must be a number of 1 or more (1: first come first served), got "
                               f"{self.queue_ageing:g}")  # fmt: skip
        if (self.batch_redis is None) != (self.batch_dir is None):
            raise ServingError("the Batch API needs both --batch-redis (its state) and --batch-dir (its files)")


DEFAULT_GATEWAY_OPTIONS = GatewayOptions()
