"""Reasoning in Qwen3-VL's output: Thinking checkpoints write `<think>...</think>` before the answer, and their chat
template's generation prompt already ends with `<think>\\n`, so the output usually holds only `</think>`. This follows
vLLM's `qwen3` reasoning parser (vllm/reasoning/qwen3_reasoning_parser.py, on BaseThinkingReasoningParser in
vllm/reasoning/basic_parsers.py):

- a `<think>` the model writes itself is dropped; reasoning is the text up to the first `</think>`, kept as written
  (vLLM does not strip it), content what follows, None when empty;
- no `</think>` while thinking (the prompt opened it, or the output did): all reasoning, cut off while thinking.

Our choices: only a `<think>` at the start of the output (leading whitespace aside) opens reasoning (vLLM drops the
text up to the first `<think>` anywhere, even one inside the answer); the newlines right after `</think>` (the
template's `</think>\\n\\n`) are dropped from content (vLLM keeps them); when neither the prompt nor the output opened
reasoning (Instruct, or thinking off) all text is content, a stray `</think>` included, so that streaming never has
to hold back an Instruct answer (vLLM's serving layer streams those as content too); reasoning is None when empty
(vLLM gives ""); and vLLM's implicit end of reasoning at `<tool_call>\\n<function=` (Qwen3.5's XML calls) is left out:
Qwen3-VL's calls are JSON and come after `</think>`.
"""

from __future__ import annotations

from typing import Literal

from .protocol import held_prefix

OPEN = "<think>"
CLOSE = "</think>"

Kind = Literal["reasoning", "content"]


def split_reasoning(text: str, prompt_opens_think: bool) -> tuple[str | None, str | None]:
    """(reasoning_content, content) of a whole output."""
    head = text.lstrip()
    opened = head.startswith(OPEN)
    if not (opened or prompt_opens_think):
        return None, text or None
    body = head[len(OPEN) :] if opened else text
    reasoning, end, content = body.partition(CLOSE)
    if not end:
        return body or None, None
    return reasoning or None, content.lstrip("\n") or None


class ReasoningStream:
    """Streamed output in, ("reasoning" | "content", piece) out; the pieces of each kind join to split_reasoning's."""

    def __init__(self, prompt_opens_think: bool) -> None:
        self._prompt_opens = prompt_opens_think
        self._buffer = ""
        # start: is there a leading <think>?  reasoning: until </think>.  after: dropping newlines.  content: the rest.
        self._state: Literal["start", "reasoning", "after", "content"] = "start"

    def feed(self, text: str) -> list[tuple[Kind, str]]:
        self._buffer += text
        out: list[tuple[Kind, str]] = []
        if self._state == "start":
            head = self._buffer.lstrip()
            if not head or (len(head) < len(OPEN) and OPEN.startswith(head)):
                return out  # whitespace, or the start of <think>: not decided yet
            if head.startswith(OPEN):
                self._buffer, self._state = head[len(OPEN) :], "reasoning"
            else:
                self._state = "reasoning" if self._prompt_opens else "content"
        if self._state == "reasoning":
            reasoning, end, rest = self._buffer.partition(CLOSE)
            if end:
                self._buffer, self._state = rest, "after"
            else:
                cut = len(reasoning) - held_prefix(reasoning, CLOSE)
                reasoning, self._buffer = reasoning[:cut], reasoning[cut:]
            if reasoning:
                out.append(("reasoning", reasoning))
        if self._state == "after":
            self._buffer = self._buffer.lstrip("\n")
            if self._buffer:
                self._state = "content"
        if self._state == "content" and self._buffer:
            out.append(("content", self._buffer))
            self._buffer = ""
        return out

    def finish(self) -> list[tuple[Kind, str]]:
        """What is still held back: an undecided start, or a tail that did not become `</think>`."""
        held, self._buffer = self._buffer, ""
        if not held:
            return []
        if self._state == "start":
            return [("reasoning" if self._prompt_opens else "content", held)]
        return [("reasoning" if self._state == "reasoning" else "content", held)]
