"""The layers engine_model.py touches, from tensorrt_llm/layers/ (normalization.py, attention.py, embedding.py)."""

import torch

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


class Attention:  # layers/attention.py: the q/k norms take the constructor's eps
    def __init__(self, *, attention_head_size, qk_layernorm=False, eps=ATTENTION_DEFAULT_EPS, **_):
        if qk_layernorm:
            self.q_layernorm = RmsNorm(attention_head_size, eps=eps)
            self.k_layernorm = RmsNorm(attention_head_size, eps=eps)


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
