"""The deployment's client over tritonclient gRPC: `qwen3vl-trt infer` and a small Python API.

    from qwen3vl_trt.serving.client import Client
    answer = Client("127.0.0.1:8001").generate("Describe the image.", images=[jpeg_bytes], max_tokens=64)
    print(answer.text, answer.token_ids)

The ensemble holds a decoupled model, so every request goes over gRPC's bidirectional stream; with
stream=True each response carries the new text, which `on_text` receives as it arrives.
"""

from __future__ import annotations

import json
import queue
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import Qwen3VLTrtError
from . import interface


class InferenceError(Qwen3VLTrtError):
    """The server answered the request with an error, or could not be reached."""


class RequestRejectedError(InferenceError):
    """The deployment refused the request as sent (bad image, too many images, prompt too long...)."""


class ServerUnavailableError(InferenceError):
    """No answer from the server: unreachable, or it stopped responding within the timeout."""


@dataclass(frozen=True)
class Answer:
    text: str
    token_ids: list[int]  # generated tokens (end ids excluded): `text` decodes from them


def _server_error(url: str, error: Any) -> InferenceError:
    message = error.message() if hasattr(error, "message") else str(error)
    status = str(error.status()) if hasattr(error, "status") else ""
    if interface.REJECTED_REQUEST in (message or ""):
        return RequestRejectedError(f"{url}: {message}")
    if "UNAVAILABLE" in status or "DEADLINE_EXCEEDED" in status:
        return ServerUnavailableError(f"{url} is unavailable: {message}")
    return InferenceError(f"{url}: {message}")


_CANCELLED = object()


class Generation:
    """One request's responses as they arrive: iterate for the Answer pieces (the new text and token
    ids of each response). cancel(), from any thread, ends the request on the server; so does leaving
    the iteration early."""

    def __init__(self, client: Client, inputs: list[Any], request_id: str | None = None):
        self._client = client
        self.request_id = request_id or uuid.uuid4().hex
        self._responses: queue.Queue[Any] = queue.Queue()
        self._open = True
        self._lock = threading.Lock()
        client.grpc.start_stream(callback=lambda result, error: self._responses.put((result, error)))
        try:
            client.grpc.async_stream_infer(
                client.model, inputs, request_id=self.request_id, enable_empty_final_response=True
            )
        except Exception as e:  # tritonclient's own error types
            self._close(cancel=True)
            raise _server_error(client.url, e) from e

    def __iter__(self) -> Iterator[Answer]:
        client = self._client
        try:
            while True:
                try:
                    item = self._responses.get(timeout=client.timeout_s)
                except queue.Empty:
                    raise ServerUnavailableError(f"no response from {client.url} in {client.timeout_s:.0f} s") from None
                if item is _CANCELLED:
                    return
                result, error = item
                if error is not None:
                    self._close(cancel=False)
                    raise _server_error(client.url, error)
                text = result.as_numpy(interface.TEXT_OUTPUT.name)
                if text is not None:
                    ids = result.as_numpy(interface.OUTPUT_IDS_OUT.name).reshape(-1)
                    yield Answer(b"".join(text.reshape(-1)).decode(), [int(t) for t in ids])
                final = result.get_response().parameters.get("triton_final_response")
                if final is not None and final.bool_param:
                    self._close(cancel=False)
                    return
        finally:
            self.cancel()  # nothing to do after the final response

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


_NUMPY_TYPES = {"INT32": np.int32, "UINT64": np.uint64, "FP32": np.float32, "BOOL": bool, "STRING": object}


def _input(tensor: interface.Tensor, values: Sequence[Any]) -> Any:
    import tritonclient.grpc as grpcclient

    array = np.array([list(values)], dtype=_NUMPY_TYPES[tensor.data_type])
    spec = grpcclient.InferInput(
        tensor.name, list(array.shape), "BYTES" if tensor.data_type == "STRING" else tensor.data_type
    )
    spec.set_data_from_numpy(array)
    return spec


