"""tensorrt_llm/functional.py: graph ops, here as the torch ops they stand for."""

import torch

Tensor = torch.Tensor


def embedding(idx, table):
    return table[idx]


def where(condition, a, b):
    return torch.where(condition, a, torch.as_tensor(b))


def expand(tensor, shape):
    return tensor.expand(shape)


def shape(tensor):
    return tensor.shape


def unsqueeze(tensor, dim):
    return tensor.unsqueeze(dim)


def recv(tensor, src):
    return tensor  # the runtime feeds hidden_states_input


def send(tensor, dst):
    return tensor  # ... and reads hidden_states_output


def gpt_attention(qkv, rotary_cos_sin, *, num_heads, num_kv_heads, hidden_size_per_head):
    """The gpt_attention plugin's context phase over one sequence (a CUDA kernel; here its arithmetic): each token's
    qkv [(num_heads + 2 * num_kv_heads) * head_size] read as consecutive Q, K, V blocks, q and k rotated half by half
    (GPT-NeoX style, as the plugin's mrope path) with the token's (cos, sin), then causal softmax(q k^T / sqrt(d)) v
    with each key/value head serving num_heads / num_kv_heads consecutive query heads; [tokens, num_heads * d]."""
    d = hidden_size_per_head
    q, k, v = (
        t.unflatten(-1, (-1, d)).transpose(0, 1)
        for t in qkv.split([num_heads * d, num_kv_heads * d, num_kv_heads * d], -1)
    )
    cos, sin = rotary_cos_sin

    def rotate(x):
        return x * cos + torch.cat([-x[..., d // 2 :], x[..., : d // 2]], dim=-1) * sin

    group = num_heads // num_kv_heads
    k, v = rotate(k).repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    out = torch.nn.functional.scaled_dot_product_attention(rotate(q), k, v, is_causal=True)
    return out.transpose(0, 1).flatten(1)
