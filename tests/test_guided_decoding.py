"""Guided decoding: the tokenizer info file, the grammars the gateway sends and the CPU runtime's masking.

A "model" that draws random logits each step (seeded) decodes under each guide; whatever it ends with must be
what the guide promises: JSON valid for the schema, Qwen3-VL tool-call blocks, reasoning closed by </think>.
"""

from __future__ import annotations

import itertools
import json
import threading

import jsonschema
import pytest
import torch
import xgrammar as xgr
from qwen3vl_trt.decoding import guides as gd
from qwen3vl_trt.errors import CheckpointError, InputError
from qwen3vl_trt.qa.tiny import ENDOFTEXT_ID, IM_END_ID, VOCAB_SIZE
from qwen3vl_trt.runtime.guided import GrammarCache, GuidedTokens
from qwen3vl_trt.serving.request import GUIDE_TEXT, GUIDE_TYPE, GenerationRequest

THINK_END = "</think>"
THINK_END_ID = 151668  # an added token of Qwen's tokenizer
STEPS = 400


@pytest.fixture(scope="module")
def info_path(tiny_dense, tmp_path_factory):
    path = tmp_path_factory.mktemp("guided") / "xgrammar_tokenizer_info.json"
    gd.write_tokenizer_info(tiny_dense, VOCAB_SIZE, [IM_END_ID], path)
    return path


@pytest.fixture(scope="module")
def cache(info_path):
    return GrammarCache(gd.load_tokenizer_info(info_path, VOCAB_SIZE))


def decode(cache: GrammarCache, guide: gd.Guide, seed: int, boost: dict[int, int] | None = None) -> tuple[str, bool]:
    """Random logits, masked, argmax; boost {step: token}: that token made likeliest at that step (if allowed).
    The text up to the stop token, and whether the grammar finished."""
    tokens = cache.matcher(guide.type, guide.text)
    vocab = cache.tokenizer_info.decoded_vocab
    generator = torch.Generator().manual_seed(seed)
    out = b""
    for step in range(STEPS):
        logits = torch.randn(VOCAB_SIZE, generator=generator)
        if boost and step in boost:
            logits[boost[step]] = 1e4
        tokens.mask(logits)
        token = int(logits.argmax())
        tokens.accept(token)
        if tokens.finished:
            assert token == IM_END_ID
            return out.decode(), True
        out += vocab[token]
    return out.decode(errors="replace"), False


def accepts(cache: GrammarCache, guide: gd.Guide, text: str) -> bool:
    """Whether the guide's grammar takes exactly `text`, then the stop token."""
    matcher = xgr.GrammarMatcher(cache.compile(guide.type, guide.text))
    return matcher.accept_string(text) and matcher.accept_token(IM_END_ID)


def test_tokenizer_info_file(info_path, tiny_dense):
    info = json.loads(info_path.read_text())
    assert set(info) == {"encoded_vocab", "tokenizer_str", "stop_token_ids"}  # what model_instance_state.cc reads
    vocab = json.loads((tiny_dense / "tokenizer.json").read_text())
    assert info["encoded_vocab"][220] == "Ġ" and vocab["model"]["vocab"]["Ġ"] == 220
    assert info["encoded_vocab"][IM_END_ID] == "<|im_end|>" and info["encoded_vocab"][THINK_END_ID] == THINK_END
    assert json.loads(info["tokenizer_str"])["decoder"]["type"] == "ByteLevel"
    assert info["stop_token_ids"] == [IM_END_ID]
    assert [p.name for p in info_path.parent.iterdir()] == [info_path.name]  # no temporary file left

    loaded = gd.load_tokenizer_info(info_path, VOCAB_SIZE)
    assert loaded.vocab_size == VOCAB_SIZE and loaded.stop_token_ids == [IM_END_ID]
    assert loaded.vocab_type == xgr.VocabType.BYTE_LEVEL and not loaded.add_prefix_space
    assert loaded.decoded_vocab[220] == b" " and loaded.decoded_vocab[THINK_END_ID] == THINK_END.encode()


