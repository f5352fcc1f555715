"""The OpenAI gateway's parts that need no server: admission (slots, bounded queue, bounded wait), the JSON
depth bound, the defaults its settings take from the engine limits and the flags that override them, and
how Triton's refusals map to the client's errors."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
import anyio.abc
import pytest
from deployment import LIMITS
from qwen3vl_trt.cli import _gateway_options, parser
from qwen3vl_trt.errors import RequestError
from qwen3vl_trt.serving import interface
from qwen3vl_trt.serving.client import (
    RequestRejectedError,
    ServerBusyError,
    ServerUnavailableError,
    request_inputs,
    server_error,
    stream_request,
)
from qwen3vl_trt.serving.gateway.admission import MAX_JSON_DEPTH, Admission, Overloaded, json_too_deep
from qwen3vl_trt.serving.gateway.options import BODY_SLACK_BYTES, MAX_DEFAULT_REQUEST_BYTES, GatewayOptions
from qwen3vl_trt.serving.gateway.protocol import _UNSUPPORTED, APIError
from qwen3vl_trt.serving.gateway.settings import GatewaySettings
from qwen3vl_trt.serving.request import BATCH_PRIORITY, GenerationRequest
from tritonclient.grpc._utils import _get_inference_request
from tritonclient.utils import InferenceServerException

pytestmark = pytest.mark.gpu_image  # how tritonclient 2.68's errors map, at the GPU image's version too


def _admitted(admission: Admission, cost: float = 0, count: int = 1) -> contextlib.AbstractAsyncContextManager[None]:
    """A request's way through the admission as ChatRequestGuard and the app take it: enter, run, leave."""

    @contextlib.asynccontextmanager
    async def admitted() -> AsyncIterator[None]:
        ticket = admission.enter()
        try:
            await admission.run(ticket, cost, count)
            yield
        finally:
            admission.leave(ticket)

    return admitted()


def _admission(max_in_flight: int, max_queued: int, **kwargs: Any) -> Admission:
    kwargs = {"max_wait_s": 5.0, "max_queued_bytes": 2**20, **kwargs}
    return Admission(max_in_flight=max_in_flight, max_queued=max_queued, **kwargs)


async def _requests(
    tasks: anyio.abc.TaskGroup, admission: Admission, costs: dict[str, float], order: list[str]
) -> dict[str, anyio.Event]:
    """Starts a request per name (one after another, in the dict's order) that holds its slot until its event is
    set; each one's admission is appended to order."""
    holds = {name: anyio.Event() for name in costs}

    async def request(name: str) -> None:
        try:
            async with _admitted(admission, costs[name]):
                order.append(f"{name} in")
                await holds[name].wait()
        except Overloaded:
            order.append(f"{name} refused")

    for name in costs:
        tasks.start_soon(request, name)
        await anyio.sleep(0.01)
    return holds


def _run(main: Callable[[anyio.abc.TaskGroup], Awaitable[None]]) -> None:
    """main(tasks), whose tasks end before this returns."""

    async def in_group() -> None:
        async with anyio.create_task_group() as tasks:
            await main(tasks)

    anyio.run(in_group)


@pytest.mark.parametrize("order", ["fifo", "short-first"])
def test_admission_serves_up_to_its_limit_queues_a_few_and_refuses_the_rest_at_once(order):
    admission = _admission(2, 2, order=order)
    served: list[str] = []

    async def main(tasks: anyio.abc.TaskGroup) -> None:
        holds = await _requests(tasks, admission, dict.fromkeys("abcde", 1.0), served)
        assert (admission.in_flight, admission.queued) == (2, 2)
        assert served == ["a in", "b in", "e refused"]
        holds["a"].set()
        await anyio.sleep(0.01)
        assert served[-1] == "c in" and (admission.in_flight, admission.queued) == (2, 1)
        for name in "bcd":
            holds[name].set()
        await anyio.sleep(0.01)
        assert served[-1] == "d in" and (admission.in_flight, admission.queued) == (0, 0)

    _run(main)


