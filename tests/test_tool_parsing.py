"""The gateway's readers of Qwen3-VL's output: hermes-style `<tool_call>` blocks (tool_calls) and `<think>`
reasoning (reasoning), whole and streamed; streamed in any chunking they give what the whole-text readers give."""

from __future__ import annotations

import json
import random

import pytest
from qwen3vl_trt.serving.gateway.reasoning import ReasoningStream, split_reasoning
from qwen3vl_trt.serving.gateway.tool_calls import (
    ContentDelta,
    StreamDelta,
    ToolCall,
    ToolCallDelta,
    ToolCallStream,
    parse_tool_calls,
)

NAMES = ("get_weather", "search")


def block(name: str, arguments: object, raw: str | None = None) -> str:
    body = raw if raw is not None else json.dumps({"name": name, "arguments": arguments})
    return f"<tool_call>\n{body}\n</tool_call>"


WEATHER = block("get_weather", {"city": "Paris", "unit": "celsius"})
SEARCH = block("search", {"query": "Qwen3-VL 视觉", "top_k": 3, "filters": {"lang": ["en", "zh"]}})


def chunkings(text: str, seed: int = 0) -> list[list[str]]:
    """The text whole, a character at a time, split once at every boundary, and in random chunks."""
    rng = random.Random(seed)
    out = [[text], list(text)] + [[text[:i], text[i:]] for i in range(1, len(text))]
    for _ in range(20):
        chunks, pos = [], 0
        while pos < len(text):
            step = rng.randint(1, 12)
            chunks.append(text[pos : pos + step])
            pos += step
        out.append(chunks)
    return out


def stream_tools(chunks: list[str], names=NAMES) -> tuple[str, list[tuple[str, str]], list[StreamDelta], bool]:
    """Streamed content joined, the calls as (name, arguments) assembled as a client does, the deltas, has_calls."""
    stream = ToolCallStream(names)
    deltas: list[StreamDelta] = []
    for chunk in chunks:
        deltas += stream.feed(chunk)
    deltas += stream.finish()
    content = "".join(d.text for d in deltas if isinstance(d, ContentDelta))
    calls: dict[int, list[str]] = {}
    ids: dict[int, str] = {}
    for d in deltas:
        if isinstance(d, ToolCallDelta):
            if d.id is not None:
                assert d.index not in calls and d.index == len(calls) and d.name is not None and d.arguments == ""
                calls[d.index], ids[d.index] = [d.name, ""], d.id
            else:
                assert d.name is None and d.index in calls
                calls[d.index][1] += d.arguments
    assert all(isinstance(d, ToolCallDelta) or d.text for d in deltas), "no empty content deltas"
    assert len(set(ids.values())) == len(ids)
    return content, [(n, a) for n, a in calls.values()], deltas, stream.has_calls


def named(calls: list[ToolCall]) -> list[tuple[str, str]]:
    return [(c.name, c.arguments) for c in calls]


# --- parse_tool_calls -------------------------------------------------------------------------------------------


def test_one_call_gives_its_name_and_arguments_as_a_json_string_and_no_content():
    content, calls = parse_tool_calls(WEATHER, NAMES)
    assert content is None
    assert named(calls) == [("get_weather", '{"city": "Paris", "unit": "celsius"}')]
    assert calls[0].id.startswith("call_") and len(calls[0].id) == len("call_") + 24


def test_parallel_calls_keep_their_order_with_unique_ids_and_non_ascii_arguments_unescaped():
    content, calls = parse_tool_calls(WEATHER + "\n" + SEARCH + "\n", NAMES)
    assert content is None
    assert [c.name for c in calls] == ["get_weather", "search"]
    assert json.loads(calls[1].arguments) == {"query": "Qwen3-VL 视觉", "top_k": 3, "filters": {"lang": ["en", "zh"]}}
    assert "视觉" in calls[1].arguments
    assert calls[0].id != calls[1].id


def test_text_before_the_calls_is_content_stripped():
    content, calls = parse_tool_calls("I'll check the weather first.\n\n" + WEATHER, NAMES)
    assert content == "I'll check the weather first."
    assert len(calls) == 1


def test_text_after_the_calls_stays_content():
    content, calls = parse_tool_calls(WEATHER + "\n\nDone.\n", NAMES)
    assert content == "Done." and len(calls) == 1


def test_text_without_blocks_is_content_verbatim():
    assert parse_tool_calls("  The answer is 4.\n", NAMES) == ("  The answer is 4.\n", [])
    assert parse_tool_calls("", NAMES) == ("", [])


