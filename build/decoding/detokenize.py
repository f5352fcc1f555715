"""Generated token ids -> text, wherever the text is consumed: the deployment's postprocessing (the ensemble that
returns text), the gRPC client and the OpenAI gateway (the ensemble that returns token ids, which they decode
incrementally, as vLLM's frontend does: no python step per streamed token in the server), and one process
(runtime.local). One decoding for all of them, so every route gives the same text for the same ids."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from ..hf.checkpoint import generation_end_ids, parse_config, read_config

Alternatives = tuple[tuple[int, float], ...]
"""A generated token's likeliest tokens with their log probabilities, the likeliest first."""


@dataclass(frozen=True)
class Answer:
    """Generated text, or a piece of it: the text and the token ids it decodes from (end ids excluded), and their
    log probabilities when the request asked for them (return_log_probs, or top_logprobs: then with each token's
    alternatives in `top`, both from the model's own distribution, the log-softmax of its logits)."""

    text: str
    token_ids: list[int]
    log_probs: tuple[float, ...] = ()
    top: tuple[Alternatives, ...] = ()

    @staticmethod
    def joined(answers: Sequence[Answer]) -> Answer:
        """Consecutive pieces as one."""
        return Answer(
            "".join(a.text for a in answers),
            [t for a in answers for t in a.token_ids],
            tuple(p for a in answers for p in a.log_probs),
            tuple(t for a in answers for t in a.top),
        )


def logits_rows(generation_logits: Any) -> np.ndarray:
    """The generation logits the llm sends with a response, as one row per generated token [tokens, vocab]: the
    tensorrtllm backend's [n, beams, V] when streaming and [beams, max_tokens, V] otherwise (interface.
    GENERATION_LOGITS), under a batch dimension; the engine has one beam, so the beams axis is the one of size 1."""
    rows = np.asarray(generation_logits)
    while rows.ndim > 3:
        rows = rows[0]
    return rows[:, 0] if rows.shape[1] == 1 else rows[0]


def log_softmax_top(
    rows: np.ndarray, vocab_size: int, tokens: Sequence[int], k: int
) -> tuple[list[float], list[Alternatives]]:
    """Each row's log probability of its token and its k likeliest tokens (ties by id), under the log-softmax of the
    logits over the vocabulary (the padded tail dropped); rows [len(tokens), >= vocab_size]."""
    x = np.asarray(rows[: len(tokens), :vocab_size], dtype=np.float32)
    peak = x.max(-1, keepdims=True)
    log_probs = x - (peak + np.log(np.exp(x - peak).sum(-1, keepdims=True, dtype=np.float64))).astype(np.float32)
    chosen = [float(log_probs[i, t]) for i, t in enumerate(tokens)]
    tops = []
    for row in log_probs:
        ids = _likeliest(row, k)
        tops.append(tuple((int(t), float(row[t])) for t in ids))
    return chosen, tops


_BLOCK = 256


def _likeliest(row: np.ndarray, k: int) -> list[int]:
    """The ids of the k largest values, the largest first (ties by id). The k-th largest of the blocks' maxima is at
    most the k-th largest value (k blocks hold values at least that large), so the values at or above it hold the
    k largest: a few candidates instead of a partition of the whole vocabulary (a tenth of argpartition's time)."""
    maxima = np.maximum.reduceat(row, np.arange(0, row.size, _BLOCK))
    floor = np.partition(maxima, -k)[-k] if maxima.size >= k else -np.inf
    candidates = np.flatnonzero(row >= floor)
    return sorted(candidates.tolist(), key=lambda t: (-row[t], t))[:k]


