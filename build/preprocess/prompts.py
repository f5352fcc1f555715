"""Prompts: chat messages or a plain prompt -> token ids with one placeholder per image and per video frame
pair, and the images' and videos' bytes in prompt order.

The chat template is the checkpoint's own, rendered the way transformers renders it (sandboxed
Jinja with trim_blocks/lstrip_blocks, its tojson, raise_exception, strftime_now), and tokenized by
the checkpoint's tokenizer.json, so the ids equal `processor.apply_chat_template(..., tokenize=True)`.
Images and videos travel as bytes: OpenAI-style `image_url` / `video_url` parts with a data: URL, or `image` /
`video` parts holding the bytes. URLs and paths are not fetched: a server has no business reading them.

A video's `<|vision_start|><|video_pad|><|vision_end|>` becomes, per temporal patch, `<{t:.1f} seconds>` and that
patch's `<|vision_start|><|video_pad|><|vision_end|>`, substituted in the text before it is tokenized, as
transformers 4.57.3's processor (and vLLM) do. transformers 5.x keeps the outer wrapper as well (one more
<|vision_start|> before the first timestamp and <|vision_end|> after the last); the layout Qwen3-VL was released
with is 4.57's.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, NamedTuple

import jinja2
import jinja2.ext
import numpy as np
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from ..common.limits import ImageLimits, VideoLimits
from ..errors import CheckpointError, ImageTooLargeError, MessageError
from .videos import DecodedVideo, VideoSource, check_video_bytes

ROLES = ("system", "user", "assistant", "tool")
IMAGE_PLACEHOLDER = "<|image_pad|>"
VISION_START, VISION_END, VIDEO_PLACEHOLDER = "<|vision_start|>", "<|vision_end|>", "<|video_pad|>"
VIDEO_WRAPPED = VISION_START + VIDEO_PLACEHOLDER + VISION_END
# Names transformers passes a message's reasoning under; templates read the first (5.x aliases them).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_BASE64_LINE_BREAKS = (" ", "\t", "\r", "\n")
# A tool that no template names: rendering with it and without tells whether a template has a tools section.
_PROBE_TOOL = {"type": "function", "function": {"name": "probe_7f3a", "description": "", "parameters": {}}}


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # transformers overrides Jinja's tojson, which would HTML-escape.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; it renders its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def _special_tokens(root: Path) -> dict[str, str]:
    """The tokenizer's named special tokens, which transformers passes to the template (eos_token, ...)."""
    found: dict[str, str] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        path = root / name
        if not path.is_file():
            continue
        try:
            config = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{path} is not valid JSON: {e}") from e
        for key in _SPECIAL_TOKEN_NAMES:
            value = config.get(key)
            value = value.get("content") if isinstance(value, Mapping) else value
            if isinstance(value, str) and key not in found:
                found[key] = value
    return found


def load_chat_template(model_dir: str | os.PathLike[str]) -> str:
    """The processor's template: chat_template.jinja, chat_template.json, then tokenizer_config.json."""
    root = Path(model_dir)
    if (root / "chat_template.jinja").is_file():
        return (root / "chat_template.jinja").read_text()
    for name in ("chat_template.json", "tokenizer_config.json"):
        path = root / name
        if path.is_file():
            try:
                template = json.loads(path.read_text()).get("chat_template")
            except json.JSONDecodeError as e:
                raise CheckpointError(f"{path} is not valid JSON: {e}") from e
            if isinstance(template, str):
                return template
    raise CheckpointError(
        f"{root} has no chat template (chat_template.jinja, chat_template.json or tokenizer_config.json)"
    )


@dataclass(frozen=True)
class Prompt:
    """The prompt's text with one wrapped placeholder per image and per video, and their sources in the same order;
    PromptBuilder.token_ids tokenizes it once the videos' timestamps are known. ids: the prompt tokenized already
    (by a client that rendered it: Preprocessor.prompt_ids), which replaces the text."""

    text: str
    add_special_tokens: bool
    images: tuple[bytes, ...]
    videos: tuple[VideoSource, ...] = ()
    ids: np.ndarray | None = None


class NormalizedMessages(NamedTuple):
    """Chat messages normalize_messages checked, in the form the template expects (image and video parts reduced
    to {"type": "image"} and {"type": "video"}), with the images' bytes and the videos in the order of their parts."""

    messages: list[dict[str, Any]]
    images: list[bytes]
    videos: list[VideoSource]


