"""The part of OpenAI's chat-completions and completions APIs the gateway speaks: request and response models,
streamed events, error bodies and stop strings as the API defines them (matched in the decoded text). Which
parameters are served and which are refused, on each target, is docs/openai-api.md's table."""

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
MAX_CHOICES = 16  # n: each choice is a request of its own on the deployment
MAX_LOGIT_BIAS = 300  # entries, as OpenAI's API caps logit_bias
FinishReason = Literal["stop", "length", "tool_calls"]


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


# The body's names of GenerationRequest's fields where they differ (OpenAI's), else the field's own.
_PARAMS = {"prompt": "messages", "images": "messages", "videos": "messages", "stop_words": "stop",
           "guide": "response_format", "return_log_probs": "logprobs"}  # fmt: skip
# The completions body names top_logprobs logprobs (an int).
COMPLETION_PARAMS = {"top_logprobs": "logprobs"}


def request_error(error: RequestError, **params: str) -> APIError:
    """The answer to a RequestError: its param the body's name of the field at fault (`params` over the usual
    ones: the body may name max_tokens max_completion_tokens), or messages."""
    field = error.field or "messages"
    return rejected(str(error), type(error).__name__, params.get(field) or _PARAMS.get(field, field))


def rejected(message: str, kind: str | None, param: str = "messages") -> APIError:
    """A request refused as sent, by the gateway or a stage: the same code for the same kind of RequestError
    (`kind`: its class name) wherever it was found."""
    code = next((c for error, c in _ERROR_CODES if error.__name__ == kind), None)
    return APIError(400, message, param=param, code=code)


# -- requests -------------------------------------------------------------------------------------


class StreamOptions(BaseModel):
    include_usage: bool = False


class FunctionDefinition(BaseModel):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")  # OpenAI's rule for names
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; none: any object
    strict: bool | None = None


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class JSONSchemaFormat(BaseModel):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")  # none: any JSON object
    strict: bool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class SamplingRequest(BaseModel):
    """What chat and text completions share: sampling, penalties, stop strings, choices and streaming. Extra
    fields are kept so that those asking for something the deployment does not do are refused by name (see
    refuse_unsupported); the rest (user, metadata, ...) are ignored."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    # The bounds the engine needs are the generation request's (serving.request, checked once the body is planned);
    # these are the OpenAI API's own caps.
    model: str
    max_tokens: int | None = None
    temperature: float | None = Field(None, le=2.0)
    top_p: float | None = None
    top_k: int | None = None  # an extension vLLM and TensorRT-LLM's servers take too
    min_tokens: int | None = None  # idem
    # The engine subtracts them from the logits of tokens already in the sequence.
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = None  # an extension, as vLLM takes it
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES)


class ChatCompletionRequest(SamplingRequest):
    """The chat-completions fields the gateway serves."""

    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)


class CompletionRequest(SamplingRequest):
    """The (legacy) completions fields the gateway serves: a prompt as it is, without the chat template."""

    prompt: str | list[str]
    max_tokens: int | None = 16  # OpenAI's default for completions
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=5)
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)


# Fields whose non-default values ask for something the deployment does not do, and why.
_UNSUPPORTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "functions": (bool, "deprecated; send tools"),
    "function_call": (
        lambda v: v is not None,
        "deprecated; send tool_choice",
    ),
    "audio": (lambda v: v is not None, "this model has no audio output"),
    "modalities": (lambda v: v not in (None, ["text"]), "this model answers in text only"),
    "prediction": (lambda v: v is not None, "predicted outputs are not served"),
    "web_search_options": (lambda v: v is not None, "web search is not served"),
}


def refuse_unsupported(body: SamplingRequest) -> None:
    extra = body.model_extra or {}
    for name, (asks, why) in _UNSUPPORTED.items():
        if name in extra and asks(extra[name]):
            raise APIError(400, f"{name}: {why}", param=name, code="unsupported_parameter")
    if isinstance(body, ChatCompletionRequest) and body.top_logprobs and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs true", param="top_logprobs")
    if isinstance(body, CompletionRequest):
        if body.echo and body.logprobs is not None:
            raise APIError(400, "echo with logprobs: the engine returns no log probabilities for the prompt",
                           param="echo", code="unsupported_parameter")  # fmt: skip
        if body.suffix:
            raise APIError(400, "suffix: Qwen3-VL has no fill-in-the-middle mode", param="suffix",
                           code="unsupported_parameter")  # fmt: skip
        if body.best_of not in (None, body.n):
            raise APIError(400, "best_of: the deployment returns every sequence it generates; send n only",
                           param="best_of", code="unsupported_parameter")  # fmt: skip


def logit_bias_ids(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias (token id strings -> a bias in [-100, 100]) as ids (the vocabulary's bound is the
    generation request's)."""
    if not bias:
        return None
    if len(bias) > MAX_LOGIT_BIAS:
        raise APIError(400, f"logit_bias takes up to {MAX_LOGIT_BIAS} tokens", param="logit_bias")
    out = {}
    for key, value in bias.items():
        if not key.isdigit():
            raise APIError(400, f"logit_bias: {key!r} is not a token id", param="logit_bias")
        if not -100.0 <= value <= 100.0:
            raise APIError(400, f"logit_bias: the bias of {key} must be in [-100, 100]", param="logit_bias")
        out[int(key)] = float(value)
    return out


def stop_strings(stop: str | list[str] | None) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOP_STRINGS:
        raise APIError(400, f"stop takes up to {MAX_STOP_STRINGS} strings", param="stop")
    return stops


def held_prefix(text: str, *tags: str) -> int:
    """The length of the longest tail of `text` that is a proper start of one of the tags (it may yet become one)."""
    return max((n for tag in tags for n in range(1, len(tag)) if text.endswith(tag[:n])), default=0)


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
        keep = held_prefix(self.pending, *self.stops)
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


class FunctionCall(BaseModel):
    name: str
    arguments: str  # a JSON object, as a string


class ToolCallMessage(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    """reasoning_content: a Thinking checkpoint's reasoning, split from the answer (vLLM's name for it)."""

    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallMessage] | None = None  # absent without a call, as OpenAI's

    @model_serializer(mode="wrap")
    def _without_absent_calls(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        body = handler(self)
        if self.tool_calls is None:
            body.pop("tool_calls", None)
        return body


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)  # top_logprobs of them, the likeliest first


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob]


class Choice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: FinishReason


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage


class FunctionCallDelta(BaseModel):
    name: str | None = None
    arguments: str = ""

    @model_serializer(mode="wrap")
    def _carried(self, serialize: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {key: value for key, value in serialize(self).items() if value is not None}


class ToolCallChunk(BaseModel):
    """A streamed tool call: the first chunk of a call has its id, type and name, the next ones argument
    fragments, as OpenAI streams them."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta

    @model_serializer(mode="wrap")
    def _carried(self, serialize: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {key: value for key, value in serialize(self).items() if value is not None}


class Delta(BaseModel):
    """A chunk's new text; fields it does not carry are left out, as OpenAI sends them (the last chunk's is {})."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallChunk] | None = None

    @model_serializer(mode="wrap")
    def _carried(self, serialize: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {key: value for key, value in serialize(self).items() if value is not None}


class ChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    logprobs: ChoiceLogprobs | None = None
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


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None = None  # with logprobs > 0: each token's alternatives by their text
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None


class Completion(BaseModel):
    """A text completion, whole or (object the same, as OpenAI streams them) one streamed chunk of it."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


def sse_event(payload: str) -> str:
    """A streamed event (server-sent events), as OpenAI frames each chunk."""
    return f"data: {payload}\n\n"


class Model(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Model]
