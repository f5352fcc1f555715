"""The OpenAI API that agents use, on the CPU deployment (a real tritonserver; random weights), called with the
official `openai` client and LangChain's ChatOpenAI, with API keys required: tool calls (required, named and auto,
streamed and not) whose arguments validate against the functions' schemas, a tool loop that renders back, JSON
schema outputs that finish and validate, log probabilities, logit bias, penalties, seeds and n, text completions,
and a Thinking checkpoint's reasoning split out. Every grammar is enforced by the deployment's llm (guided
decoding with xgrammar), not by the gateway."""

from __future__ import annotations

import asyncio
import json
import shutil
import urllib.error
import urllib.request
from pathlib import Path
from typing import Literal

import jsonschema
import numpy as np
import openai
import pytest
import torch
from deployment import LIMITS, Gateway, build_cpu_repository, data_url, error_body, port_flags
from images import jpeg
from pydantic import BaseModel, Field
from qwen3vl_trt.hf.reference import hf_greedy_log_softmax, hf_request_inputs
from qwen3vl_trt.preprocess import Preprocessor
from qwen3vl_trt.qa.ports import free_port
from qwen3vl_trt.qa.tiny import ENDOFTEXT_ID, IM_END_ID, make_tiny_checkpoint
from qwen3vl_trt.serving.gateway.planning import Planner
from qwen3vl_trt.serving.gateway.protocol import APIError, ChatCompletionRequest
from qwen3vl_trt.serving.gateway.settings import GatewaySettings
from qwen3vl_trt.serving.ports import free_ports
from tokenizers import Tokenizer
from transformers import AutoModelForImageTextToText

pytestmark = [pytest.mark.slow, pytest.mark.server]

