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

from .checkpoint import generation_end_ids, parse_config, read_config


@dataclass(frozen=True)
class Answer:
    """Generated text, or a piece of it: the text and the token ids it decodes from (end ids excluded), and their
    log probabilities when the request asked for them (return_log_probs)."""

    text: str
    token_ids: list[int]
    log_probs: tuple[float, ...] = ()

    @staticmethod
    def joined(answers: Sequence[Answer]) -> Answer:
        """Consecutive pieces as one."""
        return Answer(
            "".join(a.text for a in answers),
            [t for a in answers for t in a.token_ids],
            tuple(p for a in answers for p in a.log_probs),
        )


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

    def stream(self) -> TextStream:
        return TextStream(self)


class TextStream:
    """One request's responses as the llm sends them (streamed: each with its new tokens only, the tensorrt_llm
    backend's streaming output) -> each response's new text, the ids shown and their log probabilities."""

    def __init__(self, detokenizer: Detokenizer):
        self.detokenizer = detokenizer
        self.text = StreamingDetokenizer(detokenizer.tokenizer)

    def piece(self, output_ids: Any, sequence_length: Any, log_probs: Any = None) -> Answer:
        """output_ids [beams, tokens] and sequence_length [beams] as the llm sends them; log_probs [beams, tokens]:
        those of every token generated so far (as the tensorrtllm backend streams them), or None."""
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
