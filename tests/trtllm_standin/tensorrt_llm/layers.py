"""The layers engine_model.py touches, from tensorrt_llm/layers/ (normalization.py, attention.py, linear.py,
embedding.py) and quantization/layers.py. What needs CUDA is replaced by the torch arithmetic it stands for: a linear
is the matmul of this rank's weight (the weight-only plugin's: its int8 / packed int4 values times their channel
scales), gpt_attention is causal attention over the fused [Q; K; V] it is given (functional.gpt_attention)."""

import torch

from . import functional

ATTENTION_DEFAULT_EPS = 1e-05  # layers/attention.py, Attention.__init__(eps=1e-05)


class Module:  # module.py: calling a module runs its forward
    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)


class RmsNorm(Module):  # layers/normalization.py
    def __init__(self, normalized_shape, eps=1e-06, dtype=None):
        self.weight = torch.ones(normalized_shape)
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Linear(Module):
    """ColumnLinear / RowLinear (layers/linear.py) and their weight-only forms (quantization/layers.py,
    WeightOnlyQuant{Column,Row}Linear): this rank's part of x @ W^T in float32. Float weights are [out, in];
    weight-only ones [in, out * bits / 8] int8 (int4: two per byte along out, the even one in the low nibble, as the
    quantizer packs them before the GPU's layout, which preprocess_weights_for_mixed_gemm keeps here) beside
    `per_channel_scale` [out]. A row-parallel output is this rank's share of the all-reduce's sum."""

    def __init__(self, bits=None):
        self.bits = bits
        self.weight = None
        self.per_channel_scale = None

    def forward(self, x):
        if self.weight.dtype == torch.float8_e4m3fn:
            raise NotImplementedError("FP8Linear's arithmetic (quantized activations) is not modelled here")
        if self.bits is None:
            return x @ self.weight.float().T
        w = self.weight
        if self.bits == 4:
            w = torch.stack([(w << 4) >> 4, w >> 4], dim=-1).flatten(-2)  # arithmetic shifts keep each sign
        scale = self.per_channel_scale  # in the engine dtype, which the kernel dequantizes into
        return x @ (w.float() * scale.float()).to(scale.dtype).float()


class Attention(Module):
    """layers/attention.py's Attention for a decoder's self-attention with the gpt_attention plugin: per rank
    num_attention_heads / tp query heads and ceil(num_kv_heads / tp) key/value heads; forward runs the fused qkv
    linear, the `if self.qk_layernorm:` block as upstream writes it (below), gpt_attention and the dense linear.
    RoPE inputs: where upstream passes the rotary tables and mrope_params to the plugin, the stand-in takes each
    token's (cos, sin) [tokens, head_size]."""

    def __init__(
        self,
        *,
        hidden_size,
        num_attention_heads,
        num_kv_heads=None,
        attention_head_size=None,
        tp_size=1,
        qk_layernorm=False,
        eps=ATTENTION_DEFAULT_EPS,
        quant_mode=None,
        **_,
    ):
        self.attention_head_size = attention_head_size or hidden_size // num_attention_heads
        self.num_attention_heads = num_attention_heads // tp_size
        kv = num_kv_heads if num_kv_heads is not None else num_attention_heads
        self.num_attention_kv_heads = (kv + tp_size - 1) // tp_size
        bits = {"W8A16": 8, "W4A16": 4}.get(quant_mode)
        self.qkv, self.dense = Linear(bits), Linear(bits)
        self.qk_layernorm = qk_layernorm
        if qk_layernorm:  # layernorm_share (the default): one norm of head_size for every head
            self.q_layernorm = RmsNorm(self.attention_head_size, eps=eps)
            self.k_layernorm = RmsNorm(self.attention_head_size, eps=eps)

    def split_qkv(self, qkv):
        """Upstream's `if self.qk_layernorm:` block (read in the TensorRT-LLM 1.1/1.2 line; the same in every copy
        of that era): the per-rank fused qkv [tokens, (q + 2 kv) * head_size] is cut as three consecutive blocks when
        the rank's query and key/value head counts differ, and viewed as [heads, 3, head_size] (each head's q, k, v
        together) when they are equal; q and k are normalized per head and the three are concatenated back as
        [Q; K; V], the layout gpt_attention reads."""
        base_shape = qkv.shape[:-1]
        sections = [self.num_attention_heads, self.num_attention_kv_heads, self.num_attention_kv_heads]
        total_heads = sum(sections)
        if self.num_attention_heads != self.num_attention_kv_heads:
            qkv = qkv.view(*base_shape, total_heads, self.attention_head_size)
            query, key, value = qkv.split(sections, dim=qkv.ndim - 2)
        else:
            qkv = qkv.view(*base_shape, self.num_attention_heads, 3, self.attention_head_size)
            query, key, value = (t.squeeze(-2) for t in qkv.split(1, dim=qkv.ndim - 2))
        query = self.q_layernorm(query)
        key = self.k_layernorm(key)
        qkv = torch.cat([query, key, value], dim=query.ndim - 2)
        return qkv.view(*base_shape, total_heads * self.attention_head_size)

    def forward(self, hidden_states, rotary_cos_sin):
        qkv = self.qkv(hidden_states)
        if self.qk_layernorm:
            qkv = self.split_qkv(qkv)
        context = functional.gpt_attention(
            qkv,
            rotary_cos_sin,
            num_heads=self.num_attention_heads,
            num_kv_heads=self.num_attention_kv_heads,
            hidden_size_per_head=self.attention_head_size,
        )
        return self.dense(context)


class KeyValueCacheParams:  # layers/attention.py
    def __init__(self, past_key_value=None):
        self.past_key_value = past_key_value

    def fill_none_tensor_list(self, list_size):
        if self.past_key_value is None:
            self.past_key_value = tuple([None] * list_size)


class Embedding(Module):  # layers/embedding.py, PromptTuningEmbedding when a table is given
    def __init__(self, config):
        self.vocab_size = config.vocab_size
        self.weight = torch.randn(config.vocab_size, config.hidden_size, generator=torch.Generator().manual_seed(0))

    def forward(self, input_ids, prompt_embedding_table=None, tasks=None, task_vocab_size=None):
        visual = input_ids > self.vocab_size - 1
        out = self.weight[torch.where(visual, 0, input_ids)]
        if prompt_embedding_table is not None:
            rows = torch.where(visual, input_ids - self.vocab_size + tasks * task_vocab_size, 0)
            out = torch.where(visual[:, None], prompt_embedding_table[rows], out)
        return out