KEY = "sk-agents-Qm4v81ZtP0"
WEATHER = {
    "name": "get_weather",
    "description": "Current weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}
ZOOM = {
    "name": "zoom",
    "description": "Crop the picture by a factor.",
    "parameters": {
        "type": "object",
        "properties": {"factor": {"type": "integer", "minimum": 1, "maximum": 4}},
        "required": ["factor"],
        "additionalProperties": False,
    },
}
TOOLS = [{"type": "function", "function": WEATHER}, {"type": "function", "function": ZOOM}]
SCHEMAS = {f["name"]: f["parameters"] for f in (WEATHER, ZOOM)}
PHOTO = jpeg(64, 96, seed=4)


def _deployment(model_dir: Path, root: Path, keys: Path | None = None) -> Gateway:
    repo = build_cpu_repository(model_dir, root)
    ports, port = free_ports(), free_port()
    args = ["serve", "--repo", str(repo), "--openai-port", str(port), *port_flags(ports)]
    args += ["--api-key-file", str(keys)] if keys is not None else []
    return Gateway(args, port, root / "serve.log", ready_status=200)


@pytest.fixture(scope="module")
def served(checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("agents")
    keys = root / "keys"
    keys.write_text(f"# the test's key\n{KEY}\n")
    gateway = _deployment(checkpoints["dense"], root, keys)
    gateway.model_dir = checkpoints["dense"]
    yield gateway
    gateway.stop()


@pytest.fixture(scope="module")
def thinking(tmp_path_factory):
    """A Thinking checkpoint (the released Thinking template, whose generation prompt opens <think>), served."""
    root = tmp_path_factory.mktemp("thinking")
    model = make_tiny_checkpoint(root / "thinking", seed=3, template="thinking")
    gateway = _deployment(model, root)
    gateway.model_dir = model
    yield gateway
    gateway.stop()


def _client(served: Gateway, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key=key, max_retries=0, timeout=300)


def _user(text: str, *images: bytes) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": data_url(i)}} for i in images]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def _validated_calls(calls) -> list[tuple[str, dict]]:
    out = []
    for call in calls:
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        assert call.id and call.type == "function"
        out.append((call.function.name, arguments))
    return out


def _streamed_calls(stream) -> tuple[dict[int, dict], str | None]:
    """Tool calls from streamed deltas, put together as clients do: the id and name from a call's first delta,
    its arguments concatenated."""
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or ():
                call = calls.setdefault(delta.index, {"id": None, "name": None, "arguments": ""})
                call["id"] = call["id"] or delta.id
                call["name"] = call["name"] or (delta.function.name if delta.function else None)
                call["arguments"] += (delta.function.arguments or "") if delta.function else ""
    return calls, finish


# -- who may call it ------------------------------------------------------------------------------------------


def _raw_status(url: str, headers: dict[str, str]) -> tuple[int, dict]:
    request = urllib.request.Request(url, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def test_keys_are_required_on_v1_and_health_stays_open(served):
    for headers in ({}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": f"Basic {KEY}"}):
        status, body = _raw_status(f"{served.url}/v1/models", headers)
        assert status == 401 and body["error"]["code"] == "invalid_api_key", (headers, body)
    with pytest.raises(openai.AuthenticationError):
        _client(served, "sk-wrong").models.list()
    assert _raw_status(f"{served.url}/health", {})[0] == 200
    assert [m.id for m in _client(served).models.list()] == ["dense"]
    assert _client(served).models.retrieve("dense").id == "dense"
    with pytest.raises(openai.NotFoundError):
        _client(served).models.retrieve("gpt-4o")


# -- tool calls -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_required_and_named_tool_choices_give_calls_that_validate(served, stream):
    client = _client(served)
    # One call each: with parallel calls allowed, the random model may go on calling until max_tokens.
    for tool_choice, parallel in (("required", False), ({"type": "function", "function": {"name": "zoom"}}, True)):
        request = dict(model="dense", messages=_user("Look closer.", PHOTO), tools=TOOLS, tool_choice=tool_choice,
                       parallel_tool_calls=parallel, max_tokens=160)  # fmt: skip
        if not stream:
            choice = client.chat.completions.create(**request).choices[0]
            assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice
            calls = _validated_calls(choice.message.tool_calls)
        else:
            found, finish = _streamed_calls(client.chat.completions.create(**request, stream=True))
            assert finish == "tool_calls" and found
            calls = []
            for call in found.values():
                assert call["id"] and call["name"] in SCHEMAS
                jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
                calls.append((call["name"], json.loads(call["arguments"])))
        if isinstance(tool_choice, dict):
            assert [name for name, _ in calls] == ["zoom"]  # a named function: one call of it


def test_one_call_without_parallel_calls_then_the_tool_result_renders_into_the_next_turn(served):
    client = _client(served)
    messages = _user("What is the weather where this was taken?", PHOTO)
    first = client.chat.completions.create(model="dense", messages=messages, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=160)  # fmt: skip
    (call,) = first.choices[0].message.tool_calls
    assert _validated_calls([call])
    result = [{"type": "image_url", "image_url": {"url": data_url(jpeg(48, 48, seed=9))}},
              {"type": "text", "text": '{"temperature": 21}'}]  # fmt: skip
    turn = [*messages, first.choices[0].message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": result}]  # fmt: skip
    second = client.chat.completions.create(model="dense", messages=turn, tools=TOOLS, max_tokens=8)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # The call and the result (with its picture) are in the prompt the server ran.
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + first.usage.completion_tokens
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="dense", messages=[*turn[:-1], {"role": "tool", "content": "21"}])
    assert "tool_call_id" in error_body(refused.value)["message"]


# -- structured outputs ---------------------------------------------------------------------------------------


def _schemas() -> list[dict]:
    """20 bounded schemas: strings with maxLength, arrays with maxItems, bounded integers, enums, nested objects."""
    out = []
    for k in range(20):
        item = [{"type": "string", "maxLength": 3 + k % 5}, {"type": "integer", "minimum": -k, "maximum": 10 + k},
                {"enum": ["red", "green", f"c{k}"]}, {"type": "boolean"}][k % 4]  # fmt: skip
        properties = {
            f"field{k}": item,
            "items": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 1 + k % 3},
            "inner": {
                "type": "object",
                "properties": {"label": {"type": "string", "maxLength": 4}, "level": {"enum": [1, 2, 3]}},
                "required": ["label", "level"] if k % 2 else ["level"],
                "additionalProperties": False,
            },
        }
        out.append({"type": "object", "properties": properties, "required": list(properties),
                    "additionalProperties": False})  # fmt: skip
    return out


def test_json_schema_outputs_finish_and_validate_in_20_of_20(served):
    async def ask(client: openai.AsyncOpenAI, k: int, schema: dict):
        response_format = {"type": "json_schema", "json_schema": {"name": f"s{k}", "schema": schema, "strict": True}}
        return await client.chat.completions.create(model="dense", messages=_user(f"Fill form {k}."),
                                                    response_format=response_format, max_tokens=400, seed=k,
                                                    temperature=1.0)  # fmt: skip

    async def all_of_them():
        async with openai.AsyncOpenAI(base_url=f"{served.url}/v1", api_key=KEY, max_retries=0, timeout=300) as client:
            return await asyncio.gather(*(ask(client, k, s) for k, s in enumerate(_schemas())))

    answers = asyncio.run(all_of_them())
    for schema, answer in zip(_schemas(), answers, strict=True):
        choice = answer.choices[0]
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), schema)


class Sighting(BaseModel):
    animal: Literal["cat", "dog", "owl"]
    count: int = Field(ge=0, le=9)
    note: str = Field(max_length=10)


def test_parse_with_a_pydantic_model_and_json_object(served):
    client = _client(served)
    parsed = client.chat.completions.parse(model="dense", messages=_user("What animal?", PHOTO),
                                           response_format=Sighting, max_tokens=200)  # fmt: skip
    assert isinstance(parsed.choices[0].message.parsed, Sighting)
    answer = client.chat.completions.create(model="dense", messages=_user("JSON please."), max_tokens=64,
                                            response_format={"type": "json_object"})  # fmt: skip
    choice = answer.choices[0]
    if choice.finish_reason == "stop":  # an object of free strings may run past max_tokens
        assert isinstance(json.loads(choice.message.content), dict)
    else:
        assert choice.finish_reason == "length"
    bad = {"type": "json_schema", "json_schema": {"name": "bad", "schema": {"$ref": "#/nowhere"}}}
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="dense", messages=_user("Hi."), max_tokens=8, response_format=bad)
    assert error_body(refused.value)["code"] == "invalid_schema"