def test_tokenizer_info_refused(tiny_dense, tmp_path):
    with pytest.raises(CheckpointError, match="stop_token_ids"):
        gd.write_tokenizer_info(tiny_dense, VOCAB_SIZE, [VOCAB_SIZE], tmp_path / "info.json")
    with pytest.raises(CheckpointError, match="more than the model's vocab_size"):
        gd.write_tokenizer_info(tiny_dense, 1000, [0], tmp_path / "info.json")
    (tmp_path / "bad.json").write_text('{"encoded_vocab": []}')
    with pytest.raises(CheckpointError, match="tokenizer_str"):
        gd.load_tokenizer_info(tmp_path / "bad.json", VOCAB_SIZE)
    assert not (tmp_path / "info.json").exists()


BOUNDED = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "kind": {"enum": ["cat", "dog", 3, None]},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
        "where": {
            "type": "object",
            "properties": {"x": {"type": "integer", "minimum": -5, "maximum": 5}, "label": {"const": "here"}},
            "required": ["x"],
        },
        "maybe": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "null"}]},
    },
    "required": ["name", "age", "kind", "where"],
}
ITEMS = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 99},
            "note": {"type": "string", "maxLength": 4},
        },
        "required": ["id"],
    },
    "minItems": 1,
    "maxItems": 2,
}


@pytest.mark.parametrize("schema", [BOUNDED, ITEMS], ids=["object", "array"])
@pytest.mark.parametrize("seed", [0, 1])
def test_random_model_meets_the_schema(cache, schema, seed):
    guide = gd.json_schema_guide(schema)
    assert guide.type == gd.GUIDE_TYPE_EBNF == "ebnf_grammar"
    text, finished = decode(cache, guide, seed)
    assert finished, text
    value = json.loads(text)
    jsonschema.validate(value, schema)
    assert text == json.dumps(value, ensure_ascii=False)  # ", " and ": ", no other whitespace


def test_json_object(cache):
    guide = gd.json_object_guide()
    assert accepts(cache, guide, '{"a": [1, {"b": null}], "c": "x", "d": -2.5e3}')
    assert accepts(cache, guide, "{}")
    for text in ['{ "a": 1}', '{"a":1}', '{"a": 1 }', '{"a": 1}\n', "[1]", '"a"']:
        assert not accepts(cache, guide, text), text
    text, finished = decode(cache, guide, seed=0)
    if finished:
        assert isinstance(json.loads(text), dict)


def test_reasoning_then_json(cache):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"]}
    guide = gd.json_schema_guide(schema, think_end=THINK_END)
    for reasoning in [
        "</think>",
        "<</think>",
        "</thin</think>",
        "a </ b</think>",
        "x\n\n</think>\n",
        "é日本</think>\n\n",
    ]:
        assert accepts(cache, guide, reasoning + '{"n": 1}'), reasoning
    for text in ['{"n": 1}', '</think>\n\n\n{"n": 1}', '</think></think>{"n": 1}', '</think> {"n": 1}']:
        assert not accepts(cache, guide, text), text
    text, finished = decode(cache, guide, seed=0, boost={3: THINK_END_ID})
    assert finished, text
    reasoning, _, answer = text.partition(THINK_END)
    assert THINK_END not in reasoning and len(answer) - len(answer.lstrip("\n")) <= 2
    jsonschema.validate(json.loads(answer), schema)


@pytest.mark.parametrize("think_end", ["aab", "abab", "a-]^"])
def test_reasoning_ends_at_the_first_think_end(cache, think_end):
    """Every string over think_end's characters (and one more): taken iff think_end occurs once, at its end."""
    guide = gd.json_schema_guide({"const": 0}, think_end=think_end)
    alphabet = sorted({*think_end, "z"})
    for text in ("".join(t) for n in range(6) for t in itertools.product(alphabet, repeat=n)):
        once_at_the_end = text.endswith(think_end) and text.find(think_end) == len(text) - len(think_end)
        assert accepts(cache, guide, text + "0") == once_at_the_end, text


