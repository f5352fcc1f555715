"""The OpenAI-compatible gateway: `POST /v1/chat/completions` over the deployment's gRPC client API.

    qwen3vl-trt serve --repo DIR --openai-port 9000           # beside tritonserver
    qwen3vl-trt openai --triton-url HOST:8001 --port 9000     # in front of a running deployment

Each request is checked here with the deployment's own preprocessing code from the image headers
alone (no pixel is decoded): bad messages or images, too many images and prompts over the limit are
answered 400 before Triton sees them, and the prompt's token count that `usage` reports is the one
the server runs. Stop strings are matched in the decoded text, as the OpenAI API defines them (the
server also gets them as stop words, so it usually stops by itself); a match, a client that goes
away mid-stream, or the request's deadline cancels the request on the server.

It runs on one event loop with one gRPC channel to each Triton replica (fleet.Fleet: one replica, or a fleet that
a name or a list gives, balanced round robin with failed requests retried elsewhere), which every request and health
probe shares. Requests are admitted up to a concurrency limit, a bounded queue waits behind it, and the
rest are refused at once (429 with Retry-After); request bodies are bounded in size and JSON depth before
they are parsed. GET /metrics serves Prometheus metrics (gateway_metrics).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import re
import threading
import time
import urllib.request
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ...errors import PromptTooLongError, RequestError, ServingError
from ...limits import EngineLimits
from ...preprocess import Preprocessor
from ...preprocess.prompts import normalize_messages
from .. import interface
from ..client import Answer, Client, InferenceError, RequestRejectedError, ServerBusyError, ServerUnavailableError
from ..ports import DEFAULT_TRITON_REFRESH_S, NO_GATEWAY_OPTIONS, GatewayOptions, host_port
from ..repository import model_config as serving_config
from .fleet import Fleet, FleetTarget
from .metrics import CONTENT_TYPE, GatewayMetrics, RequestRecord
from .protocol import (
    APIError,
    AssistantMessage,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Choice,
    ChunkChoice,
    Delta,
    FinishReason,
    Model,
    ModelList,
    StopFinder,
    Usage,
    overloaded,
    refuse_unsupported,
    request_error,
    stop_strings,
)

DEFAULT_PORT = 9000
CHAT_PATH = "/v1/chat/completions"
# A chat request nests about 5 deep (body, messages, message, content, part, image_url); nothing needs 32.
MAX_JSON_DEPTH = 32
# Besides its images, a request's body holds text, which the prompt's token limit bounds far below this.
BODY_SLACK_BYTES = 4 * 2**20
# The default body cap at most: several camera photos as base64 data URLs fit (a 12 MP JPEG is ~5 MB, ~7 MB
# as base64); the limits' worst case (max_images images of max_image_bytes each) is over a gigabyte, and
# parsing a body takes several times its size in memory. --max-request-bytes raises it.
DEFAULT_MAX_REQUEST_BYTES = 32 * 2**20
RETRY_AFTER_S = 1  # a refusal under load: the next slot frees within about a request's time
RETRY_UNAVAILABLE_S = 5  # the deployment is down or starting
# Connections uvicorn accepts beyond the admitted and queued requests (health probes, scrapes, and the
# requests it refuses itself with 429) before it answers 503 on its own (uvicorn's limit_concurrency).
CONNECTION_HEADROOM = 1024
GRACEFUL_SHUTDOWN_S = 10  # on SIGTERM, streams still open after this are cut (uvicorn's timeout_graceful_shutdown)


@dataclass(frozen=True)
class GatewaySettings:
    """triton_url: the deployment's gRPC endpoints (one, or a fleet of replicas: see fleet.FleetTarget), names
    among them resolved again every triton_refresh_s. model_dir and limits: the checkpoint and engine limits
    the deployment's preprocessing runs with (read from its model config). served_model_name: the
    `model` clients ask for. The rest as GatewayOptions describes them, resolved (see resolve)."""

    triton_url: str
    model_dir: Path
    limits: EngineLimits
    served_model_name: str
    allow_remote_images: bool = False
    remote_image_timeout_s: float = 10.0
    request_timeout_s: float = 600.0
    max_concurrent_requests: int = 16
    max_queued_requests: int = 32
    max_queue_wait_s: float = 30.0
    max_request_bytes: int = 64 * 2**20
    triton_refresh_s: float = DEFAULT_TRITON_REFRESH_S

    @classmethod
    def resolve(
        cls, triton_url: str, model_dir: Path, limits: EngineLimits, options: GatewayOptions = NO_GATEWAY_OPTIONS
    ) -> GatewaySettings:
        """Options as given, else defaults from the limits: twice max_batch_size in flight (one batch
        generating, the next being preprocessed), four times that queued; bodies up to max_images images
        of max_image_bytes each as base64, plus slack, and at most DEFAULT_MAX_REQUEST_BYTES."""
        images = limits.request_limits()
        base64_image = 4 * -(-images.max_image_bytes // 3)
        return cls(
            triton_url,
            model_dir,
            limits,
            options.served_model_name or model_dir.name,
            allow_remote_images=options.allow_remote_images,
            request_timeout_s=_given(options.request_timeout_s, cls.request_timeout_s),
            max_concurrent_requests=_given(options.max_concurrent_requests, 2 * limits.max_batch_size),
            max_queued_requests=_given(options.max_queued_requests, 8 * limits.max_batch_size),
            max_queue_wait_s=_given(options.max_queue_wait_s, cls.max_queue_wait_s),
            max_request_bytes=_given(
                options.max_request_bytes,
                min(images.max_images * base64_image + BODY_SLACK_BYTES, DEFAULT_MAX_REQUEST_BYTES),
            ),
        )

    @classmethod
    def from_preprocessing_parameters(
        cls, triton_url: str, parameters: dict[str, str], options: GatewayOptions = NO_GATEWAY_OPTIONS
    ) -> GatewaySettings:
        limits = EngineLimits(**json.loads(parameters["limits"]))
        return cls.resolve(triton_url, Path(parameters["model_dir"]), limits, options)

    @classmethod
    def from_repository(
        cls, triton_url: str, repo: Path, options: GatewayOptions = NO_GATEWAY_OPTIONS
    ) -> GatewaySettings:
        config = serving_config.read(Path(repo) / interface.PREPROCESSING)
        return cls.from_preprocessing_parameters(triton_url, _string_parameters(config.parameters), options)

    @classmethod
    def from_server(
        cls, triton_url: str, options: GatewayOptions = NO_GATEWAY_OPTIONS, wait_s: float = 0.0
    ) -> GatewaySettings:
        """Asks a replica for its preprocessing model's configuration (once, before serving), waiting up to
        wait_s for one to answer (replicas load their engines for minutes)."""
        target = FleetTarget.parse(triton_url)
        deadline = time.monotonic() + wait_s
        waiting = False
        while True:
            problems = []
            try:
                addresses = target.resolve()
            except Exception as e:  # socket.gaierror, dnspython's errors
                addresses, problems = [], [f"cannot resolve: {e}"]
            for address in addresses:
                client = Client(address)
                try:
                    config = client.grpc.get_model_config(interface.PREPROCESSING, client_timeout=10.0).config
                except Exception as e:  # tritonclient's own error types
                    problems.append(f"{address}: {e}")
                    continue
                finally:
                    client.close()
                return cls.from_preprocessing_parameters(triton_url, _string_parameters(config.parameters), options)
            if time.monotonic() >= deadline:
                raise ServerUnavailableError(
                    f"cannot read the {interface.PREPROCESSING} model's configuration from {triton_url} "
                    f"({'; '.join(problems) or 'no address resolved'}); start the deployment first, or pass --repo "
                    "with its model repository"
                )
            if not waiting:
                print(f"waiting up to {wait_s:g} s for a replica of {triton_url} to answer", flush=True)
                waiting = True
            time.sleep(1.0)


def _given(value: Any, default: Any) -> Any:
    return default if value is None else value


def _string_parameters(parameters: Any) -> dict[str, str]:
    return {key: value.string_value for key, value in parameters.items()}


# -- admission --------------------------------------------------------------------------------------


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
        if self.in_flight < self.max_in_flight and not self._waiting:
            self.in_flight += 1
        elif len(self._waiting) >= self.max_queued:
            raise Overloaded(f"{self.in_flight} requests in flight and {self.queued} waiting, the most it takes")
        else:
            await self._wait()
        try:
            yield
        finally:
            self._release()

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
    """ASGI middleware in front of the chat endpoint: counts the request's outcome, admits it (Admission),
    then reads its body up to max_request_bytes (refused 413 from Content-Length at once, or as soon as
    the body read so far passes the limit) and checks its JSON depth, all before the app parses it."""

    def __init__(self, app: ASGIApp, settings: GatewaySettings, admission: Admission, metrics: GatewayMetrics):
        self.app, self.settings, self.admission, self.metrics = app, settings, admission, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] != CHAT_PATH or scope["method"] != "POST":
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
        limit = self.settings.max_request_bytes
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
        await _error_response(error, {"Connection": "close"})(scope, receive, send)


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


def _error_response(error: APIError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(
        error.response().model_dump(), status_code=error.status, headers={**error.headers(), **(headers or {})}
    )


# -- serving ----------------------------------------------------------------------------------------


@dataclass
class _Plan:
    """One validated request: what goes to the deployment and what the response reports."""

    id: str
    created: int
    model: str
    chat: list[dict[str, Any]]
    images: list[bytes]
    videos: list[Any]  # encoded bytes (the gateway takes no DecodedVideo)
    prompt_tokens: int
    max_tokens: int
    options: dict[str, Any]
    stops: list[str]
    include_usage: bool
    deadline: float  # time.monotonic() by which the request ends
    # Whether Triton sends the tokens as they come: for a streamed answer, and for stop strings (matched here in
    # the text as it comes, so the request is cancelled at the match); else one response, which spares a
    # postprocessing request per token (about 1.5 ms each on the CPU target).
    piecewise: bool = True
    completion_tokens: int = 0
    finish_reason: FinishReason = "stop"
    stop_finder: StopFinder = field(init=False)

    def __post_init__(self) -> None:
        self.stop_finder = StopFinder(self.stops)

    def usage(self) -> Usage:
        total = self.prompt_tokens + self.completion_tokens
        return Usage(prompt_tokens=self.prompt_tokens, completion_tokens=self.completion_tokens, total_tokens=total)

    def chunk(self, delta: Delta, finish_reason: FinishReason | None = None) -> str:
        chunk = ChatCompletionChunk(
            id=self.id,
            created=self.created,
            model=self.model,
            choices=[ChunkChoice(delta=delta, finish_reason=finish_reason)],
        )
        return _event(chunk.model_dump_json(exclude=None if self.include_usage else {"usage"}, exclude_none=False))


class Gateway:
    def __init__(self, settings: GatewaySettings, metrics: GatewayMetrics):
        self.settings = settings
        self.metrics = metrics
        self.preprocessor = Preprocessor.from_pretrained(settings.model_dir, limits=settings.limits.request_limits())
        # A byte-level BPE token covers at most its longest vocabulary entry's bytes, so text longer than
        # this cannot fit the prompt limit: refused before tokenizing it (the tokenizer's memory grows with
        # the text, gigabytes for tens of megabytes).
        vocabulary = self.preprocessor.prompts.tokenizer.get_vocab()
        self.max_prompt_chars = settings.limits.max_input_len * max(map(len, vocabulary))
        self._client: Fleet | None = None

    @property
    def client(self) -> Fleet:
        if self._client is None:
            raise ServingError("the gateway is not started")
        return self._client

    async def start(self) -> None:
        """Opens the channels to the replicas (on the serving event loop, which grpc.aio binds them to)."""
        settings = self.settings
        target = FleetTarget.parse(settings.triton_url)
        self._client = Fleet(target, refresh_s=settings.triton_refresh_s, metrics=self.metrics)
        await self._client.start()

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()

    async def ready(self) -> bool:
        return await self.client.is_ready()

    # -- requests ---------------------------------------------------------------------------------

    async def plan(self, body: ChatCompletionRequest, started: float) -> _Plan:
        settings = self.settings
        if body.model != settings.served_model_name:
            raise APIError(
                404,
                f"the model {body.model!r} does not exist; this deployment serves {settings.served_model_name!r}",
                param="model",
                code="model_not_found",
            )
        refuse_unsupported(body)
        stops = stop_strings(body.stop)
        messages = await self._fetch_remote_images(body.messages)
        try:
            limits = settings.limits.request_limits()
            chat, images, videos = normalize_messages(messages, limits.max_image_bytes, limits.max_video_bytes)
            if _text_chars(chat) > self.max_prompt_chars:
                raise PromptTooLongError(
                    f"the messages hold over {self.max_prompt_chars:,} characters of text, more than a prompt of "
                    f"{settings.limits.max_input_len} tokens can; the limit is {settings.limits.max_input_len} tokens"
                )
            # On a worker thread: tens of milliseconds for a long prompt would stall every stream on the loop.
            prompt_tokens = await anyio.to_thread.run_sync(self._count_tokens, chat, images, videos)
        except RequestError as e:
            raise request_error(e) from None
        room = settings.limits.max_seq_len - prompt_tokens
        asked = body.max_completion_tokens or body.max_tokens
        if asked is not None and asked > room:
            raise APIError(
                400,
                f"this deployment's maximum context length is {settings.limits.max_seq_len} tokens; the messages take "
                f"{prompt_tokens} and {asked} were asked for the completion (at most {room})",
                param="max_completion_tokens" if body.max_completion_tokens else "max_tokens",
                code="context_length_exceeded",
            )
        options = {
            "temperature": body.temperature,
            "top_p": body.top_p,
            "top_k": body.top_k,
            "seed": body.seed,
            "min_tokens": body.min_tokens,
            "stop_words": stops,
        }
        return _Plan(
            id=f"chatcmpl-{uuid.uuid4().hex}",
            created=int(time.time()),
            model=settings.served_model_name,
            chat=chat,
            images=images,
            videos=videos,
            prompt_tokens=prompt_tokens,
            max_tokens=asked or room,
            options=options,
            stops=stops,
            include_usage=bool(body.stream_options and body.stream_options.include_usage),
            deadline=started + settings.request_timeout_s,
            piecewise=body.stream or bool(stops),
        )

    def _count_tokens(self, chat: list[dict[str, Any]], images: list[bytes], videos: list[Any]) -> int:
        pending = {"image": iter(images), "video": iter(videos)}
        filled = [
            {
                **m,
                "content": [
                    {**p, p["type"]: next(pending[p["type"]])} if p["type"] in pending else p for p in m["content"]
                ],
            }
            if isinstance(m.get("content"), list)
            else m
            for m in chat
        ]
        return self.preprocessor.count_tokens(filled)

    async def _fetch_remote_images(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Messages whose http(s) image URLs are replaced by the downloaded bytes, when the gateway allows it
        (preprocessing refuses URLs it would have to fetch)."""
        if not self.settings.allow_remote_images:
            return messages
        fetched = []
        for message in messages:
            content = message.get("content")
            if not isinstance(content, list):
                fetched.append(message)
                continue
            parts = []
            for part in content:
                kind, url = _remote_url(part)
                parts.append({"type": kind, kind: await self._download(url, kind)} if url else part)
            fetched.append({**message, "content": parts})
        return fetched

    async def _download(self, url: str, kind: str) -> bytes:
        limits = self.settings.limits.request_limits()
        limit = limits.max_image_bytes if kind == "image" else limits.max_video_bytes

        def get() -> bytes:
            with urllib.request.urlopen(url, timeout=self.settings.remote_image_timeout_s) as response:
                data = response.read(limit + 1)
            if len(data) > limit:
                raise APIError(
                    400, f"the {kind} at {url} is over {limit:,} bytes", param="messages", code=f"{kind}_too_large"
                )
            return data

        try:
            # urllib blocks; only gateways that allow remote images get here, and anyio's pool bounds the threads.
            return await anyio.to_thread.run_sync(get)
        except OSError as e:
            raise APIError(
                400, f"cannot fetch the {kind} at {url}: {e}", param="messages", code=f"invalid_{kind}"
            ) from e

    # -- generation -------------------------------------------------------------------------------

    async def _pieces(self, plan: _Plan) -> AsyncGenerator[Answer, None]:
        """The deployment's responses for one request, until its deadline; leaving early (stop string,
        disconnect, deadline) cancels it on the server."""
        self.metrics.prompt_tokens.inc(plan.prompt_tokens)
        responses = self.client.stream(
            "",
            plan.images,
            plan.max_tokens,
            request_id=plan.id,
            stream=plan.piecewise,
            messages=plan.chat,
            videos=plan.videos,
            **plan.options,
        )
        try:
            while True:
                try:
                    with anyio.fail_after(max(0.0, plan.deadline - time.monotonic())):
                        piece = await responses.__anext__()
                except StopAsyncIteration:
                    return
                except TimeoutError:
                    raise APIError(
                        504,
                        f"the request did not finish within this gateway's {self.settings.request_timeout_s:g} s "
                        "limit; it was cancelled on the server",
                        type="server_error",
                        code="timeout",
                    ) from None
                except InferenceError as e:
                    raise await self._inference_error(e) from None
                yield piece
        finally:
            await responses.aclose()  # cancels the request on the server unless it finished

    async def _inference_error(self, error: InferenceError) -> APIError:
        if isinstance(error, RequestRejectedError):
            return APIError(400, str(error), param="messages")
        if isinstance(error, ServerBusyError):
            self.metrics.refusals.labels("server_busy").inc()
            return overloaded(f"the deployment is at capacity: {error}", RETRY_AFTER_S, status=503)
        if isinstance(error, ServerUnavailableError) or not await self.ready():
            self.metrics.refusals.labels("server_unavailable").inc()
            return APIError(503, f"the deployment is not ready: {error}", type="server_error", code="unavailable",
                            retry_after_s=RETRY_UNAVAILABLE_S)  # fmt: skip
        return APIError(500, str(error), type="server_error")

    async def _texts(self, plan: _Plan) -> AsyncGenerator[str, None]:
        """The completion's text in deltas, stop strings applied; counts its tokens into plan."""
        pieces = self._pieces(plan)
        try:
            async for piece in pieces:
                plan.completion_tokens += len(piece.token_ids)
                text = plan.stop_finder.feed(piece.text)
                if text:
                    yield text
                if plan.stop_finder.stopped:
                    return
            tail = plan.stop_finder.flush()
            if tail:
                yield tail
            if plan.completion_tokens >= plan.max_tokens:
                plan.finish_reason = "length"
        finally:
            with anyio.CancelScope(shield=True):  # also when the client went away and this task is cancelled
                await pieces.aclose()
            self.metrics.completion_tokens.inc(plan.completion_tokens)

    async def complete(self, plan: _Plan) -> ChatCompletion:
        text = "".join([t async for t in self._texts(plan)])
        return ChatCompletion(
            id=plan.id,
            created=plan.created,
            model=plan.model,
            choices=[Choice(message=AssistantMessage(content=text), finish_reason=plan.finish_reason)],
            usage=plan.usage(),
        )

    async def stream(self, plan: _Plan, record: RequestRecord) -> StreamingResponse:
        texts = self._texts(plan)
        # The first delta comes before the response starts, so a request the deployment refuses still
        # gets its HTTP error status.
        try:
            first: str | None = await texts.__anext__()
        except StopAsyncIteration:
            first = None
        except BaseException:
            with anyio.CancelScope(shield=True):
                await texts.aclose()
            raise
        metrics = self.metrics

        async def events() -> AsyncIterator[str]:
            last = time.monotonic()
            record.outcome = "cancelled"  # until it ends otherwise
            try:
                yield plan.chunk(Delta(role="assistant", content=""))
                if first is not None:
                    metrics.time_to_first_token.observe(last - record.started)
                    yield plan.chunk(Delta(content=first))
                    async for text in texts:
                        now = time.monotonic()
                        metrics.inter_token_latency.observe(now - last)
                        last = now
                        yield plan.chunk(Delta(content=text))
                yield plan.chunk(Delta(), plan.finish_reason)
                if plan.include_usage:
                    usage = ChatCompletionChunk(id=plan.id, created=plan.created, model=plan.model, choices=[],
                                                usage=plan.usage())  # fmt: skip
                    yield _event(usage.model_dump_json())
                record.outcome = "completed"
            except APIError as e:
                record.outcome = "timed_out" if e.status == 504 else "failed"
                yield _event(e.response().model_dump_json())
            finally:
                with anyio.CancelScope(shield=True):
                    await texts.aclose()
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def _text_chars(value: Any) -> int:
    """Characters in the strings among the values (not the keys) of a JSON-like value; its depth is bounded
    (MAX_JSON_DEPTH) before it gets here."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(_text_chars(v) for v in value.values())
    if isinstance(value, list):
        return sum(_text_chars(v) for v in value)
    return 0


def _remote_url(part: Any) -> tuple[str, str | None]:
    """("image" or "video", the http(s) URL of an image_url or video_url part, or None)."""
    if not isinstance(part, dict) or part.get("type") not in ("image_url", "video_url"):
        return "", None
    kind = part["type"].removesuffix("_url")
    url = part.get(f"{kind}_url")
    url = url.get("url") if isinstance(url, dict) else url
    return kind, url if isinstance(url, str) and url.startswith(("http://", "https://")) else None


def _event(payload: str) -> str:
    return f"data: {payload}\n\n"


def create_app(settings: GatewaySettings) -> FastAPI:
    metrics = GatewayMetrics()
    gateway = Gateway(settings, metrics)
    admission = Admission(settings.max_concurrent_requests, settings.max_queued_requests, settings.max_queue_wait_s)
    metrics.watch(lambda: admission.in_flight, lambda: admission.queued)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        await gateway.start()
        try:
            yield
        finally:
            await gateway.close()

    app = FastAPI(
        title="qwen3vl-trt", summary="OpenAI-compatible chat completions over a Triton deployment", lifespan=lifespan
    )
    app.add_middleware(ChatRequestGuard, settings=settings, admission=admission, metrics=metrics)

    @app.exception_handler(APIError)
    async def api_error(_request: Request, error: APIError) -> JSONResponse:
        return _error_response(error)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_request: Request, error: RequestValidationError) -> JSONResponse:
        problems = error.errors()
        first = problems[0] if problems else {}
        location = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
        message = "; ".join(f"{'.'.join(str(p) for p in e['loc'] if p != 'body')}: {e['msg']}" for e in problems)
        return _error_response(APIError(400, message or "invalid request body", param=location))

    @app.get("/health")
    async def health() -> JSONResponse:
        if await gateway.ready():
            return JSONResponse({"status": "ready"})
        return JSONResponse({"status": "not ready", "triton_url": settings.triton_url}, status_code=503)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[Model(id=settings.served_model_name, owned_by="qwen3vl-trt")])

    @app.post(CHAT_PATH, response_model=None)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        record: RequestRecord = request.scope[RECORD]
        plan = await gateway.plan(body, record.started)
        if body.stream:
            return await gateway.stream(plan, record)
        # Serialized by pydantic directly (FastAPI's jsonable_encoder walks the model in Python first).
        return Response((await gateway.complete(plan)).model_dump_json(), media_type="application/json")

    app.state.gateway = gateway
    app.state.metrics = metrics
    return app


class GatewayServer:
    """uvicorn serving the gateway app, in the foreground (run) or on a thread beside tritonserver."""

    def __init__(self, settings: GatewaySettings, host: str = "127.0.0.1", port: int = DEFAULT_PORT):
        import uvicorn

        self.url = f"http://{host_port(host, port)}"
        config = uvicorn.Config(
            create_app(settings),
            host=host,
            port=port,
            log_level="warning",
            access_log=False,
            limit_concurrency=settings.max_concurrent_requests + settings.max_queued_requests + CONNECTION_HEADROOM,
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        )
        self.server = uvicorn.Server(config)
        self._thread: threading.Thread | None = None

    def run(self) -> None:
        self.server.run()

    def start(self, timeout_s: float = 30.0) -> None:
        self._thread = threading.Thread(target=self.server.run, name="openai-gateway", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise ServingError(f"the OpenAI gateway did not start on {self.url} (port taken?)")
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=GRACEFUL_SHUTDOWN_S + 20)


def run_openai(
    triton_url: str,
    repo: Path | None,
    options: GatewayOptions,
    address: str = "127.0.0.1",
    port: int = DEFAULT_PORT,
    refresh_s: float = DEFAULT_TRITON_REFRESH_S,
    wait_s: float = 0.0,
) -> int:
    """`qwen3vl-trt openai`: the gateway alone, in front of a running deployment or a fleet of replicas (its
    settings read from the repository when given, else asked of a replica, waiting up to wait_s for one).
    SIGINT or SIGTERM stops it within GRACEFUL_SHUTDOWN_S (uvicorn handles both)."""
    if repo is not None:
        settings = GatewaySettings.from_repository(triton_url, repo, options)
    else:
        settings = GatewaySettings.from_server(triton_url, options, wait_s)
    settings = dataclasses.replace(settings, triton_refresh_s=refresh_s)
    server = GatewayServer(settings, address, port)
    print(f"OpenAI gateway on {server.url}/v1 (model {settings.served_model_name!r}) -> {triton_url}", flush=True)
    server.run()
    return 0