def test_langchain_runs_a_tool_loop_and_structured_output_with_only_url_and_key(served):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def zoom(factor: int) -> str:
        """Crop the picture by a factor."""
        return f"zoomed {factor}x"

    llm = ChatOpenAI(model="dense", base_url=f"{served.url}/v1", api_key=KEY, max_tokens=120, max_retries=0)
    question = HumanMessage(content=[{"type": "text", "text": "Zoom in."},
                                     {"type": "image_url", "image_url": {"url": data_url(PHOTO)}}])  # fmt: skip
    asked = llm.bind_tools([zoom], tool_choice="required", parallel_tool_calls=False).invoke([question])
    assert asked.tool_calls and asked.tool_calls[0]["name"] == "zoom"
    results = [ToolMessage(content=zoom.invoke(call["args"]), tool_call_id=call["id"]) for call in asked.tool_calls]
    answer = llm.bind_tools([zoom]).invoke([question, asked, *results])
    assert answer.response_metadata["finish_reason"] in ("stop", "length", "tool_calls")
    sighting = llm.with_structured_output(Sighting).invoke([question])
    assert isinstance(sighting, Sighting)


# -- sampling and output options ------------------------------------------------------------------------------


def test_logprobs_logit_bias_penalties_seed_and_n(served):
    client = _client(served)
    tokenizer = Tokenizer.from_file(str(served.model_dir / "tokenizer.json"))
    ask = dict(model="dense", messages=_user("Count."), max_tokens=12)
    answer = client.chat.completions.create(**ask, logprobs=True, top_logprobs=0)
    plain, entries = answer.choices[0], answer.choices[0].logprobs.content
    assert len(entries) == answer.usage.completion_tokens > 0 and all(e.logprob <= 0.0 for e in entries)
    (token,) = tokenizer.encode(" owl", add_special_tokens=False).ids
    biased = client.chat.completions.create(**ask, logit_bias={str(token): 100}).choices[0]
    assert biased.message.content == " owl" * 12
    penalized = client.chat.completions.create(**ask, frequency_penalty=2.0, presence_penalty=1.0).choices[0]
    assert penalized.message.content != plain.message.content
    sampled = dict(ask, temperature=1.0, seed=11, n=3)
    first, again = client.chat.completions.create(**sampled), client.chat.completions.create(**sampled)
    assert [c.message.content for c in first.choices] == [c.message.content for c in again.choices]
    assert [c.index for c in first.choices] == [0, 1, 2] and len({c.message.content for c in first.choices}) > 1
    assert first.usage.completion_tokens == 36
    # Choice i is the request seeded seed + i, as the engine seeds the i-th sequence of one request.
    alone = client.chat.completions.create(**dict(sampled, n=1, seed=11 + 2)).choices[0]
    assert alone.message.content == first.choices[2].message.content
    chunks = list(client.chat.completions.create(**dict(sampled, n=2), stream=True))
    texts = {i: "".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
             for i in (0, 1)}  # fmt: skip
    assert texts == {i: first.choices[i].message.content for i in (0, 1)}


