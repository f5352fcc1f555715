"""A choice's generated text made into the OpenAI answer: a Thinking checkpoint's reasoning split from its answer
(reasoning.py), tool-call blocks made into `tool_calls` (tool_calls.py), log probabilities per token, whole
(chat message, completion choice) or as the chunks a stream sends (ChatChunks, CompletionChunks)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field

from tokenizers import Tokenizer

from ...decoding.detokenize import Alternatives
from ..client import Answer
from .planning import ChoiceRun, Plan
from .protocol import (
    AssistantMessage,
    ChatCompletionChunk,
    Choice,
    ChoiceLogprobs,
    ChunkChoice,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    Delta,
    FinishReason,
    FunctionCall,
    FunctionCallDelta,
    TokenLogprob,
    ToolCallChunk,
    ToolCallMessage,
    TopLogprob,
    sse_event,
)
from .reasoning import ReasoningStream, split_reasoning
from .tool_calls import ContentDelta, ToolCallStream, parse_tool_calls


class TokenTexts:
    """Each token's own text, as `logprobs` reports it (a token that ends inside a UTF-8 character shows U+FFFD)."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer

    def entries(self, answer: Answer) -> list[TokenLogprob]:
        """Each token's chat logprobs entry, with its alternatives when the answer has them (top_logprobs)."""
        tops = answer.top or [()] * len(answer.token_ids)
        return [
            TokenLogprob(token=text, logprob=log_prob, bytes=list(text.encode()), top_logprobs=self.alternatives(top))
            for text, log_prob, top in zip(self.texts(answer.token_ids), answer.log_probs, tops, strict=False)
        ]

    def alternatives(self, top: Alternatives) -> list[TopLogprob]:
        texts = self.texts([t for t, _ in top])
        return [
            TopLogprob(token=text, logprob=p, bytes=list(text.encode()))
            for text, (_, p) in zip(texts, top, strict=True)
        ]

    def by_text(self, answer: Answer) -> list[dict[str, float]] | None:
        """Each token's alternatives as completions report them: log probability by text (a text two tokens share
        keeps the likelier's)."""
        if not answer.top:
            return None
        tops: list[dict[str, float]] = []
        for top in answer.top:
            entries: dict[str, float] = {}
            for text, (_, p) in zip(self.texts([t for t, _ in top]), top, strict=True):
                entries.setdefault(text, p)  # the likeliest first
            tops.append(entries)
        return tops

    def texts(self, token_ids: Sequence[int]) -> list[str]:
        return [self.tokenizer.decode([t], skip_special_tokens=False) for t in token_ids]


def chat_choice(plan: Plan, run: ChoiceRun, answer: Answer, tokens: TokenTexts) -> Choice:
    reasoning, content = split_reasoning(answer.text, plan.opens_reasoning) if plan.reasoning else (None, answer.text)
    calls = []
    if plan.tool_names and content:
        content, found = parse_tool_calls(content, plan.tool_names)
        calls = [ToolCallMessage(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments)) for c in found]
    if content is None and reasoning is None and not calls:
        content = ""
    return Choice(
        index=run.index,
        message=AssistantMessage(content=content, reasoning_content=reasoning, tool_calls=calls or None),
        logprobs=ChoiceLogprobs(content=tokens.entries(answer)) if plan.logprobs else None,
        finish_reason="tool_calls" if calls else run.finish_reason,
    )


def completion_choice(plan: Plan, run: ChoiceRun, answer: Answer, tokens: TokenTexts) -> CompletionChoice:
    return CompletionChoice(
        index=run.index,
        text=plan.echo + answer.text,
        logprobs=completion_logprobs(answer, tokens, len(plan.echo)) if plan.logprobs else None,
        finish_reason=run.finish_reason,
    )


def completion_logprobs(answer: Answer, tokens: TokenTexts, offset: int) -> CompletionLogprobs:
    texts = tokens.texts(answer.token_ids)
    offsets = []
    for text in texts:
        offsets.append(offset)
        offset += len(text)
    return CompletionLogprobs(
        tokens=texts, token_logprobs=list(answer.log_probs), top_logprobs=tokens.by_text(answer), text_offset=offsets
    )


@dataclass
class ChatDeltas:
    """One streamed chat choice: its text as it comes in, made into deltas (reasoning, content, tool calls)."""

    plan: Plan
    reasoning: ReasoningStream | None = field(init=False)
    tools: ToolCallStream | None = field(init=False)

    def __post_init__(self) -> None:
        self.reasoning = ReasoningStream(self.plan.opens_reasoning) if self.plan.reasoning else None
        self.tools = ToolCallStream(self.plan.tool_names) if self.plan.tool_names else None

    @property
    def called(self) -> bool:
        return self.tools is not None and self.tools.has_calls

    @property
    def plain(self) -> bool:
        """Whether every delta is the text as it comes (no reasoning to split, no tool calls to parse)."""
        return self.reasoning is None and self.tools is None

    def feed(self, text: str) -> list[Delta]:
        if self.reasoning is None:
            return self._content(text, final=False)
        return self._split(self.reasoning.feed(text), final=False)

    def finish(self) -> list[Delta]:
        if self.reasoning is None:
            return self._content("", final=True)
        return self._split(self.reasoning.finish(), final=True)

    def _split(self, pieces: Sequence[tuple[str, str]], final: bool) -> list[Delta]:
        out = []
        for kind, text in pieces:
            if kind == "reasoning":
                out.append(Delta(reasoning_content=text))
            else:
                out.extend(self._content(text, final=False))
        if final:
            out.extend(self._content("", final=True))
        return out

    def _content(self, text: str, final: bool) -> list[Delta]:
        if self.tools is None:
            return [Delta(content=text)] if text else []
        events = self.tools.feed(text) if text else []
        if final:
            events += self.tools.finish()
        out = []
        for event in events:
            if isinstance(event, ContentDelta):
                if event.text:
                    out.append(Delta(content=event.text))
            else:
                function = FunctionCallDelta(name=event.name, arguments=event.arguments)
                first = event.id is not None
                call = ToolCallChunk(
                    index=event.index, id=event.id, type="function" if first else None, function=function
                )
                out.append(Delta(tool_calls=[call]))
        return out


