"""The OpenAI gateway's parts that need no server: admission (slots, bounded queue, bounded wait), the JSON
depth bound, the defaults its settings take from the engine limits and the flags that override them, and
how Triton's refusals map to the client's errors."""

from __future__ import annotations

import json
import time

import anyio
import pytest
from deployment import LIMITS
from qwen3vl_trt.cli import _gateway_options, parser
from qwen3vl_trt.serving import interface
from qwen3vl_trt.serving.client import RequestRejectedError, ServerBusyError, ServerUnavailableError, server_error
from qwen3vl_trt.serving.gateway.admission import MAX_JSON_DEPTH, Admission, Overloaded, json_too_deep
from qwen3vl_trt.serving.gateway.options import BODY_SLACK_BYTES, MAX_DEFAULT_REQUEST_BYTES, GatewayOptions
from qwen3vl_trt.serving.gateway.protocol import _UNSUPPORTED
from qwen3vl_trt.serving.gateway.settings import GatewaySettings
from tritonclient.utils import InferenceServerException

pytestmark = pytest.mark.gpu_image  # how tritonclient 2.68's errors map, at the GPU image's version too


def test_admission_serves_up_to_its_limit_queues_a_few_and_refuses_the_rest_at_once():
    admission = Admission(max_in_flight=2, max_queued=2, max_wait_s=5.0)
    order: list[str] = []

    async def request(name: str, hold: anyio.Event) -> None:
        try:
            async with admission.slot():
                order.append(f"{name} in")
                await hold.wait()
        except Overloaded:
            order.append(f"{name} refused")

    async def main() -> None:
        holds = {name: anyio.Event() for name in "abcde"}
        async with anyio.create_task_group() as tasks:
            for name in "abcde":
                tasks.start_soon(request, name, holds[name])
                await anyio.sleep(0.01)
            assert (admission.in_flight, admission.queued) == (2, 2)
            assert order == ["a in", "b in", "e refused"]
            holds["a"].set()
            await anyio.sleep(0.01)
            assert order[-1] == "c in" and (admission.in_flight, admission.queued) == (2, 1)
            for name in "bcd":
                holds[name].set()
        assert order[-1] == "d in" and (admission.in_flight, admission.queued) == (0, 0)

    anyio.run(main)


def test_admission_refuses_a_request_that_waited_too_long_and_forgets_one_that_left():
    admission = Admission(max_in_flight=1, max_queued=4, max_wait_s=0.2)

    async def main() -> None:
        async with admission.slot():
            started = time.monotonic()
            with pytest.raises(Overloaded, match="within 0.2 s"):
                async with admission.slot():
                    pass
            assert 0.2 <= time.monotonic() - started < 2.0 and admission.queued == 0
            with anyio.move_on_after(0.05):  # a client that goes away while it waits
                async with admission.slot():
                    pass
            assert admission.queued == 0
        assert admission.in_flight == 0
        async with admission.slot():
            assert admission.in_flight == 1

    anyio.run(main)


def test_json_depth_is_bounded_without_parsing():
    chat = {"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}
    assert not json_too_deep(json.dumps(chat).encode(), MAX_JSON_DEPTH)
    started = time.monotonic()
    assert json_too_deep(b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", MAX_JSON_DEPTH)
    assert time.monotonic() - started < 2.0
    # Brackets inside strings, escaped quotes included, are text, not structure.
    text = json.dumps({"messages": [{"content": '[[[[ "{{{{' * 1000}]}).encode()
    assert not json_too_deep(text, MAX_JSON_DEPTH)
    assert json_too_deep(b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1), MAX_JSON_DEPTH)
    assert not json_too_deep(b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH, MAX_JSON_DEPTH)


def test_settings_take_their_bounds_from_the_engine_limits_unless_told(tmp_path):
    settings = GatewaySettings.resolve("127.0.0.1:8001", tmp_path / "checkpoint", LIMITS)
    images = LIMITS.request_limits()
    assert settings.served_model_name == "checkpoint"
    assert settings.max_concurrent_requests == 2 * LIMITS.max_batch_size
    assert settings.max_queued_requests == 8 * LIMITS.max_batch_size
    assert settings.max_request_bytes == min(
        MAX_DEFAULT_REQUEST_BYTES, 4 * -(-images.max_image_bytes // 3) * images.max_images + BODY_SLACK_BYTES
    )

    args = parser().parse_args(
        ["openai", "--max-concurrent-requests", "3", "--max-queued-requests", "0", "--max-queue-wait", "2.5"]
        + ["--max-request-bytes", "1000", "--request-timeout", "9", "--served-model-name", "m"]
    )
    options = _gateway_options(args)
    assert options == GatewayOptions(
        served_model_name="m",
        max_concurrent_requests=3,
        max_queued_requests=0,
        max_queue_wait_s=2.5,
        max_request_bytes=1000,
        request_timeout_s=9.0,
        replica_ready_port=8003,
    )
    settings = GatewaySettings.resolve("127.0.0.1:8001", tmp_path / "checkpoint", LIMITS, options)
    assert (settings.max_concurrent_requests, settings.max_queued_requests, settings.max_request_bytes) == (3, 0, 1000)
    assert settings.served_model_name == "m"
    with pytest.raises(SystemExit):
        parser().parse_args(["openai", "--max-concurrent-requests", "0"])
    # Each replica's readiness: its serve's endpoint (the port `serve --ready-port` defaults to), or 0: over gRPC.
    assert GatewaySettings.resolve("127.0.0.1:8001", tmp_path, LIMITS).options.replica_ready_port == 0
    assert parser().parse_args(["openai", "--replica-ready-port", "0"]).replica_ready_port == 0
    with pytest.raises(SystemExit):
        parser().parse_args(["openai", "--replica-ready-port", "70000"])


def test_triton_refusals_map_to_the_errors_the_gateway_answers():
    # As Triton's streams carry them: the response's error message, no status (core's scheduler_utils.cc).
    busy = server_error("h:1", InferenceServerException(msg="in ensemble 'qwen3vl', Exceeds maximum queue size"))
    assert isinstance(busy, ServerBusyError) and isinstance(busy, ServerUnavailableError)
    assert busy.reason == "Exceeds maximum queue size"  # no address, no ensemble: what the gateway may tell
    message = f"in ensemble 'qwen3vl_tokens', {interface.REJECTED_REQUEST} [ImageDecodeError]: image 0 is truncated"
    rejected = server_error("h:1", InferenceServerException(msg=message))
    assert isinstance(rejected, RequestRejectedError) and str(rejected) == f"h:1: {message}"
    assert (rejected.reason, rejected.kind) == ("image 0 is truncated", "ImageDecodeError")
    down = server_error("h:1", InferenceServerException(msg="connect failed", status="StatusCode.UNAVAILABLE"))
    assert type(down) is ServerUnavailableError


def test_every_refusal_text_is_whole():
    texts = [why for _, why in _UNSUPPORTED.values()]
    for text in texts:
        assert text.count("(") == text.count(")"), text  # no sentence cut off inside its parentheses
        assert text[-1].isalnum() or text[-1] in ").'", text
