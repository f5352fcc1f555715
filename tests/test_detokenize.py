"""qwen3vl_trt.decoding.detokenize on responses shaped as the llms send them: the CPU llm's and the tensorrtllm
backend's ([beams, tokens] in a model, [1, beams, tokens] where a client gets them), the engine's empty last
streamed response, an echoed prompt's visual ids, end ids and the log probabilities of every token so far."""

from __future__ import annotations

import numpy as np
import pytest
from qwen3vl_trt.decoding.detokenize import Answer, Detokenizer


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


def test_top_logprobs_from_either_backend_shape_equal_torch_log_softmax(detokenizer):
    """Generation logits as the tensorrtllm backend answers them (streamed [1, n, beams, V], else [1, beams, T, V]
    with rows past the generated tokens unset; V padded past the vocabulary) give each shown token's log-softmax
    and its k likeliest alternatives, ties by id; the end id's row is not shown."""
    import torch

    vocab = detokenizer.vocab_size
    rng = np.random.default_rng(3)
    logits = (rng.standard_normal((4, vocab + 8)) * 4).astype(np.float32)
    logits[:, vocab:] = 50.0  # padding past the vocabulary: never an alternative
    logits[1, [10, 11, 12]] = logits[1].max() + 1  # a three-way tie at the top
    end = min(detokenizer.end_ids)
    tokens = [1000, 10, 1002, end]
    expected = torch.log_softmax(torch.from_numpy(logits[:, :vocab]), -1).numpy()

    def check(answer, k):
        assert answer.token_ids == tokens[:3]
        assert answer.log_probs == pytest.approx([expected[i, t] for i, t in enumerate(tokens[:3])], abs=1e-4)
        for i, top in enumerate(answer.top):
            ids = sorted(range(vocab), key=lambda t: (-expected[i, t], t))[:k]
            assert [t for t, _ in top] == ids
            assert [p for _, p in top] == pytest.approx(expected[i, ids], abs=1e-4)
        assert [t for t, _ in answer.top[1]][:3] == [10, 11, 12][:k]

    for k in (1, 3, 5):
        whole = np.concatenate([logits, np.full((6, vocab + 8), np.nan, np.float32)])  # max_tokens 10
        check(detokenizer.stream(k).piece(_ids(tokens), [[4]], generation_logits=whole[None, None]), k)
        stream = detokenizer.stream(k)
        pieces = [
            stream.piece(_ids([t]), [[1]], generation_logits=logits[i, None, None][None]) for i, t in enumerate(tokens)
        ]
        check(Answer.joined(pieces), k)
