"""Guided decoding on the CPU runtime: each step's logits masked by the request's grammar, as TensorRT-LLM 1.2.1's
executor masks them (cpp/tensorrt_llm/batch_manager/guidedDecoder.cpp; see qwen3vl_trt.decoding.guides).

GuidedDecoder::build compiles a request's guide at its first context step and gives the matcher each generated
token (AcceptToken) before it fills the next bitmask (FillNextTokenBitmask); GuidedDecoder::execute then sets the
logits of masked tokens to -inf (kernels/logitsBitmask.cu) before sampling. Here GrammarCache compiles guides with
PyPI xgrammar over the same tokenizer info, and GuidedTokens is one sequence's matcher: mask, then accept.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import TYPE_CHECKING

import torch

from ..decoding.guides import GUIDE_TYPE_EBNF, GUIDE_TYPES, GuideError, xgrammar_call
from ..errors import InputError

if TYPE_CHECKING:
    import xgrammar


class GuidedTokens:
    """One sequence's grammar matcher: mask(logits) before each token is picked, accept(token) after.

    Once the grammar is complete it allows only the tokenizer info's stop tokens (xgrammar's bitmask); once one
    of them is accepted the matcher is terminated (`finished`) and stop tokens stay the only ones allowed."""

    def __init__(self, compiled: xgrammar.CompiledGrammar):
        import xgrammar as xgr

        info = compiled.tokenizer_info
        self.vocab_size = info.vocab_size
        self.stop_token_ids = frozenset(info.stop_token_ids)
        self._stops = torch.tensor(sorted(self.stop_token_ids), dtype=torch.long)
        self._matcher = xgr.GrammarMatcher(compiled)
        self._bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)

    @property
    def finished(self) -> bool:
        return self._matcher.is_terminated()

    def mask(self, logits: torch.Tensor) -> None:
        """Sets, in place, the float32 CPU logits [vocab_size] of the tokens the grammar forbids now to -inf."""
        if logits.shape != (self.vocab_size,) or logits.dtype != torch.float32 or logits.device.type != "cpu":
            raise InputError(
                f"guided logits must be float32 [{self.vocab_size}] on the CPU, got {logits.dtype} "
                f"{list(logits.shape)} on {logits.device}"
            )
        if self.finished:  # xgrammar refuses to fill a terminated matcher's bitmask
            stops = logits[self._stops]
            logits.fill_(float("-inf"))
            logits[self._stops] = stops
            return
        import xgrammar as xgr

        self._matcher.fill_next_token_bitmask(self._bitmask)
        xgr.apply_token_bitmask_inplace(logits, self._bitmask[0])

    def accept(self, token: int) -> None:
        if self.finished and token in self.stop_token_ids:
            return
        if not self._matcher.accept_token(int(token)):
            raise GuideError(f"token {token} is not allowed by the request's grammar here")


class GrammarCache:
    """Compiled guides by (type, text), the `capacity` last used kept; thread-safe."""

    def __init__(self, tokenizer_info: xgrammar.TokenizerInfo, capacity: int = 256):
        import xgrammar as xgr

        self.tokenizer_info = tokenizer_info
        self.capacity = capacity
        # guidedDecoder.cpp: GrammarCompiler(tokenizerInfo, max_threads 8, ...); its own cache is off here, this
        # one bounds what is kept.
        self._compiler = xgr.GrammarCompiler(tokenizer_info, max_threads=8, cache_enabled=False)
        self._compiled: OrderedDict[tuple[str, str], xgrammar.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, guide_type: str, text: str) -> xgrammar.CompiledGrammar:
        key = (guide_type, text)
        with self._lock:
            if key in self._compiled:
                self._compiled.move_to_end(key)
                return self._compiled[key]
        compiled = self._compile(guide_type, text)  # outside the lock: compiling takes long, other guides go on
        with self._lock:
            self._compiled[key] = compiled
            self._compiled.move_to_end(key)
            while len(self._compiled) > self.capacity:
                self._compiled.popitem(last=False)
        return compiled

    def matcher(self, guide_type: str, text: str) -> GuidedTokens:
        return GuidedTokens(self.compile(guide_type, text))

    def _compile(self, guide_type: str, text: str) -> xgrammar.CompiledGrammar:
        c = self._compiler
        compilers = {
            "json": c.compile_builtin_json_grammar,  # the guide's text is not read
            "json_schema": lambda: c.compile_json_schema(text),  # xgrammar's defaults, as CompileJSONSchema's
            "regex": lambda: c.compile_regex(text),
            GUIDE_TYPE_EBNF: lambda: c.compile_grammar(text),
        }
        if guide_type not in compilers:
            raise GuideError(f"guide type {guide_type!r} is not one of {', '.join(GUIDE_TYPES)}")
        return xgrammar_call(compilers[guide_type], f"the {guide_type} guide")