class PromptBuilder:
    def __init__(self, model_dir: str | os.PathLike[str]):
        root = Path(model_dir)
        tokenizer_file = root / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise CheckpointError(f"{tokenizer_file} is missing; copy tokenizer.json from the released checkpoint")
        self.tokenizer = Tokenizer.from_file(str(tokenizer_file))
        image_token_id = self.tokenizer.token_to_id(IMAGE_PLACEHOLDER)
        if image_token_id is None:
            raise CheckpointError(f"{tokenizer_file} has no {IMAGE_PLACEHOLDER} token")
        self.image_token_id = image_token_id
        self._vision_start = self.tokenizer.token_to_id(VISION_START)
        self._vision_end = self.tokenizer.token_to_id(VISION_END)
        self._video_token_id = self.tokenizer.token_to_id(VIDEO_PLACEHOLDER)
        # transformers encodes chat prompts without truncation or padding, whatever tokenizer.json says.
        self.tokenizer.no_truncation()
        self.tokenizer.no_padding()
        self.special_tokens = _special_tokens(root)
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _GenerationTag]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self.template = env.from_string(load_chat_template(root))
        except CheckpointError:
            raise
        except Exception as e:  # syntax errors, unknown tags or filters
            raise CheckpointError(f"{root}: the chat template does not compile: {e}") from e
        self.root = root
        probe = [{"role": "user", "content": "hi"}]
        self.renders_tools = self._render(probe, True, {"tools": [_PROBE_TOOL]}) != self._render(probe, True, {})
        # A Thinking template's generation prompt opens the reasoning block, so generation starts inside it.
        opened = self._render(probe, True, {}).removeprefix(self._render(probe, False, {}))
        self.opens_reasoning = opened.rstrip().endswith("<think>")

    def from_messages(
        self,
        messages: Sequence[Mapping[str, Any]] | NormalizedMessages,
        add_generation_prompt: bool = True,
        max_image_bytes: int = ImageLimits.max_image_bytes,
        max_video_bytes: int = VideoLimits.max_video_bytes,
        **template_kwargs: Any,
    ) -> Prompt:
        """Renders the checkpoint's chat template; extra keyword arguments (tools, documents, template
        switches) reach the template as transformers passes them. Messages normalized already are taken as they
        are (their media were checked against the byte limits they were normalized with)."""
        if "continue_final_message" in template_kwargs:
            raise MessageError("continue_final_message is not supported; send the conversation to continue from")
        if template_kwargs.get("tools") and not self.renders_tools:
            raise MessageError(
                f"the chat template of {self.root.name} has no tools section, so the model would never see the tools; "
                "send the request without tools, or serve a checkpoint whose template renders them"
            )
        if not isinstance(messages, NormalizedMessages):
            messages = normalize_messages(messages, max_image_bytes, max_video_bytes)
        chat, images, videos = messages
        try:
            text = self._render(chat, add_generation_prompt, template_kwargs)
        except Exception as e:  # raise_exception() from the template, or its code tripping on odd content
            raise MessageError(f"the chat template rejected the messages: {e}") from e
        prompt = Prompt(text, False, tuple(images), tuple(videos))
        self._check_placeholders(prompt, self._encode(text, add_special_tokens=False), "the rendered chat")
        return prompt

    def _render(self, chat: Sequence[Mapping[str, Any]], add_generation_prompt: bool, kwargs: Mapping[str, Any]) -> str:
        return self.template.render(
            messages=chat, add_generation_prompt=add_generation_prompt, **{**self.special_tokens, **kwargs}
        )

    def from_prompt(
        self,
        prompt: str,
        images: Sequence[bytes] = (),
        max_image_bytes: int = ImageLimits.max_image_bytes,
        videos: Sequence[VideoSource] = (),
        max_video_bytes: int = VideoLimits.max_video_bytes,
    ) -> Prompt:
        """A raw prompt (no template); each image is <|vision_start|><|image_pad|><|vision_end|> in it, each
        video <|vision_start|><|video_pad|><|vision_end|>."""
        if not isinstance(prompt, str):
            raise MessageError(f"prompt must be a string, got {type(prompt).__name__}")
        if not prompt:
            raise MessageError("the prompt is empty")
        for k, image in enumerate(images):
            _check_image_bytes(len(image), max_image_bytes, f"image {k}")
        for k, video in enumerate(videos):
            _check_video(video, max_video_bytes, f"video {k}")
        made = Prompt(prompt, True, tuple(images), tuple(videos))
        ids = self._encode(prompt, add_special_tokens=True)
        self._check_placeholders(made, ids, "the prompt")
        pads = np.flatnonzero(ids == self.image_token_id)
        wrapped = (pads > 0) & (pads < ids.size - 1)
        wrapped[wrapped] &= (ids[pads[wrapped] - 1] == self._vision_start) & (
            ids[pads[wrapped] + 1] == self._vision_end
        )
        if not wrapped.all():
            # transformers finds images by their vision_start token; a bare placeholder gets wrong positions.
            raise MessageError(
                f"image placeholder {int(np.flatnonzero(~wrapped)[0])} is not written as "
                f"{VISION_START}{IMAGE_PLACEHOLDER}{VISION_END}"
            )
        return made

    def from_ids(
        self,
        prompt_ids: Sequence[int] | np.ndarray,
        images: Sequence[bytes] = (),
        videos: Sequence[VideoSource] = (),
        max_bytes: tuple[int, int] = (ImageLimits.max_image_bytes, VideoLimits.max_video_bytes),
    ) -> Prompt:
        """A prompt a client tokenized already (Preprocessor.prompt_ids), checked as far as ids can be: ids the
        tokenizer knows, one placeholder per image (the videos' are counted once their frames are known:
        Preprocessor._prepare). max_bytes: the image and the video byte limits."""
        ids = np.asarray(prompt_ids, dtype=np.int64).reshape(-1)
        known = self.tokenizer.get_vocab_size(with_added_tokens=True)
        if ids.size == 0 or ids.min() < 0 or ids.max() >= known:
            raise MessageError(f"prompt_ids must be a non-empty list of token ids below {known}")
        placeholders = int((ids == self.image_token_id).sum())
        if placeholders != len(images):
            raise MessageError(f"prompt_ids hold {placeholders} image placeholder(s) but {len(images)} image(s) came")
        for k, image in enumerate(images):
            _check_image_bytes(len(image), max_bytes[0], f"image {k}")
        for k, video in enumerate(videos):
            _check_video(video, max_bytes[1], f"video {k}")
        return Prompt("", False, tuple(images), tuple(videos), ids)

    def token_ids(self, prompt: Prompt, video_timestamps: Sequence[Sequence[float]] = ()) -> np.ndarray:
        """The prompt's ids, each video's placeholder replaced by its temporal patches (one <|video_pad|> each,
        introduced by its time) before tokenizing, as the processor substitutes text."""
        if prompt.ids is not None:
            return prompt.ids
        if len(video_timestamps) != len(prompt.videos):
            raise MessageError(f"{len(prompt.videos)} videos but timestamps for {len(video_timestamps)}")
        pieces = prompt.text.split(VIDEO_WRAPPED)
        text = pieces[0]
        for seconds, piece in zip(video_timestamps, pieces[1:], strict=True):
            text += "".join(f"<{t:.1f} seconds>{VIDEO_WRAPPED}" for t in seconds) + piece
        return self._encode(text, prompt.add_special_tokens)

    def _encode(self, text: str, add_special_tokens: bool) -> np.ndarray:
        return np.asarray(self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids, dtype=np.int64)

    def _check_placeholders(self, prompt: Prompt, ids: np.ndarray, where: str) -> None:
        num_images = len(prompt.images)
        if self._video_token_id is not None:
            wrapped, bare = prompt.text.count(VIDEO_WRAPPED), int((ids == self._video_token_id).sum())
            if bare != wrapped:
                raise MessageError(f"{where}: write each video placeholder as {VIDEO_WRAPPED}")
            if wrapped != len(prompt.videos):
                raise MessageError(
                    f"{where} has {wrapped} {VIDEO_PLACEHOLDER} placeholder(s) but {len(prompt.videos)} video(s) were "
                    f"sent; put {VIDEO_WRAPPED} where each video goes"
                )
        placeholders = int((ids == self.image_token_id).sum())
        if placeholders != num_images:
            raise MessageError(
                f"{where} has {placeholders} {IMAGE_PLACEHOLDER} placeholder(s) but {num_images} image(s) were sent; "
                f"put <|vision_start|>{IMAGE_PLACEHOLDER}<|vision_end|> where each image goes"
            )


