"""The TensorRT-LLM engine model (engine_model.py) traced over the stand-in for TensorRT-LLM 1.2.1
(tests/trtllm_standin: graph ops as torch ops, decoder layers that double their input, so the output says after
which layer each DeepStack feature arrived). The stand-in keeps what TensorRT-LLM decides and our code depends on:
the per-rank inputs `prepare_inputs` declares, the layer split of Mapping.pp_layers, the stock prompt-tuning lookup,
and Attention's default q/k norm epsilon. The real classes' behaviour is checked on GPU hosts
(scripts/gpu_acceptance.sh)."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch
from qwen3vl_trt.errors import UnsupportedModelError
from qwen3vl_trt.llm import engine_model as package_engine_model
from qwen3vl_trt.llm import inputs as llm_inputs
from qwen3vl_trt.llm.checkpoint_format import read_trtllm_config
from qwen3vl_trt.llm.convert import convert_llm
from transformers import AutoConfig
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRMSNorm

IMAGE_TOKEN_ID = 151655


@pytest.fixture
def standin(trtllm_standin):
    """What the tests read of the stand-in: the declared-input marker, Attention's default epsilon."""
    import tensorrt_llm.layers
    import tensorrt_llm.models.qwen.model

    return SimpleNamespace(
        Declared=tensorrt_llm.models.qwen.model.Declared,
        attention_default_eps=tensorrt_llm.layers.ATTENTION_DEFAULT_EPS,
    )


@pytest.fixture
def engine_model(standin):
    """A private copy of engine_model.py loaded by path over the stand-in (the package's own module
    keeps seeing the real, absent TensorRT-LLM)."""
    spec = importlib.util.spec_from_file_location("stand_in_engine_model", package_engine_model.__file__)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.TRTLLM_IMPORT_ERROR is None
    module.standin = standin
    return module


@pytest.fixture(scope="module")
def dense_checkpoint(checkpoints, tmp_path_factory):
    return convert_llm(checkpoints["dense"], tmp_path_factory.mktemp("engine-model") / "c", progress=False)


def _engine_config(engine_model, checkpoint, pp_size=1, pp_rank=0):
    """The checkpoint's config as the model class's config_class makes it, for one pipeline rank."""
    cfg, _ = read_trtllm_config(checkpoint)
    mapping = {**cfg["mapping"], "world_size": pp_size, "tp_size": 1, "pp_size": pp_size, "moe_tp_size": 1}
    config = engine_model.Qwen3VLForCausalLM.config_class(**{**cfg, "mapping": mapping})
    config.set_rank(pp_rank)
    return config


def _bind(engine_model, inputs: dict, feed: dict) -> dict:
    """What the runtime passes: a tensor for every declared input, nothing for undeclared ones."""
    declared = engine_model.standin.Declared
    return {name: feed[value] if isinstance(value, declared) else value for name, value in inputs.items()}


def _run_pipeline(engine_model, checkpoint, pp_size, feed, use_cache):
    """Every pipeline rank in turn, each fed the inputs it declares; returns the last rank's output and
    the models."""
    hidden, models, presents = None, [], []
    for pp_rank in range(pp_size):
        model = engine_model.Qwen3VLForCausalLM(_engine_config(engine_model, checkpoint, pp_size, pp_rank))
        inputs = model.prepare_inputs(use_cache=use_cache, prompt_embedding_table_size=4096)
        out = model.forward(**_bind(engine_model, inputs, {**feed, "hidden_states_input": hidden}))
        hidden, rank_presents = out if use_cache else (out, ())
        presents += rank_presents
        models.append(model)
    return hidden, models, presents


