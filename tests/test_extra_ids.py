"""prompt_table_extra_ids: what keys TensorRT-LLM's KV-cache block reuse for visual tokens.

TensorRT-LLM's `tensorrt_llm` Triton model takes `prompt_table_extra_ids` as UINT64 [-1] and hands it
to the executor only when there is one per input token (triton_backend inflight_batcher_llm
src/utils.cc); its own preprocessing model puts the request's extra id where the engine id is
>= vocab_size and 0 elsewhere. Ours gives each visual token its image's content id, so two images
with the same token layout (the same fake ids) never share KV blocks, and the same image does.
"""

from __future__ import annotations

import numpy as np
import pytest
from images import jpeg
from qwen3vl_trt.common.contracts import LLM_INPUTS, PROMPT_TABLE_EXTRA_IDS
from qwen3vl_trt.errors import InputError
from qwen3vl_trt.llm.inputs import prompt_table_extra_ids
from qwen3vl_trt.preprocess import Preprocessor

IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


@pytest.fixture(scope="module")
def pre(tiny_dense):
    return Preprocessor.from_pretrained(tiny_dense)


def test_one_id_per_token_zero_for_text(pre):
    request = pre(prompt=f"Compare {IMAGE} with {IMAGE}.", images=[jpeg(64, 96, seed=1), jpeg(64, 64, seed=2)])
    extra = request.prompt_table_extra_ids
    assert extra.dtype == np.uint64 and extra.shape == request.input_ids.shape  # as the backend requires
    assert PROMPT_TABLE_EXTRA_IDS in LLM_INPUTS and PROMPT_TABLE_EXTRA_IDS.dtype == extra.dtype.name
    vocab_size = pre.info.text.vocab_size
    visual = request.engine_input_ids >= vocab_size  # where TensorRT-LLM's preprocessing puts extra ids
    assert not extra[~visual].any() and extra[visual].all()
    tokens_per_image = request.image_grid_thw.prod(axis=1) // 4  # 2x2 merge
    first, second = (set(ids.tolist()) for ids in np.split(extra[visual], np.cumsum(tokens_per_image)[:-1]))
    assert len(first) == len(second) == 1 and first != second  # one id per image
    assert request.engine_inputs(4096)[PROMPT_TABLE_EXTRA_IDS.name] is extra


def test_same_image_same_ids_different_images_different_ids(pre):
    a, b = jpeg(64, 64, seed=3), jpeg(64, 64, seed=4)
    with_a, again_a, with_b = (pre(prompt=f"{IMAGE} What is it?", images=[image]) for image in (a, a, b))
    # The same token layout: without extra ids the KV-cache block keys would be equal.
    np.testing.assert_array_equal(with_a.engine_input_ids, with_b.engine_input_ids)
    assert not np.array_equal(with_a.prompt_table_extra_ids, with_b.prompt_table_extra_ids)
    np.testing.assert_array_equal(with_a.prompt_table_extra_ids, again_a.prompt_table_extra_ids)  # reusable
    twice = pre(prompt=f"{IMAGE} and {IMAGE}", images=[a, a])
    visual = twice.engine_input_ids >= pre.info.text.vocab_size
    assert set(twice.prompt_table_extra_ids[visual].tolist()) == set(with_a.prompt_table_extra_ids.tolist()) - {0}


def test_text_only_requests_have_zeros(pre):
    request = pre([{"role": "user", "content": "Hello!"}])
    assert request.prompt_table_extra_ids.dtype == np.uint64
    assert request.prompt_table_extra_ids.shape == request.input_ids.shape and not request.prompt_table_extra_ids.any()


def test_mismatched_images_are_refused():
    ids = np.array([1, 151655, 151655, 151655, 151655, 2])
    with pytest.raises(InputError, match="do not match"):
        prompt_table_extra_ids(ids, 151655, [bytes(16)], np.array([[1, 4, 8]]), merge_size=2)  # 8 tokens, 4 in the ids
