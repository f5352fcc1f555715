"""The part of OpenAI's chat-completions API the gateway speaks: request and response models, streamed events,
error bodies and stop strings as the API defines them (matched in the decoded text)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer

from ...errors import (
    ImageDecodeError,
    ImageShapeError,
    ImageTooLargeError,
    PromptTooLongError,
    RequestError,
    TooManyImagesError,
    TooManyVideosError,
    VideoDecodeError,
    VideoTooLargeError,
)

MAX_STOP_STRINGS = 4  # as the OpenAI API allows
FinishReason = Literal["stop", "length"]


# -- errors ---------------------------------------------------------------------------------------


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class APIError(Exception):
    """An OpenAI-style error response. retry_after_s: sent as Retry-After (refusals under load)."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, retry_after_s: int | None = None):  # fmt: skip
        super().__init__(message)
        self.status, self.retry_after_s = status, retry_after_s
        self.detail = ErrorDetail(message=message, type=type, param=param, code=code)

    @property
    def message(self) -> str:
        return self.detail.message

    def response(self) -> ErrorResponse:
        return ErrorResponse(error=self.detail)

    def headers(self) -> dict[str, str]:
        return {} if self.retry_after_s is None else {"Retry-After": str(self.retry_after_s)}


def overloaded(message: str, retry_after_s: int, status: int = 429) -> APIError:
    """A refusal under load, which clients retry after retry_after_s (the official clients do, on 429 and 503)."""
    return APIError(status, message, type="server_error", code="overloaded", retry_after_s=retry_after_s)


_ERROR_CODES: list[tuple[type[RequestError], str]] = [
    (PromptTooLongError, "context_length_exceeded"),
    (TooManyImagesError, "too_many_images"),
    (ImageTooLargeError, "image_too_large"),
    (ImageDecodeError, "invalid_image"),
    (ImageShapeError, "invalid_image"),
    (TooManyVideosError, "too_many_videos"),
    (VideoTooLargeError, "video_too_large"),
    (VideoDecodeError, "invalid_video"),
]


def request_error(error: RequestError) -> APIError:
    code = next((c for kind, c in _ERROR_CODES if isinstance(error, kind)), None)
    return APIError(400, str(error), param="messages", code=code)


# -- requests -------------------------------------------------------------------------------------


class StreamOptions(BaseModel):
    include_usage: bool = False


class ChatCompletionRequest(BaseModel):
    """The chat-completions fields the gateway serves; others that would change the answer are refused
    (see refuse_unsupported), the rest (user, metadata, ...) are ignored."""

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


def refuse_unsupported(body: ChatCompletionRequest) -> None:
    if body.n != 1:
        raise APIError(400, f"n = {body.n} is not supported: this deployment returns one choice per request", param="n")
    extra = body.model_extra or {}
    for name, asks in _UNSUPPORTED.items():
        if name in extra and asks(extra[name]):
            raise APIError(400, f"{name} is not supported by this deployment", param=name, code="unsupported_parameter")


def stop_strings(stop: str | list[str] | None) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOP_STRINGS or not all(stops):
        raise APIError(400, f"stop takes up to {MAX_STOP_STRINGS} non-empty strings", param="stop")
    return stops


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


# -- responses ------------------------------------------------------------------------------------


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class Choice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: None = None
    finish_reason: FinishReason


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage


class Delta(BaseModel):
    """A chunk's new text; fields it does not carry are left out, as OpenAI sends them (the last chunk's is {})."""

    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _carried(self, serialize: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {key: value for key, value in serialize(self).items() if value is not None}


class ChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    logprobs: None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(BaseModel):
    """One streamed event. `usage` is null on every chunk but the last when the client asked for it
    (stream_options.include_usage), and absent otherwise, as OpenAI sends it."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None


def sse_event(payload: str) -> str:
    """A streamed event (server-sent events), as OpenAI frames each chunk."""
    return f"data: {payload}\n\n"


class Model(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Model]
