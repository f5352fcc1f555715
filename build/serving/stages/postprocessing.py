"""The `postprocessing` model: generated ids -> text.

Streamed responses carry only their new tokens (the tensorrt_llm backend's streaming output), and
an ensemble step after a decoupled model sees nothing but that model's outputs, so the text of a
response is decoded against the tokens before it by keeping each request's detokenizer, keyed by
the request id the ensemble gives every step (core: src/ensemble_scheduler/ensemble_scheduler.cc,
InitStep: `irequest->SetId(request_id_)`): each response gets only its new text. States are
dropped least recently used beyond `max_streams` (a few tokens each). A request sent without an id
has its responses decoded one by one. End ids are never shown; prompt ids (when the llm echoes the
prompt) are shown with the image placeholder for the visual fake ids. Log probabilities, when the llm
sends them (those of every token generated so far, as the tensorrtllm backend streams them), are passed on for
the response's tokens shown.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from ...checkpoint import generation_end_ids, parse_config, read_config
from ...runtime.local import StreamingDetokenizer
from .. import interface


class Detokenizing:
    def __init__(self, model_dir: str | Path, max_streams: int = 4096):
        self.tokenizer = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
        self.end_ids = frozenset(generation_end_ids(Path(model_dir)))
        info = parse_config(read_config(Path(model_dir))[1])
        self.vocab_size, self.image_token_id = info.text.vocab_size, info.image_token_id
        self.max_streams = max_streams
        self.streams: OrderedDict[str, StreamingDetokenizer] = OrderedDict()

    def execute(self, requests: Sequence[Mapping[str, Any]], request_ids: Sequence[str]) -> list[dict[str, Any]]:
        return [self._one(inputs, request_id) for inputs, request_id in zip(requests, request_ids, strict=True)]

    def _one(self, inputs: Mapping[str, Any], request_id: str) -> dict[str, Any]:
        ids = np.atleast_2d(np.asarray(inputs[interface.LLM_OUTPUT_IDS.name]))  # [beams, tokens]
        length = int(np.asarray(inputs[interface.SEQUENCE_LENGTH.name]).reshape(-1)[0])
        received = ids[0, : min(length, ids.shape[1])].astype(np.int64)
        received[received >= self.vocab_size] = self.image_token_id
        shown = np.array([int(t) not in self.end_ids for t in received], dtype=bool)
        tokens = [int(t) for t in received[shown]]
        detokenizer = self.streams.pop(request_id, None) if request_id else None
        detokenizer = detokenizer or StreamingDetokenizer(self.tokenizer)
        text = "".join(detokenizer.push(t) for t in tokens)
        if request_id:
            self.streams[request_id] = detokenizer
            while len(self.streams) > self.max_streams:
                self.streams.popitem(last=False)
        else:
            text += detokenizer.finish()
        outputs = {
            interface.TEXT_OUTPUT.name: np.array([text.encode()], dtype=object),
            interface.OUTPUT_IDS_OUT.name: np.array(tokens, dtype=np.int32),
        }
        log_probs = inputs.get(interface.OUTPUT_LOG_PROBS.name)
        if log_probs is not None:
            # The last ones are this response's: its tokens, which end the ids (an echoed prompt comes first).
            generated = np.atleast_2d(np.asarray(log_probs, np.float32))[0]
            count = min(generated.size, received.size)
            mine = generated[generated.size - count :]
            outputs[interface.LOG_PROBS_OUT.name] = mine[shown[received.size - count :]]
        return outputs
