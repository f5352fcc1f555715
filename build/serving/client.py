"""The deployment's client over tritonclient gRPC: `qwen3vl-trt infer` and a small Python API.

    from qwen3vl_trt.serving.client import Client
    answer = Client("127.0.0.1:8001").generate("Describe the image.", images=[jpeg_bytes], max_tokens=64)
    print(answer.text, answer.token_ids)

The ensemble holds a decoupled model, so every request goes over gRPC's bidirectional stream; with
stream=True each response carries the new text, which `on_text` receives as it arrives.
"""

from __future__ import annotations

import asyncio
import queue
import re
import threading
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator, Sequence
from typing import Any

import numpy as np

from ..decoding.detokenize import Answer, Detokenizer
from ..errors import Qwen3VLTrtError
from . import interface
from .ports import LOCAL_TRITON_URL
from .request import GenerationRequest
from .tensors import NUMPY_DTYPES, Tensor

# How long the blocking client waits for each response of a request.
RESPONSE_TIMEOUT_S = 600.0


class InferenceError(Qwen3VLTrtError):
    """The server answered the request with an error, or could not be reached. `reason`: what went wrong, without the
    server's address or the deployment's model names (what the gateway's clients are told)."""

    def __init__(self, message: str, reason: str | None = None):
        super().__init__(message)
        self.reason = message if reason is None else reason


class RequestRejectedError(InferenceError):
    """The deployment refused the request as sent (bad image, too many images, prompt too long...). `kind`: the name
    of the qwen3vl_trt.errors.RequestError class the stage refused it with."""

    def __init__(self, message: str, reason: str | None = None, kind: str | None = None):
        super().__init__(message, reason)
        self.kind = kind


class ServerUnavailableError(InferenceError):
    """No answer from the server: unreachable, or it stopped responding within the timeout."""


class RequestTimedOutError(InferenceError):
    """The request's deadline passed before it finished; it was cancelled on the server."""


class ServerBusyError(ServerUnavailableError):
    """The server refused the request because a model's queue is full (its dynamic batcher's
    max_queue_size); the request may succeed when retried later."""


# A request whose stream stays silent this long asks whether the deployment is still ready. A stage whose python
# stub died leaves the requests in it unanswered (python_backend r24.10 has no cleanup for a dead decoupled
# stub), while the launcher's supervisor unloads and reloads that stage: readiness is false for the whole reload
# (the stage's load time, seconds), so probing each second of silence sees it and ends the request at once.
# Only a server that answers "not ready" ends it: one that stops gracefully refuses new calls, the probe among
# them, while it finishes those in flight (server r26.04 src/grpc/grpc_server.cc, GracefulStop), and a server
# that is gone ends the stream itself.
STALL_PROBE_S = 1.0


def _lost_in_crash(url: str, model: str) -> ServerUnavailableError:
    reason = (
        "the deployment stopped being ready while this request was in flight (a stage crashed and is being "
        "reloaded); the request is lost: send it again"
    )
    return ServerUnavailableError(f"{url}: {model}: {reason}", reason)


# Triton's ensemble scheduler puts the ensemble's name before a step's error (core r24.10
# src/ensemble_scheduler/ensemble_scheduler.cc: "in ensemble '<name>', <message>").
_IN_ENSEMBLE = re.compile(r"^in ensemble '[^']*', ")
# What a stage's refusal says after interface.REJECTED_REQUEST (stages.triton_adapters.error_response).
_REJECTION = re.compile(rf"{re.escape(interface.REJECTED_REQUEST)}(?: \[(\w+)\])?: (.*)", re.DOTALL)


def server_error(url: str, error: Any) -> InferenceError:
    """tritonclient's InferenceServerException, or grpc's RpcError (the asyncio stream raises it unwrapped)."""
    if hasattr(error, "details"):  # grpc.RpcError
        message, status = error.details() or "", str(error.code())
    else:
        message = error.message() if hasattr(error, "message") else str(error)
        status = str(error.status()) if hasattr(error, "status") else ""
    message = message or ""
    reason = _IN_ENSEMBLE.sub("", message)
    rejection = _REJECTION.search(message)
    if rejection is not None:
        return RequestRejectedError(f"{url}: {message}", rejection.group(2), rejection.group(1))
    if interface.QUEUE_FULL in message or interface.QUEUE_TIMEOUT in message:
        return ServerBusyError(f"{url} is busy: {message}", reason)
    if "UNAVAILABLE" in status or "DEADLINE_EXCEEDED" in status or interface.SERVER_STOPPING in message:
        return ServerUnavailableError(f"{url} is unavailable: {message}", reason)
    return InferenceError(f"{url}: {message}", reason)


