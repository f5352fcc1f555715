"""Tool calls in Qwen3-VL's output: the chat template (Instruct and Thinking alike) asks for blocks
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, several in a row for parallel calls, text possibly
before them. vLLM reads them with its `hermes` parser (vllm/tool_parsers/hermes_tool_parser.py); this module follows
its format and its rule that text which is not a valid call stays content, with these choices of our own:

- a block counts only if its JSON names one of the request's tools (hermes accepts any name);
- text after the calls stays content (hermes keeps only the text before the first block), and whitespace next to a
  call is dropped; a block left open is content (hermes tries to parse it to the end of the text);
- streamed, a block is held until `</tool_call>` and then sent whole (name, then its arguments in a few fragments),
  so that an invalid one can still go out as content; hermes streams names and arguments as they parse.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from .protocol import held_prefix

OPEN = "<tool_call>"
CLOSE = "</tool_call>"


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, as text (OpenAI's `function.arguments`)


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class ToolCallDelta:
    index: int
    id: str | None  # set (with name) on a call's first delta only; its arguments then follow in fragments
    name: str | None
    arguments: str


StreamDelta = ContentDelta | ToolCallDelta


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _reject_constant(token: str) -> Any:
    raise ValueError(f"{token} is not JSON")


def _parse_block(body: str, names: Collection[str]) -> tuple[str, str] | None:
    """(name, arguments JSON) of a block's text between the tags, or None when it is not a call of one of `names`."""
    try:
        call = json.loads(body, parse_constant=_reject_constant)
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or call["name"] not in names:
            return None
        arguments = call.get("arguments")
        if arguments is None:
            arguments = {}
        elif isinstance(arguments, str):  # hermes too accepts arguments sent as a JSON string holding the object
            arguments = json.loads(arguments, parse_constant=_reject_constant)
    except (ValueError, RecursionError):  # not JSON, NaN/Infinity (not JSON either), or nested too deep
        return None
    if not isinstance(arguments, dict):
        return None
    return call["name"], json.dumps(arguments, ensure_ascii=False)  # as hermes writes them


def parse_tool_calls(text: str, names: Collection[str]) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a whole output. Every block must be a valid call, or the text is all content."""
    outside: list[str] = []
    calls: list[ToolCall] = []
    pos = 0
    while (start := text.find(OPEN, pos)) != -1:
        end = text.find(CLOSE, start + len(OPEN))
        parsed = None if end == -1 else _parse_block(text[start + len(OPEN) : end], names)
        if parsed is None:
            return text, []
        outside.append(text[pos:start])
        calls.append(ToolCall(new_call_id(), *parsed))
        pos = end + len(CLOSE)
    if not calls:
        return text, []
    outside.append(text[pos:])
    # Whitespace next to a call is dropped (ToolCallStream does the same as it streams).
    return "".join(piece.strip() for piece in outside) or None, calls


def _fragments(arguments: str, pieces: int = 3) -> list[str]:
    size = max(1, -(-len(arguments) // pieces))
    return [arguments[i : i + size] for i in range(0, len(arguments), size)]


class ToolCallStream:
    """Streamed output in, content and tool-call deltas out. Content is passed on at once, except a tail that may
    start `<tool_call>` and whitespace that may precede one; a block is held until it closes. For a text whose blocks
    are all valid calls, the deltas give parse_tool_calls' calls and content (whitespace at the very start of the
    output, before text that is followed by calls, aside: that went out before the calls could be known)."""

    def __init__(self, names: Collection[str]) -> None:
        self._names = frozenset(names)
        self._buffer = ""  # text not yet decided: inside a block, or a tail that may start one
        self._in_block = False
        self._space = ""  # whitespace held back: dropped if a call follows
        self._after_call = False  # drop whitespace right after a call
        self._calls = 0

    @property
    def has_calls(self) -> bool:
        return self._calls > 0

    def feed(self, text: str) -> list[StreamDelta]:
        out: list[StreamDelta] = []
        self._buffer += text
        while True:
            if self._in_block:
                end = self._buffer.find(CLOSE)
                if end == -1:
                    return out
                body, self._buffer = self._buffer[:end], self._buffer[end + len(CLOSE) :]
                self._in_block = False
                self._close_block(body, out)
            else:
                start = self._buffer.find(OPEN)
                if start == -1:
                    cut = len(self._buffer) - held_prefix(self._buffer, OPEN)
                    self._content(self._buffer[:cut], out)
                    self._buffer = self._buffer[cut:]
                    return out
                self._content(self._buffer[:start], out)
                self._buffer = self._buffer[start + len(OPEN) :]
                self._in_block = True

    def finish(self) -> list[StreamDelta]:
        out: list[StreamDelta] = []
        if self._in_block:  # left open: content, with the whitespace before it
            out.append(ContentDelta(self._space + OPEN + self._buffer))
            self._space = ""
        else:
            self._content(self._buffer, out)
            if self._space and not self.has_calls:  # trailing whitespace: parse_tool_calls strips it only with calls
                out.append(ContentDelta(self._space))
        self._buffer, self._space, self._in_block = "", "", False
        return out

    def _content(self, text: str, out: list[StreamDelta]) -> None:
        if self._after_call:
            text = text.lstrip()
            self._after_call = not text
        kept = text.rstrip()
        if kept:
            out.append(ContentDelta(self._space + kept))
            self._space = ""
        self._space += text[len(kept) :]

    def _close_block(self, body: str, out: list[StreamDelta]) -> None:
        parsed = _parse_block(body, self._names)
        if parsed is None:  # not a call: the block goes out as it came, tags and all
            out.append(ContentDelta(self._space + OPEN + body + CLOSE))
            self._space, self._after_call = "", False
            return
        name, arguments = parsed
        index, self._calls = self._calls, self._calls + 1
        out.append(ToolCallDelta(index, new_call_id(), name, ""))
        out.extend(ToolCallDelta(index, None, None, piece) for piece in _fragments(arguments))
        self._space, self._after_call = "", True
