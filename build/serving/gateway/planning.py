"""Request planning: an OpenAI chat or text completion request turned into the deployment's requests (a Plan, one
request per choice), checked first with the deployment's own preprocessing code from the image and video headers
alone (no pixel is decoded), so that bad messages or media, too many of them and prompts over the limit are
answered 400 before Triton sees them, and the prompt's token count that `usage` reports is the one the server runs:
the prompt goes to the deployment rendered and tokenized (prompt_ids), so preprocessing renders and tokenizes only
for clients that send text or messages.
Tools are rendered by the checkpoint's own chat template; a required or named tool choice and a JSON response
format become the guided-decoding grammar the engine applies (qwen3vl_trt.decoding.guides). Remote image and video
URLs are fetched here when the gateway allows them."""

from __future__ import annotations

import functools
import time
import urllib.request
import uuid
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import anyio
import anyio.to_thread

from ...decoding.guides import Guide, GuideError, json_object_guide, json_schema_guide, tool_call_guide
from ...errors import PromptTooLongError, RequestError
from ...preprocess import Preprocessor
from ...preprocess.prompts import normalize_messages
from ..request import GenerationRequest
from .protocol import (
    COMPLETION_PARAMS,
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
    completion. request: what each choice asks the deployment (its seed aside). tool_names: the functions whose calls
    the answer is parsed for (none: no parsing). reasoning: split a Thinking checkpoint's reasoning from the answer.
    echo: the text a completion's answer starts with (its prompt, when asked to echo it)."""

    id: str
    created: int
    model: str
    kind: Literal["chat", "completion"]
    request: GenerationRequest
    prompt_tokens: int
    stops: list[str]
    include_usage: bool
    deadline: float  # time.monotonic() by which the request ends
    n: int = 1
    tool_names: tuple[str, ...] = ()
    reasoning: bool = False
    opens_reasoning: bool = False
    echo: str = ""
    choices: list[ChoiceRun] = field(init=False)

    def __post_init__(self) -> None:
        self.choices = [ChoiceRun(i, StopFinder(self.stops)) for i in range(self.n)]

    @property
    def max_tokens(self) -> int:
        return self.request.max_tokens

    @property
    def expected_cost(self) -> int:
        """What the admission's short-first order ranks it by: the tokens each choice may take, prompt and output."""
        return self.n * (self.prompt_tokens + self.max_tokens)

    @property
    def logprobs(self) -> bool:
        return self.request.return_log_probs

    def choice(self, run: ChoiceRun) -> tuple[str, GenerationRequest]:
        """The request id and the deployment's request of one choice. The n choices are n requests seeded as
        TensorRT-LLM seeds the n sequences of one (the request's seed plus the sequence's index:
        batch_manager/llmRequest.cpp createChildRequest); 1.2.1's backend cannot ask for n sequences itself (its
        num_return_sequences input lands in another sampling field: TensorRT-LLM PR #13633)."""
        if self.n == 1:
            return self.id, self.request
        seed = (self.request.seed + run.index) % 2**64  # the executor's uint64
        return f"{self.id}-{run.index}", replace(self.request, seed=seed)

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
        self.reasoning = settings.options.reasoning_parser == "qwen3" or (
            settings.options.reasoning_parser == "auto" and prompts.opens_reasoning
        )

    def _check_model(self, model: str) -> None:
        if model != self.settings.served_model_name:
            raise APIError(
                404,
                f"the model {model!r} does not exist; this deployment serves {self.settings.served_model_name!r}",
                param="model",
                code="model_not_found",
            )

    async def plan(self, body: ChatCompletionRequest, started: float, priority: int = 0) -> Plan:
        """priority: the request's on the deployment (serving.request.PRIORITY_LEVELS; 0, interactive)."""
        settings = self.settings
        self._check_model(body.model)
        refuse_unsupported(body)
        stops = stop_strings(body.stop)
        tools, tool_names, guide = await self._tools_and_guide(body)
        messages = await self._fetch_remote_media(_checked_tool_turns(body.messages))
        try:
            limits = settings.limits.request_limits()
            chat = normalize_messages(messages, limits.max_image_bytes, limits.max_video_bytes)
            if _text_chars(chat.messages) + _text_chars(tools) > self.max_prompt_chars:
                raise self._too_many_chars()
            kwargs: dict[str, Any] = {"tools": tools} if tools else {}
            tokenize = functools.partial(self.preprocessor.prompt_ids, chat, **kwargs)
            # A long prompt on a worker thread: tens of milliseconds would stall every stream on the loop. A short
            # one here: its tokens take less than handing it to a thread and back.
            short = _text_chars(chat.messages) + _text_chars(tools) <= INLINE_COUNT_CHARS and not chat.videos
            ids, prompt_tokens = tokenize() if short else await anyio.to_thread.run_sync(tokenize)
        except RequestError as e:
            raise request_error(e) from None
        # The prompt goes rendered and tokenized: preprocessing takes its ids and does neither again.
        content = dict(prompt_ids=ids, images=chat.images, videos=chat.videos)
        # max_completion_tokens over the deprecated max_tokens, as OpenAI takes them (0 is refused, not skipped).
        named = body.max_completion_tokens is not None
        param = "max_completion_tokens" if named else "max_tokens"
        asked = body.max_completion_tokens if named else body.max_tokens
        if body.top_logprobs and asked is None:
            # The engine holds each such request's logits for max_tokens tokens in pinned host memory (TensorRT-LLM's
            # llmRequest.h allocGenerationLogitsHost): not the whole context's worth by default.
            raise APIError(400, "top_logprobs needs max_completion_tokens (or max_tokens): the engine holds the "
                           "logits of that many tokens in host memory per request",
                           param="max_completion_tokens")  # fmt: skip
        request = self._request(body, asked, {"max_tokens": param}, prompt_tokens, stops, guide=guide,
                                return_log_probs=body.logprobs, top_logprobs=body.top_logprobs, priority=priority,
                                **content)  # fmt: skip
        return Plan(
            id=f"chatcmpl-{uuid.uuid4().hex}",
            kind="chat",
            request=request,
            prompt_tokens=prompt_tokens,
            **self._shared(body, started, stops),
            tool_names=tool_names,
            reasoning=self.reasoning,
            opens_reasoning=self.opens_reasoning,
        )

    async def plan_completion(self, body: CompletionRequest, started: float, priority: int = 0) -> Plan:
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
            tokenize = functools.partial(self.preprocessor.prompt_ids, prompt=prompt)
            short = len(prompt) <= INLINE_COUNT_CHARS
            ids, prompt_tokens = tokenize() if short else await anyio.to_thread.run_sync(tokenize)
        except RequestError as e:
            raise request_error(e) from None
        request = self._request(body, body.max_tokens, COMPLETION_PARAMS, prompt_tokens, stops, prompt_ids=ids,
                                priority=priority,
                                return_log_probs=body.logprobs is not None, top_logprobs=body.logprobs)  # fmt: skip
        return Plan(
            id=f"cmpl-{uuid.uuid4().hex}",
            kind="completion",
            request=request,
            prompt_tokens=prompt_tokens,
            **self._shared(body, started, stops),
            echo=prompt if body.echo else "",
        )

    def _request(
        self,
        body: SamplingRequest,
        max_tokens: int | None,
        params: dict[str, str],
        prompt_tokens: int,
        stops: list[str],
        **content: Any,
    ) -> GenerationRequest:
        """The deployment's request of the body: its sampling options, `content` (the prompt or messages, media,
        tools, guide) and max_tokens, all the room the context leaves when the body asks for none. Refused where
        GenerationRequest refuses it, with its message and the body's name of the field at fault (`params`: the
        body's names of fields where they are not the usual ones)."""
        max_seq_len = self.settings.limits.max_seq_len
        try:
            request = GenerationRequest(
                max_tokens=max_seq_len - prompt_tokens if max_tokens is None else max_tokens,
                # Tokens as they come for a streamed answer, and for stop strings (matched here in the text as it
                # comes, so the request is cancelled at the match); else one response, which spares a
                # postprocessing request per token (about 1.5 ms each on the CPU target).
                stream=body.stream or bool(stops),
                stop_words=stops,
                **_sampling(body),
                **content,
            )
            request.check_vocabulary(self.vocab_size)
            request.check_top_logprobs(self.settings.limits.max_top_logprobs)
            request.check_length(prompt_tokens, max_seq_len)
        except RequestError as e:
            raise request_error(e, **params) from None
        return request

    def _shared(self, body: SamplingRequest, started: float, stops: list[str]) -> dict[str, Any]:
        """The Plan fields that chat and text completions fill alike."""
        return {
            "created": int(time.time()),
            "model": self.settings.served_model_name,
            "stops": stops,
            "include_usage": bool(body.stream_options and body.stream_options.include_usage),
            "deadline": started + self.settings.options.request_timeout_s,
            "n": body.n,
        }

    def _too_many_chars(self) -> PromptTooLongError:
        limit = self.settings.limits.max_input_len
        return PromptTooLongError(
            f"the request holds over {self.max_prompt_chars:,} characters of text, more than a prompt of {limit} "
            f"tokens can; the limit is {limit} tokens"
        )

    async def _tools_and_guide(
        self, body: ChatCompletionRequest
    ) -> tuple[list[dict[str, Any]] | None, tuple[str, ...], Guide | None]:
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
            return None, (), guide
        tools = [t.model_dump(exclude_none=True) for t in body.tools or ()]
        return tools, names, guide

    async def _fetch_remote_media(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Messages whose http(s) image and video URLs are replaced by the downloaded bytes, when the gateway
        allows it (preprocessing refuses URLs it would have to fetch)."""
        if not self.settings.options.allow_remote_media:
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
            with urllib.request.urlopen(url, timeout=self.settings.options.remote_media_timeout_s) as response:
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


def _sampling(body: SamplingRequest) -> dict[str, Any]:
    """The body's sampling options as GenerationRequest takes them (None: not asked for, the request's default)."""
    return dict(
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        min_tokens=body.min_tokens,
        seed=body.seed,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty,
        logit_bias=logit_bias_ids(body.logit_bias),
    )


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
