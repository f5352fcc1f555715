"""MRoPE with the released text geometry (head_dim 128, mrope_section [24, 20, 20] interleaved,
theta 5e6) against transformers' Qwen3-VL text rotary embedding, at real 3-D positions from
get_rope_index for a prompt whose images sit after a long text prefix (positions in the thousands).

Tolerance: 1e-6 absolute on cos and sin (both are computed in float32 from the same float32
angles; measured 0).
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from images import jpeg
from qwen3vl_trt.hf.reference import hf_rope_index, hf_text_rotary, load_hf_text_model
from qwen3vl_trt.llm.inputs import H_AXIS, T_AXIS, W_AXIS, rope_pair_axes
from qwen3vl_trt.preprocess import Preprocessor
from qwen3vl_trt.qa.tiny import IMAGE_TOKEN_ID

RELEASED_HEAD_DIM, RELEASED_SECTION = 128, [24, 20, 20]
ROTARY_TOLERANCE = 1e-6
# About 3000 text tokens before the first image, so its positions (and the text after it) are in the thousands.
LONG_PREFIX = "The quick brown fox jumps over the lazy dog. " * 300


@pytest.fixture(scope="module")
def released_geometry(tiny_dense, tmp_path_factory):
    """The tiny checkpoint's small files with the released head_dim and mrope_section."""
    model = tmp_path_factory.mktemp("released-rope")
    for path in tiny_dense.iterdir():
        if path.suffix == ".json" and path.name != "model.safetensors.index.json":
            shutil.copy(path, model / path.name)
    config = json.loads((model / "config.json").read_text())
    config["text_config"]["head_dim"] = RELEASED_HEAD_DIM
    config["text_config"]["rope_scaling"]["mrope_section"] = RELEASED_SECTION
    (model / "config.json").write_text(json.dumps(config))
    return model


@pytest.fixture(scope="module")
def request_and_reference(released_geometry):
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": LONG_PREFIX},
                {"type": "image", "image": jpeg(480, 640, seed=3)},
                {"type": "text", "text": "and, much later, "},
                {"type": "image", "image": jpeg(256, 512, seed=4)},
                {"type": "text", "text": "Which of the two is wider?"},
            ],
        }
    ]
    request = Preprocessor.from_pretrained(released_geometry)(messages)
    return request, load_hf_text_model(released_geometry)


def test_released_sections_assign_24_20_20_pairs():
    axes = rope_pair_axes(RELEASED_HEAD_DIM, RELEASED_SECTION)
    assert [int((axes == a).sum()) for a in (T_AXIS, H_AXIS, W_AXIS)] == RELEASED_SECTION
    pair = np.arange(RELEASED_HEAD_DIM // 2)
    np.testing.assert_array_equal(axes[(pair % 3 == 1) & (pair < 60)], H_AXIS)
    np.testing.assert_array_equal(axes[(pair % 3 == 2) & (pair < 60)], W_AXIS)
    assert (axes[60:] == T_AXIS).all()


def test_positions_reach_the_thousands_and_equal_get_rope_index(request_and_reference):
    request, hf_model = request_and_reference
    positions, delta = hf_rope_index(hf_model, request.input_ids, request.image_grid_thw, IMAGE_TOKEN_ID)
    np.testing.assert_array_equal(request.position_ids, positions)
    assert request.mrope_position_delta == delta
    first_image = int(np.flatnonzero(request.input_ids == IMAGE_TOKEN_ID)[0])
    assert first_image > 2000 and request.position_ids[:, first_image].min() > 2000
    # Inside an image the three axes differ, so every section is exercised at distinct positions.
    image_positions = request.position_ids[:, request.input_ids == IMAGE_TOKEN_ID]
    assert (image_positions[1] != image_positions[2]).any() and (image_positions[0] != image_positions[1]).any()


def test_rotary_equals_transformers_at_released_sections(request_and_reference):
    request, hf_model = request_and_reference
    cos, sin = hf_text_rotary(hf_model, request.position_ids)
    half = RELEASED_HEAD_DIM // 2
    assert request.rotary_cos_sin.shape == (request.num_tokens, half, 2) and cos.shape[1] == RELEASED_HEAD_DIM
    np.testing.assert_array_equal(cos[:, :half], cos[:, half:])  # transformers duplicates the halves
    assert np.abs(request.rotary_cos_sin[..., 0] - cos[:, :half]).max() <= ROTARY_TOLERANCE
    assert np.abs(request.rotary_cos_sin[..., 1] - sin[:, :half]).max() <= ROTARY_TOLERANCE


def test_engine_table_equals_transformers_at_released_sections(request_and_reference):
    request, hf_model = request_and_reference
    max_positions = request.num_tokens + 16
    table = request.engine_inputs(max_positions)["mrope_rotary_cos_sin"]
    assert table.shape == (max_positions * RELEASED_HEAD_DIM,)
    pairs = table.reshape(max_positions, RELEASED_HEAD_DIM // 2, 2)[: request.num_tokens]
    cos, sin = hf_text_rotary(hf_model, request.position_ids)
    assert np.abs(pairs[..., 0] - cos[:, : RELEASED_HEAD_DIM // 2]).max() <= ROTARY_TOLERANCE
    assert np.abs(pairs[..., 1] - sin[:, : RELEASED_HEAD_DIM // 2]).max() <= ROTARY_TOLERANCE
