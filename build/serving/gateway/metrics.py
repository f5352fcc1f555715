"""The OpenAI gateway's Prometheus metrics (GET /metrics): chat requests by outcome and HTTP status,
refusals by reason, streamed time to first token and inter-token latency, prompt and completion tokens,
requests in flight and queued; and of the fleet of Triton replicas behind it: requests sent to each, retries on
another replica, replicas in the rotation. Each app has its own registry, so several gateways live in one process."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

CONTENT_TYPE = CONTENT_TYPE_LATEST

Outcome = Literal["completed", "rejected", "refused", "failed", "timed_out", "cancelled"]
RefusalReason = Literal["overloaded", "request_too_large", "json_too_deep", "server_busy", "server_unavailable"]

# Token latencies of a small model on a CPU up to a large one under load: 5 ms .. 60 s.
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


@dataclass
class RequestRecord:
    """What one chat request came to, filled in as it is served (outcome None: from its HTTP status)."""

    started: float  # time.monotonic() at arrival
    status: int = 0
    outcome: Outcome | None = None

    def final_outcome(self) -> Outcome:
        if self.outcome is not None:
            return self.outcome
        if self.status == 0:
            return "cancelled"  # no response started: the client went away first
        if self.status < 400:
            return "completed"
        if self.status in (413, 429):
            return "refused"
        return "rejected" if self.status < 500 else "failed"


@dataclass
class GatewayMetrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        self.requests = Counter(
            "qwen3vl_gateway_requests", "Chat completion requests by outcome and HTTP status", ["outcome", "status"],
            registry=r,
        )  # fmt: skip
        self.refusals = Counter(
            "qwen3vl_gateway_refusals", "Requests refused before or instead of generation, by reason", ["reason"],
            registry=r,
        )  # fmt: skip
        self.time_to_first_token = Histogram(
            "qwen3vl_gateway_time_to_first_token_seconds",
            "Streamed requests: from the request's arrival to its first text delta",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.inter_token_latency = Histogram(
            "qwen3vl_gateway_inter_token_latency_seconds",
            "Streamed requests: between successive text deltas",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.request_duration = Histogram(
            "qwen3vl_gateway_request_duration_seconds",
            "Chat completion requests: from arrival to the end of the response, any outcome",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "qwen3vl_gateway_prompt_tokens", "Prompt tokens of the requests sent to the deployment", registry=r
        )
        self.completion_tokens = Counter(
            "qwen3vl_gateway_completion_tokens", "Completion tokens the deployment generated", registry=r
        )
        self.queue_wait = Histogram(
            "qwen3vl_gateway_queue_wait_seconds",
            "From asking for a request slot to getting one (or to being refused at the wait limit), by traffic class "
            "(interactive: a planned request; batch: a batch line, which waits while interactive requests do)",
            ["traffic_class"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.in_flight = Gauge("qwen3vl_gateway_requests_in_flight", "Chat requests being served", registry=r)
        self.queued = Gauge(
            "qwen3vl_gateway_requests_queued",
            "Requests held without a slot: being read, planned or waiting",
            registry=r,
        )
        self.replica_requests = Counter(
            "qwen3vl_gateway_replica_requests", "Requests sent to each Triton replica, retries included", ["replica"],
            registry=r,
        )  # fmt: skip
        self.retries = Counter(
            "qwen3vl_gateway_retries",
            "Requests sent again to another replica after the first failed before returning any text",
            registry=r,
        )
        self.replicas_ready = Gauge(
            "qwen3vl_gateway_replicas_ready", "Triton replicas in the rotation (ready when last probed)", registry=r
        )
        # The Batch API's (gateway.batch): of the whole deployment as this gateway last looked, and its own runners'.
        self.batches = Gauge(
            "qwen3vl_gateway_batches", "Batches not ended, by status (the deployment's, as last looked)", ["status"],
            registry=r,
        )  # fmt: skip
        self.batch_entries_queued = Gauge(
            "qwen3vl_gateway_batch_entries_queued",
            "Work entries (up to 16 lines each) not yet run to the end, the deployment's (as last looked)",
            registry=r,
        )
        self.batch_lines_running = Gauge(
            "qwen3vl_gateway_batch_lines_running", "Batch lines this gateway's runners are running", registry=r
        )
        self.batch_lines = Counter(
            "qwen3vl_gateway_batch_lines", "Batch lines this gateway ran, by outcome", ["outcome"], registry=r
        )
        self.batch_line_duration = Histogram(
            "qwen3vl_gateway_batch_line_seconds",
            "Batch lines: from getting a request slot to the answer",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )

    def watch(self, in_flight: Callable[[], float], queued: Callable[[], float]) -> None:
        """The gauges read the admission's counts when scraped."""
        self.in_flight.set_function(in_flight)
        self.queued.set_function(queued)

    def finish(self, record: RequestRecord, now: float) -> None:
        self.requests.labels(record.final_outcome(), str(record.status)).inc()
        self.request_duration.observe(now - record.started)

    def render(self) -> bytes:
        return generate_latest(self.registry)