# A streamed chunk as sent, and whether it carries generated text (for the latency metrics).
Event = tuple[str, bool]


class ChatChunks:
    """A streamed chat choice's chunks: the role first, then its deltas, then the finish."""

    def __init__(self, plan: Plan, run: ChoiceRun, tokens: TokenTexts):
        self.plan, self.run, self.tokens = plan, run, tokens
        self.deltas = ChatDeltas(plan)
        self.started = False
        self.pending: list[Answer] = []  # pieces whose log probabilities no chunk has carried yet
        self.content = _ContentChunk(self._chunk(Delta(content=_ContentChunk.MARKER)))

    def feed(self, piece: Answer) -> list[Event]:
        out = self._start()
        if not self.plan.logprobs and self.deltas.plain:  # the common case: text only, from a template
            return out + ([(self.content.event(piece.text), True)] if piece.text else [])
        self.pending.append(piece)
        return out + [(self._chunk(delta), True) for delta in self.deltas.feed(piece.text)]

    def finish(self) -> list[Event]:
        out = self._start() + [(self._chunk(delta), True) for delta in self.deltas.finish()]
        return [*out, (self._chunk(Delta(), "tool_calls" if self.deltas.called else self.run.finish_reason), False)]

    def _start(self) -> list[Event]:
        if self.started:
            return []
        self.started = True
        return [(self._chunk(Delta(role="assistant", content="")), False)]

    def _chunk(self, delta: Delta, finish_reason: FinishReason | None = None) -> str:
        plan = self.plan
        logprobs = None
        if plan.logprobs and self.pending:
            logprobs = ChoiceLogprobs(content=self.tokens.entries(Answer.joined(self.pending)))
            self.pending = []
        choice = ChunkChoice(index=self.run.index, delta=delta, logprobs=logprobs, finish_reason=finish_reason)
        chunk = ChatCompletionChunk(id=plan.id, created=plan.created, model=plan.model, choices=[choice])
        return sse_event(chunk.model_dump_json(exclude=None if plan.include_usage else {"usage"}, exclude_none=False))


class _ContentChunk:
    """A choice's streamed events that carry text only, made from one serialized chunk (the choice's, with MARKER as
    its text) by putting each text in its place: the same JSON as the chunk's model would give, at the cost of one
    string escape per event."""

    MARKER = "\x00"

    def __init__(self, event: str):
        self.prefix, self.suffix = event.split(json.dumps(self.MARKER), 1)

    def event(self, text: str) -> str:
        return self.prefix + json.dumps(text, ensure_ascii=False) + self.suffix


class CompletionChunks:
    """A streamed text completion's chunks: its text (the echoed prompt first), then the finish."""

    def __init__(self, plan: Plan, run: ChoiceRun, tokens: TokenTexts):
        self.plan, self.run, self.tokens = plan, run, tokens
        self.offset = 0  # characters of the choice's text sent so far
        self.content = _ContentChunk(self._chunk(_ContentChunk.MARKER, None))

    def feed(self, piece: Answer) -> list[Event]:
        text = piece.text
        if self.offset and not self.plan.logprobs:  # the common case: text only, from a template
            self.offset += len(text)
            return [(self.content.event(text), True)] if text else []
        if self.offset == 0 and self.plan.echo:
            text = self.plan.echo + text
            self.offset = len(self.plan.echo)
        logprobs = completion_logprobs(piece, self.tokens, self.offset) if self.plan.logprobs else None
        self.offset += len(piece.text)
        return [(self._chunk(text, logprobs), bool(piece.text))] if text or logprobs else []

    def finish(self) -> list[Event]:
        text = self.plan.echo if self.offset == 0 else ""
        return [(self._chunk(text, None, self.run.finish_reason), False)]

    def _chunk(self, text: str, logprobs: CompletionLogprobs | None, finish_reason: FinishReason | None = None) -> str:
        plan = self.plan
        choice = CompletionChoice(index=self.run.index, text=text, logprobs=logprobs, finish_reason=finish_reason)
        completion = Completion(id=plan.id, created=plan.created, model=plan.model, choices=[choice])
        return sse_event(completion.model_dump_json(exclude=None if plan.include_usage else {"usage"}))