@pytest.fixture(scope="module")
def reference(served):
    """transformers' greedy tokens and log-softmax rows (hf_greedy_log_softmax) for chat messages or a raw prompt,
    and each token's text as logprobs report it."""
    hf = AutoModelForImageTextToText.from_pretrained(served.model_dir, dtype=torch.float32).eval()
    pre = Preprocessor.from_pretrained(served.model_dir)
    tokenizer = Tokenizer.from_file(str(served.model_dir / "tokenizer.json"))

    def scores(max_tokens: int, messages=None, prompt=None):
        request = pre(messages, prompt=prompt)
        inputs = hf_request_inputs(hf, request, pre.info.image_token_id, pre.info.video_token_id)
        return hf_greedy_log_softmax(hf, inputs, max_tokens, (IM_END_ID, ENDOFTEXT_ID))

    scores.text = lambda token: tokenizer.decode([token], skip_special_tokens=False)
    return scores


def _expected_entries(reference, tokens, rows, k):
    """(text, log prob, [(alternative's text, its log prob)] * k) per token, as transformers' log-softmax gives them."""
    return [
        (
            reference.text(t),
            float(row[t]),
            [(reference.text(a), float(row[a])) for a in np.argsort(-row, kind="stable")[:k]],
        )
        for t, row in zip(tokens, rows, strict=True)
    ]


def _assert_entries_equal(got, expected):
    assert [(text, [a for a, _ in top]) for text, _, top in got] == [
        (text, [a for a, _ in top]) for text, _, top in expected
    ]
    for (_, p, top), (_, q, reference_top) in zip(got, expected, strict=True):
        assert p == pytest.approx(q, abs=1e-4)
        assert [a for _, a in top] == pytest.approx([b for _, b in reference_top], abs=1e-4)


@pytest.mark.parametrize("k", [1, 5])
def test_top_logprobs_equal_transformers_log_softmax(served, reference, k):
    """Chat (top_logprobs) and completions (logprobs k), streamed and not: each token's log probability and its k
    alternatives (texts and log probabilities) are transformers' log-softmax of the model's logits, within 1e-4."""
    client = _client(served)
    messages = _user("Count.")
    expected = _expected_entries(reference, *reference(6, messages=messages), k)
    ask = dict(model="dense", messages=messages, max_tokens=6, logprobs=True, top_logprobs=k)

    def chat_entries(content):
        return [(e.token, e.logprob, [(a.token, a.logprob) for a in e.top_logprobs]) for e in content]

    whole = client.chat.completions.create(**ask)
    _assert_entries_equal(chat_entries(whole.choices[0].logprobs.content), expected)
    chunks = list(client.chat.completions.create(**ask, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    _assert_entries_equal(chat_entries(streamed), expected)

    prompt = "Once upon a time"
    expected = _expected_entries(reference, *reference(6, prompt=prompt), k)
    ask = dict(model="dense", prompt=prompt, max_tokens=6, logprobs=k)

    def completion_entries(logprobs):
        return [
            (text, p, list(top.items()))
            for text, p, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True)
        ]

    done = client.completions.create(**ask)
    _assert_entries_equal(completion_entries(done.choices[0].logprobs), expected)
    chunks = [c.choices[0].logprobs for c in client.completions.create(**ask, stream=True) if c.choices[0].logprobs]
    joined = [entry for logprobs in chunks for entry in completion_entries(logprobs)]
    _assert_entries_equal(joined, expected)


def test_text_completions(served):
    client = _client(served)
    done = client.completions.create(model="dense", prompt="Once upon a time", max_tokens=6, logprobs=0)
    choice = done.choices[0]
    assert len(choice.logprobs.tokens) == len(choice.logprobs.token_logprobs) == done.usage.completion_tokens
    assert choice.logprobs.text_offset[0] == 0 and done.object == "text_completion"
    echoed = client.completions.create(model="dense", prompt="Once upon a time", max_tokens=6, echo=True)
    assert echoed.choices[0].text == "Once upon a time" + choice.text
    chunks = list(client.completions.create(model="dense", prompt="A", max_tokens=4, n=2, stream=True, seed=1,
                                            temperature=1.0))  # fmt: skip
    assert {c.choices[0].index for c in chunks if c.choices} == {0, 1}
    for refused in (dict(echo=True, logprobs=0), dict(suffix="end")):
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model="dense", prompt="A", max_tokens=4, **refused)


