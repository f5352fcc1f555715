"""The OpenAI gateway's bounds on the CPU deployment: a gateway limited to 2 requests in flight and 2 queued
under 64 concurrent streams (complete answers or quick 429s, none hangs, memory flat), bodies over the
size limit and deeply nested JSON refused before they are parsed, the request deadline, SIGTERM, and the
Prometheus metrics counted against what the clients received."""

from __future__ import annotations

import asyncio
import select
import signal
import socket
import subprocess
import time
import urllib.request

import openai
import psutil
import pytest
import test_gateway
from deployment import Gateway, http_status, user
from prometheus_client.parser import text_string_to_metric_families
from qwen3vl_trt.qa.ports import free_port
from qwen3vl_trt.serving import interface
from qwen3vl_trt.serving.stages import metrics as stage_metrics
from test_gateway import PHOTO, PROMPT

# gpu_image: the gateway's asyncio client runs again on the GPU image's tritonclient 2.68 and grpcio 1.67.
pytestmark = [pytest.mark.slow, pytest.mark.server, pytest.mark.gpu_image]

served = test_gateway.served  # the CPU deployment with `serve --openai-port`, one for this module

MAX_IN_FLIGHT, MAX_QUEUED, MAX_QUEUE_WAIT_S = 2, 2, 1.0
MAX_REQUEST_BYTES = 4_000_000
REQUEST_TIMEOUT_S = 3.0
REFUSAL_WITHIN_S = 2.0  # a refused request hears so within this (the queue wait is 1 s)


@pytest.fixture(scope="module")
def limited(served):
    """`qwen3vl-trt openai` in front of the served deployment, with small limits."""
    port = free_port()
    args = ["openai", "--repo", str(served.repo), "--triton-url", served.grpc_url, "--port", str(port)]
    args += ["--replica-ready-port", str(served.ready_port)]
    args += ["--max-concurrent-requests", str(MAX_IN_FLIGHT), "--max-queued-requests", str(MAX_QUEUED)]
    args += ["--max-queue-wait", str(MAX_QUEUE_WAIT_S), "--max-request-bytes", str(MAX_REQUEST_BYTES)]
    args += ["--request-timeout", str(REQUEST_TIMEOUT_S)]
    gateway = Gateway(args, port, served.log.parent / "openai-limited.log", timeout_s=120)
    gateway.host_port = ("127.0.0.1", port)
    yield gateway
    gateway.stop()


def _rss(gateway: Gateway) -> int:
    return psutil.Process(gateway.process.pid).memory_info().rss


