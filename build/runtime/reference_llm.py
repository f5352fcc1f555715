"""The reference LLM runtime: the TensorRT-LLM engine's contract, run by PyTorch.

It loads a converted TensorRT-LLM checkpoint (any tensor/pipeline split, reassembled) and takes the
engine's per-request inputs exactly: fake-id `input_ids`, the DeepStack-interleaved
`prompt_embedding_table`, `mrope_rotary_cos_sin` and `mrope_position_deltas` (see contracts.py and
llm_inputs.py). What the engine computes, it computes:

- an id >= vocab_size takes row `prompt_table_row(id, vocab_size)` of the request's table (the
  stock prompt-tuning lookup); after decoder layer j < K, row `prompt_table_row(id, vocab_size, j)`
  is added at the same positions (DeepStack, the Qwen3-VL engine model);
- prompt positions rotate with the request's cos/sin table; a generated token at sequence index t
  rotates at position t + delta on every axis, from the model's own frequencies (as the
  generation-phase attention kernel does);
- Qwen3 decoder layers (q/k RMSNorm per head, GQA, SwiGLU or top-k MoE with renormalized weights).

It is also the LLM of the CPU deployment: requests of different lengths decode together over one
KV cache (DecodeBatch; new requests may join between steps, as with inflight batching), with greedy
or sampled tokens, end ids, and a per-token callback for streaming.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F

from ..contracts import LLM_INPUT_IDS, MROPE_POSITION_DELTAS, MROPE_ROTARY_COS_SIN
from ..errors import InputError
from ..llm.checkpoint_format import LLMWeights, MoEWeights, load_llm_weights
from ..llm.inputs import prompt_table_row, rope_inv_freq
from .sampling import SamplingParams, TokenSampler

if TYPE_CHECKING:
    from ..preprocess import Request

TokenCallback = Callable[[int, int], None]
"""Called as (request index, token id) for every generated token, in order."""


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
        max_position_embeddings: int,
        image_embeds: Any = None,
        deepstack_embeds: Any = None,
        sampling: SamplingParams | None = None,
    ) -> LLMRequest:
        """The engine inputs of a preprocessed request and its vision encoder outputs (the
        request's images only: image_embeds [M, D], deepstack_embeds [K, M, D])."""
        inputs = request.engine_inputs(max_position_embeddings)
        table = None
        if request.num_visual_tokens:
            if image_embeds is None or deepstack_embeds is None:
                raise InputError(f"the request has {request.num_visual_tokens} visual tokens but no vision outputs")
            table = request.prompt_embedding_table(torch.as_tensor(image_embeds), torch.as_tensor(deepstack_embeds))
        return cls(
            input_ids=inputs[LLM_INPUT_IDS.name],
            prompt_embedding_table=table,
            mrope_rotary_cos_sin=inputs[MROPE_ROTARY_COS_SIN.name],
            mrope_position_deltas=int(inputs[MROPE_POSITION_DELTAS.name][0]),
            sampling=sampling or SamplingParams(),
        )


@dataclass
class GenerationResult:
    output_ids: list[int]
    finish_reason: str  # "stop" (an end id was generated) or "length"
    prompt_length: int


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Qwen3 RMSNorm: statistics in float32, scaled in the model dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """GPT-NeoX rotation: pair i turns dims i and i + half. x [..., L, head_dim]; cos/sin [L, half]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


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

    @classmethod
    def from_checkpoint(
        cls, checkpoint_dir: str | os.PathLike[str], device: str | torch.device = "cpu"
    ) -> ReferenceLLM:
        return cls(load_llm_weights(checkpoint_dir), device=device)

    # -- one request's prompt --------------------------------------------------------------------

    def _check(self, request: LLMRequest) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The prompt's ids (int64), and its cos/sin [L, half] as the context phase applies them."""
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
        return ids, cos, sin

    def _positions_cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [n, half] of plain positions (all three axes equal), in float32 as transformers."""
        angles = positions.float()[:, None] * self.inv_freq[None, :]
        return angles.cos(), angles.sin()

    def _embed(self, ids: torch.Tensor, table: torch.Tensor | None) -> torch.Tensor:
        visual = ids >= self.vocab_size
        h = F.embedding(ids.masked_fill(visual, 0), self.w.vocab_embedding)
        if visual.any():
            assert table is not None
            h[visual] = table[prompt_table_row(ids[visual], self.vocab_size)].to(h.dtype)
        return h

    def _deepstack(self, h: torch.Tensor, ids: torch.Tensor, table: torch.Tensor | None, layer: int) -> None:
        """Adds the DeepStack feature of decoder layer `layer` at the visual positions, in place."""
        if table is None or layer >= self.config.deepstack_count:
            return
        visual = ids >= self.vocab_size
        if visual.any():
            h[visual] += table[prompt_table_row(ids[visual], self.vocab_size, layer)].to(h.dtype)

    def _mlp(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        w = self.w.layers[layer].mlp
        if isinstance(w, MoEWeights):
            return self._moe(w, x)
        return F.linear(F.silu(F.linear(x, w.gate)) * F.linear(x, w.up), w.down)

    def _moe(self, w: MoEWeights, x: torch.Tensor) -> torch.Tensor:
        moe = self.config.moe
        assert moe is not None
        flat = x.reshape(-1, x.shape[-1])
        probs = F.softmax(F.linear(flat.float(), w.router), dim=-1)  # the router runs in float32
        top_p, top_e = probs.topk(moe.top_k, dim=-1)
        if moe.renormalize:
            top_p = top_p / top_p.sum(dim=-1, keepdim=True)
        top_p = top_p.to(x.dtype)
        out = torch.zeros_like(flat)
        for expert in top_e.unique().tolist():
            token, slot = (top_e == expert).nonzero(as_tuple=True)
            xs = flat[token]
            hidden = F.silu(F.linear(xs, w.gate[expert])) * F.linear(xs, w.up[expert])
            out.index_add_(0, token, F.linear(hidden, w.down[expert]) * top_p[token, slot, None])
        return out.reshape(x.shape)

    def _qkv(self, layer: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """q [B, H, n, hd], k/v [B, KV, n, hd] of x [B, n, D], normalized per head and rotated."""
        w = self.w.layers[layer]
        b, n, _ = x.shape
        qkv = F.linear(x, w.qkv)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        eps = self.config.norm_epsilon
        q = _rms_norm(q.view(b, n, -1, self.head_dim), w.q_norm, eps).transpose(1, 2)
        k = _rms_norm(k.view(b, n, -1, self.head_dim), w.k_norm, eps).transpose(1, 2)
        v = v.view(b, n, -1, self.head_dim).transpose(1, 2)
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        return _rotate(q, cos, sin), _rotate(k, cos, sin), v

    def _attend(self, layer: int, q, k, v, mask: torch.Tensor | None, causal: bool) -> torch.Tensor:
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
        b, _, n, _ = out.shape
        return F.linear(out.transpose(1, 2).reshape(b, n, self.q_size), self.w.layers[layer].dense)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        h = _rms_norm(h, self.w.ln_f, self.config.norm_epsilon)
        return F.linear(h, self.w.lm_head).float()

    @torch.inference_mode()
    def _prefill(
        self, request: LLMRequest, all_logits: bool
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """Runs one prompt; returns its logits (every position, or the last) and per-layer (k, v)."""
        ids, cos, sin = self._check(request)
        table = request.prompt_embedding_table
        if table is not None:
            table = table.to(self.device)
        eps = self.config.norm_epsilon
        h = self._embed(ids, table)[None]  # [1, L, D]
        cache = []
        for layer, w in enumerate(self.w.layers):
            q, k, v = self._qkv(layer, _rms_norm(h, w.input_layernorm, eps), cos, sin)
            cache.append((k[0], v[0]))
            h = h + self._attend(layer, q, k, v, None, causal=True)
            h = h + self._mlp(layer, _rms_norm(h, w.post_layernorm, eps))
            self._deepstack(h[0], ids, table, layer)
        return self._logits(h[0] if all_logits else h[0, -1:]), cache

    def prompt_logits(self, request: LLMRequest) -> torch.Tensor:
        """float32 logits [L, vocab_size] at every prompt position (what gather_context_logits returns)."""
        return self._prefill(request, all_logits=True)[0]

    # -- batched generation ---------------------------------------------------------------------------

    def generate(self, requests: Sequence[LLMRequest], on_token: TokenCallback | None = None) -> list[GenerationResult]:
        """Generates for several requests at once: each prompt is run on its own, then all active
        requests decode together, one token each per step, over one KV cache."""
        batch = DecodeBatch(self, on_token)
        results = [batch.add(request, index) for index, request in enumerate(requests)]
        while batch:
            batch.step()
        return results

    def _decode_step(self, ids, position, delta, cache_k, cache_v) -> torch.Tensor:
        """One token per row: writes its k/v at `position` and returns float32 logits [B, vocab]."""
        rows = torch.arange(ids.numel(), device=self.device)
        span = int(position.max()) + 1
        mask = (torch.arange(span, device=self.device)[None, :] <= position[:, None])[:, None, None, :]
        cos, sin = self._positions_cos_sin(position + delta)
        cos, sin = cos[:, None, None, :], sin[:, None, None, :]  # per row: [B, 1, 1, half]
        eps = self.config.norm_epsilon
        h = F.embedding(ids, self.w.vocab_embedding)[:, None]  # [B, 1, D]
        for layer, w in enumerate(self.w.layers):
            q, k, v = self._qkv(layer, _rms_norm(h, w.input_layernorm, eps), cos, sin)
            cache_k[layer][rows, :, position] = k[:, :, 0]
            cache_v[layer][rows, :, position] = v[:, :, 0]
            keys, values = cache_k[layer][:, :, :span], cache_v[layer][:, :, :span]
            h = h + self._attend(layer, q, keys, values, mask, causal=False)
            h = h + self._mlp(layer, _rms_norm(h, w.post_layernorm, eps))
        return self._logits(h[:, 0])


@dataclass
class _Sequence:
    """A request in a decode batch: the caller's index, its sampler, result and rope delta."""

    index: int
    sampler: TokenSampler
    result: GenerationResult
    delta: int
    next_id: int = 0


class DecodeBatch:
    """Requests decoding together over one KV cache. A request joins with `add` (its prompt is run
    then) at any point between steps, as in inflight batching; `step` generates one token for every
    request and drops the finished ones. Cache rows are [KV heads, capacity, head_dim] per layer,
    the capacity growing to the longest prompt + max_new_tokens that joined."""

    def __init__(self, llm: ReferenceLLM, on_token: TokenCallback | None = None):
        self.llm, self.on_token = llm, on_token
        self.sequences: list[_Sequence] = []
        c = llm.config
        empty = (0, c.num_key_value_heads, 0, c.head_size)
        self.cache_k = [torch.zeros(empty, dtype=llm.dtype, device=llm.device) for _ in llm.w.layers]
        self.cache_v = [torch.zeros(empty, dtype=llm.dtype, device=llm.device) for _ in llm.w.layers]
        self.position = torch.zeros(0, dtype=torch.int64, device=llm.device)  # sequence index of each row's next token

    def __len__(self) -> int:
        return len(self.sequences)

    @torch.inference_mode()
    def add(self, request: LLMRequest, index: int = 0) -> GenerationResult:
        """Runs the request's prompt and picks its first token; the returned result fills as steps run."""
        llm = self.llm
        length = int(np.asarray(request.input_ids).size)
        need = length + request.sampling.max_new_tokens
        if need > llm.config.max_position_embeddings:
            raise InputError(
                f"prompt of {length} tokens + max_new_tokens {request.sampling.max_new_tokens} exceeds the model's "
                f"{llm.config.max_position_embeddings} positions"
            )
        logits, kv = llm._prefill(request, all_logits=False)
        seq = _Sequence(
            index,
            TokenSampler(request.sampling, llm.device),
            GenerationResult([], "length", length),
            int(np.asarray(request.mrope_position_deltas).reshape(-1)[0]),
        )
        self._accept(seq, logits[-1])
        if seq.sampler.finished:
            return seq.result
        capacity = max(need, self.cache_k[0].shape[2])
        for caches, new in ((self.cache_k, [k for k, _ in kv]), (self.cache_v, [v for _, v in kv])):
            for layer, rows in enumerate(caches):
                row = F.pad(new[layer], (0, 0, 0, capacity - length))[None]
                caches[layer] = torch.cat([F.pad(rows, (0, 0, 0, capacity - rows.shape[2])), row])
        self.position = torch.cat([self.position, self.position.new_tensor([length])])
        self.sequences.append(seq)
        return seq.result

    @torch.inference_mode()
    def step(self) -> None:
        """One token for every request in the batch; finished requests leave it."""
        if not self.sequences:
            return
        ids = torch.tensor([s.next_id for s in self.sequences], device=self.llm.device)
        delta = self.position.new_tensor([s.delta for s in self.sequences])
        logits = self.llm._decode_step(ids, self.position, delta, self.cache_k, self.cache_v)
        self.position = self.position + 1
        for row, seq in enumerate(self.sequences):
            self._accept(seq, logits[row])
        keep = [row for row, seq in enumerate(self.sequences) if not seq.sampler.finished]
        if len(keep) < len(self.sequences):
            rows = torch.tensor(keep, dtype=torch.int64, device=self.llm.device)
            self.cache_k = [c.index_select(0, rows) for c in self.cache_k]
            self.cache_v = [c.index_select(0, rows) for c in self.cache_v]
            self.position = self.position[rows]
            self.sequences = [self.sequences[row] for row in keep]

    def _accept(self, seq: _Sequence, logits: torch.Tensor) -> None:
        seq.next_id = seq.sampler.next_token(logits)
        seq.result.output_ids.append(seq.next_id)
        if seq.sampler.finished:
            seq.result.finish_reason = seq.sampler.finish_reason
        if self.on_token is not None:
            self.on_token(seq.index, seq.next_id)