def test_the_key_is_in_no_log_line(served):
    assert KEY not in served.log.read_text(errors="replace")


# -- reasoning ------------------------------------------------------------------------------------------------


def test_a_thinking_checkpoint_has_its_reasoning_split_out(thinking):
    client = openai.OpenAI(base_url=f"{thinking.url}/v1", api_key="unused", max_retries=0, timeout=300)
    tokenizer = Tokenizer.from_file(str(thinking.model_dir / "tokenizer.json"))
    think_end = str(tokenizer.token_to_id("</think>"))
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "n": {"type": "integer",
              "minimum": 0, "maximum": 9}}, "required": ["answer", "n"], "additionalProperties": False}  # fmt: skip
    # The bias makes the random model close its reasoning after a few tokens; the grammar then asks for the JSON.
    ask = dict(model="thinking", messages=_user("Think, then answer."), max_tokens=200, temperature=1.0, seed=5, n=4,
               logit_bias={think_end: 9.0},
               response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}})  # fmt: skip
    whole = client.chat.completions.create(**ask)
    for choice in whole.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), schema)
        assert "</think>" not in (choice.message.reasoning_content or "")
    assert any(c.message.reasoning_content for c in whole.choices)
    streamed = {i: {"reasoning": "", "content": ""} for i in range(4)}
    for chunk in client.chat.completions.create(**ask, stream=True):
        for c in chunk.choices:
            delta = c.delta.model_dump()
            streamed[c.index]["reasoning"] += delta.get("reasoning_content") or ""
            streamed[c.index]["content"] += delta.get("content") or ""
    for choice in whole.choices:
        assert streamed[choice.index] == {"reasoning": choice.message.reasoning_content or "",
                                          "content": choice.message.content}  # fmt: skip
    # Unconstrained, the random model never closes its reasoning: all of it is reasoning, cut by max_tokens.
    plain = client.chat.completions.create(model="thinking", messages=_user("Think."), max_tokens=8).choices[0]
    assert plain.finish_reason == "length" and plain.message.reasoning_content and plain.message.content is None


def test_tools_on_a_template_without_a_tools_section_are_refused_before_the_server(tiny_dense, tmp_path):
    model = tmp_path / "no-tools"
    model.mkdir()
    for path in tiny_dense.iterdir():
        if path.suffix == ".json" and path.name != "model.safetensors.index.json":
            shutil.copy(path, model / path.name)
    chat_ml = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    (model / "chat_template.json").write_text(json.dumps({"chat_template": chat_ml + "<|im_start|>assistant\n"}))
    planner = Planner(GatewaySettings.resolve("127.0.0.1:8001", model, LIMITS))
    body = ChatCompletionRequest(model="no-tools", messages=[{"role": "user", "content": "Hi"}], tools=TOOLS)
    with pytest.raises(APIError) as refused:
        asyncio.run(planner.plan(body, 0.0))
    assert refused.value.status == 400 and "no tools section" in refused.value.message
