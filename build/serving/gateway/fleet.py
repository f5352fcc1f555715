"""The OpenAI gateway as a client of a fleet of Triton replicas.

`--triton-url` names the replicas:

    triton-0:8001                        one address, or a name that resolves to several (a Kubernetes headless
                                         Service resolves to every ready pod)
    10.0.0.5:8001,10.0.0.6:8001          a list (each entry may be a name too)
    dns:///triton.svc:8001               gRPC's target syntax for a name ...
    dns://10.96.0.10:53/triton.svc:8001  ... optionally with the DNS server to ask

Names are resolved again every `refresh_s`: replicas that appear are probed and join, those that disappear
leave the rotation at once and their channel closes when their last request ends. Every replica has its own
gRPC channel and is probed for readiness every PROBE_INTERVAL_S (ServeProbe: the readiness endpoint of the replica's
`serve`, ready once it is warmed up; GrpcProbe, for plain tritonservers: server and ensemble ready); requests go
round robin over the ready ones. A replica whose request fails for want of a server (connection lost, the stream
silent while the replica reports not ready, the replica stopping) is taken out until a probe finds it ready
again; such a request, or one a full queue refused, is sent once more, to another replica, if it had not yet
returned any text; one that had is never sent again (its client already has part of the answer).

Why not one gRPC channel with the `round_robin` policy over `dns:///`: gRPC's DNS resolver resolves again
only when a connection fails (grpc/grpc#12295), so replicas added by scaling out would not be seen; its
connection states see a replica that is up but not ready (loading its engines, a stage being reloaded) as
ready; and a retry on the same channel cannot be steered away from the replica that failed.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import Protocol

from ...decoding.detokenize import Detokenizer
from ..client import Answer, AsyncClient, ServerBusyError, ServerUnavailableError
from ..ports import host_port
from ..request import GenerationRequest
from ..targets import FleetTarget
from .metrics import GatewayMetrics
from .options import DEFAULT_GATEWAY_OPTIONS

PROBE_INTERVAL_S = 1.0
PROBE_TIMEOUT_S = 2.0


class Replica:
    def __init__(self, address: str, client: AsyncClient):
        self.address = address
        self.client = client
        self.ready = False
        self.in_flight = 0

    @property
    def host(self) -> str:
        """The address's host (an IPv6 address without its brackets)."""
        host = self.address.rpartition(":")[0]
        return host[1:-1] if host.startswith("[") else host


class ReplicaProbe(Protocol):
    """How the fleet asks whether a replica is ready (within PROBE_TIMEOUT_S)."""

    async def ready(self, replica: Replica) -> bool: ...

    async def close(self) -> None: ...


class GrpcProbe:
    """tritonserver's own readiness (server and ensemble ready), over the replica's gRPC channel: for replicas that
    are plain tritonservers. Ready as soon as the models are loaded, before any warm-up."""

    async def ready(self, replica: Replica) -> bool:
        return await replica.client.is_ready(PROBE_TIMEOUT_S)

    async def close(self) -> None:
        pass


class ServeProbe:
    """GET http://<replica's address>:<port>/ready, the readiness endpoint of the replica's `serve`
    (server.readiness): 200 once it is warmed up and while its tritonserver is ready."""

    def __init__(self, port: int):
        import httpx

        self.port = port
        self._errors = (httpx.HTTPError,)
        # Straight to the replica: a proxy the environment names (HTTP_PROXY) is not on the way to a pod.
        self._http = httpx.AsyncClient(timeout=PROBE_TIMEOUT_S, trust_env=False)

    async def ready(self, replica: Replica) -> bool:
        try:
            answer = await self._http.get(f"http://{host_port(replica.host, self.port)}/ready")
        except self._errors:  # not listening (yet), or too slow
            return False
        return answer.status_code == 200

    async def close(self) -> None:
        await self._http.aclose()


