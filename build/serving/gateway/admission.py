"""What the gateway lets in, before the app parses a request: Admission (a concurrency limit and a bounded, timed
queue behind it, the rest refused at once with 429 and Retry-After) and ChatRequestGuard, the ASGI middleware in
front of the chat endpoint that admits each request and bounds its body's size and JSON depth."""

from __future__ import annotations

import collections
import contextlib
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from typing import Any

import anyio
import numpy as np
from fastapi.responses import JSONResponse

from .metrics import GatewayMetrics, RequestRecord
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


class Admission:
    """At most max_in_flight requests at once; up to max_queued more wait, first come first served, at most
    max_wait_s each; beyond that, requests are refused at once (Overloaded)."""

    def __init__(self, max_in_flight: int, max_queued: int, max_wait_s: float):
        self.max_in_flight, self.max_queued, self.max_wait_s = max_in_flight, max_queued, max_wait_s
        self.in_flight = 0
        self._waiting: collections.deque[anyio.Event] = collections.deque()

    @property
    def queued(self) -> int:
        return len(self._waiting)

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        await self._acquire()
        try:
            yield
        finally:
            self._release()

    @contextlib.asynccontextmanager
    async def batch_slot(self, share: float) -> AsyncIterator[None]:
        """A slot for a batch line: taken only while no request waits and fewer than `share` of the slots are in use
        (looked at again every BATCH_POLL_S), so batch work uses what interactive traffic leaves; given back as any
        slot is (to a waiting request first)."""
        cap = max(1, int(self.max_in_flight * share))
        while self._waiting or self.in_flight >= cap:
            await anyio.sleep(BATCH_POLL_S)
        self.in_flight += 1
        try:
            yield
        finally:
            self._release()

    async def take(self, count: int) -> None:
        """count more slots for a request that holds one already (each of its n choices is a request on the
        deployment), taken as any request's; give them back with give_back."""
        if count >= self.max_in_flight:
            raise APIError(400, f"n = {count + 1} is more than the {self.max_in_flight} requests this gateway runs at "
                           "once", param="n")  # fmt: skip
        taken = 0
        try:
            for _ in range(count):
                await self._acquire()
                taken += 1
        except BaseException:
            self.give_back(taken)
            raise

    def give_back(self, count: int) -> None:
        for _ in range(count):
            self._release()

    async def _acquire(self) -> None:
        if self.in_flight < self.max_in_flight and not self._waiting:
            self.in_flight += 1
        elif len(self._waiting) >= self.max_queued:
            raise Overloaded(f"{self.in_flight} requests in flight and {self.queued} waiting, the most it takes")
        else:
            await self._wait()

    async def _wait(self) -> None:
        """Returns holding a slot that a finishing request passed on (_release), or raises Overloaded."""
        turn = anyio.Event()
        self._waiting.append(turn)
        try:
            with anyio.move_on_after(self.max_wait_s):
                await turn.wait()
        except BaseException:  # cancelled: the client went away
            if turn.is_set():
                self._release()  # the slot came just as it left: pass it on
            else:
                self._waiting.remove(turn)
            raise
        if not turn.is_set():
            self._waiting.remove(turn)
            raise Overloaded(f"no request slot freed within {self.max_wait_s:g} s")

    def _release(self) -> None:
        if self._waiting:  # the slot passes to the first waiter: in_flight stays
            self._waiting.popleft().set()
        else:
            self.in_flight -= 1


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


class ChatRequestGuard:
    """ASGI middleware in front of the generation endpoints (GENERATION_PATHS): counts the request's outcome, admits
    it (Admission), then reads its body up to max_request_bytes (refused 413 from Content-Length at once, or as soon
    as the body read so far passes the limit) and checks its JSON depth, all before the app parses it. Slots the app
    took for the request's further choices (RequestRecord.extra_slots) are given back when it is answered."""

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
            self.admission.give_back(record.extra_slots)
            self.metrics.finish(record, time.monotonic())

    async def _guarded(self, scope: Scope, receive: Receive, send: Send, record: RequestRecord) -> None:
        limit = self.max_request_bytes
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            await self._refuse(scope, receive, send, _too_large(limit), "request_too_large")
            return
        try:
            async with self.admission.slot():
                body = await _read_body(receive, limit)
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
            await self._refuse(scope, receive, send, overloaded(f"the gateway is at capacity: {e}", RETRY_AFTER_S),
                               "overloaded")  # fmt: skip

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, error: APIError, reason: str) -> None:
        self.metrics.refusals.labels(reason).inc()
        # Connection: close, so that the server drops the rest of a body it did not read.
        await error_response(error, {"Connection": "close"})(scope, receive, send)


async def _read_body(receive: Receive, limit: int) -> bytes | None:
    """The request's body, or its first bytes past limit; None if the client went away."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        chunks.append(chunk)
        size += len(chunk)
        if size > limit or not message.get("more_body", False):
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
