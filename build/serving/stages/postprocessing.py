"""The `postprocessing` model: generated ids -> text, for the ensemble that returns text (`qwen3vl`: tritonclient
callers, genai-perf). Clients that decode themselves use the ensemble that returns the ids (`qwen3vl_tokens`), which
has no python step per streamed token.

Streamed responses carry only their new tokens (the tensorrt_llm backend's streaming output), and an ensemble step
after a decoupled model sees nothing but that model's outputs, so the text of a response is decoded against the
tokens before it by keeping each request's TextStream, keyed by the request id the ensemble gives every step (core:
src/ensemble_scheduler/ensemble_scheduler.cc, InitStep: `irequest->SetId(request_id_)`): each response gets only its
new text. States are dropped least recently used beyond `max_streams` (a few tokens each). A request sent without an
id has its responses decoded one by one. What is shown is qwen3vl_trt.decoding.detokenize's (end ids never; the echoed
prompt's visual fake ids as the image placeholder; log probabilities for the tokens shown; with generation logits,
each token's likeliest alternatives, as many as the deployment serves).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ...decoding.detokenize import Detokenizer, TextStream
from .. import interface


class Detokenizing:
    def __init__(self, model_dir: str | Path, max_streams: int = 4096, top_logprobs: int = 0):
        """top_logprobs: the alternatives each token of a response with generation logits gets (the deployment's
        max_top_logprobs: this step does not see the request, so its clients take the first ones they asked)."""
        self.detokenizer = Detokenizer.from_model_dir(model_dir)
        self.max_streams = max_streams
        self.top_logprobs = top_logprobs
        self.streams: OrderedDict[str, TextStream] = OrderedDict()

    def execute(self, requests: Sequence[Mapping[str, Any]], request_ids: Sequence[str]) -> list[dict[str, Any]]:
        return [self._one(inputs, request_id) for inputs, request_id in zip(requests, request_ids, strict=True)]

    def _one(self, inputs: Mapping[str, Any], request_id: str) -> dict[str, Any]:
        stream = self.streams.pop(request_id, None) if request_id else None
        stream = stream or self.detokenizer.stream(self.top_logprobs)
        log_probs = inputs.get(interface.OUTPUT_LOG_PROBS.name)
        logits = inputs.get(interface.GENERATION_LOGITS.name)
        ids, length = inputs[interface.LLM_OUTPUT_IDS.name], inputs[interface.SEQUENCE_LENGTH.name]
        answer = stream.piece(ids, length, log_probs, logits)
        text = answer.text
        if request_id:
            self.streams[request_id] = stream
            while len(self.streams) > self.max_streams:
                self.streams.popitem(last=False)
        else:
            text += stream.finish()
        outputs = {
            interface.TEXT_OUTPUT.name: np.array([text.encode()], dtype=object),
            interface.OUTPUT_IDS_OUT.name: np.array(answer.token_ids, dtype=np.int32),
        }
        if log_probs is not None or logits is not None:
            outputs[interface.LOG_PROBS_OUT.name] = np.array(answer.log_probs, dtype=np.float32)
        if logits is not None:
            k = self.top_logprobs
            outputs[interface.TOP_IDS_OUT.name] = np.array(
                [[t for t, _ in top] for top in answer.top], np.int32
            ).reshape(-1, k)
            outputs[interface.TOP_LOG_PROBS_OUT.name] = np.array(
                [[p for _, p in top] for top in answer.top], np.float32
            ).reshape(-1, k)
        return outputs