@pytest.mark.parametrize(
    "bad",
    [
        block("get_weather", None, raw='{"name": "get_weather", "arguments": {"city": "Paris"'),  # invalid JSON
        block("get_weather", None, raw="not json at all"),
        block("delete_everything", {"path": "/"}),  # not one of the request's tools
        block("get_weather", None, raw='{"arguments": {"city": "Paris"}}'),  # no name
        block("get_weather", None, raw='{"name": 7, "arguments": {}}'),
        block("get_weather", None, raw='["get_weather", {}]'),
        block("get_weather", [1, 2]),  # arguments not an object
        block("get_weather", '"just a string"'),
        block("get_weather", None, raw='{"name": "get_weather", "arguments": {"x": NaN}}'),
        "<tool_call>\n" + '{"name": "get_weather", "arguments": {"city": "Paris"}}',  # left open
        "<tool_call><tool_call>" + WEATHER[len("<tool_call>") :],
    ],
)
def test_a_block_that_is_not_a_valid_call_leaves_the_whole_text_as_content(bad):
    for text in (bad, "Sure.\n" + bad, WEATHER + "\n" + bad, bad + "\n" + SEARCH):
        assert parse_tool_calls(text, NAMES) == (text, [])


def test_arguments_sent_as_a_json_string_or_left_out_are_accepted():
    text = block("search", None, raw=json.dumps({"name": "search", "arguments": json.dumps({"query": "cats"})}))
    assert named(parse_tool_calls(text, NAMES)[1]) == [("search", '{"query": "cats"}')]
    text = block("search", None, raw='{"name": "search"}')
    assert named(parse_tool_calls(text, NAMES)[1]) == [("search", "{}")]


def test_a_closing_tag_alone_is_just_text():
    assert parse_tool_calls("see </tool_call>", NAMES) == ("see </tool_call>", [])


# --- ToolCallStream ---------------------------------------------------------------------------------------------

VALID_TEXTS = [
    WEATHER,
    WEATHER + "\n" + SEARCH,
    WEATHER + "\n\n" + SEARCH + "\n",
    "\n" + WEATHER,
    "Let me look that up.\n\n" + WEATHER + "\n" + SEARCH,
    "Checking <b>both</b> a < b:\n" + WEATHER,
    WEATHER + "\nThe results will follow.\n",
    "First." + WEATHER + " then " + SEARCH + " done",
    block("search", None, raw='{"name": "search"}'),
    block("search", None, raw=json.dumps({"name": "search", "arguments": json.dumps({"q": "</tool"})})),
    block("get_weather", {"city": "<tool_call> & </tool"}),  # tags' starts inside a block's strings
]


@pytest.mark.parametrize("text", VALID_TEXTS)
def test_streamed_calls_and_content_match_the_whole_text_parse_in_every_chunking(text):
    content, calls = parse_tool_calls(text, NAMES)
    assert calls, "each of these texts is all valid calls"
    for chunks in chunkings(text):
        streamed, streamed_calls, deltas, has_calls = stream_tools(chunks)
        assert (streamed or None) == content, chunks
        assert streamed_calls == named(calls), chunks
        assert has_calls
        # the arguments come in more than one fragment (up to 3) after the delta with id and name
        for index in range(len(calls)):
            fragments = [d for d in deltas if isinstance(d, ToolCallDelta) and d.index == index and d.id is None]
            assert 2 <= len(fragments) <= 3


INVALID_TEXTS = [
    "",
    "Plain answer, no tools.\n",
    "  leading and trailing spaces  \n\n",
    "An HTML-ish <tool> and a <tool_ca",
    "Sure.\n" + block("delete_everything", {"path": "/"}) + "\n",
    block("get_weather", None, raw="{broken json"),
    "Here goes:\n<tool_call>\n" + '{"name": "get_weather", "arguments": {"city": "Par',  # left open
    "<tool_call>",
    "</tool_call> stray",
]


@pytest.mark.parametrize("text", INVALID_TEXTS)
def test_streamed_text_without_valid_calls_comes_out_verbatim_as_content(text):
    assert parse_tool_calls(text, NAMES) == (text, [])
    for chunks in chunkings(text):
        streamed, calls, _, has_calls = stream_tools(chunks)
        assert streamed == text and calls == [] and not has_calls, chunks


def test_stream_passes_content_on_at_once_and_holds_back_only_what_may_start_a_block():
    stream = ToolCallStream(NAMES)
    assert stream.feed("Hello") == [ContentDelta("Hello")]
    assert stream.feed(" world <tool") == [ContentDelta(" world")]  # " <tool" may become a call
    assert stream.feed("box> x") == [ContentDelta(" <toolbox> x")]
    assert stream.feed('\n<tool_call>\n{"name": ') == []
    deltas = stream.feed('"search", "arguments": {"query": "cats"}}\n</tool_call>')
    assert isinstance(deltas[0], ToolCallDelta) and (deltas[0].index, deltas[0].name) == (0, "search")
    assert "".join(d.arguments for d in deltas if isinstance(d, ToolCallDelta)) == '{"query": "cats"}'
    assert stream.has_calls
    assert stream.feed("\n\n") == [] and stream.finish() == []


def test_an_invalid_block_streams_as_content_between_valid_calls():
    bad = block("delete_everything", {})
    content, calls, _, has_calls = stream_tools(list(WEATHER + "\n" + bad + "\n" + SEARCH))
    assert [n for n, _ in calls] == ["get_weather", "search"] and has_calls
    assert content == bad


def test_an_unclosed_block_after_a_call_is_flushed_as_content_at_finish():
    tail = '<tool_call>\n{"name": "search", "argu'
    content, calls, _, _ = stream_tools([WEATHER, "\n", tail])
    assert [n for n, _ in calls] == ["get_weather"] and content == tail


