"""The OpenAI-compatible gateway: `POST /v1/chat/completions` over the deployment's gRPC client API.

    qwen3vl-trt serve --repo DIR --openai-port 9000           # beside tritonserver
    qwen3vl-trt openai --triton-url HOST:8001 --port 9000     # in front of a running deployment

Each request is checked here with the deployment's own preprocessing code from the image headers
alone (no pixel is decoded): bad messages or images, too many images and prompts over the limit are
answered 400 before Triton sees them, and the prompt's token count that `usage` reports is the one
the server runs. Stop strings are matched in the decoded text, as the OpenAI API defines them (the
server also gets them as stop words, so it usually stops by itself); a match, or a client that goes
away mid-stream, cancels the request on the server.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
import urllib.request
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import anyio
import anyio.to_thread
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from ..errors import (
    ImageDecodeError,
    ImageShapeError,
    ImageTooLargeError,
    PromptTooLongError,
    RequestError,
    ServingError,
    TooManyImagesError,
)
from ..limits import EngineLimits
from ..preprocess import Preprocessor
from ..preprocess.prompts import normalize_messages
from . import config as serving_config
from . import interface
from .client import Answer, Client, InferenceError, RequestRejectedError, ServerUnavailableError
from .endpoints import NO_GATEWAY_OPTIONS, GatewayOptions, host_port

MAX_STOP_STRINGS = 4  # as the OpenAI API allows
DEFAULT_PORT = 9000
# Each request in flight waits for its next response on a worker thread (the gRPC client blocks); anyio's
# default of 40 would queue the 41st concurrent stream's tokens behind the others.
WORKER_THREADS = 512


@dataclass(frozen=True)
class GatewaySettings:
    """triton_url: the deployment's gRPC endpoint. model_dir and limits: the checkpoint and engine limits
    the deployment's preprocessing runs with (read from its model config). served_model_name: the
    `model` clients ask for."""

    triton_url: str
    model_dir: Path
    limits: EngineLimits
    served_model_name: str
    allow_remote_images: bool = False
    remote_image_timeout_s: float = 10.0
    request_timeout_s: float = 600.0

    @classmethod
    def from_preprocessing_parameters(
        cls, triton_url: str, parameters: dict[str, str], options: GatewayOptions = NO_GATEWAY_OPTIONS
    ) -> GatewaySettings:
        model_dir = Path(parameters["model_dir"])
        return cls(
            triton_url,
            model_dir,
            EngineLimits(**json.loads(parameters["limits"])),
            options.served_model_name or model_dir.name,
            allow_remote_images=options.allow_remote_images,
        )

    @classmethod
    def from_repository(
        cls, triton_url: str, repo: Path, options: GatewayOptions = NO_GATEWAY_OPTIONS
    ) -> GatewaySettings:
        config = serving_config.read(Path(repo) / interface.PREPROCESSING)
        return cls.from_preprocessing_parameters(triton_url, _string_parameters(config.parameters), options)

    @classmethod
    def from_server(cls, triton_url: str, options: GatewayOptions = NO_GATEWAY_OPTIONS) -> GatewaySettings:
        """Asks the running deployment for its preprocessing model's configuration."""
        client = Client(triton_url)
        try:
            config = client.grpc.get_model_config(interface.PREPROCESSING).config
        except Exception as e:  # tritonclient's own error types
            raise ServerUnavailableError(
                f"cannot read the {interface.PREPROCESSING} model's configuration from {triton_url} ({e}); "
                "start the deployment first, or pass --repo with its model repository"
            ) from e
        finally:
            client.close()
        return cls.from_preprocessing_parameters(triton_url, _string_parameters(config.parameters), options)


def _string_parameters(parameters: Any) -> dict[str, str]:
    return {key: value.string_value for key, value in parameters.items()}


# -- the protocol ---------------------------------------------------------------------------------