WEATHER = {
    "name": "get_weather",
    "description": "Current weather",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
        "required": ["city"],
    },
}
ADD = {
    "name": "add",
    "parameters": {
        "type": "object",
        "properties": {"a": {"$ref": "#/$defs/small"}, "b": {"$ref": "#/$defs/small"}},
        "required": ["a", "b"],
        "$defs": {"small": {"type": "integer", "minimum": -9, "maximum": 9}},
    },
}
NOTHING = {"name": "nothing", "parameters": {"type": "object", "properties": {}}}


def calls_of(text: str, functions: dict[str, dict]) -> list[dict]:
    """The calls of Qwen3-VL tool-call blocks, a newline apart; each checked against its function's parameters."""
    lines = text.split("\n")  # JSON strings here cannot hold a raw newline
    assert len(lines) % 3 == 0, text
    calls = []
    for i in range(0, len(lines), 3):
        assert lines[i] == "<tool_call>" and lines[i + 2] == "</tool_call>", text
        call = json.loads(lines[i + 1])
        assert list(call) == ["name", "arguments"], text
        jsonschema.validate(call["arguments"], functions[call["name"]].get("parameters") or {"type": "object"})
        calls.append(call)
    return calls


@pytest.mark.parametrize("parallel", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_random_model_calls_tools(cache, parallel, seed):
    functions = {f["name"]: f for f in (WEATHER, ADD, NOTHING)}
    text, finished = decode(cache, gd.tool_call_guide(list(functions.values()), None, parallel), seed)
    assert finished, text
    calls = calls_of(text, functions)
    assert len(calls) == 1 or parallel


def test_tool_call_choices(cache):
    functions = [WEATHER, ADD, {"name": "anything"}]
    named = gd.tool_call_guide(functions, "add", parallel=True, think_end=THINK_END)
    block = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": -2}}\n</tool_call>'
    assert accepts(cache, named, f"hm</think>\n\n{block}\n{block}")
    assert not accepts(cache, named, f"</think>{block.replace('add', 'get_weather')}")
    assert not accepts(cache, named, f"</think>{block}\n\n{block}")  # one newline between calls
    assert not accepts(cache, named, f"</think>{block.replace('-2', '10')}")
    single = gd.tool_call_guide(functions, None, parallel=False)
    assert accepts(cache, single, '<tool_call>\n{"name": "anything", "arguments": {"x": [true]}}\n</tool_call>')
    assert not accepts(cache, single, f"{block}\n{block}")
    assert not accepts(cache, single, '<tool_call>\n{"arguments": {}, "name": "anything"}\n</tool_call>')
    text, finished = decode(cache, named, seed=2, boost={1: THINK_END_ID})
    assert finished, text
    assert {c["name"] for c in calls_of(text.partition(THINK_END)[2].lstrip("\n"), {"add": ADD})} == {"add"}


@pytest.mark.parametrize(
    "schema, says",
    [
        ({"type": "foo"}, 'Unsupported type "foo"'),
        ({"type": "string", "pattern": "(?=a)b"}, "Lookahead is not supported"),
        ({"type": "integer", "minimum": 5, "maximum": 1}, "minimum greater than maximum"),
        ({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}, "'not' at #/properties/a"),
        ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "'uniqueItems'"),
        ({"allOf": [{"type": "string"}, {"maxLength": 2}]}, "allOf"),
        ({"$ref": "https://example.com/schema.json"}, "only references inside the schema"),
        ({"type": "number", "maximum": float("nan")}, "not JSON compliant"),
    ],
)
def test_schema_refused(schema, says):
    with pytest.raises(gd.GuideError, match=says):
        gd.json_schema_guide(schema)


def test_tools_refused():
    with pytest.raises(gd.GuideError, match="not among the tools"):
        gd.tool_call_guide([WEATHER], "add", parallel=False)
    with pytest.raises(gd.GuideError, match="no name"):
        gd.tool_call_guide([{"parameters": {}}], None, parallel=False)
    with pytest.raises(gd.GuideError, match="at least one"):
        gd.tool_call_guide([], None, parallel=True)
    with pytest.raises(gd.GuideError, match="Unsupported type"):
        gd.tool_call_guide([{"name": "f", "parameters": {"type": "foo"}}], None, parallel=False)


