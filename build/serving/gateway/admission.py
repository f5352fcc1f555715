"""What the gateway lets in, and in which order: Admission (a concurrency limit and a bounded, timed queue behind it,
served short-first with ageing or first come first served, the rest refused at once with 429 and Retry-After) and
ChatRequestGuard, the ASGI middleware in front of the generation endpoints that enters each request and bounds its
body's size and JSON depth before the app plans it; the app then asks for its slots at the plan's expected cost."""

from __future__ import annotations

import contextlib
import itertools
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import anyio
import numpy as np
from fastapi.responses import JSONResponse

from .metrics import GatewayMetrics, RequestRecord
from .options import QueueOrder
from .protocol import APIError, overloaded

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
GENERATION_PATHS = (CHAT_PATH, COMPLETIONS_PATH)
# A chat request nests about 5 deep (body, messages, message, content, part, image_url); nothing needs 32.
MAX_JSON_DEPTH = 32
RETRY_AFTER_S = 1  # a refusal under load: the next slot frees within about a request's time
BATCH_POLL_S = 0.05  # how often a batch line waiting for a slot looks again


class Overloaded(Exception):
    pass


@dataclass(eq=False)
class Ticket:
    """One request's hold on the gateway, from its arrival (Admission.enter) to its answer (Admission.leave): the
    bytes of its body while it has no slot, then the slots it runs in."""

    body_bytes: int = 0
    slots: int = 0


@dataclass(eq=False)
class _Waiter:
    ticket: Ticket
    cost: float
    count: int
    joined: int  # the queue's arrival order
    passes_left: int  # later requests that may still be served before it
    turn: anyio.Event = field(default_factory=anyio.Event)


