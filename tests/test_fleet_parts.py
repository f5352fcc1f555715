"""Fleet.stream's retry rule, exactly: a request that fails for want of a server before its first text is sent once
more, to another replica; one that had returned text, one already retried, and one the deployment refused as sent
are not. The replicas here are scripted (tests/test_fleet.py runs the same code against real tritonservers); the
rotation follows each replica's serve readiness endpoint, a real one here over a scripted state."""

from __future__ import annotations

import asyncio
import itertools
import json
import urllib.error
import urllib.request
from collections.abc import AsyncIterator

import pytest
from qwen3vl_trt.serving.client import Answer, RequestRejectedError, ServerBusyError, ServerUnavailableError
from qwen3vl_trt.serving.gateway.fleet import Fleet, Replica, ServeProbe
from qwen3vl_trt.serving.gateway.metrics import GatewayMetrics
from qwen3vl_trt.serving.ports import free_ports
from qwen3vl_trt.serving.request import GenerationRequest
from qwen3vl_trt.serving.server.readiness import BuildInfo, Readiness, ReadinessServer, ServeMetrics
from qwen3vl_trt.serving.targets import FleetTarget

REQUEST = GenerationRequest(prompt="Hi.", max_tokens=4)

pytestmark = pytest.mark.once


class ScriptedClient:
    """A replica's client that answers with the given pieces, then fails with `error` (if any)."""

    def __init__(self, pieces: list[Answer], error: Exception | None = None):
        self.pieces, self.error = pieces, error
        self.requests: list[str] = []

    async def stream(self, _request, *, request_id: str, deadline=None) -> AsyncIterator[Answer]:
        self.requests.append(request_id)
        for piece in self.pieces:
            yield piece
        if self.error is not None:
            raise self.error

    async def is_ready(self, timeout_s: float = 5.0) -> bool:
        return True

    async def close(self) -> None:
        pass


def _fleet(*clients: ScriptedClient) -> tuple[Fleet, GatewayMetrics]:
    metrics = GatewayMetrics()
    fleet = Fleet(FleetTarget.parse("127.0.0.1:1,127.0.0.2:1"), metrics=metrics)
    for i, client in enumerate(clients):
        replica = Replica(f"r{i}", client)  # type: ignore[arg-type]
        replica.ready = True
        fleet.replicas[replica.address] = replica
    fleet._turn = -1  # the first pick is r0
    return fleet, metrics


def _run(fleet: Fleet) -> list[Answer] | Exception:
    async def collect() -> list[Answer]:
        return [answer async for answer in fleet.stream(REQUEST, request_id="req")]

    try:
        return asyncio.run(collect())
    except Exception as e:
        return e


LOST = ServerUnavailableError("the connection was lost")


def test_a_failure_before_any_text_is_retried_once_elsewhere():
    partial = Answer("", [7])  # a token that ends inside a UTF-8 character: no text yet
    first, second = ScriptedClient([partial], LOST), ScriptedClient([Answer("hé", [7, 8]), Answer("!", [9])])
    fleet, metrics = _fleet(first, second)
    assert _run(fleet) == [Answer("hé", [7, 8]), Answer("!", [9])]  # nothing of the failed attempt
    assert first.requests == second.requests == ["req"]
    assert metrics.retries._value.get() == 1
    assert not fleet.replicas["r0"].ready and fleet.replicas["r1"].ready  # taken out until a probe finds it ready
    assert [r.in_flight for r in fleet.replicas.values()] == [0, 0]


def test_pieces_without_text_reach_the_caller_with_the_next_text():
    only = ScriptedClient([Answer("", [1]), Answer("", [2]), Answer("a", [3]), Answer("", [4])])
    fleet, _ = _fleet(only)
    assert _run(fleet) == [Answer("a", [1, 2, 3]), Answer("", [4])]
    fleet, _ = _fleet(ScriptedClient([Answer("", [5])]))
    assert _run(fleet) == [Answer("", [5])]


