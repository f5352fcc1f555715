"""Request planning: an OpenAI chat or text completion request turned into the deployment's requests (a Plan, one
request per choice), checked first with the deployment's own preprocessing code from the image and video headers
alone (no pixel is decoded), so that bad messages or media, too many of them and prompts over the limit are
answered 400 before Triton sees them, and the prompt's token count that `usage` reports is the one the server runs.
Tools are rendered by the checkpoint's own chat template; a required or named tool choice and a JSON response
format become the guided-decoding grammar the engine applies (qwen3vl_trt.guided_decoding). Remote image and video
URLs are fetched here when the gateway allows them."""

from __future__ import annotations

import functools
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

import anyio
import anyio.to_thread

from ...errors import PromptTooLongError, RequestError
from ...guided_decoding import Guide, GuideError, json_object_guide, json_schema_guide, tool_call_guide
from ...preprocess import Preprocessor
from ...preprocess.prompts import normalize_messages
from .protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    FinishReason,
    NamedToolChoice,
    SamplingRequest,
    StopFinder,
    Usage,
    logit_bias_ids,
    refuse_unsupported,
    request_error,
    stop_strings,
)
from .reasoning import CLOSE as THINK_END
from .settings import GatewaySettings

# Prompts up to this many characters (and no video) are counted on the event loop: a millisecond or less, below the
# cost of handing them to a worker thread and back.
INLINE_COUNT_CHARS = 2048


@dataclass
class ChoiceRun:
    """One of a request's n choices as it is generated: its own request on the deployment."""

    index: int
    stop_finder: StopFinder
    completion_tokens: int = 0
    finish_reason: FinishReason = "stop"


@dataclass
class Plan:
    """One validated request: what goes to the deployment and what the response reports. kind: a chat or a text
    completion. messages (chat) or prompt (a completion's text, sent as the raw prompt). tool_names: the functions
    whose calls the answer is parsed for (none: no parsing). reasoning: split a Thinking checkpoint's reasoning
    from the answer. echo: the text a completion's answer starts with (its prompt, when asked to echo it)."""

    id: str
    created: int
    model: str
    kind: Literal["chat", "completion"]
    messages: list[dict[str, Any]] | None
    prompt: str | None
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
    n: int = 1
    seed: int | None = None
    logprobs: bool = False
    tool_names: tuple[str, ...] = ()
    reasoning: bool = False
    opens_reasoning: bool = False
    echo: str = ""
    choices: list[ChoiceRun] = field(init=False)

    def __post_init__(self) -> None:
        self.choices = [ChoiceRun(i, StopFinder(self.stops)) for i in range(self.n)]

    def request(self, choice: ChoiceRun) -> dict[str, Any]:
        """The deployment's request for one choice (AsyncClient.stream's arguments). The n choices are n requests
        seeded as TensorRT-LLM seeds the n sequences of one (the request's seed, 0 if none, plus the sequence's
        index: batch_manager/llmRequest.cpp createChildRequest); 1.2.1's backend cannot ask for n sequences itself
        (its num_return_sequences input lands in another sampling field: TensorRT-LLM PR #13633)."""
        seed = self.seed if self.n == 1 else ((self.seed or 0) + choice.index) % 2**64  # the executor's uint64
        content = {"messages": self.messages} if self.messages is not None else {"raw_prompt": True}
        return {
            "prompt": self.prompt or "",
            "images": self.images,
            "max_tokens": self.max_tokens,
            "request_id": self.id if self.n == 1 else f"{self.id}-{choice.index}",
            "stream": self.piecewise,
            "videos": self.videos,
            "seed": seed,
            "return_log_probs": self.logprobs,
            **content,
            **self.options,
        }

    def usage(self) -> Usage:
        completion = sum(c.completion_tokens for c in self.choices)
        return Usage(prompt_tokens=self.prompt_tokens, completion_tokens=completion,
                     total_tokens=self.prompt_tokens + completion)  # fmt: skip


