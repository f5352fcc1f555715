"""The chat templates Qwen3-VL's Instruct and Thinking checkpoints were released with, kept as published in
data/chat_templates (provenance: its SOURCES.md). Tiny checkpoints carry them, so tests render what users serve."""

from __future__ import annotations

import importlib.resources
import json

RELEASED_TEMPLATES = ("instruct", "thinking")


def released_chat_template(name: str) -> str:
    """The chat template of the released Qwen3-VL checkpoints of this kind (RELEASED_TEMPLATES)."""
    if name not in RELEASED_TEMPLATES:
        raise ValueError(f"unknown chat template {name!r}; choose one of {', '.join(RELEASED_TEMPLATES)}")
    data = importlib.resources.files("qwen3vl_trt") / "data" / "chat_templates" / f"qwen3_vl_{name}.chat_template.json"
    return str(json.loads(data.read_text())["chat_template"])