class Admission:
    """At most max_in_flight slots in use; up to max_queued more requests held (their bodies being read, planned or
    waiting for slots), each waiting at most max_wait_s for its slots and their bodies max_queued_bytes in all;
    beyond that, requests are refused at once (Overloaded).

    order "short-first": a free slot goes to the waiting request of least expected cost (its prompt and output
    tokens), but one that joined behind `ahead` others is passed by at most max_in_flight + (ageing - 1) x (ahead + 1)
    later ones, so it gets its slot within ageing x the slots handed out before it would get one first come first
    served ("fifo", the other order), plus one round of the slots; requests passed that often go first, in their
    order."""

    def __init__(
        self,
        max_in_flight: int,
        max_queued: int,
        max_wait_s: float,
        max_queued_bytes: int,
        order: QueueOrder = "short-first",
        ageing: float = 2.0,
    ):
        self.max_in_flight, self.max_queued, self.max_wait_s = max_in_flight, max_queued, max_wait_s
        self.max_queued_bytes, self.order, self.ageing = max_queued_bytes, order, ageing
        self.in_flight = 0  # slots in use
        self.queued = 0  # requests entered that hold no slot (being read, planned, or waiting for slots)
        self.queued_bytes = 0  # their bodies
        self._queue: list[_Waiter] = []  # in the order they joined
        self._joins = itertools.count()

    def enter(self) -> Ticket:
        """A place for a request that just arrived, or Overloaded when the gateway holds all it takes."""
        if self.in_flight + self.queued >= self.max_in_flight + self.max_queued:
            raise Overloaded(f"{self.in_flight} requests in flight and {self.queued} waiting, the most it takes")
        self.queued += 1
        return Ticket()

    def hold(self, ticket: Ticket, size: int) -> None:
        """size more bytes of the request's body, read before it has a slot; Overloaded past max_queued_bytes."""
        if self.queued_bytes + size > self.max_queued_bytes:
            raise Overloaded(f"the requests waiting hold {self.queued_bytes:,} bytes of bodies; this gateway holds "
                             f"at most {self.max_queued_bytes:,}")  # fmt: skip
        ticket.body_bytes += size
        self.queued_bytes += size

    async def run(self, ticket: Ticket, cost: float, count: int = 1) -> float:
        """Waits until count slots are the request's (ordered by `cost` as the order says), or raises Overloaded
        after max_wait_s; returns the seconds it waited. Its body's bytes are counted until it has its slots."""
        if count > self.max_in_flight:
            raise APIError(400, f"n = {count} is more than the {self.max_in_flight} requests this gateway runs at "
                           "once", param="n")  # fmt: skip
        if not self._queue and self.in_flight + count <= self.max_in_flight:
            self._grant(ticket, count)
            return 0.0
        passes = self.max_in_flight + int((self.ageing - 1) * (len(self._queue) + 1))
        waiter = _Waiter(ticket, cost, count, next(self._joins), passes)
        self._queue.append(waiter)
        self._dispatch()  # it may go first, and fit the slots a request needing more leaves free
        if waiter.turn.is_set():
            return 0.0
        joined = time.monotonic()
        try:
            with anyio.move_on_after(self.max_wait_s):
                await waiter.turn.wait()
        except BaseException:  # cancelled (the client went away): a slot given just now is left to leave()
            if not waiter.turn.is_set():
                self._queue.remove(waiter)
                self._dispatch()
            raise
        if not waiter.turn.is_set():
            self._queue.remove(waiter)
            self._dispatch()  # a request needing several slots may have held up others
            raise Overloaded(f"no request slot freed within {self.max_wait_s:g} s")
        return time.monotonic() - joined

    def leave(self, ticket: Ticket) -> None:
        """The request is answered (or refused, or gone): its slots pass to those waiting."""
        self._drop_body(ticket)
        if ticket.slots:
            self.in_flight -= ticket.slots
            ticket.slots = 0
            self._dispatch()
        else:
            self.queued -= 1

    @contextlib.asynccontextmanager
    async def batch_slot(self, share: float) -> AsyncIterator[None]:
        """A slot for a batch line: taken only while no request waits for one and fewer than `share` of the slots
        are in use (looked at again every BATCH_POLL_S), so batch work uses what interactive traffic leaves; given
        back as any slot is (to a waiting request first)."""
        cap = max(1, int(self.max_in_flight * share))
        while self._queue or self.in_flight >= cap:
            await anyio.sleep(BATCH_POLL_S)
        self.in_flight += 1
        try:
            yield
        finally:
            self.in_flight -= 1
            self._dispatch()

    def _grant(self, ticket: Ticket, count: int) -> None:
        self._drop_body(ticket)
        self.queued -= 1
        self.in_flight += count
        ticket.slots = count

    def _drop_body(self, ticket: Ticket) -> None:
        self.queued_bytes -= ticket.body_bytes
        ticket.body_bytes = 0

    def _dispatch(self) -> None:
        """Free slots to the waiting requests, next first, until the next needs more than are free."""
        while self._queue:
            waiter = self._next()
            if self.in_flight + waiter.count > self.max_in_flight:
                return
            self._queue.remove(waiter)
            for other in self._queue:
                if other.joined < waiter.joined:
                    other.passes_left -= 1
            self._grant(waiter.ticket, waiter.count)
            waiter.turn.set()

    def _next(self) -> _Waiter:
        if self.order == "fifo":
            return self._queue[0]
        for waiter in self._queue:
            if waiter.passes_left <= 0:
                return waiter  # passed as often as it may be: next, in the order they joined
        return min(self._queue, key=lambda w: (w.cost, w.joined))


# -- request bodies ---------------------------------------------------------------------------------

_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_DEPTH_CHUNK = 2**20


def json_too_deep(body: bytes, limit: int) -> bool:
    """Whether the JSON text nests arrays and objects more than limit deep, found without parsing it (so a
    body of nested brackets costs a scan, not a recursion): strings are removed, then the brackets left
    are counted, a chunk at a time."""
    if body.count(b"[") + body.count(b"{") <= limit:
        return False  # a chat request's few brackets: no scan needed
    structure = _JSON_STRING.sub(b"", body)
    depth = 0
    for start in range(0, len(structure), _DEPTH_CHUNK):
        chunk = np.frombuffer(structure, np.uint8, count=min(_DEPTH_CHUNK, len(structure) - start), offset=start)
        steps = np.isin(chunk, _OPENING).astype(np.int32) - np.isin(chunk, _CLOSING).astype(np.int32)
        levels = np.cumsum(steps, dtype=np.int64) + depth
        if levels.size and int(levels.max()) > limit:
            return True
        depth = int(levels[-1]) if levels.size else depth
    return False