# --- reasoning --------------------------------------------------------------------------------------------------

REASONING_CASES = [
    # (text, prompt_opens_think, reasoning, content)
    ("The user wants 2+2.\n</think>\n\nIt is 4.", True, "The user wants 2+2.\n", "It is 4."),
    ("<think>\nThe user wants 2+2.\n</think>\n\nIt is 4.", True, "\nThe user wants 2+2.\n", "It is 4."),
    ("<think>\nhmm\n</think>\n\nIt is 4.", False, "\nhmm\n", "It is 4."),
    ("\n<think>hmm</think>ok", False, "hmm", "ok"),
    ("Still thinking about whether", True, "Still thinking about whether", None),  # cut off while thinking
    ("<think>\nStill thinking", False, "\nStill thinking", None),
    ("<think>", False, None, None),
    ("", True, None, None),
    ("", False, None, None),
    ("reasoning done</think>", True, "reasoning done", None),
    ("</think>\n\nJust the answer.", True, None, "Just the answer."),
    ("The answer is 4.", False, None, "The answer is 4."),  # Instruct: no tags at all
    ("\n\nThe answer is 4.\n", False, None, "\n\nThe answer is 4.\n"),
    ("Use a </think> tag?", False, None, "Use a </think> tag?"),  # Instruct: a stray tag is just text
    ("a <think> b </think>\n\nc", True, "a <think> b ", "c"),  # only a leading <think> is dropped
    ("r</think>\n\nTags: <think> and </think> here.", True, "r", "Tags: <think> and </think> here."),  # in content
    ("<thin", True, "<thin", None),
    ("  <thin", False, None, "  <thin"),
    ("think </thi", True, "think </thi", None),
    ("x</think>\n\n", True, "x", None),
    ("x</think>\n \nanswer", True, "x", " \nanswer"),  # only the newlines right after </think> go
    ("<think>\n\n</think>\n\n" + WEATHER, False, "\n\n", WEATHER),
]


@pytest.mark.parametrize(("text", "prompt_opens", "reasoning", "content"), REASONING_CASES)
def test_split_reasoning(text, prompt_opens, reasoning, content):
    assert split_reasoning(text, prompt_opens) == (reasoning, content)


def stream_reasoning(chunks: list[str], prompt_opens: bool) -> tuple[str | None, str | None]:
    stream = ReasoningStream(prompt_opens)
    pieces = [p for chunk in chunks for p in stream.feed(chunk)] + stream.finish()
    assert all(piece for _, piece in pieces)
    kinds = [kind for kind, _ in pieces]
    assert kinds == sorted(kinds, key=lambda k: k == "content"), "all reasoning comes before any content"
    join = "".join
    return join(p for k, p in pieces if k == "reasoning") or None, join(p for k, p in pieces if k == "content") or None


@pytest.mark.parametrize(("text", "prompt_opens", "reasoning", "content"), REASONING_CASES)
def test_streamed_reasoning_matches_the_whole_split_in_every_chunking(text, prompt_opens, reasoning, content):
    for chunks in chunkings(text):
        assert stream_reasoning(chunks, prompt_opens) == (reasoning, content), chunks


def test_reasoning_stream_passes_text_on_at_once_and_holds_back_only_a_possible_tag():
    stream = ReasoningStream(prompt_opens_think=True)
    assert stream.feed("Let me think") == [("reasoning", "Let me think")]
    assert stream.feed(" </th") == [("reasoning", " ")]
    assert stream.feed("ink>\n") == []
    assert stream.feed("\nIt is 4.") == [("content", "It is 4.")]
    assert stream.feed(" <think>") == [("content", " <think>")]
    assert stream.finish() == []
    instruct = ReasoningStream(prompt_opens_think=False)
    assert instruct.feed("<th") == []  # may be a leading <think>
    assert instruct.feed("e answer") == [("content", "<the answer")]


def test_reasoning_then_tool_calls_streamed_through_both_readers():
    text = "I need the weather.\n</think>\n\nLet me check.\n" + WEATHER
    reasoning, content = split_reasoning(text, prompt_opens_think=True)
    assert reasoning == "I need the weather.\n"
    assert content is not None
    whole_content, whole_calls = parse_tool_calls(content, NAMES)
    assert whole_content == "Let me check."
    for chunks in chunkings(text)[:40]:
        reasoning_stream, tools = ReasoningStream(True), ToolCallStream(NAMES)
        got_reasoning, deltas = "", []
        for chunk in chunks:
            for kind, piece in reasoning_stream.feed(chunk):
                if kind == "reasoning":
                    got_reasoning += piece
                else:
                    deltas += tools.feed(piece)
        for kind, piece in reasoning_stream.finish():
            assert kind == "content"
            deltas += tools.feed(piece)
        deltas += tools.finish()
        assert got_reasoning == reasoning
        assert "".join(d.text for d in deltas if isinstance(d, ContentDelta)) == whole_content
        assert [d.name for d in deltas if isinstance(d, ToolCallDelta) and d.name] == [c.name for c in whole_calls]
