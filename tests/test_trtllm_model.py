"""The DeepStack wiring of the TensorRT-LLM engine model, traced over a stand-in for TensorRT-LLM.

TensorRT-LLM cannot be installed on CPU machines, so this runs trtllm_model.py against a minimal
stand-in package: graph ops as torch ops, QWen classes whose decoder layers are identities and
whose embedding is zero. What remains is exactly our code: which layers add a feature, which table
row each visual position gets (fake ids, task offsets), and that text positions are untouched. The
real classes' behaviour is verified on GPU hosts only.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from types import SimpleNamespace

import pytest
import torch
from qwen3vl_trt.llm import engine_model as trtllm_model
from qwen3vl_trt.llm import inputs as llm_inputs


def _stand_in() -> dict[str, types.ModuleType]:
    functional = types.ModuleType("tensorrt_llm.functional")
    functional.Tensor = torch.Tensor
    functional.embedding = lambda idx, table: table[idx]
    functional.where = lambda c, a, b: torch.where(c, a, torch.as_tensor(b))
    functional.expand = lambda t, shape: t.expand(shape)
    functional.shape = lambda t: t.shape
    functional.unsqueeze = lambda t, d: t.unsqueeze(d)

    class DecoderLayerList(list):
        def __init__(self, cls, config):
            super().__init__(cls(config, i) for i in range(config.num_hidden_layers))

    class QWenDecoderLayer:
        def __init__(self, config, layer_idx):
            self.layer_idx = layer_idx

        def forward(self, hidden_states, use_cache=False, **kwargs):
            return (hidden_states, f"kv{self.layer_idx}") if use_cache else hidden_states

    class QWenModel:
        def __init__(self, config):
            self.config = config
            self.layers = DecoderLayerList(QWenDecoderLayer, config)

        def forward(self, input_ids, use_cache=False, prompt_embedding_table=None, **kwargs):
            hidden = torch.zeros(input_ids.shape[0], self.config.hidden_size)
            presents = []
            for layer in self.layers:
                out = layer.forward(hidden, use_cache=use_cache)
                hidden = out[0] if use_cache else out
                presents += [out[1]] if use_cache else []
            return (hidden, presents) if use_cache else hidden

    class QWenForCausalLM:
        def __init__(self, config):
            self.config = config
            self.transformer = QWenModel(config)

        def prepare_inputs(self, **kwargs):
            return kwargs

    modeling_utils = types.ModuleType("tensorrt_llm.models.modeling_utils")
    modeling_utils.DecoderLayerList = DecoderLayerList
    qwen_model = types.ModuleType("tensorrt_llm.models.qwen.model")
    qwen_model.QWenDecoderLayer, qwen_model.QWenModel, qwen_model.QWenForCausalLM = (
        QWenDecoderLayer,
        QWenModel,
        QWenForCausalLM,
    )
    return {
        "tensorrt_llm": types.ModuleType("tensorrt_llm"),
        "tensorrt_llm.functional": functional,
        "tensorrt_llm.models": types.ModuleType("tensorrt_llm.models"),
        "tensorrt_llm.models.modeling_utils": modeling_utils,
        "tensorrt_llm.models.qwen": types.ModuleType("tensorrt_llm.models.qwen"),
        "tensorrt_llm.models.qwen.model": qwen_model,
    }


@pytest.fixture
def engine_model(monkeypatch):
    """A private copy of trtllm_model.py loaded by path over the stand-in (the package's own
    module keeps seeing the real, absent TensorRT-LLM)."""
    for name, module in _stand_in().items():
        monkeypatch.setitem(sys.modules, name, module)
    spec = importlib.util.spec_from_file_location("stand_in_trtllm_model", trtllm_model.__file__)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.TRTLLM_IMPORT_ERROR is None
    return module


@pytest.mark.parametrize("use_cache", [False, True])
def test_deepstack_rows_are_added_after_the_first_k_layers(engine_model, use_cache):
    vocab, k, d, m = 50, 3, 4, 3
    config = SimpleNamespace(
        vocab_size=vocab,
        hidden_size=d,
        num_hidden_layers=5,
        qwen3_vl={"deepstack_count": k},
        max_position_embeddings=64,
        rotary_embedding_dim=8,
    )
    model = engine_model.Qwen3VLForCausalLM(config)
    assert [layer.deepstack for layer in model.transformer.layers] == [True, True, True, False, False]
    ids = torch.tensor([3, 9, 151655, 151655, 7, 151655])
    fake = torch.from_numpy(llm_inputs.fake_prompt_ids(ids.numpy(), 151655, vocab, k)).long()
    image, deepstack = torch.randn(m, d), torch.randn(k, m, d)
    table = llm_inputs.interleave_prompt_table(image, deepstack)
    task_rows = table.shape[0]
    # Two tasks' tables back to back; this request is task 1, as the runtime's per-request offset.
    tables = torch.cat([torch.full_like(table, 1e3), table])
    tasks = torch.ones_like(fake)
    out = model.transformer.forward(
        fake,
        use_cache=use_cache,
        prompt_embedding_table=tables,
        prompt_tasks=tasks,
        prompt_vocab_size=torch.tensor([task_rows]),
    )
    hidden = out[0] if use_cache else out
    if use_cache:
        assert out[1] == [f"kv{i}" for i in range(5)]
    visual = fake >= vocab
    assert torch.equal(hidden[~visual], torch.zeros(int((~visual).sum()), d))  # text positions untouched
    assert torch.allclose(hidden[visual], deepstack.sum(0))  # zero embedding + the K features, in order
    assert all(layer.visual is None for layer in model.transformer.layers)  # nothing kept past the trace
    assert model.prepare_inputs(max_batch_size=1)["mrope_rotary_cos_sin_size"] == 64 * 8
