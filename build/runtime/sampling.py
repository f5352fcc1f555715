"""Per-request token selection as TensorRT-LLM 1.2's decoder makes it: greedy, or temperature / top-k / top-p
sampling from a seeded generator, after the guide's mask, the embedding bias and the penalties.

The order is the engine's (upstream paths; read on the 1.2 line, TRTLLM_KERNELS_NAMESPACE era):

1. the guided-decoding bitmask, applied to the step's logits before the decoder runs
   (batch_manager/trtGptModelInflightBatching.cpp: mGuidedDecoder->execute(decoderInputBuffers) precedes
   mDecoder->forwardAsync);
2. kernels/penaltyKernels.cu batchApplyPenalty, per vocabulary id: + embedding bias; * 1/(temperature + 1e-6)
   unless the temperature is 1; then, for ids seen in the prompt or the output, repetition
   (logit < 0 ? logit * p : logit / p), presence (- p) and frequency (- p * occurrences); the result clamped to
   +-FLT_MAX; then the end id masked while fewer than min_tokens tokens were generated;
3. the bad-words ban (layers/dynamicDecodeLayer: BanWordsLayer after the penalty layer);
4. sampling (layers/samplingLayer.cpp): a softmax over the whole vocabulary whenever log probs are asked for
   (skipSoftMax is false), then top-k / top-p among those probabilities.

Penalty occurrences (penaltyKernels.cu, context phase): every prompt id below vocab_size counts, for all three
penalties alike (prompt_ignore_length, executor.h "Default is 0", is never set by the Triton backend), and
each generated token counts from the next step on. Visual fake ids (>= vocab_size) never count.

A chosen token's log prob is the log of its probability under that full-vocabulary softmax of the processed
logits: after the bias, temperature, penalties and bans, never renormalized over the top-k / top-p cut
(kernels/samplingTopKKernels.cu topKStage2Sampling: logf(expLogit) with logitsHasProbs and
normalizeLogProbs false, TopKSamplingLayer::setup normalizeLogProbs.value_or(false);
kernels/samplingTopPKernels.cu epilogue: logf(sortedProbs[offset])). Greedy (top_k 1) takes the argmax of
the same probabilities, so its log prob still depends on the temperature and penalties.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from ..errors import InputError

FLT_MAX = float(np.finfo(np.float32).max)


class LogitsGuide(Protocol):
    """A sequence's grammar (guided decoding): which tokens may come next, and what came.

    mask returns the logits [vocab] with the tokens the grammar forbids at -inf (it may change and return its
    argument); accept takes the token chosen, which then advances the grammar."""

    def mask(self, logits: torch.Tensor) -> torch.Tensor | None: ...
    def accept(self, token: int) -> Any: ...


class GuideFailed(InputError):
    """A request's guide failed while it decoded: that request fails, the others go on."""


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens and when it stops.

    temperature 0 or top_k 1 is greedy (argmax). As in the engine, the logits are scaled by
    1/(temperature + 1e-6) unless the temperature is 1: at 0 that swamps the penalties and the bias and makes
    log probs near 0, so a greedy pick of the penalized logits sends temperature 1 with top_k 1. Otherwise the
    processed logits (see the module) are cut to the top_k most likely tokens (0: no cut) and to the smallest
    set whose probability reaches top_p (1.0: no cut), then sampled from a generator seeded with `seed` (same
    seed, same tokens). Generation stops after an id in end_ids (which is kept in the output), after a stop
    sequence (kept too) or at max_new_tokens. End ids cannot be picked before min_new_tokens tokens; a bad
    sequence's last token cannot be picked where the tokens before it were just generated.
    repetition_penalty (> 0, 1: off), presence_penalty and frequency_penalty (0: off) and embedding_bias
    (float32 [vocab_size], added to the logits) shape the logits as the engine does; return_log_probs records
    each chosen token's log prob; return_generation_logits hands each step's raw logits to the decode batch's step
    callback (the executor's OutputConfig.returnGenerationLogits); guide masks each step's logits.
    """

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    end_ids: Sequence[int] = ()
    min_new_tokens: int = 0
    stop_sequences: Sequence[Sequence[int]] = ()
    bad_sequences: Sequence[Sequence[int]] = ()
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    embedding_bias: torch.Tensor | None = field(default=None, compare=False, repr=False)
    return_log_probs: bool = False
    return_generation_logits: bool = False
    guide: LogitsGuide | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise InputError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}")
        if self.temperature < 0:  # executor samplingConfig.cpp checkTemperature: >= 0
            raise InputError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise InputError(f"top_k must be >= 0 (0: no limit), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise InputError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.min_new_tokens < 0:
            raise InputError(f"min_new_tokens must be >= 0, got {self.min_new_tokens}")
        if any(not seq for seq in (*self.stop_sequences, *self.bad_sequences)):
            raise InputError("stop and bad sequences must not be empty")
        # samplingConfig.cpp checkRepetitionPenalty: > 0; presence and frequency penalties take any value.
        if not self.repetition_penalty > 0:
            raise InputError(f"repetition_penalty must be > 0 (1: off), got {self.repetition_penalty}")
        if self.embedding_bias is not None and self.embedding_bias.ndim != 1:
            shape = list(self.embedding_bias.shape)
            raise InputError(f"embedding_bias must hold one value per vocabulary id, got shape {shape}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


def _almost(a: float, b: float) -> bool:
    return abs(a - b) < 1e-9  # penaltyKernels.cu almostEqual(x, default, 1e-9)


class TokenSampler:
    """Picks one request's tokens step by step and tracks when it is finished.

    prompt_ids: the request's prompt (its ids below the vocabulary count for the penalties); vocab_size: the
    model's, which an embedding bias must match."""

    def __init__(
        self,
        params: SamplingParams,
        device: torch.device,
        prompt_ids: Sequence[int] | np.ndarray | torch.Tensor = (),
        vocab_size: int | None = None,
    ):
        self.params = params
        self.device = device
        self.end_ids = frozenset(int(i) for i in params.end_ids)
        self.generated: list[int] = []
        self.log_probs: list[float] = []  # one per generated token, with return_log_probs
        self.stops = [tuple(int(t) for t in seq) for seq in params.stop_sequences]
        self.bans = [tuple(int(t) for t in seq) for seq in params.bad_sequences]
        self.finish_reason = ""
        self.generator: torch.Generator | None = None
        if not params.greedy:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(params.seed)
        self.bias: torch.Tensor | None = None
        if params.embedding_bias is not None:
            bias = params.embedding_bias.to(device=device, dtype=torch.float32)
            if vocab_size is not None and bias.numel() != vocab_size:
                raise InputError(f"embedding_bias holds {bias.numel()} values; the vocabulary has {vocab_size}")
            self.bias = bias
        # penaltyKernels.cu: temperature applies unless it is the default 1; penalties (accumulateVocab) unless all
        # three are their defaults.
        self.inv_temperature = None if _almost(params.temperature, 1.0) else 1.0 / (params.temperature + 1e-6)
        self.penalized = not (
            _almost(params.repetition_penalty, 1.0)
            and _almost(params.presence_penalty, 0.0)
            and _almost(params.frequency_penalty, 0.0)
        )
        if not isinstance(prompt_ids, torch.Tensor):
            prompt_ids = torch.from_numpy(np.asarray(prompt_ids, dtype=np.int64))
        self.prompt_ids = prompt_ids.to(device=device, dtype=torch.int64).reshape(-1)
        self.counts: torch.Tensor | None = None  # occurrences per vocabulary id: the prompt's, then the output's
        # Anything but a plain argmax needs the logits processed.
        self.processes = (
            self.bias is not None
            or self.penalized
            or params.guide is not None
            or params.return_log_probs
            or self.generator is not None
        )

    @property
    def finished(self) -> bool:
        return bool(self.finish_reason)

    def next_token(self, logits: torch.Tensor, argmax: int | None = None) -> int:
        """The next token from float32 logits [vocab]; argmax: their argmax when the caller has it
        already (a decode batch takes all its rows' in one op), used when greedy with nothing to process."""
        banned = self._banned()
        if argmax is not None and not banned and not self.processes:
            token = argmax
        else:
            scores = self.process(logits, banned)
            token = int(scores.argmax()) if self.generator is None else self._sample(scores)
            if self.params.return_log_probs:
                self.log_probs.append(self.log_prob(scores, token))
        guide = self.params.guide
        if guide is not None:
            try:
                guide.accept(token)
            except Exception as e:
                raise GuideFailed(f"the guide refused token {token}: {e}") from e
        self.generated.append(token)
        if self.counts is not None and token < self.counts.numel():
            self.counts[token] += 1
        if token in self.end_ids or any(self._ends_with(seq) for seq in self.stops):
            self.finish_reason = "stop"
        elif len(self.generated) >= self.params.max_new_tokens:
            self.finish_reason = "length"
        return token

    def cancel(self) -> None:
        self.finish_reason = "cancelled"

    def fail(self) -> None:
        self.finish_reason = "error"

    def process(self, logits: torch.Tensor, banned: Sequence[int] = ()) -> torch.Tensor:
        """The logits as the engine samples from them (the module's steps 1-3), float32 [vocab]."""
        p = self.params
        scores = logits.float().clone()
        if p.guide is not None:
            try:
                masked = p.guide.mask(scores)
            except Exception as e:
                raise GuideFailed(f"the guide could not mask the logits: {e}") from e
            if masked is not None:
                scores = masked.float()
        if self.bias is not None:
            scores = scores + self.bias
        if self.inv_temperature is not None:
            scores = scores * self.inv_temperature
        if self.penalized:
            counts = self._counts(scores.numel())
            seen = counts > 0
            if not _almost(p.repetition_penalty, 1.0):
                rp = p.repetition_penalty
                scores = torch.where(seen, torch.where(scores < 0, scores * rp, scores / rp), scores)
            if p.presence_penalty != 0:
                scores = scores - seen.float() * p.presence_penalty
            if p.frequency_penalty != 0:
                scores = scores - counts.float() * p.frequency_penalty
        scores = scores.clamp(-FLT_MAX, FLT_MAX)  # penaltyKernels.cu: "do clamp to prevent overflow"
        if banned:
            scores[list(banned)] = float("-inf")
        return scores

    @staticmethod
    def log_prob(scores: torch.Tensor, token: int) -> float:
        """log P(token) under the softmax over the whole vocabulary (the sampling layer's probabilities)."""
        return float(scores.softmax(-1)[token].log())

    def _counts(self, vocab: int) -> torch.Tensor:
        if self.counts is None:
            ids = self.prompt_ids[self.prompt_ids < vocab]
            self.counts = torch.bincount(ids, minlength=vocab)[:vocab].to(torch.int64)
            for token in self.generated:  # tokens picked before the first processed step
                if token < vocab:
                    self.counts[token] += 1
        return self.counts

    def _ends_with(self, seq: tuple[int, ...]) -> bool:
        return not seq or (len(self.generated) >= len(seq) and tuple(self.generated[-len(seq) :]) == seq)

    def _banned(self) -> list[int]:
        banned = [seq[-1] for seq in self.bans if self._ends_with(seq[:-1])]
        if len(self.generated) < self.params.min_new_tokens:
            banned.extend(self.end_ids)
        return banned

    def _sample(self, scores: torch.Tensor) -> int:
        p = self.params
        if 0 < p.top_k < scores.numel():
            kth = scores.topk(p.top_k).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_scores, order = scores.sort(descending=True)
            probs = sorted_scores.softmax(-1)
            # Drop a token once the more likely ones already reach top_p; the first always stays.
            drop = (probs.cumsum(-1) - probs) >= p.top_p
            scores = scores.scatter(0, order[drop], float("-inf"))
        probs = scores.softmax(-1)
        return int(torch.multinomial(probs, 1, generator=self.generator))