def _metrics(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a /metrics endpoint (the gateway's, Triton's), keyed by sample name and sorted labels."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def _sample(metrics: dict, name: str, **labels: str) -> float:
    return metrics.get((name, tuple(sorted(labels.items()))), 0.0)


async def _stream_or_refusal(client: openai.AsyncOpenAI, messages: list[dict]) -> tuple[str, object, float]:
    """("answer", text, seconds) or ("refused", (status, Retry-After), seconds until the refusal)."""
    started = time.monotonic()
    try:
        stream = await client.chat.completions.create(model="dense", messages=messages, max_tokens=8, stream=True)
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        return "answer", text, time.monotonic() - started
    except openai.APIStatusError as e:
        return "refused", (e.status_code, e.response.headers.get("retry-after")), time.monotonic() - started


def test_overload_gets_answers_or_quick_refusals_and_memory_stays_flat(limited, served):
    messages = user("Hi!")
    expected = served.client().chat.completions.create(model="dense", messages=messages, max_tokens=8)
    expected_text = expected.choices[0].message.content

    async def burst(n: int) -> list[tuple[str, object, float]]:
        client = openai.AsyncOpenAI(base_url=f"{limited.url}/v1", api_key="unused", max_retries=0, timeout=60)
        async with client:
            return await asyncio.wait_for(
                asyncio.gather(*[_stream_or_refusal(client, messages) for _ in range(n)]), 120
            )

    asyncio.run(burst(64))  # warms up what a burst allocates once (connections, buffers)
    before, rss_before = _metrics(limited.url), _rss(limited)
    results = asyncio.run(burst(64))
    rss_growth = _rss(limited) - rss_before

    answers = [text for kind, text, _ in results if kind == "answer"]
    refusals = [(what, seconds) for kind, what, seconds in results if kind == "refused"]
    assert len(answers) >= MAX_IN_FLIGHT and answers == [expected_text] * len(answers)
    assert refusals, "64 concurrent requests against 2 in flight and 2 queued: some must be refused"
    assert {status for (status, _), _ in refusals} == {429}
    assert all(retry_after is not None and int(retry_after) >= 1 for (_, retry_after), _ in refusals)
    assert max(seconds for _, seconds in refusals) < REFUSAL_WITHIN_S
    assert rss_growth < 32 * 2**20, f"the gateway grew by {rss_growth / 2**20:.0f} MiB over one burst"

    after = _metrics(limited.url)
    refused = _sample(after, "qwen3vl_gateway_refusals_total", reason="overloaded")
    refused -= _sample(before, "qwen3vl_gateway_refusals_total", reason="overloaded")
    assert refused == len(refusals)
    assert _sample(after, "qwen3vl_gateway_requests_in_flight") == 0
    assert _sample(after, "qwen3vl_gateway_requests_queued") == 0
    assert http_status(f"{limited.url}/health") == 200
    assert limited.client().chat.completions.create(model="dense", messages=messages, max_tokens=8).choices


def _raw_post(host_port: tuple[str, int], head: bytes, body_chunks: list[bytes]) -> tuple[bytes, float]:
    """Sends a request as raw bytes, the head and then body chunks until the server answers or closes the
    connection; returns the response's status line and the seconds until it came."""
    started = time.monotonic()
    response = b""
    with socket.create_connection(host_port, timeout=30) as s:
        s.sendall(head)
        for chunk in body_chunks:
            readable, _, _ = select.select([s], [], [], 0)
            if readable:
                break  # the server answered before the body was sent
            try:
                s.sendall(chunk)
            except OSError:  # the server closed the connection: its answer is waiting
                break
        try:
            while b"\r\n" not in response:
                more = s.recv(65536)
                if not more:
                    break
                response += more
        except ConnectionResetError:
            pass
    return response.split(b"\r\n", 1)[0], time.monotonic() - started


def test_oversized_bodies_and_deep_json_are_refused_before_parsing(limited):
    size = 80 * 2**20
    megabyte = b"x" * 2**20
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
    rss_before = _rss(limited)

    status, seconds = _raw_post(limited.host_port, head + b"Content-Length: %d\r\n\r\n" % size, [megabyte] * 80)
    assert status.startswith(b"HTTP/1.1 413") and seconds < 1.0, (status, seconds)

    chunked = [b"%x\r\n%s\r\n" % (len(megabyte), megabyte)] * 80 + [b"0\r\n\r\n"]
    status, seconds = _raw_post(limited.host_port, head + b"Transfer-Encoding: chunked\r\n\r\n", chunked)
    assert status.startswith(b"HTTP/1.1 413") and seconds < 2.0, (status, seconds)
    assert _rss(limited) - rss_before < 8 * 2**20

    nested = b'{"model": "dense", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    status, seconds = _raw_post(limited.host_port, head + b"Content-Length: %d\r\n\r\n" % len(nested), [nested])
    assert status.startswith(b"HTTP/1.1 400") and seconds < 2.0, (status, seconds)
    assert http_status(f"{limited.url}/v1/models") == 200

    # Text far over what the prompt limit can hold is refused without tokenizing it (which would take
    # seconds and hundreds of MB here).
    rss_before = _rss(limited)
    started = time.monotonic()
    with pytest.raises(openai.BadRequestError) as raised:
        limited.client().chat.completions.create(model="dense", messages=user("word " * 700_000), max_tokens=2)
    assert time.monotonic() - started < 2.0 and raised.value.code == "context_length_exceeded"
    assert _rss(limited) - rss_before < 64 * 2**20


def test_a_request_past_its_deadline_ends_with_an_error_and_is_cancelled(limited, served):
    cancelled = "cancelled by its client"
    before = served.log.read_text(errors="replace").count(cancelled)
    started = time.monotonic()
    with pytest.raises(openai.APIStatusError) as raised:
        # min_tokens keeps it generating for several times the deadline.
        limited.client().chat.completions.create(
            model="dense", messages=user("Go on."), max_tokens=1900, extra_body={"min_tokens": 1800}
        )
    assert raised.value.status_code == 504 and time.monotonic() - started < REQUEST_TIMEOUT_S + 10
    error = raised.value.body
    error = error.get("error", error) if isinstance(error, dict) else {}
    assert error.get("code") == "timeout" and f"{REQUEST_TIMEOUT_S:g} s" in error.get("message", "")
    deadline = time.monotonic() + 30
    while served.log.read_text(errors="replace").count(cancelled) <= before:
        assert time.monotonic() < deadline, "the server never logged the request's cancellation"
        time.sleep(0.2)


def test_sigterm_stops_the_gateway_with_a_stream_in_flight(served, tmp_path):
    port = free_port()
    args = ["openai", "--repo", str(served.repo), "--triton-url", served.grpc_url, "--port", str(port)]
    args += ["--replica-ready-port", str(served.ready_port)]
    gateway = Gateway(args, port, tmp_path / "openai-sigterm.log", timeout_s=120)
    try:
        stream = gateway.client().chat.completions.create(
            model="dense", messages=user("Go on."), max_tokens=1900, stream=True, extra_body={"min_tokens": 1800}
        )
        next(stream)
        gateway.process.send_signal(signal.SIGTERM)
        gateway.process.wait(30)  # the graceful shutdown waits 10 s for open streams, then cuts them
    except subprocess.TimeoutExpired:
        pytest.fail("the gateway was still running 30 s after SIGTERM")
    finally:
        gateway.stop()


def _llm_idle(served, quiet_s: float = 1.5, within_s: float = 90.0) -> None:
    """Waits until the llm's generated-token count stops moving: an earlier test's long stream (the SIGTERM test's,
    cut by the gateway's shutdown) may still be generating until the llm sees its cancellation."""
    deadline = time.monotonic() + within_s
    last = None
    while time.monotonic() < deadline:
        samples = stage_metrics.read(f"{served.triton_metrics_url}/metrics")
        now = samples.get((stage_metrics.TOKENS_GENERATED.name, interface.LLM))
        if now == last:
            return
        last = now
        time.sleep(quiet_s)
    pytest.fail(f"the llm was still generating {within_s:g} s later")


def test_metrics_count_requests_tokens_and_stream_latencies(served):
    """The gateway's /metrics and, on Triton's metrics port, the python models' own, both counted against what
    the clients sent and received."""
    client = served.client()
    _llm_idle(served)
    before, triton_before = _metrics(served.url), _metrics(served.triton_metrics_url)
    replies = [
        client.chat.completions.create(model="dense", messages=user(PROMPT, PHOTO), max_tokens=k) for k in (3, 5)
    ]
    streams = [
        list(
            client.chat.completions.create(
                model="dense",
                messages=user("Hi!"),
                max_tokens=k,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        for k in (2, 4, 6)
    ]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=user("Hi!"), max_tokens=2)
    after, triton_after = _metrics(served.url), _metrics(served.triton_metrics_url)

    def delta(name: str, **labels: str) -> float:
        return _sample(after, name, **labels) - _sample(before, name, **labels)

    def triton_delta(metric: stage_metrics.Metric, model: str) -> float:
        def total(samples: dict) -> float:  # over the model's python stubs (label stub_pid)
            return sum(v for (name, labels), v in samples.items() if name == metric.name and ("model", model) in labels)

        return total(triton_after) - total(triton_before)

    usages = [r.usage for r in replies] + [chunks[-1].usage for chunks in streams]
    assert delta("qwen3vl_gateway_requests_total", outcome="completed", status="200") == 5
    assert delta("qwen3vl_gateway_requests_total", outcome="rejected", status="404") == 1
    assert delta("qwen3vl_gateway_completion_tokens_total") == sum(u.completion_tokens for u in usages)
    assert delta("qwen3vl_gateway_prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert delta("qwen3vl_gateway_time_to_first_token_seconds_count") == len(streams)
    deltas = sum(len([c for c in chunks if c.choices and c.choices[0].delta.content]) for chunks in streams)
    assert delta("qwen3vl_gateway_inter_token_latency_seconds_count") == deltas - len(streams)
    assert delta("qwen3vl_gateway_request_duration_seconds_count") == 6
    # The five served requests reached every stage (the unknown model's never left the gateway; the llm may also
    # count stop requests of earlier tests' cancellations, which go to it directly).
    assert triton_delta(stage_metrics.REQUESTS, interface.PREPROCESSING) == 5
    # Preprocessing sends the vision encoder one request per batch with images to encode: here one per photo.
    assert triton_delta(stage_metrics.REQUESTS, interface.VISION_ENCODER) == len(replies)
    for model in (interface.PREPROCESSING, interface.VISION_ENCODER, interface.LLM):
        assert triton_delta(stage_metrics.REQUEST_ERRORS, model) == 0, model
    assert triton_delta(stage_metrics.IMAGES_DECODED, interface.PREPROCESSING) == len(replies)  # one photo each
    completion_tokens = sum(u.completion_tokens for u in usages)
    assert triton_delta(stage_metrics.TOKENS_GENERATED, interface.LLM) == completion_tokens