def test_admission_serves_the_cheapest_first_and_a_passed_request_after_a_bounded_number_of_passes():
    # One slot, ageing 2: "long" joins first with nobody before it (passed at most 1 + (2 - 1) x 1 = twice), then
    # "mid" behind it (at most three times), then three short ones.
    admission = _admission(1, 8, ageing=2.0)
    fifo = _admission(1, 8, order="fifo")
    costs = {"first": 1.0, "long": 100.0, "mid": 50.0, "s1": 1.0, "s2": 1.0, "s3": 1.0}
    served: dict[str, list[str]] = {"short-first": [], "fifo": []}

    async def main(tasks: anyio.abc.TaskGroup) -> None:
        for queue in (admission, fifo):
            holds = await _requests(tasks, queue, costs, served[queue.order])
            for _ in costs:  # the one request running ends, and the next is let in
                for name in costs:
                    if f"{name} in" in served[queue.order]:
                        holds[name].set()
                await anyio.sleep(0.01)
            assert (queue.in_flight, queue.queued) == (0, 0)

    _run(main)
    assert served["fifo"] == [f"{name} in" for name in costs]
    # s1 and s2 pass long and mid; long may be passed no more, so it goes next; mid was passed twice, s3 passes it.
    assert served["short-first"] == ["first in", "s1 in", "s2 in", "long in", "s3 in", "mid in"]


def test_admission_grants_several_slots_at_once_and_refuses_more_than_it_has():
    admission = _admission(3, 4)
    order: list[str] = []

    async def main(tasks: anyio.abc.TaskGroup) -> None:
        holds = await _requests(tasks, admission, {"a": 1.0, "b": 1.0}, order)

        async def wide() -> None:
            async with _admitted(admission, 2.0, count=3):
                order.append("wide in")

        tasks.start_soon(wide)
        await anyio.sleep(0.01)
        assert order == ["a in", "b in"] and admission.in_flight == 2  # the one free slot waits for two more
        # A cheaper request that comes meanwhile goes first, into the free slot, at once.
        holds |= await _requests(tasks, admission, {"c": 1.0}, order)
        assert order == ["a in", "b in", "c in"] and admission.in_flight == 3
        for name in "ab":
            holds[name].set()
        await anyio.sleep(0.01)
        assert order == ["a in", "b in", "c in"]  # wide waits for c too
        holds["c"].set()
        await anyio.sleep(0.01)
        assert order[-1] == "wide in" and (admission.in_flight, admission.queued) == (0, 0)
        with pytest.raises(APIError, match="n = 4 is more than the 3 requests"):
            async with _admitted(admission, count=4):
                pass

    _run(main)


def test_admission_refuses_a_request_that_waited_too_long_and_forgets_one_that_left():
    admission = _admission(1, 4, max_wait_s=0.2)

    async def main() -> None:
        async with _admitted(admission):
            started = time.monotonic()
            with pytest.raises(Overloaded, match="within 0.2 s"):
                async with _admitted(admission):
                    pass
            assert 0.2 <= time.monotonic() - started < 2.0 and admission.queued == 0
            with anyio.move_on_after(0.05):  # a client that goes away while it waits
                async with _admitted(admission):
                    pass
            assert admission.queued == 0
        assert admission.in_flight == 0
        async with _admitted(admission):
            assert admission.in_flight == 1

    anyio.run(main)


def test_admission_bounds_the_bytes_of_bodies_held_without_a_slot():
    admission = _admission(1, 8, max_queued_bytes=1000)
    first, second = admission.enter(), admission.enter()
    admission.hold(first, 600)
    with pytest.raises(Overloaded, match="hold 600 bytes of bodies; this gateway holds at most 1,000"):
        admission.hold(second, 500)
    admission.hold(second, 400)

    async def main() -> None:
        await admission.run(first, 1.0)  # running: its body no longer counts
        assert admission.queued_bytes == 400
        with anyio.move_on_after(0.05):  # waiting for the one slot: its body still counts
            await admission.run(second, 1.0)
        assert admission.queued_bytes == 400
        admission.leave(second)
        assert admission.queued_bytes == 0 and admission.queued == 0
        admission.leave(first)
        assert admission.in_flight == 0

    anyio.run(main)


