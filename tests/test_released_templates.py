"""The released Qwen3-VL Instruct and Thinking chat templates render as transformers renders them.

Each released template (qwen3vl_trt/data/chat_templates/, provenance in its SOURCES.md) is installed as
chat_template.json in a copy of the tiny checkpoint's small files; the token ids of this package's Preprocessor must
equal `processor.apply_chat_template(..., tokenize=True)` on the same files, for conversations with
tools, multi-turn history, reasoning content (as a field and inline <think>), tool calls, tool
responses and images.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import transformers
from images import jpeg
from qwen3vl_trt.hf.reference import load_hf_processor
from qwen3vl_trt.preprocess import Preprocessor
from qwen3vl_trt.preprocess.prompts import load_chat_template

DATA = Path(__file__).parents[1] / "build" / "data" / "chat_templates"
TEMPLATES = {"instruct": "qwen3_vl_instruct.chat_template.json", "thinking": "qwen3_vl_thinking.chat_template.json"}
TRANSFORMERS_5 = int(transformers.__version__.split(".")[0]) >= 5

IMAGE_A, IMAGE_B = jpeg(64, 96, seed=1), jpeg(96, 64, seed=2)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "City name, e.g. Zürich"}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {"name": "zoom", "description": "Crop the picture.", "parameters": {"type": "object"}},
    },
]


def _text(text: str) -> dict:
    return {"type": "text", "text": text}


def _image(data: bytes) -> dict:
    return {"type": "image", "image": data}


def _weather_call(city: str, as_string: bool = False) -> dict:
    arguments = f'{{"city": "{city}"}}' if as_string else {"city": city}
    return {"type": "function", "function": {"name": "get_weather", "arguments": arguments}}


# Content is given as parts throughout: transformers 4.57's processor reads every message's content as a list.
CHATS: dict[str, tuple[list[dict], dict]] = {
    "system and image": (
        [
            {"role": "system", "content": [_text("You are a careful assistant.")]},
            {"role": "user", "content": [_image(IMAGE_A), _text("What is in this picture?")]},
        ],
        {},
    ),
    "multi-turn with reasoning": (
        [
            {"role": "user", "content": [_text("Compare "), _image(IMAGE_A), _text(" with "), _image(IMAGE_B)]},
            {
                "role": "assistant",
                "content": [_text("The first is wider.")],
                "reasoning_content": "Look at both aspect ratios.",
            },
            {"role": "user", "content": [_text("And the colours?")]},
            {"role": "assistant", "content": [_text("<think>\nCheck the hues.\n</think>\n\nBoth are warm.")]},
            {"role": "user", "content": [_text("Thanks. Which one is brighter?")]},
        ],
        {"add_vision_id": True},
    ),
    "tools, calls and responses": (
        [
            {"role": "system", "content": [_text("Use tools when they help.")]},
            {"role": "user", "content": [_image(IMAGE_B), _text("Where was this taken, and how is the weather?")]},
            {
                "role": "assistant",
                "content": [_text("Let me check the weather in both places.")],
                "reasoning_content": "The skyline looks like Zürich or Basel.",
                "tool_calls": [_weather_call("Zürich"), _weather_call("Basel", as_string=True)],
            },
            {"role": "tool", "content": [_text('{"temperature": 21, "sky": "clear"}')]},
            {"role": "tool", "content": [_text('{"temperature": 19, "sky": "cloudy"}')]},
            {
                "role": "assistant",
                "content": [_text("Zoom in first.")],
                "tool_calls": [{"type": "function", "function": {"name": "zoom", "arguments": {}}}],
            },
            {"role": "tool", "content": [_image(IMAGE_A), _text("the cropped view")]},
        ],
        {"tools": TOOLS},
    ),
}


def _for_transformers(messages: list[dict], image_paths: dict[bytes, str]) -> list[dict]:
    """The same chat for the processor, which loads images from files."""
    out = []
    for message in messages:
        parts = [
            {"type": "image", "path": image_paths[part["image"]]} if part["type"] == "image" else part
            for part in message["content"]
        ]
        out.append({**message, "content": parts})
    return out


@pytest.fixture(scope="module")
def released(tiny_dense, tmp_path_factory):
    """{name: (Preprocessor, transformers processor, image paths)} with the released template installed."""
    root = tmp_path_factory.mktemp("released")
    image_paths = {}
    for i, data in enumerate((IMAGE_A, IMAGE_B)):
        image_paths[data] = str(root / f"image{i}.jpg")
        Path(image_paths[data]).write_bytes(data)
    out = {}
    for name, file in TEMPLATES.items():
        model = root / name
        model.mkdir()
        for path in tiny_dense.iterdir():
            if path.suffix == ".json" and path.name != "model.safetensors.index.json":
                shutil.copy(path, model / path.name)
        shutil.copy(DATA / file, model / "chat_template.json")
        theirs = load_hf_processor(model, "torchvision")
        assert (
            theirs.chat_template == load_chat_template(model) == json.loads((DATA / file).read_text())["chat_template"]
        )
        out[name] = (Preprocessor.from_pretrained(model), theirs, image_paths)
    return out


@pytest.mark.parametrize("chat", list(CHATS))
@pytest.mark.parametrize("template", list(TEMPLATES))
def test_released_template_renders_as_transformers(released, template, chat):
    ours, theirs, image_paths = released[template]
    messages, kwargs = CHATS[chat]
    request = ours(messages, **kwargs)
    hf = theirs.apply_chat_template(
        _for_transformers(messages, image_paths), tokenize=True, add_generation_prompt=True, return_dict=True, **kwargs
    )
    np.testing.assert_array_equal(request.input_ids, np.asarray(hf["input_ids"]).reshape(-1))
    if "image_grid_thw" in hf:
        np.testing.assert_array_equal(request.image_grid_thw, np.asarray(hf["image_grid_thw"]))


@pytest.mark.parametrize("template", list(TEMPLATES))
def test_released_template_text_equals_transformers(released, template):
    """The rendered text itself (not only its ids), for the conversation that uses every feature."""
    ours, theirs, image_paths = released[template]
    messages, kwargs = CHATS["tools, calls and responses"]
    text = ours.prompts.tokenizer.decode(ours(messages, **kwargs).input_ids.tolist(), skip_special_tokens=False)
    hf_text = theirs.apply_chat_template(
        _for_transformers(messages, image_paths), tokenize=False, add_generation_prompt=True, **kwargs
    )
    hf_text = hf_text[0] if isinstance(hf_text, list) else hf_text
    # The processor expands each image to its visual tokens; compare with one placeholder per image.
    assert "<tool_call>" in hf_text and "<tool_response>" in hf_text and "# Tools" in hf_text
    assert _collapse_image_tokens(text) == hf_text
    if template == "thinking":
        assert hf_text.endswith("<|im_start|>assistant\n<think>\n")
        assert "<think>\nThe skyline looks like Zürich or Basel.\n</think>" in hf_text


def _collapse_image_tokens(text: str) -> str:
    return re.sub(r"(<\|image_pad\|>)+", "<|image_pad|>", text)