def test_backend_guide_types(cache):
    text, finished = decode(cache, gd.Guide("regex", "[0-9]{3}"), seed=0)
    assert finished and len(text) == 3 and text.isdigit()
    text, finished = decode(cache, gd.Guide("json_schema", json.dumps(ITEMS)), seed=0)
    assert finished
    jsonschema.validate(json.loads(text), ITEMS)
    assert isinstance(cache.matcher("json", ""), GuidedTokens)
    with pytest.raises(gd.GuideError, match="not one of"):
        cache.compile("structural_tag", "{}")
    with pytest.raises(gd.GuideError, match='Rule "nope" is not defined'):
        cache.compile(gd.GUIDE_TYPE_EBNF, "root ::= nope")


def test_matcher_after_the_end(cache):
    tokens = cache.matcher("regex", "a")
    logits = torch.zeros(VOCAB_SIZE)
    tokens.mask(logits)
    with pytest.raises(gd.GuideError, match="not allowed"):
        tokens.accept(ENDOFTEXT_ID)
    tokens.accept(int(logits.argmax()))
    tokens.mask(logits := torch.zeros(VOCAB_SIZE))
    assert logits.isfinite().nonzero().flatten().tolist() == [IM_END_ID]  # the grammar is complete: stop only
    tokens.accept(IM_END_ID)
    assert tokens.finished
    tokens.mask(logits := torch.randn(VOCAB_SIZE))
    assert logits.isfinite().nonzero().flatten().tolist() == [IM_END_ID]
    with pytest.raises(InputError, match="float32"):
        tokens.mask(torch.zeros(VOCAB_SIZE, dtype=torch.float16))


def test_cache_keeps_the_last_used(cache):
    small = GrammarCache(cache.tokenizer_info, capacity=2)
    a, b, c = (gd.Guide("regex", r) for r in ("a", "b", "c"))
    first = small.compile(a.type, a.text)
    small.compile(b.type, b.text)
    assert small.compile(a.type, a.text) is first  # a is now the last used; b goes when c comes
    small.compile(c.type, c.text)
    assert small.compile(a.type, a.text) is first
    assert len(small._compiled) == 2 and ("regex", "b") not in small._compiled
    results = []
    threads = [threading.Thread(target=lambda: results.append(small.compile("regex", "[a-z]+"))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 4 and len(small._compiled) == 2


def test_preprocessing_refuses_a_guide_the_engine_could_not_compile(tiny_dense):
    """The executor compiles a guide inside the batch's step, where a failure ends every request in flight: each
    guide is parsed per request first, and one that does not parse, or of a type the backend would run unguided,
    is refused alone."""
    import numpy as np
    from deployment import LIMITS
    from qwen3vl_trt.serving.stages.preprocessing import Preprocessing

    component = Preprocessing(tiny_dense, LIMITS, torch.float32, 64)

    def request(guide_type: bytes, guide: bytes | None) -> dict:
        sent = GenerationRequest(prompt="Hi", max_tokens=4).named_inputs()
        sent[GUIDE_TYPE.name] = np.array([guide_type], object)
        if guide is not None:
            sent[GUIDE_TEXT.name] = np.array([guide], object)
        return sent

    good = gd.json_schema_guide({"type": "object", "properties": {"a": {"enum": [1, 2]}}})
    results = component.execute(
        [
            request(good.type.encode(), good.text.encode()),
            request(b"ebnf_grammar", b'root ::= "a" | undefined_rule'),
            request(b"structural_tag", b"{}"),
            request(b"regex", None),
            request(b"json", None),
        ]
    )
    assert not isinstance(results[0], Exception) and not isinstance(results[4], Exception)
    for result, says in zip(results[1:4], ("cannot be enforced", "is not one of", "needs its"), strict=True):
        assert isinstance(result, gd.GuideError) and says in str(result), result
