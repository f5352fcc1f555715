"""qwen3vl_trt.detokenize on responses shaped as the llms send them: the CPU llm's and the tensorrtllm backend's
([beams, tokens] in a model, [1, beams, tokens] where a client gets them), the engine's empty last streamed response,
an echoed prompt's visual ids, end ids and the log probabilities of every token so far."""

from __future__ import annotations

import numpy as np
import pytest
from qwen3vl_trt.detokenize import Answer, Detokenizer


@pytest.fixture(scope="module")
def detokenizer(checkpoints):
    return Detokenizer.from_model_dir(checkpoints["dense"])


def _ids(tokens, batch=True):
    ids = np.array([tokens], dtype=np.int32).reshape(1, -1)
    return ids[None] if batch else ids


def test_streamed_pieces_concatenate_to_the_whole_text_in_any_shape(detokenizer):
    tokens = [1000, 1001, 1002, 1003]
    whole = detokenizer.stream().piece(_ids(tokens), [[len(tokens)]])
    assert whole.token_ids == tokens and whole.text == detokenizer.tokenizer.decode(tokens)
    for batch in (True, False):
        stream = detokenizer.stream()
        pieces = [stream.piece(_ids([t], batch), [[1]] if batch else [1]) for t in tokens]
        assert Answer.joined(pieces) == whole


def test_the_engines_empty_last_response_gives_nothing(detokenizer):
    """A stream that ends on the end id: the engine's last response carries no token ([1, 1, 0], length 0)."""
    stream = detokenizer.stream()
    assert stream.piece(_ids([1000]), [[1]]).token_ids == [1000]
    empty = stream.piece(np.zeros((1, 1, 0), np.int32), [[0]], np.full((1, 1, 1), -0.5, np.float32))
    assert empty == Answer("", [], ())
    assert detokenizer.stream().piece(np.zeros((1, 0), np.int32), [0]) == Answer("", [])


def test_end_ids_are_not_shown_and_visual_ids_show_the_image_placeholder(detokenizer):
    end = min(detokenizer.end_ids)
    visual = detokenizer.vocab_size + 4  # an echoed prompt's fake id
    answer = detokenizer.stream().piece(_ids([1000, visual, 1001, end]), [[4]])
    assert answer.token_ids == [1000, detokenizer.image_token_id, 1001]


def test_log_probs_are_those_of_the_tokens_shown(detokenizer):
    """The tensorrtllm backend streams the log probabilities of every token generated so far: each response's are
    the last ones; an end id's is not shown."""
    end = min(detokenizer.end_ids)
    stream = detokenizer.stream()
    first = stream.piece(_ids([1000]), [[1]], np.array([[[-0.25]]], np.float32))
    second = stream.piece(_ids([1001, end]), [[2]], np.array([[[-0.25, -0.5, -0.75]]], np.float32))
    assert first.log_probs == (-0.25,) and second.log_probs == (-0.5,)
    assert second.token_ids == [1001]
