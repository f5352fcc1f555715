"""The OpenAI-compatible gateway's app and its lifecycle: `POST /v1/chat/completions` over the deployment's gRPC
client API.

    qwen3vl-trt serve --repo DIR --openai-port 9000           # beside tritonserver
    qwen3vl-trt openai --triton-url HOST:8001 --port 9000     # in front of a running deployment

Each request passes admission and its body's bounds (admission.ChatRequestGuard), is checked and planned with the
deployment's own preprocessing code (planning.Planner), then generated here. Stop strings are matched in the
decoded text, as the OpenAI API defines them (the server also gets them as stop words, so it usually stops by
itself); a match, a client that goes away mid-stream, or the request's deadline cancels the request on the server.

It runs on one event loop with one gRPC channel to each Triton replica (fleet.Fleet: one replica, or a fleet that
a name or a list gives, balanced round robin with failed requests retried elsewhere), which every request and health
probe shares. GET /metrics serves Prometheus metrics (metrics.GatewayMetrics).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator
from pathlib import Path

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ...errors import ServingError
from ..client import Answer, InferenceError, RequestRejectedError, ServerBusyError, ServerUnavailableError
from ..ports import DEFAULT_OPENAI_PORT, DEFAULT_TRITON_REFRESH_S, GatewayOptions, host_port
from .admission import CHAT_PATH, RECORD, RETRY_AFTER_S, Admission, ChatRequestGuard, error_response
from .fleet import Fleet, FleetTarget
from .metrics import CONTENT_TYPE, GatewayMetrics, RequestRecord
from .planning import Plan, Planner
from .protocol import (
    APIError,
    AssistantMessage,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Choice,
    Delta,
    Model,
    ModelList,
    overloaded,
    sse_event,
)
from .settings import GatewaySettings

RETRY_UNAVAILABLE_S = 5  # the deployment is down or starting
# Connections uvicorn accepts beyond the admitted and queued requests (health probes, scrapes, and the
# requests it refuses itself with 429) before it answers 503 on its own (uvicorn's limit_concurrency).
CONNECTION_HEADROOM = 1024
GRACEFUL_SHUTDOWN_S = 10  # on SIGTERM, streams still open after this are cut (uvicorn's timeout_graceful_shutdown)


class Gateway:
    """The deployment's answers to planned requests: whole, or streamed as server-sent events."""

    def __init__(self, settings: GatewaySettings, metrics: GatewayMetrics):
        self.settings = settings
        self.metrics = metrics
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

    # -- generation -------------------------------------------------------------------------------

    async def _pieces(self, plan: Plan) -> AsyncGenerator[Answer, None]:
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

    async def _texts(self, plan: Plan) -> AsyncGenerator[str, None]:
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

    async def complete(self, plan: Plan) -> ChatCompletion:
        text = "".join([t async for t in self._texts(plan)])
        return ChatCompletion(
            id=plan.id,
            created=plan.created,
            model=plan.model,
            choices=[Choice(message=AssistantMessage(content=text), finish_reason=plan.finish_reason)],
            usage=plan.usage(),
        )

    async def stream(self, plan: Plan, record: RequestRecord) -> StreamingResponse:
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
                    yield sse_event(usage.model_dump_json())
                record.outcome = "completed"
            except APIError as e:
                record.outcome = "timed_out" if e.status == 504 else "failed"
                yield sse_event(e.response().model_dump_json())
            finally:
                with anyio.CancelScope(shield=True):
                    await texts.aclose()
            yield sse_event("[DONE]")

        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def create_app(settings: GatewaySettings) -> FastAPI:
    metrics = GatewayMetrics()
    planner = Planner(settings)
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
    app.add_middleware(
        ChatRequestGuard, max_request_bytes=settings.max_request_bytes, admission=admission, metrics=metrics
    )

    @app.exception_handler(APIError)
    async def api_error(_request: Request, error: APIError) -> JSONResponse:
        return error_response(error)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_request: Request, error: RequestValidationError) -> JSONResponse:
        problems = error.errors()
        first = problems[0] if problems else {}
        location = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
        message = "; ".join(f"{'.'.join(str(p) for p in e['loc'] if p != 'body')}: {e['msg']}" for e in problems)
        return error_response(APIError(400, message or "invalid request body", param=location))

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
        plan = await planner.plan(body, record.started)
        if body.stream:
            return await gateway.stream(plan, record)
        # Serialized by pydantic directly (FastAPI's jsonable_encoder walks the model in Python first).
        return Response((await gateway.complete(plan)).model_dump_json(), media_type="application/json")

    app.state.gateway = gateway
    app.state.metrics = metrics
    return app


class GatewayServer:
    """uvicorn serving the gateway app, in the foreground (run) or on a thread beside tritonserver."""

    def __init__(self, settings: GatewaySettings, host: str = "127.0.0.1", port: int = DEFAULT_OPENAI_PORT):
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
    port: int = DEFAULT_OPENAI_PORT,
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
