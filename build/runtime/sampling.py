"""Per-request token selection: greedy, or temperature / top-k / top-p sampling from a seeded generator."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..errors import InputError


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens and when it stops.

    temperature 0 is greedy (argmax). Otherwise logits are divided by the temperature, cut to the
    top_k most likely tokens (0: no cut) and to the smallest set whose probability reaches top_p
    (1.0: no cut), then sampled from a generator seeded with `seed` (same seed, same tokens).
    Generation stops after an id in end_ids (which is kept in the output), after a stop sequence
    (kept too) or at max_new_tokens. End ids cannot be picked before min_new_tokens tokens; a bad
    sequence's last token cannot be picked where the tokens before it were just generated.
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

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise InputError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise InputError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise InputError(f"top_k must be >= 0 (0: no limit), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise InputError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.min_new_tokens < 0:
            raise InputError(f"min_new_tokens must be >= 0, got {self.min_new_tokens}")
        if any(not seq for seq in (*self.stop_sequences, *self.bad_sequences)):
            raise InputError("stop and bad sequences must not be empty")


class TokenSampler:
    """Picks one request's tokens step by step and tracks when it is finished."""

    def __init__(self, params: SamplingParams, device: torch.device):
        self.params = params
        self.end_ids = frozenset(int(i) for i in params.end_ids)
        self.generated: list[int] = []
        self.stops = [tuple(int(t) for t in seq) for seq in params.stop_sequences]
        self.bans = [tuple(int(t) for t in seq) for seq in params.bad_sequences]
        self.finish_reason = ""
        self.generator: torch.Generator | None = None
        if params.temperature > 0:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(params.seed)

    @property
    def finished(self) -> bool:
        return bool(self.finish_reason)

    def next_token(self, logits: torch.Tensor, argmax: int | None = None) -> int:
        """The next token from float32 logits [vocab]; argmax: their argmax when the caller has it
        already (a decode batch takes all its rows' in one op), used when greedy with nothing banned."""
        banned = self._banned()
        if banned:
            logits = logits.clone()
            logits[banned] = float("-inf")
        token = argmax if argmax is not None and not banned and self.generator is None else self._pick(logits)
        self.generated.append(token)
        if token in self.end_ids or any(self._ends_with(seq) for seq in self.stops):
            self.finish_reason = "stop"
        elif len(self.generated) >= self.params.max_new_tokens:
            self.finish_reason = "length"
        return token

    def cancel(self) -> None:
        self.finish_reason = "cancelled"

    def _ends_with(self, seq: tuple[int, ...]) -> bool:
        return not seq or (len(self.generated) >= len(seq) and tuple(self.generated[-len(seq) :]) == seq)

    def _banned(self) -> list[int]:
        banned = [seq[-1] for seq in self.bans if self._ends_with(seq[:-1])]
        if len(self.generated) < self.params.min_new_tokens:
            banned.extend(self.end_ids)
        return banned

    def _pick(self, logits: torch.Tensor) -> int:
        p = self.params
        if self.generator is None:
            return int(logits.argmax())
        logits = logits.float() / p.temperature
        if 0 < p.top_k < logits.numel():
            kth = logits.topk(p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_logits, order = logits.sort(descending=True)
            probs = sorted_logits.softmax(-1)
            # Drop a token once the more likely ones already reach top_p; the first always stays.
            drop = (probs.cumsum(-1) - probs) >= p.top_p
            logits = logits.scatter(0, order[drop], float("-inf"))
        probs = logits.softmax(-1)
        return int(torch.multinomial(probs, 1, generator=self.generator))