class _Decoding:
    """One request's responses -> the Answer pieces they carry (None for the empty final response): the text
    ensemble's as the server decoded them, the tokens ensemble's decoded here (detokenize.TextStream)."""

    def __init__(self, detokenizer: Detokenizer | None, top_logprobs: int):
        self.text = detokenizer.stream(top_logprobs) if detokenizer is not None else None
        self.top_logprobs = top_logprobs

    def __call__(self, result: Any) -> Answer | None:
        if self.text is None:
            return _answer(result, self.top_logprobs)
        ids = result.as_numpy(interface.LLM_OUTPUT_IDS.name)
        if ids is None:
            return None
        length = result.as_numpy(interface.SEQUENCE_LENGTH.name)
        log_probs = result.as_numpy(interface.OUTPUT_LOG_PROBS.name)
        return self.text.piece(ids, length, log_probs, result.as_numpy(interface.GENERATION_LOGITS.name))


def _answer(result: Any, top_logprobs: int) -> Answer | None:
    """The new text and token ids one response of the text ensemble carries (None for the empty final response), with
    the first top_logprobs of the alternatives it sends (as many as the deployment serves)."""
    text = result.as_numpy(interface.TEXT_OUTPUT.name)
    if text is None:
        return None
    ids = result.as_numpy(interface.OUTPUT_IDS_OUT.name).reshape(-1)
    log_probs = result.as_numpy(interface.LOG_PROBS_OUT.name)
    top_ids, top_log_probs = (result.as_numpy(t.name) for t in (interface.TOP_IDS_OUT, interface.TOP_LOG_PROBS_OUT))
    top: tuple[tuple[tuple[int, float], ...], ...] = ()
    if top_ids is not None and top_log_probs is not None:
        rows = zip(top_ids.reshape(len(ids), -1), top_log_probs.reshape(len(ids), -1), strict=True)
        top = tuple(tuple(zip(i[:top_logprobs].tolist(), p[:top_logprobs].tolist(), strict=True)) for i, p in rows)
    return Answer(
        b"".join(text.reshape(-1)).decode(),
        [int(t) for t in ids],
        () if log_probs is None else tuple(float(p) for p in log_probs.reshape(-1)),
        top,
    )


_CANCELLED = object()


class Generation:
    """One request's responses as they arrive: iterate for the Answer pieces (the new text and token
    ids of each response). cancel(), from any thread, ends the request on the server; so does leaving
    the iteration early."""

    def __init__(self, client: Client, request: GenerationRequest, request_id: str | None = None):
        self._client = client
        self.request_id = request_id or uuid.uuid4().hex
        self._decode = _Decoding(client.detokenizer, request.top_logprobs)
        inputs = request_inputs(request)
        self._responses: queue.Queue[Any] = queue.Queue()
        self._open = True
        self._lock = threading.Lock()
        client.grpc.start_stream(callback=lambda result, error: self._responses.put((result, error)))
        try:
            client.grpc.async_stream_infer(
                client.model,
                inputs,
                request_id=self.request_id,
                priority=request.priority,
                enable_empty_final_response=True,
            )
        except Exception as e:  # tritonclient's own error types
            self._close(cancel=True)
            raise server_error(client.url, e) from e

    def __iter__(self) -> Iterator[Answer]:
        client = self._client
        try:
            while True:
                item = self._next_response()
                if item is _CANCELLED:
                    return
                result, error = item
                if error is not None:
                    self._close(cancel=False)
                    raise server_error(client.url, error)
                answer = self._decode(result)
                if answer is not None:
                    yield answer
                final = result.get_response().parameters.get("triton_final_response")
                if final is not None and final.bool_param:
                    self._close(cancel=False)
                    return
        finally:
            self.cancel()  # nothing to do after the final response

    def _next_response(self) -> Any:
        """The next response (or _CANCELLED); ServerUnavailableError after timeout_s of silence, or as soon as
        the deployment is seen not ready during a silence (see STALL_PROBE_S)."""
        client = self._client
        silent_since = time.monotonic()
        while True:
            try:
                return self._responses.get(timeout=STALL_PROBE_S)
            except queue.Empty:
                pass
            if time.monotonic() - silent_since >= client.timeout_s:
                reason = f"no response from the deployment in {client.timeout_s:.0f} s"
                raise ServerUnavailableError(f"{client.url}: {reason}", reason)
            if client.reports_not_ready():
                raise _lost_in_crash(client.url, client.model)

    def cancel(self) -> None:
        """Ends the request: closes its gRPC stream and tells the llm to stop it (blocks up to a few seconds)."""
        if self._close(cancel=True):
            self._responses.put(_CANCELLED)
            self._client.stop(self.request_id)

    def _close(self, cancel: bool) -> bool:
        with self._lock:
            was_open, self._open = self._open, False
        if was_open:
            self._client.grpc.stop_stream(cancel_requests=cancel)
        return was_open


