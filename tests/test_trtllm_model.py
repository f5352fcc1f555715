"""The TensorRT-LLM engine model (engine_model.py) traced over a stand-in for TensorRT-LLM 1.2.1.

TensorRT-LLM cannot be installed on CPU machines, so this runs engine_model.py against a minimal
stand-in package with graph ops as torch ops. The stand-in keeps what TensorRT-LLM decides and our
code depends on:

- per pipeline rank, the inputs `prepare_inputs` declares (models/generation_mixin.py,
  prepare_basic_inputs): `input_ids` on the first rank only, `hidden_states_input` on the others,
  the prompt table, tasks and prompt vocab size on every rank; stages split the layers as
  Mapping.pp_layers does (torch.tensor_split), and QWenModel's embedding lives on the first rank;
- the stock prompt-tuning lookup (layers/embedding.py): a fake id reads row `id - vocab_size +
  task * task_vocab_size` of the table;
- QWenDecoderLayer's q/k RMSNorm built by Attention without an eps, i.e. with its default 1e-5.

Decoder layers double their input, so the output says after which layer each DeepStack feature
arrived. The real classes' behaviour is verified on GPU hosts only.
"""

from __future__ import annotations

import importlib.util
import sys
import types
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
ATTENTION_DEFAULT_EPS = 1e-05  # tensorrt_llm/layers/attention.py, Attention.__init__(eps=1e-05)


class Declared(str):
    """An engine input as prepare_inputs declares it: the runtime binds a tensor to the name."""


