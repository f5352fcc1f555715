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
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import Qwen3VLTrtError
from . import interface as io


class InferenceError(Qwen3VLTrtError):
    """The server answered the request with an error, or could not be reached."""


@dataclass(frozen=True)
class Answer:
    text: str
    token_ids: list[int]  # generated tokens (end ids excluded): `text` decodes from them


_NUMPY_TYPES = {"INT32": np.int32, "UINT64": np.uint64, "FP32": np.float32, "BOOL": bool, "STRING": object}


def _input(tensor: io.Tensor, values: Sequence[Any]) -> Any:
    import tritonclient.grpc as grpcclient

    array = np.array([list(values)], dtype=_NUMPY_TYPES[tensor.data_type])
    spec = grpcclient.InferInput(
        tensor.name, list(array.shape), "BYTES" if tensor.data_type == "STRING" else tensor.data_type
    )
    spec.set_data_from_numpy(array)
    return spec


class Client:
    def __init__(self, url: str = "127.0.0.1:8001", model: str = io.ENSEMBLE, timeout_s: float = 600.0):
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
        values: list[tuple[io.Tensor, Sequence[Any]]] = [
            (io.TEXT_INPUT, [prompt.encode()]),
            (io.STREAM, [stream]),
            (io.EXCLUDE_INPUT_IN, [exclude_input_in_output]),
        ]
        optional = {
            io.MAX_TOKENS: max_tokens,
            io.TEMPERATURE_IN: temperature,
            io.TOP_K: top_k,
            io.TOP_P: top_p,
            io.SEED_IN: seed,
            io.MIN_TOKENS_IN: min_tokens,
            io.MESSAGES: None if messages is None else json.dumps(messages).encode(),
            io.RAW_PROMPT: raw_prompt or None,
        }
        values += [(tensor, [value]) for tensor, value in optional.items() if value is not None]
        for tensor, items in ((io.IMAGES, images), (io.STOP_WORDS, stop_words), (io.BAD_WORDS, bad_words)):
            if items:
                values.append((tensor, [i if isinstance(i, bytes) else str(i).encode() for i in items]))
        return [_input(tensor, items) for tensor, items in values]

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
        inputs = self.request_inputs(prompt, images, max_tokens, **options)
        responses: queue.Queue[Any] = queue.Queue()
        self.grpc.start_stream(callback=lambda result, error: responses.put((result, error)))
        pieces: list[str] = []
        token_ids: list[int] = []
        try:
            self.grpc.async_stream_infer(
                self.model, inputs, request_id=uuid.uuid4().hex, enable_empty_final_response=True
            )
            while True:
                try:
                    result, error = responses.get(timeout=self.timeout_s)
                except queue.Empty:
                    raise InferenceError(f"no response from {self.url} in {self.timeout_s:.0f} s") from None
                if error is not None:
                    raise InferenceError(f"{self.url}: {error.message() if hasattr(error, 'message') else error}")
                if result.as_numpy(io.TEXT_OUTPUT.name) is not None:
                    piece = b"".join(result.as_numpy(io.TEXT_OUTPUT.name).reshape(-1)).decode()
                    pieces.append(piece)
                    token_ids.extend(int(t) for t in result.as_numpy(io.OUTPUT_IDS_OUT.name).reshape(-1))
                    if on_text is not None and piece:
                        on_text(piece)
                final = result.get_response().parameters.get("triton_final_response")
                if final is not None and final.bool_param:
                    break
        finally:
            self.grpc.stop_stream()
        return Answer("".join(pieces), token_ids)

    def close(self) -> None:
        self.grpc.close()