class APIError(Exception):
    """An OpenAI-style error response."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    include_usage: bool = False


class ChatCompletionRequest(BaseModel):
    """The chat-completions fields the gateway serves; others that would change the answer are refused
    (see _refuse_unsupported), the rest (user, metadata, ...) are ignored."""

    model_config = ConfigDict(extra="allow")

    model: str
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)  # an extension vLLM and TensorRT-LLM's servers take too
    min_tokens: int | None = Field(None, ge=0)  # idem
    seed: int | None = Field(None, ge=0, lt=2**64)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1


# Fields whose non-default values ask for something the deployment does not do.
_UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "tools": bool,
    "functions": bool,
    "tool_choice": lambda v: v not in (None, "none"),
    "logprobs": bool,
    "top_logprobs": lambda v: v is not None,
    "logit_bias": bool,
    "presence_penalty": lambda v: v not in (None, 0, 0.0),
    "frequency_penalty": lambda v: v not in (None, 0, 0.0),
    "response_format": lambda v: isinstance(v, dict) and v.get("type") not in (None, "text"),
    "audio": lambda v: v is not None,
    "modalities": lambda v: v not in (None, ["text"]),
}


def _refuse_unsupported(body: ChatCompletionRequest) -> None:
    if body.n != 1:
        raise APIError(400, f"n = {body.n} is not supported: this deployment returns one choice per request", param="n")
    extra = body.model_extra or {}
    for name, asks in _UNSUPPORTED.items():
        if name in extra and asks(extra[name]):
            raise APIError(400, f"{name} is not supported by this deployment", param=name, code="unsupported_parameter")


def _stop_strings(stop: str | list[str] | None) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOP_STRINGS or not all(stops):
        raise APIError(400, f"stop takes up to {MAX_STOP_STRINGS} non-empty strings", param="stop")
    return stops


_ERROR_CODES: list[tuple[type[RequestError], str]] = [
    (PromptTooLongError, "context_length_exceeded"),
    (TooManyImagesError, "too_many_images"),
    (ImageTooLargeError, "image_too_large"),
    (ImageDecodeError, "invalid_image"),
    (ImageShapeError, "invalid_image"),
]


def _request_error(error: RequestError) -> APIError:
    code = next((c for kind, c in _ERROR_CODES if isinstance(error, kind)), None)
    return APIError(400, str(error), param="messages", code=code)


class StopFinder:
    """Finds the first stop string in text that arrives in pieces, and holds back the tail that could
    be the start of one, so that no streamed delta ever shows a stop string."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.pending = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """The text that can be sent now; sets `stopped` once a stop string appears (text from it on is dropped)."""
        self.pending += text
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            out, self.pending = self.pending[: min(hits)], ""
            return out
        keep = max((k for s in self.stops for k in range(1, len(s)) if self.pending.endswith(s[:k])), default=0)
        out, self.pending = self.pending[: len(self.pending) - keep], self.pending[len(self.pending) - keep :]
        return out

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


# -- serving --------------------------------------------------------------------------------------


@dataclass
class _Plan:
    """One validated request: what goes to the deployment and what the response reports."""

    id: str
    created: int
    model: str
    chat: list[dict[str, Any]]
    images: list[bytes]
    prompt_tokens: int
    max_tokens: int
    options: dict[str, Any]
    stops: list[str]
    include_usage: bool
    completion_tokens: int = 0
    finish_reason: Literal["stop", "length"] = "stop"
    stop_finder: StopFinder = field(init=False)

    def __post_init__(self) -> None:
        self.stop_finder = StopFinder(self.stops)

    def usage(self) -> dict[str, int]:
        total = self.prompt_tokens + self.completion_tokens
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens, "total_tokens": total}

    def chunk(self, delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
        chunk: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}],
        }
        if self.include_usage:
            chunk["usage"] = None
        return chunk


_END = object()


class Gateway:
    def __init__(self, settings: GatewaySettings):
        self.settings = settings
        self.preprocessor = Preprocessor.from_pretrained(settings.model_dir, limits=settings.limits.request_limits())

    def client(self) -> Client:
        return Client(self.settings.triton_url, timeout_s=self.settings.request_timeout_s)

    async def ready(self) -> bool:
        def probe() -> bool:
            client = self.client()
            try:
                return client.is_ready()
            finally:
                client.close()

        return await anyio.to_thread.run_sync(probe)

    # -- requests ---------------------------------------------------------------------------------

    async def plan(self, body: ChatCompletionRequest) -> _Plan:
        settings = self.settings
        if body.model != settings.served_model_name:
            raise APIError(
                404,
                f"the model {body.model!r} does not exist; this deployment serves {settings.served_model_name!r}",
                param="model",
                code="model_not_found",
            )
        _refuse_unsupported(body)
        stops = _stop_strings(body.stop)
        messages = await self._fetch_remote_images(body.messages)
        try:
            chat, images = normalize_messages(messages, settings.limits.request_limits().max_image_bytes)
            prompt_tokens = await anyio.to_thread.run_sync(self._count_tokens, chat, images)
        except RequestError as e:
            raise _request_error(e) from None
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
            prompt_tokens=prompt_tokens,
            max_tokens=asked or room,
            options=options,
            stops=stops,
            include_usage=bool(body.stream_options and body.stream_options.include_usage),
        )

    def _count_tokens(self, chat: list[dict[str, Any]], images: list[bytes]) -> int:
        pending = iter(images)
        filled = [
            {**m, "content": [{**p, "image": next(pending)} if p["type"] == "image" else p for p in m["content"]]}
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
                url = _remote_image_url(part)
                parts.append({"type": "image", "image": await self._download(url)} if url else part)
            fetched.append({**message, "content": parts})
        return fetched

    async def _download(self, url: str) -> bytes:
        limit = self.settings.limits.request_limits().max_image_bytes

        def get() -> bytes:
            with urllib.request.urlopen(url, timeout=self.settings.remote_image_timeout_s) as response:
                data = response.read(limit + 1)
            if len(data) > limit:
                raise APIError(
                    400, f"the image at {url} is over {limit:,} bytes", param="messages", code="image_too_large"
                )
            return data

        try:
            return await anyio.to_thread.run_sync(get)
        except OSError as e:
            raise APIError(400, f"cannot fetch the image at {url}: {e}", param="messages", code="invalid_image") from e

    # -- generation -------------------------------------------------------------------------------

    async def _pieces(self, plan: _Plan) -> AsyncGenerator[Answer, None]:
        """The deployment's responses for one request; leaving early (stop string, disconnect) cancels it."""
        client = self.client()
        try:
            generation = await anyio.to_thread.run_sync(
                lambda: client.stream(
                    "",
                    plan.images,
                    plan.max_tokens,
                    request_id=plan.id,
                    stream=True,
                    messages=plan.chat,
                    **plan.options,
                )
            )
        except InferenceError as e:
            client.close()
            raise await self._inference_error(e) from None
        responses = iter(generation)
        try:
            while True:
                try:
                    piece = await anyio.to_thread.run_sync(next, responses, _END, abandon_on_cancel=True)
                except InferenceError as e:
                    raise await self._inference_error(e) from None
                if not isinstance(piece, Answer):  # _END
                    return
                yield piece
        finally:
            with anyio.CancelScope(shield=True):  # also when the client went away and this task is cancelled
                await anyio.to_thread.run_sync(generation.cancel)
            client.close()

    async def _inference_error(self, error: InferenceError) -> APIError:
        if isinstance(error, RequestRejectedError):
            return APIError(400, str(error), param="messages")
        if isinstance(error, ServerUnavailableError) or not await self.ready():
            return APIError(503, f"the deployment is not ready: {error}", type="server_error", code="unavailable")
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
            await pieces.aclose()

    async def complete(self, plan: _Plan) -> dict[str, Any]:
        text = "".join([t async for t in self._texts(plan)])
        return {
            "id": plan.id,
            "object": "chat.completion",
            "created": plan.created,
            "model": plan.model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": None,
                    "finish_reason": plan.finish_reason,
                }
            ],
            "usage": plan.usage(),
        }

    async def stream(self, plan: _Plan) -> StreamingResponse:
        texts = self._texts(plan)
        # The first delta comes before the response starts, so a request the deployment refuses still
        # gets its HTTP error status.
        try:
            first: str | None = await texts.__anext__()
        except StopAsyncIteration:
            first = None
        except BaseException:
            await texts.aclose()
            raise

        async def events() -> AsyncIterator[str]:
            try:
                yield _event(plan.chunk({"role": "assistant", "content": ""}))
                if first is not None:
                    yield _event(plan.chunk({"content": first}))
                    async for text in texts:
                        yield _event(plan.chunk({"content": text}))
                yield _event(plan.chunk({}, plan.finish_reason))
                if plan.include_usage:
                    yield _event({**plan.chunk({}), "choices": [], "usage": plan.usage()})
            except APIError as e:
                yield _event(e.body())
            finally:
                await texts.aclose()
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def _remote_image_url(part: Any) -> str | None:
    if not isinstance(part, dict) or part.get("type") != "image_url":
        return None
    url = part.get("image_url")
    url = url.get("url") if isinstance(url, dict) else url
    return url if isinstance(url, str) and url.startswith(("http://", "https://")) else None