class LocalProbe:
    """The readiness of the `serve` process the gateway runs in (serve --openai-port), asked off the event loop."""

    def __init__(self, ready: Callable[[], bool]):
        self._ready = ready

    async def ready(self, replica: Replica) -> bool:
        return await asyncio.to_thread(self._ready)

    async def close(self) -> None:
        pass


def _log(message: str) -> None:
    print(f"gateway: {message}", file=sys.stderr, flush=True)


# What a replica's failure to serve looks like (the request itself was not at fault): sent again elsewhere.
RETRIED_ERRORS = (ServerUnavailableError,)  # ServerBusyError is one


class Fleet:
    """The replicas --triton-url names, as the gateway's one client (AsyncClient's interface: stream,
    is_ready, close), each asked whether it is ready by `probe` (default: GrpcProbe). Create, use and close it on
    one event loop."""

    def __init__(
        self,
        target: FleetTarget,
        model: str | None = None,
        refresh_s: float = DEFAULT_GATEWAY_OPTIONS.triton_refresh_s,
        metrics: GatewayMetrics | None = None,
        probe: ReplicaProbe | None = None,
        detokenizer: Detokenizer | None = None,
    ):
        """model and detokenizer: as AsyncClient takes them, for every replica."""
        self.target, self.model, self.refresh_s, self.detokenizer = target, model, refresh_s, detokenizer
        self.url = target.text
        self.metrics = metrics
        self.probe = probe or GrpcProbe()
        self.replicas: dict[str, Replica] = {}
        self._turn = 0
        self._watcher: asyncio.Task[None] | None = None
        self._closing: set[asyncio.Future[None]] = set()
        self._retired: set[Replica] = set()  # no longer resolved, requests still in flight
        self._unresolved = False  # the last resolution failed (logged once)
        if metrics is not None:
            metrics.replicas_ready.set_function(lambda: len(self.rotation()))

    async def start(self) -> None:
        """Resolves the target and probes its replicas once, then keeps doing so in the background."""
        await self._refresh()
        await self._probe_all()
        ready = len(self.rotation())
        known = ", ".join(self.replicas) or "none resolved yet"
        _log(f"{self.url}: {len(self.replicas)} replicas ({known}), {ready} ready")
        self._watcher = asyncio.ensure_future(self._watch())

    async def close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
        replicas = [*self.replicas.values(), *self._retired]
        await asyncio.gather(*(r.client.close() for r in replicas), *self._closing, self.probe.close())
        self.replicas.clear()
        self._retired.clear()

    def rotation(self) -> list[Replica]:
        return [r for r in self.replicas.values() if r.ready]

    def routing(self) -> bool:
        """Whether a replica is in the rotation, asked from any thread (a resolution may change the replicas)."""
        try:
            return any(replica.ready for replica in list(self.replicas.values()))
        except RuntimeError:  # changed while read
            return False

    async def is_ready(self) -> bool:
        """Whether some replica is in the rotation (probed each PROBE_INTERVAL_S: a health check never waits on a
        slow replica)."""
        return bool(self.rotation())

    async def stream(
        self, request: GenerationRequest, *, request_id: str, deadline: float | None = None
    ) -> AsyncGenerator[Answer, None]:
        """AsyncClient.stream on a ready replica, sent once more to another when the first fails before any
        text (see RETRIED_ERRORS). Leaving early stops the request on the replica that runs it.

        Pieces without text (tokens that end inside a UTF-8 character) are held and passed on with the next
        piece that has text: until then the caller has nothing of this replica's answer, and a retry starts
        over cleanly."""
        tried: list[Replica] = []
        replica = self._pick(tried)
        while True:
            tried.append(replica)
            answered = False
            held: list[Answer] = []  # pieces without text, before the first text
            replica.in_flight += 1
            if self.metrics is not None:
                self.metrics.replica_requests.labels(replica.address).inc()
            pieces = replica.client.stream(request, request_id=request_id, deadline=deadline)
            try:
                async for answer in pieces:
                    if not answered and not answer.text:
                        held.append(answer)
                        continue
                    if held:
                        answer, held = Answer.joined([*held, answer]), []
                    answered = True
                    yield answer
                if held:
                    yield Answer.joined(held)
                return
            except RETRIED_ERRORS as error:
                if answered or len(tried) > 1:
                    raise
                if not isinstance(error, ServerBusyError):  # a full queue says nothing of the replica's health
                    self._take_out(replica, str(error))
                try:
                    replica = self._pick(tried)
                except ServerUnavailableError:
                    raise error from None
                if self.metrics is not None:
                    self.metrics.retries.inc()
                _log(f"request {request_id} failed on {tried[-1].address} before any text; sent to {replica.address}")
            finally:
                await pieces.aclose()
                self._finished(tried[-1])

    # -- rotation ---------------------------------------------------------------------------------

    def _pick(self, tried: Sequence[Replica]) -> Replica:
        candidates = [r for r in self.rotation() if r not in tried]
        if not candidates:
            known = ", ".join(sorted(self.replicas)) or "none resolved"
            reason = f"no {'other ' if tried else ''}replica is ready"
            raise ServerUnavailableError(f"{self.url}: {reason} (replicas: {known})", reason)
        self._turn += 1
        return candidates[self._turn % len(candidates)]

    def _take_out(self, replica: Replica, why: str) -> None:
        if replica.ready:
            replica.ready = False
            _log(f"replica {replica.address} taken out of the rotation until it is ready again: {why}")

    def _finished(self, replica: Replica) -> None:
        replica.in_flight -= 1
        if replica in self._retired and replica.in_flight == 0:
            self._retired.discard(replica)
            self._close_later(replica)

    def _close_later(self, replica: Replica) -> None:
        closing = asyncio.ensure_future(replica.client.close())
        self._closing.add(closing)  # asyncio keeps only weak references to tasks
        closing.add_done_callback(self._closing.discard)

    # -- watching ---------------------------------------------------------------------------------

    async def _watch(self) -> None:
        resolved_at = time.monotonic()
        while True:
            await asyncio.sleep(PROBE_INTERVAL_S)
            try:
                if time.monotonic() - resolved_at >= self.refresh_s:
                    resolved_at = time.monotonic()
                    await self._refresh()
                await self._probe_all()
            except Exception as e:  # the rotation must keep following the replicas whatever one round met
                _log(f"watching the replicas of {self.url}: {e!r}")

    async def _refresh(self) -> None:
        try:
            addresses = set(await asyncio.get_running_loop().run_in_executor(None, self.target.resolve))
        except Exception as e:  # a resolver error keeps the replicas known so far
            if not self._unresolved:
                _log(f"cannot resolve {self.url} ({e}); keeping the {len(self.replicas)} replicas known")
            self._unresolved = True
            return
        if self._unresolved:
            _log(f"{self.url} resolves again")
            self._unresolved = False
        for address in sorted(addresses - self.replicas.keys()):
            self.replicas[address] = Replica(address, AsyncClient(address, self.model, self.detokenizer))
            if self._watcher is not None:
                _log(f"replica {address} found; in the rotation once ready")
        for address in sorted(self.replicas.keys() - addresses):
            replica = self.replicas.pop(address)
            _log(f"replica {address} no longer resolved from {self.url}; out of the rotation")
            if self.metrics is not None:  # pod addresses come and go: keep the series to those known
                with contextlib.suppress(KeyError):
                    self.metrics.replica_requests.remove(address)
            if replica.in_flight == 0:
                self._close_later(replica)
            else:
                self._retired.add(replica)

    async def _probe_all(self) -> None:
        replicas = list(self.replicas.values())
        states = await asyncio.gather(*(self.probe.ready(r) for r in replicas))
        for replica, ready in zip(replicas, states, strict=True):
            if ready and not replica.ready:
                _log(f"replica {replica.address} is ready: in the rotation")
            elif replica.ready and not ready:
                _log(f"replica {replica.address} is not ready: taken out of the rotation")
            replica.ready = ready