class Client:
    def __init__(self, url: str = "127.0.0.1:8001", model: str = interface.ENSEMBLE, timeout_s: float = 600.0):
        import tritonclient.grpc as grpcclient

        self.url, self.model, self.timeout_s = url, model, timeout_s
        self.grpc = grpcclient.InferenceServerClient(url)

    def is_ready(self) -> bool:
        try:
            return bool(self.grpc.is_server_ready() and self.grpc.is_model_ready(self.model))
        except Exception:  # tritonclient raises its own error types for an unreachable server
            return False

    def request_inputs(
        self,
        prompt: str,
        images: Sequence[bytes] = (),
        max_tokens: int | None = 64,
        *,
        stream: bool = False,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        min_tokens: int | None = None,
        stop_words: Sequence[str] = (),
        bad_words: Sequence[str] = (),
        messages: list[dict[str, Any]] | None = None,
        raw_prompt: bool = False,
        exclude_input_in_output: bool = True,
    ) -> list[Any]:
        """The ensemble's inputs for one request (max_tokens None leaves it out: the server refuses that)."""
        values: list[tuple[interface.Tensor, Sequence[Any]]] = [
            (interface.TEXT_INPUT, [prompt.encode()]),
            (interface.STREAM, [stream]),
            (interface.EXCLUDE_INPUT_IN, [exclude_input_in_output]),
        ]
        optional = {
            interface.MAX_TOKENS: max_tokens,
            interface.TEMPERATURE_IN: temperature,
            interface.TOP_K: top_k,
            interface.TOP_P: top_p,
            interface.SEED_IN: seed,
            interface.MIN_TOKENS_IN: min_tokens,
            interface.MESSAGES: None if messages is None else json.dumps(messages).encode(),
            interface.RAW_PROMPT: raw_prompt or None,
        }
        values += [(tensor, [value]) for tensor, value in optional.items() if value is not None]
        for tensor, items in (
            (interface.IMAGES, images),
            (interface.STOP_WORDS, stop_words),
            (interface.BAD_WORDS, bad_words),
        ):
            if items:
                values.append((tensor, [i if isinstance(i, bytes) else str(i).encode() for i in items]))
        return [_input(tensor, items) for tensor, items in values]

    def stream(
        self,
        prompt: str,
        images: Sequence[bytes] = (),
        max_tokens: int | None = 64,
        *,
        request_id: str | None = None,
        **options: Any,
    ) -> Generation:
        """Starts one request (request_id: what the server logs it as; default a new uuid) and returns its
        responses as they arrive (see Generation). A Client runs one request at a time: use one Client per
        concurrent request."""
        return Generation(self, self.request_inputs(prompt, images, max_tokens, **options), request_id)

    def generate(
        self,
        prompt: str,
        images: Sequence[bytes] = (),
        max_tokens: int | None = 64,
        *,
        on_text: Callable[[str], None] | None = None,
        **options: Any,
    ) -> Answer:
        """One request; raises InferenceError with the server's message when it fails."""
        pieces: list[str] = []
        token_ids: list[int] = []
        for piece in self.stream(prompt, images, max_tokens, **options):
            pieces.append(piece.text)
            token_ids.extend(piece.token_ids)
            if on_text is not None and piece.text:
                on_text(piece.text)
        return Answer("".join(pieces), token_ids)

    def stop(self, request_id: str, timeout_s: float = 5.0) -> None:
        """Tells the llm to end the request with this id, as the tensorrt_llm backend takes it (its `stop`
        input): Triton's ensembles end a cancelled request between steps but do not pass the
        cancellation on to the step in flight, which for the llm is the whole generation."""
        import tritonclient.grpc as grpcclient

        inputs = [
            _input(interface.STOP, [True]),
            _input(interface.INPUT_IDS, [0]),
            _input(interface.INPUT_LENGTHS, [1]),
        ]
        inputs.append(_input(interface.REQUEST_OUTPUT_LEN, [1]))
        answered = threading.Event()
        grpc = grpcclient.InferenceServerClient(self.url)  # the request's own stream is closed by now
        try:
            grpc.start_stream(callback=lambda result, error: answered.set())
            grpc.async_stream_infer(interface.LLM, inputs, request_id=request_id, enable_empty_final_response=True)
            answered.wait(timeout_s)
            grpc.stop_stream(cancel_requests=True)
        except Exception:  # tritonclient's own error types: the server is gone, so is the request
            pass
        finally:
            grpc.close()

    def close(self) -> None:
        self.grpc.close()