def test_a_batch_slot_waits_while_a_request_does_and_takes_at_most_its_share():
    admission = _admission(4, 4)
    order: list[str] = []

    async def batch_line(name: str, hold: anyio.Event) -> None:
        async with admission.batch_slot(0.5):
            order.append(f"{name} in")
            await hold.wait()

    async def main(tasks: anyio.abc.TaskGroup) -> None:
        lines = {name: anyio.Event() for name in ("x", "y", "z")}
        for name in lines:
            tasks.start_soon(batch_line, name, lines[name])
        await anyio.sleep(0.2)
        assert sorted(order) == ["x in", "y in"] and admission.in_flight == 2  # half the slots
        holds = await _requests(tasks, admission, {"a": 1.0, "b": 1.0, "c": 1.0}, order)
        assert order[2:] == ["a in", "b in"] and admission.in_flight == 4
        lines["x"].set()
        await anyio.sleep(0.2)
        assert order[-1] == "c in"  # the freed slot went to the waiting request, not to the batch line z
        for event in (*holds.values(), *lines.values()):
            event.set()

    _run(main)


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
    assert settings.max_queued_bytes == min(settings.max_queued_requests * settings.max_request_bytes, 2**30)
    assert (settings.options.queue_order, settings.options.queue_ageing) == ("short-first", 2.0)

    args = parser().parse_args(
        ["openai", "--max-concurrent-requests", "3", "--max-queued-requests", "0", "--max-queue-wait", "2.5"]
        + ["--max-request-bytes", "1000", "--request-timeout", "9", "--served-model-name", "m"]
        + ["--queue-order", "fifo", "--queue-ageing", "3", "--max-queued-bytes", "500"]
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
        queue_order="fifo",
        queue_ageing=3.0,
        max_queued_bytes=500,
    )
    settings = GatewaySettings.resolve("127.0.0.1:8001", tmp_path / "checkpoint", LIMITS, options)
    assert (settings.max_concurrent_requests, settings.max_queued_requests, settings.max_request_bytes) == (3, 0, 1000)
    assert settings.max_queued_bytes == 1000  # at least one body of the largest
    assert settings.served_model_name == "m"
    for refused in (["--max-concurrent-requests", "0"], ["--queue-ageing", "0.5"], ["--queue-order", "lifo"]):
        with pytest.raises(SystemExit):
            parser().parse_args(["openai", *refused])
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


def test_a_requests_priority_travels_as_the_grpc_requests_priority_parameter():
    # What grpc.aio's stream_infer builds from each dict its iterator yields (tritonclient grpc/aio/__init__.py
    # _request_iterator), here at the installed tritonclient and the GPU image's.
    request = GenerationRequest(prompt="hi", max_tokens=1, priority=BATCH_PRIORITY)
    sent = stream_request("qwen3vl", request_inputs(request), "batch_req_1", request.priority)
    fields = dict.fromkeys(("model_version",), "") | {
        "outputs": None,
        "sequence_id": 0,
        "sequence_start": False,
        "sequence_end": False,
        "timeout": None,
        "parameters": None,
    }
    proto = _get_inference_request(**sent, **fields)
    assert proto.parameters["priority"].uint64_param == BATCH_PRIORITY and proto.id == "batch_req_1"
    interactive = _get_inference_request(**stream_request("qwen3vl", [], "r"), **fields)
    assert "priority" not in interactive.parameters  # 0: the models' default level
    with pytest.raises(RequestError, match=r"priority must be in \[0, 2\]"):
        GenerationRequest(prompt="hi", max_tokens=1, priority=3)