def expand_visual_tokens(ids: np.ndarray, tokens_per_placeholder: Mapping[int, Sequence[int]]) -> np.ndarray:
    """Repeats the k-th placeholder of each token id (image pad: per image; video pad: per temporal patch of every
    video) tokens_per_placeholder[id][k] times, as the processor does in text."""
    repeats = np.ones(ids.size, dtype=np.int64)
    for token_id, counts in tokens_per_placeholder.items():
        repeats[ids == token_id] = np.asarray(counts, dtype=np.int64)
    return np.repeat(ids, repeats)


def _check_image_bytes(size: int, max_image_bytes: int, where: str) -> None:
    if size > max_image_bytes:
        raise ImageTooLargeError(
            f"{where}: the image is {size:,} bytes, over the limit of {max_image_bytes:,} bytes per image "
            "(max_image_bytes); send a smaller or more compressed image"
        )


def _check_video(video: object, max_video_bytes: int, where: str) -> None:
    if isinstance(video, DecodedVideo):
        return
    if not isinstance(video, (bytes, bytearray, memoryview)):
        raise MessageError(f"{where}: expected the encoded video's bytes, got {type(video).__name__}")
    check_video_bytes(len(video), max_video_bytes, where)


def _base64_decoded_size(payload: str) -> int:
    """How many bytes a base64 payload (MIME line breaks allowed) decodes to, counted without decoding it."""
    chars = len(payload) - sum(payload.count(c) for c in _BASE64_LINE_BREAKS)
    padding = payload[-8:].rstrip()[-2:].count("=")
    return chars * 3 // 4 - padding