def _event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def create_app(settings: GatewaySettings) -> FastAPI:
    gateway = Gateway(settings)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        anyio.to_thread.current_default_thread_limiter().total_tokens = WORKER_THREADS
        yield

    app = FastAPI(
        title="qwen3vl-trt", summary="OpenAI-compatible chat completions over a Triton deployment", lifespan=lifespan
    )

    @app.exception_handler(APIError)
    async def api_error(_request: Request, error: APIError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_request: Request, error: RequestValidationError) -> JSONResponse:
        problems = error.errors()
        first = problems[0] if problems else {}
        location = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
        message = "; ".join(f"{'.'.join(str(p) for p in e['loc'] if p != 'body')}: {e['msg']}" for e in problems)
        return JSONResponse(APIError(400, message or "invalid request body", param=location).body(), status_code=400)

    @app.get("/health")
    async def health() -> JSONResponse:
        if await gateway.ready():
            return JSONResponse({"status": "ready"})
        return JSONResponse({"status": "not ready", "triton_url": settings.triton_url}, status_code=503)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        model = {"id": settings.served_model_name, "object": "model", "created": 0, "owned_by": "qwen3vl-trt"}
        return {"object": "list", "data": [model]}

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatCompletionRequest) -> dict[str, Any] | StreamingResponse:
        plan = await gateway.plan(body)
        if body.stream:
            return await gateway.stream(plan)
        return await gateway.complete(plan)

    app.state.gateway = gateway
    return app


class GatewayServer:
    """uvicorn serving the gateway app, in the foreground (run) or on a thread beside tritonserver."""

    def __init__(self, settings: GatewaySettings, host: str = "127.0.0.1", port: int = DEFAULT_PORT):
        import uvicorn

        self.url = f"http://{host_port(host, port)}"
        config = uvicorn.Config(create_app(settings), host=host, port=port, log_level="warning", access_log=False)
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
            self._thread.join(timeout=30)


def run_openai(
    triton_url: str, repo: Path | None, options: GatewayOptions, address: str = "127.0.0.1", port: int = DEFAULT_PORT
) -> int:
    """`qwen3vl-trt openai`: the gateway alone, in front of a running deployment (its settings read from the
    repository when given, else asked of the server)."""
    if repo is not None:
        settings = GatewaySettings.from_repository(triton_url, repo, options)
    else:
        settings = GatewaySettings.from_server(triton_url, options)
    server = GatewayServer(settings, address, port)
    print(f"OpenAI gateway on {server.url}/v1 (model {settings.served_model_name!r}) -> {triton_url}", flush=True)
    server.run()
    return 0