def _input(tensor: Tensor, array: np.ndarray) -> Any:
    """One input of a request of one (the batch dimension added)."""
    # tritonclient.grpc.aio re-exports this same InferInput class, so both clients send these inputs.
    import tritonclient.grpc as grpcclient

    batch = np.asarray(array, dtype=NUMPY_DTYPES[tensor.data_type])[None]
    spec = grpcclient.InferInput(
        tensor.name, list(batch.shape), "BYTES" if tensor.data_type == "STRING" else tensor.data_type
    )
    spec.set_data_from_numpy(batch)
    return spec


def request_inputs(request: GenerationRequest) -> list[Any]:
    """The ensemble's inputs for one request, as tritonclient sends them."""
    return [_input(tensor, array) for tensor, array in request.to_inputs().items()]


def stream_request(model: str, inputs: list[Any], request_id: str, priority: int = 0) -> dict[str, Any]:
    """One request as grpc.aio's stream_infer takes it from its iterator (tritonclient r24.10 and r26.04
    grpc/aio/__init__.py: "priority" defaults to 0, the model's default level)."""
    return {"model_name": model, "inputs": inputs, "request_id": request_id, "priority": priority}


def stop_inputs() -> list[Any]:
    """The llm's inputs that end the request sent with the same id, as the tensorrt_llm backend takes them
    (its `stop` input): Triton's ensembles end a cancelled request between steps but do not pass the
    cancellation on to the step in flight, which for the llm is the whole generation."""
    return [
        _input(interface.STOP, np.array([True])),
        _input(interface.INPUT_IDS, np.array([0])),
        _input(interface.INPUT_LENGTHS, np.array([1])),
        _input(interface.REQUEST_OUTPUT_LEN, np.array([1])),
    ]


class Client:
    """The blocking client (`qwen3vl-trt infer`, scripts): one request at a time per Client. With a detokenizer (the
    served checkpoint's: detokenize.Detokenizer.from_model_dir) it asks the tokens ensemble and decodes the text
    itself, which spares the server a python step per streamed token; without one, the ensemble that answers text."""

    def __init__(
        self,
        url: str = LOCAL_TRITON_URL,
        model: str | None = None,
        timeout_s: float = RESPONSE_TIMEOUT_S,
        detokenizer: Detokenizer | None = None,
    ):
        import tritonclient.grpc as grpcclient

        self.url, self.timeout_s, self.detokenizer = url, timeout_s, detokenizer
        self.model = model or (interface.TOKENS_ENSEMBLE if detokenizer is not None else interface.ENSEMBLE)
        self.grpc = grpcclient.InferenceServerClient(url)

    def is_ready(self) -> bool:
        return self._readiness() is True

    def reports_not_ready(self) -> bool:
        """Whether the server answers that it or the model is not ready (False when it does not answer: see
        STALL_PROBE_S)."""
        return self._readiness() is False

    def _readiness(self) -> bool | None:
        """The server's and model's readiness as the server answers it; None when it does not answer."""
        try:
            return bool(self.grpc.is_server_ready() and self.grpc.is_model_ready(self.model))
        except Exception:  # tritonclient raises its own error types for an unreachable server
            return None

    def submit(self, request: GenerationRequest, request_id: str | None = None) -> Generation:
        """Starts one request (request_id: what the server logs it as; default a new uuid) and returns its
        responses as they arrive (see Generation). A Client runs one request at a time: use one Client per
        concurrent request."""
        return Generation(self, request, request_id)

    def stream(
        self,
        prompt: str,
        images: Sequence[bytes] = (),
        max_tokens: int = 64,
        *,
        request_id: str | None = None,
        **options: Any,
    ) -> Generation:
        """submit() of the request of these arguments (options: GenerationRequest's other fields)."""
        request = GenerationRequest(prompt=prompt, images=images, max_tokens=max_tokens, **options)
        return self.submit(request, request_id)

    def generate(
        self,
        prompt: str,
        images: Sequence[bytes] = (),
        max_tokens: int = 64,
        *,
        on_text: Callable[[str], None] | None = None,
        **options: Any,
    ) -> Answer:
        """One request (stream's arguments); raises InferenceError with the server's message when it
        fails, and RequestError, before sending anything, for one that cannot be served as asked."""
        pieces: list[Answer] = []
        for piece in self.stream(prompt, images, max_tokens, **options):
            pieces.append(piece)
            if on_text is not None and piece.text:
                on_text(piece.text)
        return Answer.joined(pieces)

    def stop(self, request_id: str, timeout_s: float = 5.0) -> None:
        """Tells the llm to end the request with this id (see stop_inputs)."""
        import tritonclient.grpc as grpcclient

        answered = threading.Event()
        grpc = grpcclient.InferenceServerClient(self.url)  # the request's own stream is closed by now
        try:
            grpc.start_stream(callback=lambda result, error: answered.set())
            grpc.async_stream_infer(
                interface.LLM, stop_inputs(), request_id=request_id, enable_empty_final_response=True
            )
            answered.wait(timeout_s)
            grpc.stop_stream(cancel_requests=True)
        except Exception:  # tritonclient's own error types: the server is gone, so is the request
            pass
        finally:
            grpc.close()

    def close(self) -> None:
        self.grpc.close()