def _stand_in() -> dict[str, types.ModuleType]:
    functional = types.ModuleType("tensorrt_llm.functional")
    functional.Tensor = torch.Tensor
    functional.embedding = lambda idx, table: table[idx]
    functional.where = lambda c, a, b: torch.where(c, a, torch.as_tensor(b))
    functional.expand = lambda t, shape: t.expand(shape)
    functional.shape = lambda t: t.shape
    functional.unsqueeze = lambda t, d: t.unsqueeze(d)
    functional.recv = lambda tensor, src: tensor  # the runtime feeds hidden_states_input
    functional.send = lambda tensor, dst: tensor  # ... and reads hidden_states_output

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

    class KeyValueCacheParams:
        def __init__(self, past_key_value=None):
            self.past_key_value = past_key_value

        def fill_none_tensor_list(self, list_size):
            if self.past_key_value is None:
                self.past_key_value = tuple([None] * list_size)

    class DecoderLayerList(list):  # models/modeling_utils.py
        def __init__(self, cls, config):
            self.layer_list = config.mapping.pp_layers(config.num_hidden_layers)
            super().__init__(cls(config, idx) for idx in self.layer_list)

        def forward(self, hidden_states, use_cache=False, kv_cache_params=None, **kwargs):
            kv_cache_params.fill_none_tensor_list(len(self.layer_list))
            presents = []
            for layer, past in zip(self, kv_cache_params.past_key_value, strict=True):
                out = layer(hidden_states, use_cache=use_cache, kv_cache_params=KeyValueCacheParams([past]), **kwargs)
                hidden_states, present = out if use_cache else (out, None)
                presents.append(present)
            return (hidden_states, presents) if use_cache else hidden_states

    class QWenDecoderLayer(Module):  # models/qwen/model.py: Attention gets no eps
        def __init__(self, config, layer_idx):
            self.layer_idx = layer_idx
            qk_layernorm = config.qwen_type in ("qwen3", "qwen3_moe")
            self.attention = Attention(attention_head_size=config.head_size, qk_layernorm=qk_layernorm)
            self.seen_mrope_params = None

        def forward(
            self,
            hidden_states,
            attention_mask=None,
            use_cache=False,
            spec_decoding_params=None,
            kv_cache_params=None,
            attention_params=None,
            lora_layer_params=None,
            mrope_params=None,
        ):
            assert len(kv_cache_params.past_key_value) == 1  # this layer's own past
            self.seen_mrope_params = mrope_params
            out = 2 * hidden_states
            return (out, f"kv{self.layer_idx}") if use_cache else out

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

    class QWenModel:
        def __init__(self, config):
            self.mapping = config.mapping
            if self.mapping.is_first_pp_rank():
                self.vocab_embedding = Embedding(config)
            self.layers = DecoderLayerList(QWenDecoderLayer, config)
            if self.mapping.is_last_pp_rank():
                self.ln_f = lambda hidden_states: hidden_states

        def forward(
            self, input_ids, position_ids=None, use_cache=False, kv_cache_params=None, hidden_states=None, **kwargs
        ):
            ptuning = [kwargs.pop(k, None) for k in ("prompt_embedding_table", "prompt_tasks", "prompt_vocab_size")]
            if self.mapping.is_first_pp_rank():
                hidden_states = self.vocab_embedding(input_ids, *ptuning)
            else:
                hidden_states = functional.recv(hidden_states, self.mapping.prev_pp_rank())
            out = self.layers.forward(hidden_states, use_cache=use_cache, kv_cache_params=kv_cache_params, **kwargs)
            hidden_states, presents = out if use_cache else (out, None)
            if self.mapping.is_last_pp_rank():
                hidden_states = self.ln_f(hidden_states)
            else:
                hidden_states = functional.send(hidden_states, self.mapping.next_pp_rank())
            return (hidden_states, tuple(presents)) if use_cache else hidden_states

    class QWenForCausalLM:
        def __init__(self, config):
            self.config = config
            self.transformer = QWenModel(config)

        def prepare_inputs(self, use_cache=True, prompt_embedding_table_size=0, mrope_rotary_cos_sin_size=None, **_):
            first = self.config.mapping.is_first_pp_rank()
            inputs = {
                "input_ids": Declared("input_ids") if first else None,
                "use_cache": use_cache,
                "kv_cache_params": KeyValueCacheParams(),
                "attention_params": SimpleNamespace(),
            }
            if not first:
                inputs["hidden_states"] = Declared("hidden_states_input")
            if prompt_embedding_table_size > 0:
                inputs |= {
                    "prompt_embedding_table": Declared("prompt_embedding_table"),
                    "prompt_tasks": Declared("tasks"),
                    "prompt_vocab_size": Declared("prompt_vocab_size"),
                }
            if mrope_rotary_cos_sin_size is not None:
                inputs["mrope_params"] = SimpleNamespace(size=mrope_rotary_cos_sin_size)
            return inputs

        def forward(self, input_ids, last_token_ids=None, position_ids=None, **kwargs):  # DecoderModelForCausalLM
            return self.transformer.forward(input_ids, position_ids=position_ids, **kwargs)

    modeling_utils = types.ModuleType("tensorrt_llm.models.modeling_utils")
    modeling_utils.DecoderLayerList = DecoderLayerList
    qwen_model = types.ModuleType("tensorrt_llm.models.qwen.model")
    qwen_model.QWenDecoderLayer = QWenDecoderLayer
    qwen_model.QWenModel = QWenModel
    qwen_model.QWenForCausalLM = QWenForCausalLM
    return {
        "tensorrt_llm": types.ModuleType("tensorrt_llm"),
        "tensorrt_llm.functional": functional,
        "tensorrt_llm.models": types.ModuleType("tensorrt_llm.models"),
        "tensorrt_llm.models.modeling_utils": modeling_utils,
        "tensorrt_llm.models.qwen": types.ModuleType("tensorrt_llm.models.qwen"),
        "tensorrt_llm.models.qwen.model": qwen_model,
    }


class Mapping:  # tensorrt_llm/mapping.py, without tensor or context parallelism
    def __init__(self, pp_size=1, pp_rank=0):
        self.tp_size, self.pp_size, self.pp_rank = 1, pp_size, pp_rank

    def is_first_pp_rank(self):
        return self.pp_rank == 0

    def is_last_pp_rank(self):
        return self.pp_rank == self.pp_size - 1

    def prev_pp_rank(self):
        return self.pp_rank - 1

    def next_pp_rank(self):
        return self.pp_rank + 1

    def pp_layers(self, num_layers):
        return torch.tensor_split(torch.arange(num_layers), self.pp_size)[self.pp_rank].tolist()


@pytest.fixture
def engine_model(monkeypatch):
    """A private copy of engine_model.py loaded by path over the stand-in (the package's own module
    keeps seeing the real, absent TensorRT-LLM)."""
    for name, module in _stand_in().items():
        monkeypatch.setitem(sys.modules, name, module)
    spec = importlib.util.spec_from_file_location("stand_in_engine_model", package_engine_model.__file__)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.TRTLLM_IMPORT_ERROR is None
    return module