@pytest.mark.parametrize("pp_size", [1, 2])
@pytest.mark.parametrize("use_cache", [False, True])
def test_deepstack_rows_are_added_after_the_first_k_layers_on_every_split(
    engine_model, dense_checkpoint, pp_size, use_cache
):
    config = _engine_config(engine_model, dense_checkpoint)
    vocab, k, d, layers = config.vocab_size, config.qwen3_vl["deepstack_count"], config.hidden_size, 5
    assert config.num_hidden_layers == layers and k == 3  # pp=2 puts layers 0-2 on the first stage
    ids = torch.tensor([3, 9, IMAGE_TOKEN_ID, IMAGE_TOKEN_ID, 7, IMAGE_TOKEN_ID])
    fake = torch.from_numpy(llm_inputs.fake_prompt_ids(ids.numpy(), IMAGE_TOKEN_ID, vocab, k)).long()
    image, deepstack = torch.randn(3, d), torch.randn(k, 3, d)
    table = llm_inputs.interleave_prompt_table(image, deepstack)
    # Two tasks' tables back to back; this request is task 1, as the runtime's per-request offset.
    feed = {
        "input_ids": fake,
        "prompt_embedding_table": torch.cat([torch.full_like(table, 1e3), table]),
        "tasks": torch.ones_like(fake),
        "prompt_vocab_size": torch.tensor([table.shape[0]]),
    }
    hidden, models, presents = _run_pipeline(engine_model, dense_checkpoint, pp_size, feed, use_cache)

    visual = fake >= vocab
    text_embedding = models[0].transformer.vocab_embedding.weight[ids[~visual]]
    assert torch.allclose(hidden[~visual], 2**layers * text_embedding)  # text positions: the layers only
    # Feature j arrives after layer j, then passes through the remaining layers.
    expected = 2**layers * image + sum(2 ** (layers - 1 - j) * deepstack[j] for j in range(k))
    # Sums of terms up to ~50 in float32: an absolute tolerance, as elements near 0 have no relative one.
    assert torch.allclose(hidden[visual], expected, atol=1e-4), float((hidden[visual] - expected).abs().max())
    if use_cache:
        assert presents == [f"kv{i}" for i in range(layers)]


def test_layers_get_the_mrope_inputs(engine_model, dense_checkpoint):
    config = _engine_config(engine_model, dense_checkpoint)
    model = engine_model.Qwen3VLForCausalLM(config)
    inputs = model.prepare_inputs(use_cache=False)
    assert inputs["mrope_params"].size == config.max_position_embeddings * config.rotary_embedding_dim
    model.forward(**_bind(engine_model, inputs, {"input_ids": torch.tensor([1, 2, 3])}))
    assert all(layer.seen_mrope_params is inputs["mrope_params"] for layer in model.transformer.layers)


def test_qk_norms_use_the_checkpoint_epsilon(engine_model, checkpoints, dense_checkpoint):
    """TensorRT-LLM's QWenDecoderLayer leaves its q/k norms at Attention's 1e-5; the engine model's
    equal transformers' q_norm / k_norm (rms_norm_eps 1e-6) on small activations, where the two differ."""
    model = engine_model.Qwen3VLForCausalLM(_engine_config(engine_model, dense_checkpoint))
    hf_text = AutoConfig.from_pretrained(checkpoints["dense"]).text_config
    assert hf_text.rms_norm_eps != engine_model.standin.attention_default_eps
    reference = Qwen3VLTextRMSNorm(hf_text.head_dim, eps=hf_text.rms_norm_eps)
    x = 1e-3 * torch.randn(6, hf_text.num_attention_heads, hf_text.head_dim, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(x)
    for layer in model.transformer.layers:
        for norm in (layer.attention.q_layernorm, layer.attention.k_layernorm):
            assert torch.allclose(norm(x), expected, rtol=1e-5, atol=0)


def test_from_checkpoint_without_a_config_builds_ours_for_the_rank(engine_model, dense_checkpoint):
    """Upstream's from_checkpoint without a config reads config.json through MODEL_MAP, which lacks our
    architecture; ours builds its own config class and loads the rank asked for into the layers."""
    model = engine_model.Qwen3VLForCausalLM.from_checkpoint(str(dense_checkpoint), rank=0)
    assert isinstance(model.config, engine_model.Qwen3VLForCausalLM.config_class)
    assert model.weights_file.endswith("rank0.safetensors")
    qkv = model.loaded_weights["transformer.layers.4.attention.qkv.weight"]
    assert model.transformer.layers[4].attention.qkv.weight is qkv


def test_splits_without_all_deepstack_layers_first_are_refused(engine_model, dense_checkpoint):
    with pytest.raises(UnsupportedModelError, match=r"pp=3 puts DeepStack layer\(s\) \[2\].*use pp <= 2"):
        engine_model.Qwen3VLForCausalLM(_engine_config(engine_model, dense_checkpoint, pp_size=3, pp_rank=1))


def test_lora_is_refused(engine_model, dense_checkpoint):
    model = engine_model.Qwen3VLForCausalLM(_engine_config(engine_model, dense_checkpoint))
    inputs = _bind(engine_model, model.prepare_inputs(use_cache=False), {"input_ids": torch.tensor([1])})
    with pytest.raises(UnsupportedModelError, match="lora_plugin"):
        model.forward(**inputs, lora_params=SimpleNamespace())