def _media_bytes(part: Mapping[str, Any], kind: str, where: str, max_bytes: int) -> bytes | DecodedVideo:
    """The bytes of an image or video part (kind "image" or "video"), from its data: URL (`<kind>_url`) or
    `<kind>` key; a video part may also hold a DecodedVideo. The size is checked before base64 is decoded."""
    check = _check_image_bytes if kind == "image" else check_video_bytes
    if f"{kind}_url" in part:
        url = part[f"{kind}_url"]
        url = url.get("url") if isinstance(url, Mapping) else url
        if not isinstance(url, str) or not url:
            raise MessageError(f"{where}: {kind}_url has no url")
        if not url.startswith("data:"):
            raise MessageError(
                f"{where}: only data: URLs are accepted (got {url[:40]!r}); send the {kind} bytes inline, or start "
                "the OpenAI gateway with --allow-remote-media to have it fetch http(s) URLs"
            )
        header, _, payload = url.partition(",")
        if ";base64" not in header:
            raise MessageError(f"{where}: the data: URL must be base64 encoded")
        check(_base64_decoded_size(payload), max_bytes, where)
        try:
            return base64.b64decode("".join(payload.split()), validate=True)  # MIME line breaks are fine
        except (binascii.Error, ValueError) as e:
            raise MessageError(f"{where}: the data: URL is not valid base64 ({e})") from e
    media = part.get(kind)
    if isinstance(media, (bytes, bytearray, memoryview)):
        check(len(media), max_bytes, where)
        return bytes(media)
    if kind == "video" and isinstance(media, DecodedVideo):
        return media
    if media is None and not any(k in part for k in ("url", "path", "base64")):
        raise MessageError(f"{where}: {kind} part without an {kind}; put the encoded bytes under '{kind}'")
    raise MessageError(
        f"{where}: {kind} parts must carry encoded bytes under '{kind}' or a data: URL under '{kind}_url'; "
        "URLs and paths are not fetched"
    )


def normalize_messages(
    messages: Sequence[Mapping[str, Any]],
    max_image_bytes: int = ImageLimits.max_image_bytes,
    max_video_bytes: int = VideoLimits.max_video_bytes,
) -> NormalizedMessages:
    """The messages validated and normalized; an image or video over its byte limit is refused before it is
    decoded."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise MessageError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    chat: list[dict[str, Any]] = []
    images: list[bytes] = []
    videos: list[VideoSource] = []
    for m, original in enumerate(messages):
        if not isinstance(original, Mapping):
            raise MessageError(f"message {m} must be a dict with 'role' and 'content', got {type(original).__name__}")
        # As transformers 5 does: None-valued keys are dropped (OpenAI sends content=None with tool calls)
        # and reasoning under any of its names is offered under all of them.
        message = {key: value for key, value in original.items() if value is not None}
        reasoning = next((message[k] for k in _REASONING_FIELDS if k in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        role = message.get("role")
        if role not in ROLES:
            raise MessageError(f"message {m} has role {role!r}; use one of {', '.join(ROLES)}")
        content = message.get("content")
        if content is None or isinstance(content, str):
            chat.append(message)
            continue
        if not isinstance(content, Sequence) or isinstance(content, (bytes, bytearray)):
            raise MessageError(f"message {m}: content must be a string or a list of parts")
        parts: list[dict[str, Any]] = []
        for p, part in enumerate(content):
            where = f"message {m} part {p}"
            if not isinstance(part, Mapping):
                raise MessageError(f"{where} must be a dict with a 'type'")
            kind = part.get("type")
            if kind == "text":
                text = part.get("text")
                if not isinstance(text, str):
                    raise MessageError(f"{where}: text part without a 'text' string")
                parts.append({"type": "text", "text": text})
            elif kind in ("image", "image_url"):
                images.append(_media_bytes(part, "image", where, max_image_bytes))  # type: ignore[arg-type]
                parts.append({"type": "image"})
            elif kind in ("video", "video_url"):
                videos.append(_media_bytes(part, "video", where, max_video_bytes))
                parts.append({"type": "video"})
            else:
                raise MessageError(
                    f"{where} has type {kind!r}; use 'text', 'image', 'image_url', 'video' or 'video_url'"
                )
        chat.append({**message, "content": parts})
    return NormalizedMessages(chat, images, videos)