def test_a_failure_after_text_is_not_retried():
    first, second = ScriptedClient([Answer("a", [1])], LOST), ScriptedClient([Answer("b", [2])])
    fleet, metrics = _fleet(first, second)

    async def collect() -> tuple[list[Answer], Exception | None]:
        got = []
        try:
            async for answer in fleet.stream(REQUEST, request_id="req"):
                got.append(answer)
        except ServerUnavailableError as e:
            return got, e
        return got, None

    got, error = asyncio.run(collect())
    assert got == [Answer("a", [1])] and error is LOST
    assert second.requests == [] and metrics.retries._value.get() == 0


def test_only_one_retry_and_only_for_server_failures():
    fleet, _ = _fleet(ScriptedClient([], LOST), ScriptedClient([], ServerUnavailableError("also gone")))
    error = _run(fleet)
    assert isinstance(error, ServerUnavailableError) and str(error) == "also gone"

    rejected = RequestRejectedError("request rejected: bad image")
    first, second = ScriptedClient([], rejected), ScriptedClient([Answer("b", [2])])
    fleet, _ = _fleet(first, second)
    assert _run(fleet) is rejected and second.requests == []  # every replica would refuse it
    assert fleet.replicas["r0"].ready

    first, second = ScriptedClient([], ServerBusyError("queue full")), ScriptedClient([Answer("b", [2])])
    fleet, _ = _fleet(first, second)
    assert _run(fleet) == [Answer("b", [2])]
    assert fleet.replicas["r0"].ready  # busy, not broken: stays in the rotation


def test_a_stopping_server_is_unavailable_not_failed():
    from qwen3vl_trt.serving.client import server_error
    from tritonclient.utils import InferenceServerException

    for message in (
        "GRPC server is shutting down and has stopped accepting new requests.",  # r26.04, in-band on a stream
        "Server is stopping, scheduler for model has stopped accepting new inference requests",  # core r24.10
    ):
        assert isinstance(server_error("r0", InferenceServerException(message)), ServerUnavailableError)


def test_no_replica_ready_is_unavailable():
    fleet, _ = _fleet(ScriptedClient([]))
    fleet.replicas["r0"].ready = False
    error = _run(fleet)
    assert isinstance(error, ServerUnavailableError) and "no replica is ready" in str(error)


def _ready_answer(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"{url}/ready", timeout=5) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_a_replica_whose_serve_is_not_ready_stays_out_of_the_rotation():
    """ServeProbe asks the replica's serve (its readiness endpoint, server.readiness): loading, warming up, with its
    tritonserver not ready or started again by the supervisor and not yet warmed up, or stopping, it answers 503 and
    the replica is out of the rotation; warmed up, it is in."""
    triton = {"ready": True, "pid": 7}
    ticks = itertools.count(step=10)  # every readiness check asks tritonserver afresh
    readiness = Readiness(lambda: triton["ready"], lambda: triton["pid"], clock=lambda: float(next(ticks)))
    build = BuildInfo("unknown", "local", "cpu", "none", "")
    ports = free_ports()
    endpoint = ReadinessServer(readiness, ServeMetrics(readiness, build), build, "127.0.0.1", ports.ready)
    endpoint.start()
    seen: list[tuple[int, str, int]] = []  # (HTTP status, reason, replicas in the rotation)

    async def run() -> None:
        fleet = Fleet(FleetTarget.parse(f"127.0.0.1:{ports.grpc}"), probe=ServeProbe(ports.ready))
        await fleet._refresh()  # the replica, before any probe

        async def look() -> None:
            await fleet._probe_all()
            status, body = await asyncio.to_thread(_ready_answer, endpoint.url)
            seen.append((status, body.get("reason", ""), len(fleet.rotation())))

        await look()  # loading
        readiness.warming_up()
        await look()
        readiness.warmed(7)
        await look()
        triton["ready"] = False
        await look()
        triton["ready"] = True
        await look()
        triton["pid"] = 8  # started again: cold
        await look()
        readiness.warmed(8)
        await look()
        readiness.stopping()
        await look()
        await fleet.close()

    try:
        asyncio.run(run())
    finally:
        endpoint.stop()
    assert seen == [
        (503, "loading", 0),
        (503, "warming up", 0),
        (200, "", 1),
        (503, "tritonserver not ready", 0),
        (200, "", 1),
        (503, "warming up", 0),
        (200, "", 1),
        (503, "stopping", 0),
    ]
    assert Replica("[::1]:8001", None).host == "::1"  # type: ignore[arg-type]