_OPENING = np.frombuffer(b"[{", np.uint8)
_CLOSING = np.frombuffer(b"]}", np.uint8)

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
RECORD = "qwen3vl_trt.request"  # the scope key of a chat request's RequestRecord
TICKET = "qwen3vl_trt.ticket"  # and of its admission Ticket


class ChatRequestGuard:
    """ASGI middleware in front of the generation endpoints (GENERATION_PATHS): counts the request's outcome, enters
    it (Admission.enter; its Ticket in the scope under TICKET, for the app to ask for slots with), then reads its body
    up to max_request_bytes (refused 413 from Content-Length at once, or as soon as the body read so far passes the
    limit; the bytes held against the admission's bound) and checks its JSON depth, all before the app parses it.
    The ticket's slots are given back when the request is answered."""

    def __init__(self, app: ASGIApp, max_request_bytes: int, admission: Admission, metrics: GatewayMetrics):
        self.app, self.max_request_bytes, self.admission, self.metrics = app, max_request_bytes, admission, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in GENERATION_PATHS or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        record = RequestRecord(started=time.monotonic())
        scope[RECORD] = record

        async def recording_send(message: MutableMapping[str, Any]) -> None:
            if message["type"] == "http.response.start":
                record.status = message["status"]
            await send(message)

        try:
            await self._guarded(scope, receive, recording_send, record)
        finally:
            self.metrics.finish(record, time.monotonic())

    async def _guarded(self, scope: Scope, receive: Receive, send: Send, record: RequestRecord) -> None:
        limit = self.max_request_bytes
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            await self._refuse(scope, receive, send, _too_large(limit), "request_too_large")
            return
        try:
            ticket = self.admission.enter()
        except Overloaded as e:
            await self._refuse(scope, receive, send, at_capacity(e), "overloaded")
            return
        scope[TICKET] = ticket
        try:
            body = await _read_body(receive, limit, lambda size: self.admission.hold(ticket, size))
            if body is None:
                record.outcome = "cancelled"
                return
            if len(body) > limit:
                await self._refuse(scope, receive, send, _too_large(limit), "request_too_large")
                return
            if json_too_deep(body, MAX_JSON_DEPTH):
                error = APIError(400, f"the request's JSON nests more than {MAX_JSON_DEPTH} levels deep")
                await self._refuse(scope, receive, send, error, "json_too_deep")
                return
            await self.app(scope, _replay(body, receive), send)
        except Overloaded as e:
            await self._refuse(scope, receive, send, at_capacity(e), "overloaded")
        finally:
            self.admission.leave(ticket)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, error: APIError, reason: str) -> None:
        self.metrics.refusals.labels(reason).inc()
        # Connection: close, so that the server drops the rest of a body it did not read.
        await error_response(error, {"Connection": "close"})(scope, receive, send)


def at_capacity(error: Overloaded) -> APIError:
    return overloaded(f"the gateway is at capacity: {error}", RETRY_AFTER_S)


async def _read_body(receive: Receive, limit: int, hold: Callable[[int], None]) -> bytes | None:
    """The request's body, or its first bytes past limit; None if the client went away. Each chunk within the limit
    is held (`hold`) as it comes."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        chunks.append(chunk)
        size += len(chunk)
        if size > limit:  # refused as too large (413), not held: no retry would fit it
            return b"".join(chunks)
        hold(len(chunk))
        if not message.get("more_body", False):
            return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """The receive channel with the body already read given back first (then the client's, for disconnects)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replayed() -> MutableMapping[str, Any]:
        return pending.pop() if pending else await receive()

    return replayed


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is over this gateway's limit of {limit:,} bytes", code="request_too_large")


def error_response(error: APIError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(
        error.response().model_dump(), status_code=error.status, headers={**error.headers(), **(headers or {})}
    )
