"""Chat planning: an OpenAI chat request turned into the deployment's request (a Plan), checked first with the
deployment's own preprocessing code from the image and video headers alone (no pixel is decoded), so that bad
messages or media, too many of them and prompts over the limit are answered 400 before Triton sees them, and
the prompt's token count that `usage` reports is the one the server runs. Remote image and video URLs are
fetched here when the gateway allows them."""

from __future__ import annotations

import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.to_thread

from ...errors import PromptTooLongError, RequestError
from ...preprocess import Preprocessor
from ...preprocess.prompts import normalize_messages
from .protocol import (
    APIError,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChunkChoice,
    Delta,
    FinishReason,
    StopFinder,
    Usage,
    refuse_unsupported,
    request_error,
    sse_event,
    stop_strings,
)
from .settings import GatewaySettings


@dataclass
class Plan:
    """One validated request: what goes to the deployment and what the response reports."""

    id: str
    created: int
    model: str
    chat: list[dict[str, Any]]
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
    completion_tokens: int = 0
    finish_reason: FinishReason = "stop"
    stop_finder: StopFinder = field(init=False)

    def __post_init__(self) -> None:
        self.stop_finder = StopFinder(self.stops)

    def usage(self) -> Usage:
        total = self.prompt_tokens + self.completion_tokens
        return Usage(prompt_tokens=self.prompt_tokens, completion_tokens=self.completion_tokens, total_tokens=total)

    def chunk(self, delta: Delta, finish_reason: FinishReason | None = None) -> str:
        chunk = ChatCompletionChunk(
            id=self.id,
            created=self.created,
            model=self.model,
            choices=[ChunkChoice(delta=delta, finish_reason=finish_reason)],
        )
        return sse_event(chunk.model_dump_json(exclude=None if self.include_usage else {"usage"}, exclude_none=False))


class Planner:
    def __init__(self, settings: GatewaySettings):
        self.settings = settings
        self.preprocessor = Preprocessor.from_pretrained(settings.model_dir, limits=settings.limits.request_limits())
        # A byte-level BPE token covers at most its longest vocabulary entry's bytes, so text longer than
        # this cannot fit the prompt limit: refused before tokenizing it (the tokenizer's memory grows with
        # the text, gigabytes for tens of megabytes).
        vocabulary = self.preprocessor.prompts.tokenizer.get_vocab()
        self.max_prompt_chars = settings.limits.max_input_len * max(map(len, vocabulary))

    async def plan(self, body: ChatCompletionRequest, started: float) -> Plan:
        settings = self.settings
        if body.model != settings.served_model_name:
            raise APIError(
                404,
                f"the model {body.model!r} does not exist; this deployment serves {settings.served_model_name!r}",
                param="model",
                code="model_not_found",
            )
        refuse_unsupported(body)
        stops = stop_strings(body.stop)
        messages = await self._fetch_remote_media(body.messages)
        try:
            limits = settings.limits.request_limits()
            chat = normalize_messages(messages, limits.max_image_bytes, limits.max_video_bytes)
            if _text_chars(chat.messages) > self.max_prompt_chars:
                raise PromptTooLongError(
                    f"the messages hold over {self.max_prompt_chars:,} characters of text, more than a prompt of "
                    f"{settings.limits.max_input_len} tokens can; the limit is {settings.limits.max_input_len} tokens"
                )
            # On a worker thread: tens of milliseconds for a long prompt would stall every stream on the loop.
            prompt_tokens = await anyio.to_thread.run_sync(self.preprocessor.count_tokens, chat)
        except RequestError as e:
            raise request_error(e) from None
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
        return Plan(
            id=f"chatcmpl-{uuid.uuid4().hex}",
            created=int(time.time()),
            model=settings.served_model_name,
            chat=chat.messages,
            images=chat.images,
            videos=chat.videos,
            prompt_tokens=prompt_tokens,
            max_tokens=asked or room,
            options=options,
            stops=stops,
            include_usage=bool(body.stream_options and body.stream_options.include_usage),
            deadline=started + settings.request_timeout_s,
            piecewise=body.stream or bool(stops),
        )

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
