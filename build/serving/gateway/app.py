"""The OpenAI-compatible gateway's app and its lifecycle: `POST /v1/chat/completions` and `/v1/completions` over the
deployment's gRPC client API.

    qwen3vl-trt serve --repo DIR --openai-port 9000           # beside tritonserver
    qwen3vl-trt openai --triton-url HOST:8001 --port 9000     # in front of a running deployment

Each request passes admission and its body's bounds (admission.ChatRequestGuard), is checked and planned with the
deployment's own preprocessing code (planning.Planner), then generated here, each of its n choices a request of its
own, and made into the answer (answers.py: reasoning, tool calls, log probabilities). Stop strings are matched in the
decoded text, as the OpenAI API defines them (the server also gets them as stop words, so it usually stops by
itself); a match, a client that goes away mid-stream, or the request's deadline cancels the request on the server.

It runs on one event loop with one gRPC channel to each Triton replica (fleet.Fleet: one replica, or a fleet that
a name or a list gives, balanced round robin with failed requests retried elsewhere), which every request shares; each
replica's readiness is asked of its `serve` (fleet.ServeProbe, warm-up included), of plain tritonservers over that
channel. GET /metrics serves Prometheus metrics (metrics.GatewayMetrics).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import sys
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from pathlib import Path

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from ...decoding.detokenize import Detokenizer
from ...errors import ServingError
from ..client import (
    Answer,
    InferenceError,
    RequestRejectedError,
    RequestTimedOutError,
    ServerBusyError,
    ServerUnavailableError,
)
from ..ports import host_port
from ..targets import FleetTarget
from .admission import (
    CHAT_PATH,
    COMPLETIONS_PATH,
    RECORD,
    RETRY_AFTER_S,
    TICKET,
    Admission,
    ChatRequestGuard,
    Overloaded,
    at_capacity,
    error_response,
)
from .answers import ChatChunks, CompletionChunks, Event, TokenTexts, chat_choice, completion_choice
from .auth import APIKeyGuard, access_note
from .fleet import Fleet, GrpcProbe, LocalProbe, ReplicaProbe, ServeProbe
from .metrics import CONTENT_TYPE, GatewayMetrics, RequestRecord
from .options import DEFAULT_OPENAI_PORT, GatewayOptions
from .planning import ChoiceRun, Plan, Planner
from .protocol import (
    APIError,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    Model,
    ModelList,
    overloaded,
    rejected,
    sse_event,
)
from .settings import GatewaySettings

RETRY_UNAVAILABLE_S = 5  # the deployment is down or starting
# Connections uvicorn accepts beyond the admitted and queued requests (health probes, scrapes, and the
# requests it refuses itself with 429) before it answers 503 on its own (uvicorn's limit_concurrency).
CONNECTION_HEADROOM = 1024
GRACEFUL_SHUTDOWN_S = 10  # on SIGTERM, streams still open after this are cut (uvicorn's timeout_graceful_shutdown)


class GenerationDriver:
    """The deployment's answers to planned requests: whole, or streamed as server-sent events."""

    def __init__(
        self,
        settings: GatewaySettings,
        metrics: GatewayMetrics,
        tokens: TokenTexts,
        detokenizer: Detokenizer,
        readiness: Callable[[], bool] | None = None,
    ):
        """detokenizer: the served checkpoint's, which decodes the tokens ensemble's responses here (no python step
        per streamed token in the server). readiness: the readiness of the `serve` process this gateway runs in, its
        one replica's (None: the replicas are asked, as the options' replica_ready_port says)."""
        self.settings = settings
        self.metrics = metrics
        self.tokens = tokens
        self.detokenizer = detokenizer
        self.readiness = readiness
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
        probe: ReplicaProbe
        if self.readiness is not None:
            probe = LocalProbe(self.readiness)
        elif settings.options.replica_ready_port:
            probe = ServeProbe(settings.options.replica_ready_port)
        else:
            probe = GrpcProbe()
        self._client = Fleet(
            target,
            refresh_s=settings.options.triton_refresh_s,
            metrics=self.metrics,
            probe=probe,
            detokenizer=self.detokenizer,
        )
        await self._client.start()

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()

    async def ready(self) -> bool:
        return await self.client.is_ready()

    def routing(self) -> bool:
        """Whether a replica is in the rotation: a snapshot, which another thread may take."""
        return self._client is not None and self._client.routing()

    # -- generation -------------------------------------------------------------------------------

    async def _pieces(self, plan: Plan, run: ChoiceRun) -> AsyncGenerator[Answer, None]:
        """The deployment's responses for one choice, until the request's deadline; leaving early (stop string,
        disconnect, deadline) cancels it on the server."""
        self.metrics.prompt_tokens.inc(plan.prompt_tokens)
        request_id, request = plan.choice(run)
        responses = self.client.stream(request, request_id=request_id, deadline=plan.deadline)
        try:
            try:
                async for piece in responses:
                    yield piece
            except RequestTimedOutError:
                raise APIError(
                    504,
                    f"the request did not finish within this gateway's {self.settings.options.request_timeout_s:g} s "
                    "limit; it was cancelled on the server",
                    type="server_error",
                    code="timeout",
                ) from None
            except InferenceError as e:
                raise await self._inference_error(e) from None
        finally:
            await responses.aclose()  # cancels the request on the server unless it finished

    async def _inference_error(self, error: InferenceError) -> APIError:
        """The client's answer: the error's reason, without the replica's address or the ensemble's name."""
        if isinstance(error, RequestRejectedError):
            return rejected(error.reason, error.kind)
        if isinstance(error, ServerBusyError):
            self.metrics.refusals.labels("server_busy").inc()
            return overloaded(f"the deployment is at capacity: {error.reason}", RETRY_AFTER_S, status=503)
        if isinstance(error, ServerUnavailableError) or not await self.ready():
            self.metrics.refusals.labels("server_unavailable").inc()
            return APIError(503, f"the deployment is not ready: {error.reason}", type="server_error",
                            code="unavailable", retry_after_s=RETRY_UNAVAILABLE_S)  # fmt: skip
        print(f"gateway: a request failed: {error}", file=sys.stderr, flush=True)  # as fleet._log
        return APIError(500, error.reason, type="server_error")

    async def _texts(self, plan: Plan, run: ChoiceRun) -> AsyncGenerator[Answer, None]:
        """One choice's pieces, their text cut at the first stop string (and held back where one may start); counts
        its tokens into `run`."""
        pieces = self._pieces(plan, run)
        try:
            async for piece in pieces:
                run.completion_tokens += len(piece.token_ids)
                text = run.stop_finder.feed(piece.text)
                if text or piece.token_ids:
                    yield dataclasses.replace(piece, text=text)
                if run.stop_finder.stopped:
                    return
            tail = run.stop_finder.flush()
            if tail:
                yield Answer(tail, [])
            if run.completion_tokens >= plan.max_tokens:
                run.finish_reason = "length"
        finally:
            with anyio.CancelScope(shield=True):  # also when the client went away and this task is cancelled
                await pieces.aclose()
            self.metrics.completion_tokens.inc(run.completion_tokens)

    async def _whole(self, plan: Plan, run: ChoiceRun) -> Answer:
        return Answer.joined([piece async for piece in self._texts(plan, run)])

    async def complete(self, plan: Plan) -> ChatCompletion | Completion:
        """The answer whole: the n choices generated at once, a failure of one ending the others."""
        if plan.n == 1:
            answers = [await self._whole(plan, plan.choices[0])]
        else:
            tasks = [asyncio.ensure_future(self._whole(plan, run)) for run in plan.choices]
            try:
                answers = list(await asyncio.gather(*tasks))
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
        runs = zip(plan.choices, answers, strict=True)
        if plan.kind == "completion":
            completions = [completion_choice(plan, run, answer, self.tokens) for run, answer in runs]
            return Completion(id=plan.id, created=plan.created, model=plan.model, choices=completions,
                              usage=plan.usage())  # fmt: skip
        choices = [chat_choice(plan, run, answer, self.tokens) for run, answer in runs]
        return ChatCompletion(id=plan.id, created=plan.created, model=plan.model, choices=choices, usage=plan.usage())

    async def _choice_events(self, plan: Plan, run: ChoiceRun) -> AsyncGenerator[Event, None]:
        """One choice's streamed chunks, from its first piece on (so that a request the deployment refuses is
        refused before any chunk), its finish chunk last. Log probabilities go with the chunk after their tokens."""
        texts = self._texts(plan, run)
        kind = ChatChunks if plan.kind == "chat" else CompletionChunks
        chunks = kind(plan, run, self.tokens)
        try:
            async for piece in texts:
                for chunk in chunks.feed(piece):
                    yield chunk
            for chunk in chunks.finish():
                yield chunk
        finally:
            with anyio.CancelScope(shield=True):
                await texts.aclose()

    async def stream(self, plan: Plan, record: RequestRecord) -> StreamingResponse:
        events = _merged([self._choice_events(plan, run) for run in plan.choices])
        # The first chunk comes before the response starts, so a request the deployment refuses still gets its
        # HTTP error status.
        try:
            first: Event | None = await events.__anext__()
        except StopAsyncIteration:
            first = None
        except BaseException:
            with anyio.CancelScope(shield=True):
                await events.aclose()
            raise
        metrics = self.metrics

        interval = self.settings.options.stream_interval_ms / 1000

        async def body() -> AsyncIterator[str]:
            last: float | None = None  # when the last write with generated text went out
            held: list[str] = []  # chunks not written yet
            generated = 0  # how many of them carry generated text
            record.outcome = "cancelled"  # until it ends otherwise

            def written() -> str:
                """The chunks held, as one write. The latency metrics see what the client sees: the first text's
                time, then one inter-token latency per chunk of text, those of a write sharing its time since the
                last (the first write's others: 0)."""
                nonlocal last, generated
                if generated:
                    now = time.monotonic()
                    if last is None:
                        metrics.time_to_first_token.observe(now - record.started)
                        gaps = [0.0] * (generated - 1)
                    else:
                        gaps = [(now - last) / generated] * generated
                    for gap in gaps:
                        metrics.inter_token_latency.observe(gap)
                    last, generated = now, 0
                out = "".join(held)
                held.clear()
                return out

            def take(event: Event) -> None:
                nonlocal generated
                held.append(event[0])
                generated += event[1]

            try:
                if first is not None:
                    take(first)
                    if generated:
                        yield written()
                    async for event in events:
                        take(event)
                        # The first text goes out at once; later chunks together, at most once per interval.
                        if generated and (last is None or time.monotonic() - last >= interval):
                            yield written()
                    if held:
                        yield written()
                if plan.include_usage:
                    kind = Completion if plan.kind == "completion" else ChatCompletionChunk
                    usage = kind(id=plan.id, created=plan.created, model=plan.model, choices=[], usage=plan.usage())
                    yield sse_event(usage.model_dump_json())
                record.outcome = "completed"
            except APIError as e:
                record.outcome = "timed_out" if e.status == 504 else "failed"
                if held:
                    yield written()
                yield sse_event(e.response().model_dump_json())
            finally:
                with anyio.CancelScope(shield=True):
                    await events.aclose()
            yield sse_event("[DONE]")

        return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _merged(streams: list[AsyncGenerator[Event, None]]) -> AsyncGenerator[Event, None]:
    """The items of several async generators as each comes (one generator: itself). Each is advanced by a task of
    its own, one step at a time; closing this closes them all."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield item
        return
    steps = {asyncio.ensure_future(stream.__anext__()): stream for stream in streams}
    try:
        while steps:
            done, _ = await asyncio.wait(steps, return_when=asyncio.FIRST_COMPLETED)
            for step in done:
                stream = steps.pop(step)
                try:
                    item = step.result()
                except StopAsyncIteration:
                    continue
                steps[asyncio.ensure_future(stream.__anext__())] = stream
                yield item
    finally:
        for step in steps:
            step.cancel()
        await asyncio.gather(*steps, return_exceptions=True)
        for stream in streams:
            await stream.aclose()


def create_app(settings: GatewaySettings, readiness: Callable[[], bool] | None = None) -> FastAPI:
    """The gateway's app; readiness: as GenerationDriver takes it."""
    metrics = GatewayMetrics()
    planner = Planner(settings)
    detokenizer = Detokenizer.from_model_dir(settings.model_dir, planner.tokenizer)
    gateway = GenerationDriver(settings, metrics, TokenTexts(planner.tokenizer), detokenizer, readiness)
    options = settings.options
    admission = Admission(settings.max_concurrent_requests, settings.max_queued_requests, options.max_queue_wait_s,
                          settings.max_queued_bytes, options.queue_order, options.queue_ageing)  # fmt: skip
    metrics.watch(lambda: admission.in_flight, lambda: admission.queued)
    batches = None
    if settings.options.batch_redis is not None:
        from .batch.routes import BatchAPI

        batches = BatchAPI(settings, planner, gateway.complete, admission, metrics)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        await gateway.start()
        try:
            if batches is not None:
                await batches.start()
            try:
                yield
            finally:
                if batches is not None:
                    await batches.close()
        finally:
            await gateway.close()

    app = FastAPI(
        title="qwen3vl-trt", summary="OpenAI-compatible chat completions over a Triton deployment", lifespan=lifespan
    )
    app.state.gateway = gateway  # GatewayServer.serving asks it
    app.add_middleware(
        ChatRequestGuard, max_request_bytes=settings.max_request_bytes, admission=admission, metrics=metrics
    )
    # Added last, so outermost: a request without a valid key takes no admission slot and sends no body.
    app.add_middleware(APIKeyGuard, keys=settings.api_keys, open_metrics=settings.options.open_metrics, metrics=metrics)

    @app.exception_handler(APIError)
    async def api_error(_request: Request, error: APIError) -> JSONResponse:
        return error_response(error)

    @app.exception_handler(HTTPException)
    async def no_such_route(request: Request, error: HTTPException) -> JSONResponse:
        """Starlette's own answers (no route: 404, a route without the method: 405) as OpenAI's error object."""
        where = f"{request.method} {request.url.path}"
        message = f"Invalid URL ({where})" if error.status_code == 404 else f"{where}: {error.detail}"
        response = error_response(APIError(error.status_code, message))
        response.headers.update(error.headers or {})  # 405's Allow
        return response

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_request: Request, error: RequestValidationError) -> JSONResponse:
        def place(problem: dict) -> str:
            return ".".join(str(p) for p in problem.get("loc", ()) if p != "body")

        problems = error.errors()
        location = place(problems[0]) if problems else ""
        if location:
            message = "; ".join(f"{place(e)}: {e['msg']}" for e in problems)
        else:  # the body itself: not JSON, or not an object (FastAPI reads a body as JSON only when sent as such)
            message = "the request body must be a JSON object, sent with Content-Type: application/json"
        return error_response(APIError(400, message, param=location or None))

    @app.get("/health")
    async def health() -> JSONResponse:
        if await gateway.ready():
            return JSONResponse({"status": "ready"})
        return JSONResponse({"status": "not ready", "triton_url": settings.triton_url}, status_code=503)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    served = Model(id=settings.served_model_name, created=int(time.time()), owned_by="qwen3vl-trt")  # when served

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[served])

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> Model:
        if model_id != served.id:
            raise APIError(404, f"the model {model_id!r} does not exist; this deployment serves {served.id!r}",
                           param="model", code="model_not_found")  # fmt: skip
        return served

    async def answer(plan: Plan, request: Request, stream: bool) -> Response:
        """Runs the plan once its slots are the request's (ChatRequestGuard gives them back)."""
        try:
            waited = await admission.run(request.scope[TICKET], plan.expected_cost, plan.n)
        except Overloaded as e:  # waited max_queue_wait_s for a slot in vain
            metrics.queue_wait.labels("interactive").observe(admission.max_wait_s)
            metrics.refusals.labels("overloaded").inc()
            raise at_capacity(e) from None
        metrics.queue_wait.labels("interactive").observe(waited)
        if stream:
            return await gateway.stream(plan, request.scope[RECORD])
        # Serialized by pydantic directly (FastAPI's jsonable_encoder walks the model in Python first).
        return Response((await gateway.complete(plan)).model_dump_json(), media_type="application/json")

    @app.post(CHAT_PATH, response_model=None)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await answer(await planner.plan(body, request.scope[RECORD].started), request, body.stream)

    @app.post(COMPLETIONS_PATH, response_model=None)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await answer(await planner.plan_completion(body, request.scope[RECORD].started), request, body.stream)

    if batches is not None:
        batches.mount(app)
    else:

        @app.api_route("/v1/files{rest:path}", methods=["GET", "POST", "DELETE"])
        @app.api_route("/v1/batches{rest:path}", methods=["GET", "POST"])
        async def no_batches(rest: str) -> None:
            raise APIError(404, "this gateway serves no batches: start it with --batch-redis and --batch-dir")

    app.state.gateway = gateway
    app.state.metrics = metrics
    return app