class Planner:
    def __init__(self, settings: GatewaySettings):
        self.settings = settings
        self.preprocessor = Preprocessor.from_pretrained(settings.model_dir, limits=settings.limits.request_limits())
        prompts = self.preprocessor.prompts
        self.tokenizer = prompts.tokenizer
        # A byte-level BPE token covers at most its longest vocabulary entry's bytes, so text longer than
        # this cannot fit the prompt limit: refused before tokenizing it (the tokenizer's memory grows with
        # the text, gigabytes for tens of megabytes).
        vocabulary = self.tokenizer.get_vocab()
        self.max_prompt_chars = settings.limits.max_input_len * max(map(len, vocabulary))
        self.vocab_size = self.preprocessor.info.text.vocab_size
        # A Thinking template's generation prompt opens the reasoning, so guided output starts after it ends.
        self.opens_reasoning = prompts.opens_reasoning
        json_object_guide()  # the grammar library's start (seconds) is paid here, not by the first guided request
        self.reasoning = settings.reasoning_parser == "qwen3" or (
            settings.reasoning_parser == "auto" and prompts.opens_reasoning
        )

    def _check_model(self, model: str) -> None:
        if model != self.settings.served_model_name:
            raise APIError(
                404,
                f"the model {model!r} does not exist; this deployment serves {self.settings.served_model_name!r}",
                param="model",
                code="model_not_found",
            )

    async def plan(self, body: ChatCompletionRequest, started: float) -> Plan:
        settings = self.settings
        self._check_model(body.model)
        refuse_unsupported(body)
        stops = stop_strings(body.stop)
        tools, tool_names, guide = await self._tools_and_guide(body)
        if guide is not None and body.min_tokens:
            raise APIError(400, "min_tokens cannot go with a JSON response_format or a required tool call: the grammar "
                           "decides where the answer ends", param="min_tokens")  # fmt: skip
        messages = await self._fetch_remote_media(_checked_tool_turns(body.messages))
        try:
            limits = settings.limits.request_limits()
            chat = normalize_messages(messages, limits.max_image_bytes, limits.max_video_bytes)
            if _text_chars(chat.messages) + _text_chars(tools) > self.max_prompt_chars:
                raise self._too_many_chars()
            kwargs: dict[str, Any] = {"tools": tools} if tools else {}
            count = functools.partial(self.preprocessor.count_tokens, chat, **kwargs)
            # A long prompt on a worker thread: tens of milliseconds would stall every stream on the loop. A short
            # one here: its count takes less than handing it to a thread and back.
            short = _text_chars(chat.messages) + _text_chars(tools) <= INLINE_COUNT_CHARS and not chat.videos
            prompt_tokens = count() if short else await anyio.to_thread.run_sync(count)
        except RequestError as e:
            raise request_error(e) from None
        asked = body.max_completion_tokens or body.max_tokens
        param = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
        return Plan(
            id=f"chatcmpl-{uuid.uuid4().hex}",
            kind="chat",
            messages=chat.messages,
            prompt=None,
            images=chat.images,
            videos=chat.videos,
            prompt_tokens=prompt_tokens,
            max_tokens=self._max_tokens(prompt_tokens, asked, param),
            options={**self._sampling(body, stops), "tools": tools, "guide": guide},
            **self._shared(body, started, stops),
            logprobs=body.logprobs,
            tool_names=tool_names,
            reasoning=self.reasoning,
            opens_reasoning=self.opens_reasoning,
        )

    async def plan_completion(self, body: CompletionRequest, started: float) -> Plan:
        self._check_model(body.model)
        refuse_unsupported(body)
        stops = stop_strings(body.stop)
        prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
        if len(prompts) != 1:
            raise APIError(400, "prompt takes one string per request here; send the others as requests of their own",
                           param="prompt")  # fmt: skip
        (prompt,) = prompts
        if len(prompt) > self.max_prompt_chars:
            raise request_error(self._too_many_chars())
        try:
            count = functools.partial(self.preprocessor.count_tokens, prompt=prompt)
            short = len(prompt) <= INLINE_COUNT_CHARS
            prompt_tokens = count() if short else await anyio.to_thread.run_sync(count)
        except RequestError as e:
            raise request_error(e) from None
        return Plan(
            id=f"cmpl-{uuid.uuid4().hex}",
            kind="completion",
            messages=None,
            prompt=prompt,
            images=[],
            videos=[],
            prompt_tokens=prompt_tokens,
            max_tokens=self._max_tokens(prompt_tokens, body.max_tokens, "max_tokens"),
            options=self._sampling(body, stops),
            **self._shared(body, started, stops),
            logprobs=body.logprobs is not None,
            echo=prompt if body.echo else "",
        )

    def _shared(self, body: SamplingRequest, started: float, stops: list[str]) -> dict[str, Any]:
        """The Plan fields that chat and text completions fill alike."""
        return {
            "created": int(time.time()),
            "model": self.settings.served_model_name,
            "stops": stops,
            "include_usage": bool(body.stream_options and body.stream_options.include_usage),
            "deadline": started + self.settings.request_timeout_s,
            "piecewise": body.stream or bool(stops),
            "n": body.n,
            "seed": body.seed,
        }

    def _too_many_chars(self) -> PromptTooLongError:
        limit = self.settings.limits.max_input_len
        return PromptTooLongError(
            f"the request holds over {self.max_prompt_chars:,} characters of text, more than a prompt of {limit} "
            f"tokens can; the limit is {limit} tokens"
        )

    def _max_tokens(self, prompt_tokens: int, asked: int | None, param: str) -> int:
        limits = self.settings.limits
        room = limits.max_seq_len - prompt_tokens
        if asked is not None and asked > room:
            raise APIError(
                400,
                f"this deployment's maximum context length is {limits.max_seq_len} tokens; the prompt takes "
                f"{prompt_tokens} and {asked} were asked for the completion (at most {room})",
                param=param,
                code="context_length_exceeded",
            )
        return asked or room

    def _sampling(self, body: SamplingRequest, stops: list[str]) -> dict[str, Any]:
        return {
            "temperature": body.temperature,
            "top_p": body.top_p,
            "top_k": body.top_k,
            "min_tokens": body.min_tokens,
            "stop_words": stops,
            "presence_penalty": body.presence_penalty,
            "frequency_penalty": body.frequency_penalty,
            "repetition_penalty": body.repetition_penalty,
            "logit_bias": logit_bias_ids(body.logit_bias, self.vocab_size),
        }

    async def _tools_and_guide(
        self, body: ChatCompletionRequest
    ) -> tuple[list[dict[str, Any]] | None, tuple[str, ...], tuple[str, str] | None]:
        """The tools the template renders, the functions whose calls are parsed, and the guided-decoding grammar
        (a forced tool choice's or the response format's), built on a worker thread (milliseconds per schema).
        tool_choice "none" leaves the tools out of the prompt, so the model is not asked for calls."""
        choice = body.tool_choice or ("auto" if body.tools else "none")
        if choice != "none" and not body.tools:
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        names = tuple(t.function.name for t in body.tools or ())
        if len(set(names)) != len(names):
            raise APIError(400, "tools must have distinct function names", param="tools")
        named = choice.function.name if isinstance(choice, NamedToolChoice) else None
        if named is not None and named not in names:
            raise APIError(400, f"tool_choice names {named!r}, which is not among the tools", param="tool_choice")
        formats = body.response_format is not None and body.response_format.type != "text"
        forced = choice == "required" or named is not None
        if forced and formats:
            raise APIError(400, "a required or named tool_choice and a JSON response_format cannot both shape the "
                           "answer; send one of them", param="response_format")  # fmt: skip
        think_end = THINK_END if self.opens_reasoning else None
        functions = [t.function.model_dump(exclude_none=True) for t in body.tools or ()]

        def build() -> Guide | None:
            if forced:
                return tool_call_guide(functions, named, parallel=body.parallel_tool_calls and named is None,
                                       think_end=think_end)  # fmt: skip
            response_format = body.response_format
            if response_format is None or response_format.type == "text":
                return None
            if response_format.type == "json_object":
                return json_object_guide(think_end=think_end)
            if response_format.json_schema is None:
                raise APIError(400, "response_format json_schema needs its json_schema", param="response_format")
            schema = response_format.json_schema.schema_ or {"type": "object"}
            return json_schema_guide(schema, think_end=think_end)

        try:  # a thread only for a grammar to build: the round trip costs more than a request without one
            guide = await anyio.to_thread.run_sync(build) if forced or formats else None
        except GuideError as e:
            raise APIError(400, str(e), param="tools" if forced else "response_format", code="invalid_schema") from None
        if choice == "none":
            return None, (), None if guide is None else (guide.type, guide.text)
        tools = [t.model_dump(exclude_none=True) for t in body.tools or ()]
        return tools, names, None if guide is None else (guide.type, guide.text)

    async def _fetch_remote_media(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Messages whose http(s) image and video URLs are replaced by the downloaded bytes, when the gateway
        allows it (preprocessing refuses URLs it would have to fetch)."""
        if not self.settings.allow_remote_media:
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
            with urllib.request.urlopen(url, timeout=self.settings.remote_media_timeout_s) as response:
                data = response.read(limit + 1)
            if len(data) > limit:
                raise APIError(
                    400, f"the {kind} at {url} is over {limit:,} bytes", param="messages", code=f"{kind}_too_large"
                )
            return data

        try:
            # urllib blocks; only gateways that allow remote media get here, and anyio's pool bounds the threads.
            return await anyio.to_thread.run_sync(get)
        except OSError as e:
            raise APIError(
                400, f"cannot fetch the {kind} at {url}: {e}", param="messages", code=f"invalid_{kind}"
            ) from e


def _checked_tool_turns(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages, once every tool result names the call it answers, as OpenAI's API requires."""
    for m, message in enumerate(messages):
        if isinstance(message, dict) and message.get("role") == "tool" and not message.get("tool_call_id"):
            raise APIError(400, f"message {m} has role tool but no tool_call_id", param="messages")
    return messages


def _text_chars(value: Any) -> int:
    """Characters in the strings among the values (not the keys) of a JSON-like value; its depth is bounded
    (admission.MAX_JSON_DEPTH) before it gets here."""
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