# tritonclient's own channel options (no message size limit; its keepalive defaults are gRPC's: off), and a
# reconnection backoff of at most 2 s instead of gRPC's 120 s: a replica that comes back is seen at once by the
# readiness probes (a channel between reconnection attempts fails every call without trying).
CHANNEL_ARGS = [
    ("grpc.max_send_message_length", 2**31 - 1),
    ("grpc.max_receive_message_length", 2**31 - 1),
    ("grpc.initial_reconnect_backoff_ms", 500),
    ("grpc.min_reconnect_backoff_ms", 500),  # gRPC's name for the shortest connection attempt
    ("grpc.max_reconnect_backoff_ms", 2000),
]


class AsyncClient:
    """The asyncio client (the OpenAI gateway): one gRPC channel that every request and health probe shares,
    each request on its own gRPC stream over it. Create, use and close it on one event loop (grpc.aio binds
    the channel to the loop it first runs on). With a detokenizer it asks the tokens ensemble and decodes the text
    itself (see Client).

    Only API that the installed tritonclient 2.73 and the GPU image's 2.68 both have is used: `stream_infer`
    over an async iterator of request dicts, `is_server_ready`/`is_model_ready` with client_timeout, `close`, and
    the constructor's `channel_args`. Its request dicts do not ask for the empty final response (the `triton_`
    parameter that would is reserved in tritonclient after 2.68: grpc/_utils.py), so a request's end is the end of its
    stream: the iterator sends one request and then half-closes, and Triton's gRPC server finishes a half-closed
    stream once the requests on it are complete (server r26.04 src/grpc/stream_infer_handler.cc).
    """

    def __init__(self, url: str = LOCAL_TRITON_URL, model: str | None = None, detokenizer: Detokenizer | None = None):
        import tritonclient.grpc.aio as grpcclient

        self.url, self.detokenizer = url, detokenizer
        self.model = model or (interface.TOKENS_ENSEMBLE if detokenizer is not None else interface.ENSEMBLE)
        self.grpc = grpcclient.InferenceServerClient(url, channel_args=CHANNEL_ARGS)
        self._stopping: set[asyncio.Future[None]] = set()

    async def is_ready(self, timeout_s: float = 5.0) -> bool:
        return await self._readiness(timeout_s) is True

    async def reports_not_ready(self, timeout_s: float = 5.0) -> bool:
        """Whether the server answers that it or the model is not ready (False when it does not answer: see
        STALL_PROBE_S)."""
        return await self._readiness(timeout_s) is False

    async def _readiness(self, timeout_s: float) -> bool | None:
        """The server's and model's readiness as the server answers it; None when it does not answer."""
        try:
            return bool(
                await self.grpc.is_server_ready(client_timeout=timeout_s)
                and await self.grpc.is_model_ready(self.model, client_timeout=timeout_s)
            )
        except Exception:  # tritonclient raises its own error types for an unreachable server
            return None

    async def stream(
        self, request: GenerationRequest, *, request_id: str, deadline: float | None = None
    ) -> AsyncGenerator[Answer, None]:
        """One request's responses as they arrive. Past `deadline` (a time.monotonic() value) it raises
        RequestTimedOutError. Leaving the iteration early, cancelling the task iterating it, or its deadline,
        cancels the stream and stops the request on the llm (stop)."""
        responses = self._send(self.model, request_inputs(request), request_id, request.priority)
        decode = _Decoding(self.detokenizer, request.top_logprobs)
        watch = _Watch(self, responses, deadline)
        finished = False
        try:
            async for result, error in responses:
                watch.last = time.monotonic()
                if error is not None:
                    finished = True  # the server ended the request itself
                    raise server_error(self.url, error)
                answer = decode(result)
                if answer is not None:
                    yield answer
            finished = True
        except asyncio.CancelledError:
            if watch.verdict is None:  # this task was cancelled (a client that went away)
                raise
            raise watch.verdict from None  # the watch cancelled the call
        except rpc_errors() as e:
            if watch.verdict is not None:
                raise watch.verdict from None
            finished = True
            raise server_error(self.url, e) from e
        finally:
            watch.task.cancel()
            responses.cancel()  # frees the call on the shared channel (a no-op once the server ended it)
            if not finished:
                # In the background, so that a caller being cancelled (a client that went away) still stops it.
                stopping = asyncio.ensure_future(self.stop(request_id))
                self._stopping.add(stopping)  # asyncio keeps only weak references to tasks
                stopping.add_done_callback(self._stopping.discard)

    async def stop(self, request_id: str, timeout_s: float = 5.0) -> None:
        """Tells the llm to end the request with this id (see stop_inputs); waits up to timeout_s for its answer."""
        responses = self._send(interface.LLM, stop_inputs(), request_id)

        async def drain() -> None:
            async for _ in responses:
                pass

        gone_or_slow: tuple[type[Exception], ...] = (asyncio.TimeoutError, *rpc_errors())
        try:
            await asyncio.wait_for(drain(), timeout_s)
        except gone_or_slow:  # the server is gone or slow: the request ends anyway
            responses.cancel()

    def _send(self, model: str, inputs: list[Any], request_id: str, priority: int = 0) -> Any:
        async def one_request() -> AsyncIterator[dict[str, Any]]:
            yield stream_request(model, inputs, request_id, priority)

        return self.grpc.stream_infer(one_request())

    async def close(self, timeout_s: float = 5.0) -> None:
        """Closes the channel once the stop requests still under way are answered (or timeout_s passed)."""
        if self._stopping:
            await asyncio.wait(self._stopping, timeout=timeout_s)
        await self.grpc.close()


