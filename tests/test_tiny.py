"""make-tiny writes checkpoints that transformers loads as released Qwen3-VL models."""

from __future__ import annotations

import json

import numpy as np
import pytest
import tiktoken
import torch
from PIL import Image
from qwen3vl_trt.qa.tokenizer_files import QWEN_SPLIT_PATTERN, load_qwen_ranks
from transformers import AutoModelForImageTextToText, AutoProcessor


@pytest.mark.parametrize("name", ["dense", "moe"])
def test_transformers_loads_every_weight(checkpoints, name):
    model, info = AutoModelForImageTextToText.from_pretrained(checkpoints[name], output_loading_info=True)
    assert not any(info.values()), info
    expected = "Qwen3VLMoeForConditionalGeneration" if name == "moe" else "Qwen3VLForConditionalGeneration"
    assert type(model).__name__ == expected


def test_released_on_disk_format(checkpoints):
    path = checkpoints["moe"]
    config = json.loads((path / "config.json").read_text())
    rope = config["text_config"]["rope_scaling"]
    assert rope["mrope_interleaved"] is True and sum(rope["mrope_section"]) * 2 == config["text_config"]["head_dim"]
    pre = json.loads((path / "preprocessor_config.json").read_text())
    assert pre["patch_size"] == 16 and pre["image_mean"] == pre["image_std"] == [0.5, 0.5, 0.5]
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    from safetensors import safe_open

    name = "model.language_model.layers.0.mlp.experts.gate_up_proj"
    with safe_open(str(path / index["weight_map"][name]), "pt") as f:
        shape = f.get_slice(name).get_shape()
    text = config["text_config"]
    assert shape == [text["num_experts"], text["hidden_size"], 2 * text["moe_intermediate_size"]]


def test_tokenizer_is_qwens_vocabulary(tiny_dense):
    processor = AutoProcessor.from_pretrained(tiny_dense)
    tok = processor.tokenizer
    enc = tiktoken.Encoding("qwen", pat_str=QWEN_SPLIT_PATTERN, mergeable_ranks=load_qwen_ranks(), special_tokens={})
    for text in ["Hello, world! 12345", "  def f(x):\n\treturn x ** 2\n", "你好，世界。Привет 🚀 ça va?"]:
        assert tok(text)["input_ids"] == enc.encode(text)
    ids = tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|vision_start|>", "<|image_pad|>", "</think>"])
    assert ids == [151643, 151644, 151652, 151655, 151668]


def test_processor_and_chat_template(tiny_dense):
    processor = AutoProcessor.from_pretrained(tiny_dense)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe."}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert (
        text
        == "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Describe.<|im_end|>\n<|im_start|>assistant\n"
    )
    image = Image.fromarray(np.zeros((64, 96, 3), np.uint8))
    out = processor(text=[text], images=[image], return_tensors="pt")
    t, h, w = out["image_grid_thw"][0].tolist()
    assert out["pixel_values"].shape == (t * h * w, 1536)
    assert int((out["input_ids"] == 151655).sum()) == t * h * w // 4


def test_forward_runs(tiny_dense):
    model = AutoModelForImageTextToText.from_pretrained(tiny_dense)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([[151644, 872, 198]])).logits
    assert logits.shape == (1, 3, 151936) and torch.isfinite(logits).all()
