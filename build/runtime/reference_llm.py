"""The reference LLM runtime: the TensorRT-LLM engine's contract, run by PyTorch.

It loads a converted TensorRT-LLM checkpoint (any tensor/pipeline split, reassembled) and takes the
engine's per-request inputs exactly: fake-id `input_ids`, the DeepStack-interleaved
`prompt_embedding_table`, `mrope_rotary_cos_sin` and `mrope_position_deltas` (see contracts.py and
llm/inputs.py). What the engine computes, it computes:

- an id >= vocab_size takes row `prompt_table_row(id, vocab_size)` of the request's table (the
  stock prompt-tuning lookup); after decoder layer j < K, row `prompt_table_row(id, vocab_size, j)`
  is added at the same positions (DeepStack, the Qwen3-VL engine model);
- prompt positions rotate with the request's cos/sin table; a generated token at sequence index t
  rotates at position t + delta on every axis, from the model's own frequencies (as the
  generation-phase attention kernel does);
- Qwen3 decoder layers (q/k RMSNorm per head, GQA, SwiGLU or top-k MoE with renormalized weights);
- a quantized KV cache holds keys and values rounded as the engine stores them; the context phase attends over
  them unrounded, except under FP8 context FMHA (FP8 weights with an FP8 cache, llm.kv_cache.fp8_context_fmha),
  where it reads the rotated queries, keys and values as e4m3 with the KV-cache scale, as the engine's does.

It is also the LLM of the CPU deployment: requests of different lengths decode together over one
KV cache (DecodeBatch; new requests may join between steps, as with inflight batching), with greedy
or sampled tokens, end ids, and a per-token callback for streaming. Prompts joining together run as
one ragged batch, and only their last positions reach the vocabulary projection; the cache has a
row per sequence that grows by doubling, and decoding attends over it in place (grouped-query
attention without repeating keys and values). Prefill attention uses SDPA's `enable_gqa` (torch >= 2.5).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import InputError
from ..llm.checkpoint_format import LayerWeights, LLMWeights, MoEWeights, load_llm_weights
from ..llm.fp8 import linear
from ..llm.inputs import prompt_table_row, rope_inv_freq
from ..llm.kv_cache import fp8_context_fmha
from .sampling import GuideFailed, SamplingParams, TokenSampler

if TYPE_CHECKING:
    from ..preprocess import Request

TokenCallback = Callable[[int, int], None]
"""Called as (request index, token id) for every generated token, in order."""
StepCallback = Callable[[int, int, float | None, np.ndarray | None], None]
"""Called as (request index, token id, its log prob or None without return_log_probs, the raw float32 logits
[vocab_size] it was picked from or None without return_generation_logits) for every generated token."""
Observer = Callable[[str, torch.Tensor], None]
"""Called during a prefill with the input of each quantized linear of a layer ("qkv", "dense", "mlp", "down",
"experts", "experts_down"), its keys and values ("kv") and its queries ("q"; rotated, as keys are): what
calibration measures."""


@dataclass
class LLMRequest:
    """One request in the engine's input form (contracts.LLM_INPUTS)."""

    input_ids: np.ndarray  # int32 [L]; visual tokens as fake ids >= vocab_size
    prompt_embedding_table: torch.Tensor | None = None  # [(K+1)*M, D]
    mrope_rotary_cos_sin: np.ndarray | None = None  # float32 [positions * rotary_dim]; None: 1-D positions
    mrope_position_deltas: int = 0
    sampling: SamplingParams = field(default_factory=SamplingParams)

    @classmethod
    def from_preprocessed(
        cls,
        request: Request,
        image_embeds: Any = None,
        deepstack_embeds: Any = None,
        sampling: SamplingParams | None = None,
    ) -> LLMRequest:
        """The request for a preprocessed request and its vision encoder outputs (the request's
        images only: image_embeds [M, D], deepstack_embeds [K, M, D]). Its mrope table holds the
        prompt's rows only: generated tokens rotate from the model's frequencies, so the rows up to
        max_position_embeddings that the engine wants (128 MiB for released configs) are never read."""
        table = None
        if request.num_visual_tokens:
            if image_embeds is None or deepstack_embeds is None:
                raise InputError(f"the request has {request.num_visual_tokens} visual tokens but no vision outputs")
            table = request.prompt_embedding_table(torch.as_tensor(image_embeds), torch.as_tensor(deepstack_embeds))
        return cls(
            input_ids=request.engine_input_ids,
            prompt_embedding_table=table,
            mrope_rotary_cos_sin=request.rotary_cos_sin.reshape(-1),
            mrope_position_deltas=request.mrope_position_delta,
            sampling=sampling or SamplingParams(),
        )