class StreamingDetokenizer:
    """Turns generated tokens into text pieces whose concatenation is their decoded text, in time
    linear in the tokens: each push decodes only the tokens since the last piece (after the tokens
    of the piece before it, as context: some decoders drop a leading space at the start of what they
    decode), and text that ends inside a UTF-8 character is held back until the character is whole."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.context = 0  # first token decoded as context
        self.shown = 0  # tokens whose text has been returned

    def push(self, token: int) -> str:
        """The new text that this token completes (possibly empty)."""
        self.tokens.append(token)
        return self._piece(final=False)

    def finish(self) -> str:
        """The text held back at the end (an incomplete character decodes to U+FFFD, as in decode)."""
        return self._piece(final=True)

    def _piece(self, final: bool) -> str:
        shown = self.tokenizer.decode(self.tokens[self.context : self.shown])
        text = self.tokenizer.decode(self.tokens[self.context :])
        if not final and (len(text) <= len(shown) or text.endswith("\ufffd")):
            return ""
        # Only the tokens of the piece just shown stay, as the next piece's context.
        del self.tokens[: self.shown]
        self.context, self.shown = 0, len(self.tokens)
        return text[len(shown) :]


@dataclass(frozen=True)
class Detokenizer:
    """What decoding the llm's responses takes: the checkpoint's tokenizer, its generation end ids (never shown),
    and its vocabulary size: ids at or above it are the prompt's visual fake ids (the engine's contract), shown as
    the image placeholder when the llm echoes the prompt."""

    tokenizer: Tokenizer
    end_ids: frozenset[int]
    vocab_size: int
    image_token_id: int

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, tokenizer: Tokenizer | None = None) -> Detokenizer:
        model_dir = Path(model_dir)
        info = parse_config(read_config(model_dir)[1])
        return cls(
            tokenizer or Tokenizer.from_file(str(model_dir / "tokenizer.json")),
            frozenset(generation_end_ids(model_dir)),
            info.text.vocab_size,
            info.image_token_id,
        )

    def stream(self, top_logprobs: int = 0) -> TextStream:
        return TextStream(self, top_logprobs)


class TextStream:
    """One request's responses as the llm sends them (streamed: each with its new tokens only, the tensorrt_llm
    backend's streaming output) -> each response's new text, the ids shown and their log probabilities."""

    def __init__(self, detokenizer: Detokenizer, top_logprobs: int = 0):
        """top_logprobs: the alternatives each token shown gets when the responses carry generation logits."""
        self.detokenizer = detokenizer
        self.top_logprobs = top_logprobs
        self.text = StreamingDetokenizer(detokenizer.tokenizer)

    def piece(
        self, output_ids: Any, sequence_length: Any, log_probs: Any = None, generation_logits: Any = None
    ) -> Answer:
        """output_ids [beams, tokens] and sequence_length [beams] as the llm sends them; log_probs [beams, tokens]:
        those of every token generated so far (as the tensorrtllm backend streams them), or None;
        generation_logits: the logits of this response's tokens (logits_rows), which a request with top_logprobs
        gets, and whose ids are all generated (it excludes the prompt: GenerationRequest)."""
        d = self.detokenizer
        ids = np.asarray(output_ids)
        # The first beam, under a batch dimension where a client gets one; the engine's last streamed response may
        # carry none ([1, 1, 0]: the end id adds no token, TensorRT-LLM's LlmRequest and updateRequests).
        ids = ids[(0,) * (ids.ndim - 1)]
        length = int(np.asarray(sequence_length).reshape(-1)[0])
        # In Python: a streamed response holds a token or a few, for which numpy's per-call cost is the larger part.
        received = [d.image_token_id if t >= d.vocab_size else t for t in ids[:length].tolist()]
        shown = [t not in d.end_ids for t in received]
        tokens = [t for t, keep in zip(received, shown, strict=True) if keep]
        text = "".join([self.text.push(t) for t in tokens])
        if generation_logits is not None and self.top_logprobs and received:
            chosen, tops = log_softmax_top(logits_rows(generation_logits), d.vocab_size, received, self.top_logprobs)
            kept = [i for i, keep in enumerate(shown) if keep]
            return Answer(text, tokens, tuple(chosen[i] for i in kept), tuple(tops[i] for i in kept))
        if log_probs is None:
            return Answer(text, tokens)
        # The last ones are this response's: its tokens, which end the ids (an echoed prompt comes first).
        generated = np.asarray(log_probs, np.float32)
        generated = generated[(0,) * (generated.ndim - 1)].tolist()
        count = min(len(generated), len(received))
        pairs = zip(generated[len(generated) - count :], shown[len(received) - count :], strict=True)
        mine = [p for p, keep in pairs if keep]
        return Answer(text, tokens, tuple(mine))

    def finish(self) -> str:
        """The text held back at the end (see StreamingDetokenizer.finish). Streams keyed by request id in
        postprocessing, and so the clients that decode as it does, never call it: an answer cut inside a UTF-8
        character ends before that character rather than with U+FFFD."""
        return self.text.finish()
