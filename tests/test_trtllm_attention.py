"""The fused qkv of every rank file, read the way TensorRT-LLM 1.2.1's Attention reads it (the stand-in's
layers.Attention: upstream's `if self.qk_layernorm:` block, which cuts a rank's qkv as [Q; K; V] when its query and
key/value head counts differ but as [heads, 3, head_size] when they are equal), then attended and projected with that
rank's dense part; the ranks' outputs summed (the all-reduce) against transformers' own Qwen3VLTextAttention. Head
layouts: grouped-query (4 query, 2 key/value heads) at tp 1, 2 (2 and 1 per rank) and 4 (one head each), and as many
key/value heads as query heads (4) at tp 1 and 2; quantized weight-only checkpoints of the latter against the
reference runtime's reading of the same files."""

from __future__ import annotations

import warnings

import pytest
import torch
from qwen3vl_trt.hf.checkpoint import Checkpoint
from qwen3vl_trt.llm.checkpoint_format import load_llm_weights, read_trtllm_config
from qwen3vl_trt.llm.convert import convert_llm
from qwen3vl_trt.qa.tiny import make_tiny_checkpoint
from transformers import AutoConfig
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextAttention, Qwen3VLTextRotaryEmbedding

LAYER = 1
TOKENS = 7


@pytest.fixture(scope="module")
def models(checkpoints, tmp_path_factory):
    """Grouped-query (the shared tiny checkpoint) and equal heads; the latter's hidden size (128) lets weight-only
    layers take it unpadded at tp 2."""
    equal = dict(hidden_size=128, num_key_value_heads=4, intermediate_size=256, num_hidden_layers=2)
    return {
        "gqa": checkpoints["dense"],
        "equal": make_tiny_checkpoint(tmp_path_factory.mktemp("attention") / "equal", seed=3, text_overrides=equal),
    }


def _attention(model_dir, weights: dict[str, torch.Tensor]) -> Qwen3VLTextAttention:
    """transformers' attention of the checkpoint's text config in float32, with `weights` (its state dict)."""
    config = AutoConfig.from_pretrained(model_dir).text_config
    config._attn_implementation = "eager"
    attention = Qwen3VLTextAttention(config, LAYER).float().eval()
    attention.load_state_dict({name: t.float() for name, t in weights.items()})
    return attention


def _transformers_weights(model_dir) -> dict[str, torch.Tensor]:
    ckpt = Checkpoint(model_dir)
    prefix = f"model.language_model.layers.{LAYER}.self_attn."
    return {name[len(prefix) :]: t for name, t in ckpt.load_tensors(ckpt.tensor_names(prefix)).items()}


def _reference_weights(checkpoint) -> dict[str, torch.Tensor]:
    """The layer as the reference runtime reads it back from the rank files (load_llm_weights)."""
    w = load_llm_weights(checkpoint).layers[LAYER]
    c = read_trtllm_config(checkpoint)[1]
    q, kv = c.num_attention_heads * c.head_size, c.num_key_value_heads * c.head_size
    q_proj, k_proj, v_proj = w.qkv.split([q, kv, kv])
    named = dict(q_proj=q_proj, k_proj=k_proj, v_proj=v_proj, o_proj=w.dense, q_norm=w.q_norm, k_norm=w.k_norm)
    return {f"{name}.weight": t for name, t in named.items()}


def _inputs(model_dir):
    """Hidden states and their rotary (cos, sin), as transformers computes them for text positions."""
    config = AutoConfig.from_pretrained(model_dir).text_config
    x = torch.randn(TOKENS, config.hidden_size, generator=torch.Generator().manual_seed(7))
    positions = torch.arange(TOKENS)[None, None].expand(3, 1, TOKENS)
    cos, sin = Qwen3VLTextRotaryEmbedding(config)(x, positions)
    return x, (cos[0], sin[0])


def _transformers_output(attention: Qwen3VLTextAttention, x, cos_sin) -> torch.Tensor:
    causal = torch.full((TOKENS, TOKENS), torch.finfo(torch.float32).min).triu(1)[None, None]
    with torch.no_grad():
        out, _ = attention(x[None], (cos_sin[0][None], cos_sin[1][None]), causal)
    return out[0]


def _standin_output(model_cls, checkpoint, x, cos_sin) -> torch.Tensor:
    """Every rank's Attention, with the weights upstream's from_checkpoint loads into it, summed over the ranks."""
    cfg, _ = read_trtllm_config(checkpoint)
    total = torch.zeros(TOKENS, cfg["hidden_size"])
    for rank in range(cfg["mapping"]["world_size"]):
        config = model_cls.config_class(**cfg)
        config.set_rank(rank)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # every tensor declared, in its dtype
            model = model_cls.from_checkpoint(str(checkpoint), config=config)
        total += model.transformer.layers[LAYER].attention(x, cos_sin)
    return total


@pytest.mark.parametrize("heads,tp", [("gqa", 1), ("gqa", 2), ("gqa", 4), ("equal", 1), ("equal", 2)])
def test_every_ranks_qkv_read_as_upstream_gives_transformers_attention(
    models, standin_engine_model, heads, tp, tmp_path
):
    checkpoint = convert_llm(models[heads], tmp_path / "c", tp=tp, progress=False)
    x, cos_sin = _inputs(models[heads])
    expected = _transformers_output(_attention(models[heads], _transformers_weights(models[heads])), x, cos_sin)
    ours = _standin_output(standin_engine_model.Qwen3VLForCausalLM, checkpoint, x, cos_sin)
    torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.once
@pytest.mark.parametrize("quant", ["int8-wo", "int4-wo"])
def test_weight_only_ranks_read_as_upstream_give_what_the_reference_runtime_reads(
    models, standin_engine_model, quant, tmp_path
):
    """Per-channel scales travel with their rows: the rank files' quantized qkv and dense, through upstream's split,
    compute what the reference runtime's dequantized reading of the same checkpoint does."""
    checkpoint = convert_llm(models["equal"], tmp_path / "c", tp=2, quant=quant, progress=False)
    x, cos_sin = _inputs(models["equal"])
    expected = _transformers_output(_attention(models["equal"], _reference_weights(checkpoint)), x, cos_sin)
    ours = _standin_output(standin_engine_model.Qwen3VLForCausalLM, checkpoint, x, cos_sin)
    torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-5)