@dataclass
class GenerationResult:
    output_ids: list[int]
    finish_reason: str  # "stop" (an end id or stop sequence was generated), "length", "cancelled" or "error"
    prompt_length: int
    log_probs: list[float] = field(default_factory=list)  # one per output id, with return_log_probs
    error: Exception | None = None  # why the request failed (finish_reason "error"): its guide failed


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Qwen3 RMSNorm: statistics in float32, scaled in the model dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """GPT-NeoX rotation: pair i turns dims i and i + half. x [N, heads, head_dim]; cos/sin [N, 1, half]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


@dataclass
class _Prompt:
    """A checked prompt: ids (int64), its cos/sin [L, half] as the context phase applies them, its
    prompt table in the model dtype, and where its visual tokens are and which table rows they take."""

    ids: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    table: torch.Tensor | None
    visual: torch.Tensor  # positions of the visual tokens
    visual_ids: torch.Tensor  # their fake ids


class ReferenceLLM:
    """Qwen3 / Qwen3-MoE text model over TensorRT-LLM checkpoint weights."""

    def __init__(self, weights: LLMWeights, device: str | torch.device = "cpu"):
        self.config = weights.config
        self.w = weights.to(device)
        self.device = torch.device(device)
        self.dtype = self.w.vocab_embedding.dtype
        c = self.config
        self.vocab_size = c.vocab_size
        self.head_dim = c.head_size
        self.q_size = c.num_attention_heads * c.head_size
        self.kv_size = c.num_key_value_heads * c.head_size
        self.inv_freq = rope_inv_freq(c.rotary_dim, c.rotary_base).to(self.device)
        self.fp8_context_fmha = fp8_context_fmha(c.quant_algo, c.kv_cache_quant_algo)

    @classmethod
    def from_checkpoint(
        cls, checkpoint_dir: str | os.PathLike[str], device: str | torch.device = "cpu"
    ) -> ReferenceLLM:
        return cls(load_llm_weights(checkpoint_dir), device=device)

    # -- prompts ---------------------------------------------------------------------------------

    def _check(self, request: LLMRequest) -> _Prompt:
        ids = torch.as_tensor(np.asarray(request.input_ids).reshape(-1), dtype=torch.int64, device=self.device)
        length = ids.numel()
        if length == 0:
            raise InputError("input_ids is empty")
        if int(ids.min()) < 0:
            raise InputError("input_ids holds negative ids")
        table = request.prompt_embedding_table
        if int(ids.max()) >= self.vocab_size:
            if table is None:
                raise InputError("input_ids holds visual fake ids (>= vocab_size) but no prompt_embedding_table")
            deepest = int(prompt_table_row(ids.max(), self.vocab_size, self.config.deepstack_count - 1))
            if table.ndim != 2 or table.shape[1] != self.config.hidden_size or deepest >= table.shape[0]:
                raise InputError(
                    f"prompt_embedding_table {list(table.shape)} has no row {deepest} for the fake ids in input_ids "
                    f"(hidden size {self.config.hidden_size}, {self.config.deepstack_count} DeepStack features)"
                )
        half = self.config.rotary_dim // 2
        if request.mrope_rotary_cos_sin is None:
            cos, sin = self._positions_cos_sin(torch.arange(length, device=self.device))
        else:
            flat = np.asarray(request.mrope_rotary_cos_sin, dtype=np.float32).reshape(-1)
            if flat.size % (2 * half) or flat.size // (2 * half) < length:
                raise InputError(
                    f"mrope_rotary_cos_sin has {flat.size} values; expected positions x {2 * half} covering the "
                    f"prompt's {length} tokens"
                )
            pairs = torch.from_numpy(flat[: length * 2 * half].reshape(length, half, 2)).to(self.device)
            cos, sin = pairs[..., 0], pairs[..., 1]
        visual = (ids >= self.vocab_size).nonzero().reshape(-1)
        if table is not None:
            table = table.to(self.device, self.dtype)
        return _Prompt(ids, cos, sin, table, visual, ids[visual])

    def _positions_cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [n, half] of plain positions (all three axes equal), in float32 as transformers."""
        angles = positions.float()[:, None] * self.inv_freq[None, :]
        return angles.cos(), angles.sin()

    def _embed(self, prompt: _Prompt) -> torch.Tensor:
        # Visual fake ids take their prompt-table rows below; any in-vocabulary id holds their place.
        h = F.embedding(prompt.ids.clamp(max=self.vocab_size - 1), self.w.vocab_embedding)
        if prompt.table is not None:
            h[prompt.visual] = prompt.table[prompt_table_row(prompt.visual_ids, self.vocab_size)]
        return h

    def _deepstack(self, h: torch.Tensor, prompt: _Prompt, layer: int) -> None:
        """Adds the DeepStack feature of decoder layer `layer` at the prompt's visual positions of
        h (its own rows), in place."""
        if prompt.table is not None and layer < self.config.deepstack_count:
            h[prompt.visual] += prompt.table[prompt_table_row(prompt.visual_ids, self.vocab_size, layer)]

    # -- layers ----------------------------------------------------------------------------------

    def _mlp(self, w: LayerWeights, x: torch.Tensor, observe: Observer | None = None) -> torch.Tensor:
        mlp = w.mlp
        if isinstance(mlp, MoEWeights):
            return self._moe(mlp, x, observe)
        hidden = F.silu(linear(x, mlp.gate)) * linear(x, mlp.up)
        if observe is not None:
            observe("mlp", x)
            observe("down", hidden)
        return linear(hidden, mlp.down)

    def _moe(self, w: MoEWeights, x: torch.Tensor, observe: Observer | None = None) -> torch.Tensor:
        moe = self.config.moe
        assert moe is not None
        probs = F.softmax(F.linear(x.float(), w.router), dim=-1)  # the router runs in float32
        top_p, top_e = probs.topk(moe.top_k, dim=-1)
        if moe.renormalize:
            top_p = top_p / top_p.sum(dim=-1, keepdim=True)
        top_p = top_p.to(x.dtype)
        out = torch.zeros_like(x)
        if observe is not None:
            observe("experts", x)  # every token reaches top_k experts: the experts' inputs are all tokens
        for expert in top_e.unique().tolist():
            token, slot = (top_e == expert).nonzero(as_tuple=True)
            xs = x[token]
            hidden = F.silu(linear(xs, w.gate[expert])) * linear(xs, w.up[expert])
            if observe is not None:
                observe("experts_down", hidden)
            out.index_add_(0, token, linear(hidden, w.down[expert]) * top_p[token, slot, None])
        return out

    def _qkv(self, w: LayerWeights, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """q [N, H, hd], k/v [N, KV, hd] of N tokens x [N, D] rotating with cos/sin [N, half],
        normalized per head and rotated."""
        n = x.shape[0]
        q, k, v = linear(x, w.qkv).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        eps = self.config.norm_epsilon
        q = _rms_norm(q.view(n, -1, self.head_dim), w.q_norm, eps)
        k = _rms_norm(k.view(n, -1, self.head_dim), w.k_norm, eps)
        cos, sin = cos.to(x.dtype)[:, None], sin.to(x.dtype)[:, None]
        return _rotate(q, cos, sin), _rotate(k, cos, sin), v.view(n, -1, self.head_dim)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        h = _rms_norm(h, self.w.ln_f, self.config.norm_epsilon)
        return F.linear(h, self.w.lm_head).float()

    @torch.inference_mode()
    def _prefill(self, prompts: Sequence[_Prompt], all_logits: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Runs several prompts as one ragged batch (their tokens concatenated, each attending only to
        itself). Returns float32 logits (at every position, or at each prompt's last) and the keys
        and values [layers, tokens, KV heads, head_dim] of all tokens, prompt after prompt."""
        lengths = [p.ids.numel() for p in prompts]
        spans = list(zip(np.cumsum([0, *lengths[:-1]]).tolist(), np.cumsum(lengths).tolist(), strict=True))
        cos = torch.cat([p.cos for p in prompts])
        sin = torch.cat([p.sin for p in prompts])
        h = torch.cat([self._embed(p) for p in prompts])  # [T, D]
        c = self.config
        keys = h.new_empty(c.num_hidden_layers, h.shape[0], c.num_key_value_heads, self.head_dim)
        values = torch.empty_like(keys)
        for layer, w in enumerate(self.w.layers):
            h, keys[layer], values[layer] = self.prefill_layer(w, h, cos, sin, spans)
            self._round_kv(w, keys[layer], values[layer])
            for (a, b), prompt in zip(spans, prompts, strict=True):
                self._deepstack(h[a:b], prompt, layer)
        return self._logits(h if all_logits else h[[b - 1 for _, b in spans]]), keys, values

    def _round_kv(self, w: LayerWeights, k: torch.Tensor, v: torch.Tensor) -> None:
        """With a quantized KV cache, keys and values become what the cache gives back (in place): decoding attends
        over the cache (the context phase over _context_qkv's)."""
        kv = self.config.kv_cache
        if kv is not None:
            assert w.kv_scale is not None
            k.copy_(kv.round_trip(k, w.kv_scale))
            v.copy_(kv.round_trip(v, w.kv_scale))

    def _context_qkv(
        self, w: LayerWeights, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """What the context phase attends with: q, k, v unrounded, as the engine's context attention reads them,
        except under FP8 context FMHA, whose preprocessing kernel stores all three as e4m3 with the KV-cache scale
        after RoPE and whose FMHA reads them back so (`attentionOp.cpp`, enqueueContext:
        `qkv_scale_orig_quant = kv_scale_orig_quant`; `unfusedAttentionKernels_2_template.h`,
        applyBiasRopeUpdateKVCache, FP8_OUTPUT; its bmm1 scale dequantizes q and k with the same scale)."""
        kv = self.config.kv_cache
        if not self.fp8_context_fmha:
            return q, k, v
        assert kv is not None and w.kv_scale is not None
        return kv.round_trip(q, w.kv_scale), kv.round_trip(k, w.kv_scale), kv.round_trip(v, w.kv_scale)

    def prefill_layer(
        self,
        w: LayerWeights,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        spans: list[tuple[int, int]],
        observe: Observer | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One decoder layer over prompts concatenated in h (spans: each prompt's [start, stop)), each attending
        only to itself: the new h and the layer's keys and values (DeepStack is the caller's)."""
        eps = self.config.norm_epsilon
        x = _rms_norm(h, w.input_layernorm, eps)
        q, k, v = self._qkv(w, x, cos, sin)
        if observe is not None:
            observe("qkv", x)
            observe("kv", torch.cat([k, v], dim=-1))
            observe("q", q)
        keys, values = k, v
        q, k, v = (t.transpose(0, 1) for t in self._context_qkv(w, q, k, v))  # heads first
        attended = (
            torch.cat(
                [
                    F.scaled_dot_product_attention(q[:, a:b], k[:, a:b], v[:, a:b], is_causal=True, enable_gqa=True)
                    for a, b in spans
                ],
                dim=1,
            )
            .transpose(0, 1)
            .reshape(h.shape[0], self.q_size)
        )
        if observe is not None:
            observe("dense", attended)
        h = h + linear(attended, w.dense)
        h = h + self._mlp(w, _rms_norm(h, w.post_layernorm, eps), observe)
        return h, keys, values

    def prompt_logits(self, request: LLMRequest) -> torch.Tensor:
        """float32 logits [L, vocab_size] at every prompt position (what gather_context_logits returns)."""
        return self._prefill([self._check(request)], all_logits=True)[0]

    # -- batched generation ---------------------------------------------------------------------------

    def generate(self, requests: Sequence[LLMRequest], on_token: TokenCallback | None = None) -> list[GenerationResult]:
        """Generates for several requests at once: their prompts run together, then all active
        requests decode together, one token each per step, over one KV cache."""
        batch = DecodeBatch(self, on_token)
        results = batch.add_many(requests, range(len(requests)))
        while batch:
            batch.step()
        return results

    @torch.inference_mode()
    def _decode_step(
        self, ids: torch.Tensor, position: torch.Tensor, delta: torch.Tensor, cache: KVCache
    ) -> torch.Tensor:
        """One token for each of the cache's first B rows: writes its k/v at `position` (per row) and
        returns float32 logits [B, vocab]."""
        batch = ids.numel()
        rows = torch.arange(batch, device=self.device)
        span = int(position.max()) + 1
        # Rows of different lengths see only their own keys; rows of one length see all `span`.
        mask = None
        if int(position.min()) + 1 < span:
            mask = (torch.arange(span, device=self.device)[None, :] <= position[:, None])[:, None, None, :]
        cos, sin = self._positions_cos_sin(position + delta)
        eps = self.config.norm_epsilon
        kv_heads = self.config.num_key_value_heads
        h = F.embedding(ids, self.w.vocab_embedding)  # [B, D]
        for layer, w in enumerate(self.w.layers):
            q, k, v = self._qkv(w, _rms_norm(h, w.input_layernorm, eps), cos, sin)
            self._round_kv(w, k, v)
            cache.keys[layer, rows, :, position] = k
            cache.values[layer, rows, :, position] = v
            # Grouped-query attention without copying the cache: a row's single query becomes one
            # query per head of each KV group, all attending over that group's keys (views).
            grouped = q.view(batch, kv_heads, -1, self.head_dim)
            keys, values = cache.keys[layer, :batch, :, :span], cache.values[layer, :batch, :, :span]
            attended = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask)
            h = h + linear(attended.reshape(batch, self.q_size), w.dense)
            h = h + self._mlp(w, _rms_norm(h, w.post_layernorm, eps))
        return self._logits(h)


class KVCache:
    """Keys and values of a decode batch, [layers, rows, KV heads, capacity, head_dim] each. Row i
    belongs to the batch's i-th sequence. Rows and capacity grow by doubling, so requests joining
    cost amortized O(their own cache); a leaving request's row is refilled by the last row."""

    def __init__(self, llm: ReferenceLLM):
        c = llm.config
        self.max_capacity = c.max_position_embeddings
        self.keys = torch.zeros(
            (c.num_hidden_layers, 0, c.num_key_value_heads, 0, c.head_size), dtype=llm.dtype, device=llm.device
        )
        self.values = torch.zeros_like(self.keys)

    def reserve(self, rows: int, capacity: int) -> None:
        """Room for at least `rows` rows of `capacity` positions each."""
        _, have_rows, _, have_capacity, _ = self.keys.shape
        if rows <= have_rows and capacity <= have_capacity:
            return
        rows = max(rows, 2 * have_rows) if rows > have_rows else have_rows
        if capacity > have_capacity:
            capacity = min(max(capacity, 2 * have_capacity), self.max_capacity)
        else:
            capacity = have_capacity
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = old.new_zeros(old.shape[0], rows, old.shape[2], capacity, old.shape[4])
            new[:, :have_rows, :, :have_capacity] = old
            setattr(self, name, new)

    def write(self, row: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """A prompt's keys and values [layers, L, KV heads, head_dim] into row `row`."""
        length = keys.shape[1]
        self.keys[:, row, :, :length] = keys.transpose(1, 2)
        self.values[:, row, :, :length] = values.transpose(1, 2)

    def move(self, sources: list[int], targets: list[int]) -> None:
        self.keys[:, targets] = self.keys[:, sources]
        self.values[:, targets] = self.values[:, sources]


@dataclass
class _Sequence:
    """A request in a decode batch: the caller's index, its sampler, result and rope delta."""

    index: int
    sampler: TokenSampler
    result: GenerationResult
    delta: int
    next_id: int = 0


_Joining = tuple[LLMRequest, _Prompt, int]  # a request joining a batch, its checked prompt, its index


class DecodeBatch:
    """Requests decoding together over one KV cache. Requests join with `add` / `add_many` (their
    prompts are run then) at any point between steps, as in inflight batching; `step` generates one
    token for every request and drops the finished ones."""

    PREFILL_TOKENS = 8192
    """Prompts joining together run in ragged batches of at most this many tokens (a longer prompt
    alone), which bounds the activations as the engine's max_num_tokens does."""

    def __init__(self, llm: ReferenceLLM, on_token: TokenCallback | None = None, on_step: StepCallback | None = None):
        self.llm, self.on_token, self.on_step = llm, on_token, on_step
        self.sequences: list[_Sequence] = []  # sequence i decodes in cache row i
        self.cache = KVCache(llm)
        self.position = torch.zeros(0, dtype=torch.int64, device=llm.device)  # sequence index of each row's next token
        self.delta = torch.zeros(0, dtype=torch.int64, device=llm.device)

    def __len__(self) -> int:
        return len(self.sequences)

    def add(self, request: LLMRequest, index: int = 0) -> GenerationResult:
        """Runs the request's prompt and picks its first token; the returned result fills as steps run."""
        return self.add_many([request], [index])[0]

    @torch.inference_mode()
    def add_many(self, requests: Sequence[LLMRequest], indices: Iterable[int]) -> list[GenerationResult]:
        """`add` for several requests (indices: what on_token reports for each), their prompts run
        together in ragged batches."""
        llm = self.llm
        prompts = [llm._check(request) for request in requests]
        for request, prompt in zip(requests, prompts, strict=True):
            bias = request.sampling.embedding_bias
            if bias is not None and bias.numel() != llm.vocab_size:
                raise InputError(f"embedding_bias holds {bias.numel()} values; the vocabulary has {llm.vocab_size}")
            need = prompt.ids.numel() + request.sampling.max_new_tokens
            if need > llm.config.max_position_embeddings:
                raise InputError(
                    f"prompt of {prompt.ids.numel()} tokens + max_new_tokens {request.sampling.max_new_tokens} "
                    f"exceeds the model's {llm.config.max_position_embeddings} positions"
                )
        joining = list(zip(requests, prompts, indices, strict=True))
        self.cache.reserve(len(self.sequences) + len(joining), max(p.ids.numel() for p in prompts))
        results = []
        for group in self._prefill_groups(joining):
            logits, keys, values = llm._prefill([prompt for _, prompt, _ in group], all_logits=False)
            start = 0
            for (request, prompt, index), first_logits in zip(group, logits, strict=True):
                length = prompt.ids.numel()
                seq = _Sequence(
                    index,
                    TokenSampler(request.sampling, llm.device, prompt.ids, llm.vocab_size),
                    GenerationResult([], "length", length),
                    int(np.asarray(request.mrope_position_deltas).reshape(-1)[0]),
                )
                self._accept(seq, first_logits)
                if not seq.sampler.finished:
                    self._join(seq, keys[:, start : start + length], values[:, start : start + length])
                start += length
                results.append(seq.result)
        return results

    def _prefill_groups(self, joining: list[_Joining]) -> Iterator[list[_Joining]]:
        group: list[_Joining] = []
        tokens = 0
        for item in joining:
            length = item[1].ids.numel()
            if group and tokens + length > self.PREFILL_TOKENS:
                yield group
                group, tokens = [], 0
            group.append(item)
            tokens += length
        if group:
            yield group

    def _join(self, seq: _Sequence, keys: torch.Tensor, values: torch.Tensor) -> None:
        row, length = len(self.sequences), keys.shape[1]
        self.cache.reserve(row + 1, length)
        self.cache.write(row, keys, values)
        self.position = torch.cat([self.position, self.position.new_tensor([length])])
        self.delta = torch.cat([self.delta, self.delta.new_tensor([seq.delta])])
        self.sequences.append(seq)

    @torch.inference_mode()
    def step(self) -> None:
        """One token for every request in the batch; finished requests leave it."""
        if not self.sequences:
            return
        self.cache.reserve(len(self.sequences), int(self.position.max()) + 1)
        ids = torch.tensor([s.next_id for s in self.sequences], device=self.llm.device)
        logits = self.llm._decode_step(ids, self.position, self.delta, self.cache)
        self.position += 1
        # One argmax for all rows: per row it costs as much as the step's other ops at small batches.
        argmax = logits.argmax(dim=-1).tolist()
        for row, seq in enumerate(self.sequences):
            self._accept(seq, logits[row], argmax[row])
        self._drop_finished()

    def cancel(self, indices: Iterable[int]) -> None:
        """Ends the requests with these indices now (their results keep the tokens so far)."""
        cancelled = set(indices)
        for seq in self.sequences:
            if seq.index in cancelled:
                seq.sampler.cancel()
                seq.result.finish_reason = seq.sampler.finish_reason
        self._drop_finished()

    def _drop_finished(self) -> None:
        """Removes finished sequences; the last active rows move into the rows they free."""
        keep = [row for row, seq in enumerate(self.sequences) if not seq.sampler.finished]
        if len(keep) == len(self.sequences):
            return
        holes = [row for row in range(len(keep)) if self.sequences[row].sampler.finished]
        movers = [row for row in keep if row >= len(keep)]
        if holes:
            self.cache.move(movers, holes)
            for hole, mover in zip(holes, movers, strict=True):
                self.sequences[hole] = self.sequences[mover]
            self.position[holes] = self.position[movers]
            self.delta[holes] = self.delta[movers]
        del self.sequences[len(keep) :]
        self.position, self.delta = self.position[: len(keep)], self.delta[: len(keep)]

    def _accept(self, seq: _Sequence, logits: torch.Tensor, argmax: int | None = None) -> None:
        sampler = seq.sampler
        try:
            seq.next_id = sampler.next_token(logits, argmax)
        except GuideFailed as e:  # this request fails; the batch goes on
            sampler.fail()
            seq.result.finish_reason, seq.result.error = sampler.finish_reason, e
            return
        seq.result.output_ids.append(seq.next_id)
        log_prob = None
        if sampler.params.return_log_probs:
            log_prob = sampler.log_probs[-1]
            seq.result.log_probs.append(log_prob)
        if sampler.finished:
            seq.result.finish_reason = sampler.finish_reason
        if self.on_token is not None:
            self.on_token(seq.index, seq.next_id)
        if self.on_step is not None:
            raw = logits.float().numpy(force=True).copy() if sampler.params.return_generation_logits else None
            self.on_step(seq.index, seq.next_id, log_prob, raw)