class _Watch:
    """One request's watch, a task of its own that wakes once per STALL_PROBE_S (not a timer per response): when the
    stream has been silent that long it asks whether the deployment is still ready, and past the deadline it ends
    the request; either way it sets `verdict` (the error the request ends with) and cancels the call, which ends
    the stream's pending read. The stream sets `last` at each response."""

    def __init__(self, client: AsyncClient, call: Any, deadline: float | None):
        self.client, self.call, self.deadline = client, call, deadline
        self.last = time.monotonic()
        self.verdict: InferenceError | None = None
        self.task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        client = self.client
        while True:
            wake = self.last + STALL_PROBE_S
            if self.deadline is not None:
                wake = min(wake, self.deadline)
            await asyncio.sleep(max(0.0, wake - time.monotonic()))
            now = time.monotonic()
            if self.deadline is not None and now >= self.deadline:
                reason = "the request's deadline passed; it was cancelled"
                self.verdict = RequestTimedOutError(f"{client.url}: {reason}", reason)
                break
            if now - self.last >= STALL_PROBE_S and await client.reports_not_ready():
                self.verdict = _lost_in_crash(client.url, client.model)
                break
        self.call.cancel()


def rpc_errors() -> tuple[type[Exception], ...]:
    """What a broken or refused call raises: grpc's own error (the asyncio stream's iteration) or tritonclient's."""
    import grpc
    from tritonclient.utils import InferenceServerException

    return (grpc.RpcError, InferenceServerException)