class GatewayServer:
    """uvicorn serving the gateway app, in the foreground (run) or on a thread beside tritonserver."""

    def __init__(
        self,
        settings: GatewaySettings,
        host: str = "127.0.0.1",
        port: int = DEFAULT_OPENAI_PORT,
        readiness: Callable[[], bool] | None = None,
    ):
        import uvicorn

        self.url = f"http://{host_port(host, port)}"
        app = create_app(settings, readiness)
        self._gateway: GenerationDriver = app.state.gateway
        config = uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level="warning",
            access_log=False,
            limit_concurrency=settings.max_concurrent_requests + settings.max_queued_requests + CONNECTION_HEADROOM,
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        )
        self.server = uvicorn.Server(config)
        self._thread: threading.Thread | None = None

    def serving(self) -> bool:
        """Whether the gateway routes requests to a replica now (asked from another thread)."""
        return self._gateway.routing()

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
    wait_s: float = 0.0,
) -> int:
    """`qwen3vl-trt openai`: the gateway alone, in front of a running deployment or a fleet of replicas (its
    settings read from the repository when given, else asked of a replica, waiting up to wait_s for one).
    SIGINT or SIGTERM stops it within GRACEFUL_SHUTDOWN_S (uvicorn handles both)."""
    if repo is not None:
        settings = GatewaySettings.from_repository(triton_url, repo, options)
    else:
        settings = GatewaySettings.from_server(triton_url, options, wait_s)
    server = GatewayServer(settings, address, port)
    print(f"OpenAI gateway on {server.url}/v1 (model {settings.served_model_name!r}) -> {triton_url}", flush=True)
    if note := access_note(settings.api_keys, options.open_metrics, address, server.url):
        print(note, file=sys.stderr, flush=True)
    server.run()
    return 0
