"""The CPU target's `llm`: the reference runtime serving the tensorrt_llm backend's inputs with
inflight batching.

One thread owns a DecodeBatch. Between decode steps it lets waiting requests join (their prompts
run together) and drops finished and cancelled ones, so requests arriving while others decode start
at the next step, as the TensorRT-LLM executor schedules them. Tokens go out through each request's
stream: one response per token when streaming, else one response at the end, after the prompt's
ids unless exclude_input_in_output. End ids are not sent (the engine leaves them out too).

output_log_probs comes with return_log_probs only, as the tensorrtllm backend answers
(triton_backend/inflight_batcher_llm/src/model_instance_state.cc fillTritonResponse): the log probs of all the
request's generated tokens so far, [1, k], in streaming responses too (batch_manager/llmRequest.cpp createResult
puts the whole getLogProbs() in every result; the LLM API's result.py accumulates them as "a streamwise
monotonically growing list"). A request is one sequence: 1.2.1's backend cannot ask the executor for several
(its num_return_sequences lands in another sampling field, TensorRT-LLM PR #13633), so the gateway sends n.

Guided decoding (guided_decoding_guide_type json, json_schema, regex or ebnf_grammar, as utils.cc
getGuidedDecodingParamsFromTensors maps them; any other type means no guide) needs the tokenizer info that
xgrammar_tokenizer_info_path names for the tensorrtllm backend: without one a guided request fails.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from ...decoding.guides import GUIDE_TYPES, load_tokenizer_info
from ...errors import InputError, Qwen3VLTrtError
from ...runtime.guided import GrammarCache
from ...runtime.reference_llm import DecodeBatch, GenerationResult, LLMRequest, ReferenceLLM
from ...runtime.sampling import LogitsGuide, SamplingParams
from .. import interface, request
from ..tensors import Tensor
from .preprocessing import split_word_list

log = logging.getLogger(__name__)

STOP_MEMORY_S = 60.0  # how long a stop request waits for its request to arrive
CANCEL_CHECK_S = 0.05
"""How often the decode loop asks whether Triton cancelled a request: each ask is a round trip to the
server process (python_backend r24.10 src/pb_cancel.cc: PbCancel::IsCancelled enqueues the query to
the parent and waits for its answer), so asking for every request at every step would cost more than
the step itself once many requests decode together."""


class TokenStream(Protocol):
    """Where one request's tokens go. log_probs: the generated tokens' log probs so far, sent with return_log_probs
    only; generation_logits: the raw logits of the tokens sent (interface.GENERATION_LOGITS), with
    return_generation_logits only."""

    def send(
        self,
        tokens: list[int],
        final: bool,
        log_probs: list[float] | None = None,
        generation_logits: np.ndarray | None = None,
    ) -> None: ...
    def finish(self) -> None: ...  # the end of a stream whose tokens were all sent
    def fail(self, error: Exception) -> None: ...
    def cancelled(self) -> bool: ...


@dataclass
class _Job:
    request: LLMRequest
    stream: TokenStream
    streaming: bool
    end_ids: frozenset[int]
    request_id: str
    tokens: list[int] = field(default_factory=list)  # the prompt's ids first when it is echoed
    log_probs: list[float] = field(default_factory=list)
    logits: list[np.ndarray] = field(default_factory=list)  # the generated tokens' not sent yet
    result: GenerationResult | None = None


def _value(inputs: Mapping[str, Any], tensor: Tensor, default: Any) -> Any:
    value = inputs.get(tensor.name)
    return default if value is None else np.asarray(value).reshape(-1)[0].item()


def _text(inputs: Mapping[str, Any], tensor: Tensor) -> str | None:
    value = inputs.get(tensor.name)
    if value is None or np.asarray(value).size == 0:
        return None
    item = np.asarray(value, dtype=object).reshape(-1)[0]
    return item.decode() if isinstance(item, bytes) else str(item)


class InflightLLM:
    def __init__(
        self,
        checkpoint_dir: str | Path,
        end_ids: Sequence[int],
        max_batch_size: int,
        tokenizer_info_path: Path | None = None,
    ):
        """tokenizer_info_path: the xgrammar tokenizer info guided decoding needs (None: guided requests fail)."""
        self.llm = ReferenceLLM.from_checkpoint(checkpoint_dir)
        self.end_ids = tuple(end_ids)
        self.max_batch_size = max_batch_size
        self.tokenizer_info_path = tokenizer_info_path
        self._grammars: GrammarCache | None = None
        self._grammars_lock = threading.Lock()
        self._waiting: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()  # None: close
        self._stops: queue.SimpleQueue[str] = queue.SimpleQueue()  # request ids a stop request named
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._run, name="inflight-llm", daemon=True)

    def request(self, inputs: Mapping[str, Any]) -> LLMRequest:
        """The reference runtime's request for the tensorrt_llm inputs of one request."""
        ids = np.asarray(inputs[interface.INPUT_IDS.name]).reshape(-1)
        length = int(_value(inputs, interface.INPUT_LENGTHS, ids.size))
        if length != ids.size:
            raise Qwen3VLTrtError(f"input_lengths is {length} but input_ids holds {ids.size} ids")
        table = inputs.get(interface.PROMPT_TABLE.name)
        if int(ids.max(initial=0)) < self.llm.vocab_size:
            table = None  # text only: the table's placeholder row is never addressed
        return LLMRequest(
            input_ids=ids.astype(np.int32),
            prompt_embedding_table=None if table is None else torch.as_tensor(table),
            mrope_rotary_cos_sin=inputs.get(interface.MROPE_COS_SIN.name),
            mrope_position_deltas=int(_value(inputs, interface.MROPE_DELTAS, 0)),
            sampling=replace(self._sampling(inputs), guide=self._guide(inputs)),
        )

    def _sampling(self, inputs: Mapping[str, Any]) -> SamplingParams:
        end_id = int(_value(inputs, interface.END_ID, self.end_ids[0]))
        # utils.cc getSamplingConfigFromTensors drops a top_p <= 0; the sampling layers then make top_k 0 with no
        # top_p greedy (top_k 1) and give a top_k without top_p the top_p 1 (samplingTopKKernels.h
        # regularizeTopKTopP). Top-k 1 is greedy at any temperature, which still scales its log probs.
        top_k = int(_value(inputs, interface.RUNTIME_TOP_K, 0))
        top_p = float(_value(inputs, interface.RUNTIME_TOP_P, 0.0))
        if top_p <= 0:
            top_k, top_p = top_k or 1, 1.0
        bias = inputs.get(interface.EMBEDDING_BIAS.name)
        embedding_bias = None
        if bias is not None:
            embedding_bias = torch.as_tensor(np.asarray(bias, dtype=np.float32)).reshape(-1)
            if embedding_bias.numel() == 0:  # utils.cc: an embedding_bias of shape [0] is no bias
                embedding_bias = None
        return SamplingParams(
            max_new_tokens=int(_value(inputs, interface.REQUEST_OUTPUT_LEN, 0)),
            temperature=float(_value(inputs, interface.TEMPERATURE, 1.0)),
            top_k=top_k,
            top_p=top_p,
            seed=int(_value(inputs, interface.SEED, 0)),
            end_ids=tuple(dict.fromkeys((end_id, *self.end_ids))),
            min_new_tokens=int(_value(inputs, interface.MIN_TOKENS, 0)),
            stop_sequences=split_word_list(inputs.get(interface.STOP_WORDS_LIST.name)),
            bad_sequences=split_word_list(inputs.get(interface.BAD_WORDS_LIST.name)),
            repetition_penalty=float(_value(inputs, request.REPETITION_PENALTY, 1.0)),
            presence_penalty=float(_value(inputs, request.PRESENCE_PENALTY, 0.0)),
            frequency_penalty=float(_value(inputs, request.FREQUENCY_PENALTY, 0.0)),
            embedding_bias=embedding_bias,
            return_log_probs=bool(_value(inputs, request.RETURN_LOG_PROBS, False)),
            return_generation_logits=bool(_value(inputs, interface.RETURN_GENERATION_LOGITS, False)),
        )

    def _guide(self, inputs: Mapping[str, Any]) -> LogitsGuide | None:
        """The request's grammar matcher when it is guided."""
        guide_type = _text(inputs, request.GUIDE_TYPE)
        if guide_type not in GUIDE_TYPES:
            return None
        guide = _text(inputs, request.GUIDE_TEXT)
        # The guide text may be left out only for "json" (executor GuidedDecodingParams: required unless kJSON).
        if guide is None and guide_type != "json":
            raise InputError(f"guided_decoding_guide must be sent with guided_decoding_guide_type {guide_type}")
        grammars = self._grammar_cache()
        try:
            return grammars.matcher(guide_type, guide or "")
        except Qwen3VLTrtError:
            raise
        except Exception as e:  # the grammar library's own errors: a bad guide fails its request only
            raise InputError(f"the {guide_type} guide cannot be used: {e}") from e

    def _grammar_cache(self) -> GrammarCache:
        if self.tokenizer_info_path is None:
            raise InputError(
                "guided decoding is not enabled on this deployment: the llm has no xgrammar tokenizer info "
                "(tokenizer_info_path)"
            )
        with self._grammars_lock:
            if self._grammars is None:  # made at the first guided request: loading the tokenizer info takes a second
                self._grammars = GrammarCache(load_tokenizer_info(self.tokenizer_info_path, self.llm.vocab_size))
            return self._grammars

    def warm_up(self) -> None:
        """A short generation, and the grammar library's start with the tokenizer info (seconds), so the first
        request, and the first guided one, does not pay for first-use initialization."""
        self.llm.generate([LLMRequest(np.zeros(4, np.int32), sampling=SamplingParams(max_new_tokens=2))])
        if self.tokenizer_info_path is not None and Path(self.tokenizer_info_path).is_file():
            self._grammar_cache().matcher("json", "")

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._closing.set()
        self._waiting.put(None)  # wakes the loop when it waits for work
        self._thread.join(timeout=30)

    def submit(self, inputs: Mapping[str, Any], stream: TokenStream, request_id: str = "") -> None:
        if _value(inputs, interface.STOP, False):
            self._stops.put(request_id)
            stream.finish()
            return
        try:
            request = self.request(inputs)
        except Qwen3VLTrtError as e:
            stream.fail(e)
            return
        streaming = bool(_value(inputs, interface.STREAMING, False))
        job = _Job(request, stream, streaming, frozenset(request.sampling.end_ids), request_id)
        if not streaming and not _value(inputs, interface.EXCLUDE_INPUT, False):
            job.tokens.extend(int(t) for t in request.input_ids)  # the engine's output_ids hold the prompt too
        self._waiting.put(job)

    def _run(self) -> None:
        jobs: dict[int, _Job] = {}
        stopping: dict[str, float] = {}  # stop requests' ids -> when they came (a stop may overtake its request)
        batch = self._batch(jobs)
        next_index = 0
        next_cancel_check = 0.0
        while not self._closing.is_set():
            joining: dict[int, _Job] = {}
            while len(batch) + len(joining) < self.max_batch_size:
                try:
                    # Idle, it sleeps until a request (or close) comes; busy, it takes only what is waiting.
                    job = self._waiting.get(block=not batch and not joining)
                except queue.Empty:
                    break
                if job is None:
                    break
                joining[next_index] = job
                next_index += 1
            try:
                self._join(batch, jobs, joining)
                now = time.monotonic()
                ask_triton = now >= next_cancel_check
                if ask_triton:
                    next_cancel_check = now + CANCEL_CHECK_S
                batch.cancel(self._cancelled(jobs, stopping, ask_triton))
                batch.step()
            except Exception as e:  # a runtime bug: every request in flight gets the error, serving goes on
                log.exception("the decode step failed")
                for job in jobs.values():
                    job.stream.fail(e)
                jobs.clear()
                batch = self._batch(jobs)
            self._finish(batch, jobs)

    def _batch(self, jobs: dict[int, _Job]) -> DecodeBatch:
        return DecodeBatch(self.llm, on_step=lambda index, *step: self._token(jobs[index], *step))

    def _cancelled(self, jobs: dict[int, _Job], stopping: dict[str, float], ask_triton: bool) -> list[int]:
        """The jobs to drop: named by a stop request, or (when ask_triton) cancelled by Triton."""
        now = time.monotonic()
        while not self._stops.empty():
            stopping[self._stops.get()] = now
        cancelled = [
            i for i, job in jobs.items() if job.request_id in stopping or (ask_triton and job.stream.cancelled())
        ]
        for i in cancelled:
            stopping.pop(jobs[i].request_id, None)
            log.info("request %r cancelled by its client after %d tokens", jobs[i].request_id, len(jobs[i].tokens))
        for request_id in [r for r, since in stopping.items() if now - since > STOP_MEMORY_S]:
            del stopping[request_id]
        return cancelled

    def _join(self, batch: DecodeBatch, jobs: dict[int, _Job], joining: dict[int, _Job]) -> None:
        if not joining:
            return
        jobs.update(joining)
        try:
            results = batch.add_many([job.request for job in joining.values()], joining)
            for job, result in zip(joining.values(), results, strict=True):
                job.result = result
        except Qwen3VLTrtError:
            # One bad request: the others join one by one and only the bad ones are answered with errors.
            for index, job in joining.items():
                try:
                    job.result = batch.add(job.request, index)
                except Qwen3VLTrtError as e:
                    job.stream.fail(e)
                    del jobs[index]

    def _token(self, job: _Job, token: int, log_prob: float | None, logits: np.ndarray | None) -> None:
        if token in job.end_ids:
            return
        job.tokens.append(token)
        if log_prob is not None:
            job.log_probs.append(log_prob)
        if logits is not None:
            job.logits.append(logits)
        if job.streaming:
            self._send(job, [token], final=False)

    def _send(self, job: _Job, tokens: list[int], final: bool) -> None:
        sampling = job.request.sampling
        log_probs = list(job.log_probs) if sampling.return_log_probs else None
        logits = None
        if sampling.return_generation_logits:
            # The backend's shapes (interface.GENERATION_LOGITS; the stream adds the batch dimension): [n, 1, V]
            # streamed, else [1, T, V] (upstream's T is max_tokens, its rows past the generated ones unset; here the
            # generated ones).
            rows = np.stack(job.logits) if job.logits else np.zeros((0, self.llm.vocab_size), np.float32)
            logits = rows[:, None] if job.streaming else rows[None]
            job.logits.clear()
        job.stream.send(tokens, final=final, log_probs=log_probs, generation_logits=logits)

    def _finish(self, batch: DecodeBatch, jobs: dict[int, _Job]) -> None:
        running = {seq.index for seq in batch.sequences}
        for index in [i for i in jobs if i not in running]:
            job = jobs.pop(index)
            if job.result is not None and job.result.error is not None:  # its guide failed
                job.stream.fail(job.result.error)
            elif job.streaming:
                job.stream.finish()
            else:
                self._send(job, job.tokens, final=True)