@pytest.fixture(scope="module")
def dense_checkpoint(checkpoints, tmp_path_factory):
    return convert_llm(checkpoints["dense"], tmp_path_factory.mktemp("engine-model") / "c", progress=False)


def _engine_config(checkpoint, pp_size=1, pp_rank=0):
    """The checkpoint's config.json as attributes (what PretrainedConfig.from_dict makes of it), for one rank."""
    cfg, _ = read_trtllm_config(checkpoint)
    return SimpleNamespace(**{**cfg, "mapping": Mapping(pp_size, pp_rank)})


def _bind(inputs: dict, feed: dict) -> dict:
    """What the runtime passes: a tensor for every declared input, nothing for undeclared ones."""
    return {name: feed[value] if isinstance(value, Declared) else value for name, value in inputs.items()}


def _run_pipeline(engine_model, checkpoint, pp_size, feed, use_cache):
    """Every pipeline rank in turn, each fed the inputs it declares; returns the last rank's output and
    the models."""
    hidden, models, presents = None, [], []
    for pp_rank in range(pp_size):
        model = engine_model.Qwen3VLForCausalLM(_engine_config(checkpoint, pp_size, pp_rank))
        inputs = model.prepare_inputs(use_cache=use_cache, prompt_embedding_table_size=4096)
        out = model.forward(**_bind(inputs, {**feed, "hidden_states_input": hidden}))
        hidden, rank_presents = out if use_cache else (out, ())
        presents += rank_presents
        models.append(model)
    return hidden, models, presents


@pytest.mark.parametrize("pp_size", [1, 2])
@pytest.mark.parametrize("use_cache", [False, True])
def test_deepstack_rows_are_added_after_the_first_k_layers_on_every_split(
    engine_model, dense_checkpoint, pp_size, use_cache
):
    config = _engine_config(dense_checkpoint)
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
    config = _engine_config(dense_checkpoint)
    model = engine_model.Qwen3VLForCausalLM(config)
    inputs = model.prepare_inputs(use_cache=False)
    assert inputs["mrope_params"].size == config.max_position_embeddings * config.rotary_embedding_dim
    model.forward(**_bind(inputs, {"input_ids": torch.tensor([1, 2, 3])}))
    assert all(layer.seen_mrope_params is inputs["mrope_params"] for layer in model.transformer.layers)


def test_qk_norms_use_the_checkpoint_epsilon(engine_model, checkpoints, dense_checkpoint):
    """TensorRT-LLM's QWenDecoderLayer leaves its q/k norms at Attention's 1e-5; the engine model's
    equal transformers' q_norm / k_norm (rms_norm_eps 1e-6) on small activations, where the two differ."""
    model = engine_model.Qwen3VLForCausalLM(_engine_config(dense_checkpoint))
    hf_text = AutoConfig.from_pretrained(checkpoints["dense"]).text_config
    assert hf_text.rms_norm_eps != ATTENTION_DEFAULT_EPS
    reference = Qwen3VLTextRMSNorm(hf_text.head_dim, eps=hf_text.rms_norm_eps)
    x = 1e-3 * torch.randn(6, hf_text.num_attention_heads, hf_text.head_dim, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(x)
    for layer in model.transformer.layers:
        for norm in (layer.attention.q_layernorm, layer.attention.k_layernorm):
            assert torch.allclose(norm(x), expected, rtol=1e-5, atol=0)


def test_splits_without_all_deepstack_layers_first_are_refused(engine_model, dense_checkpoint):
    with pytest.raises(UnsupportedModelError, match=r"pp=3 puts DeepStack layer\(s\) \[2\].*use pp <= 2"):
        engine_model.Qwen3VLForCausalLM(_engine_config(dense_checkpoint, pp_size=3, pp_rank=1))


def test_lora_is_refused(engine_model, dense_checkpoint):
    model = engine_model.Qwen3VLForCausalLM(_engine_config(dense_checkpoint))
    inputs = _bind(model.prepare_inputs(use_cache=False), {"input_ids": torch.tensor([1])})
    with pytest.raises(UnsupportedModelError, match="lora_plugin"):
        model.forward(**inputs, lora_params=SimpleNamespace())
