"""The Qwen3-VL language model for TensorRT-LLM 1.2.1's engine flow (trtllm-build).

Extends `tensorrt_llm/models/qwen/model.py` (QWenForCausalLM, QWenModel, QWenDecoderLayer) with
qwen_type qwen3 / qwen3_moe, which already gives the q/k RMSNorm, GQA and MoE layers. Two additions:

- DeepStack: after decoder layer j < K, each visual position gets row
  `prompt_table_row(id, vocab_size, j)` of the request's prompt-embedding table added to its hidden
  state, with the same masking and task offsets as the stock lookup (`layers/embedding.py`,
  PromptTuningEmbedding.forward), which already put row `prompt_table_row(id, vocab_size)` there.
  The tensorrtllm backend's C++ executor passes the table unchanged, so no new engine inputs.
- MRoPE: the engine declares `mrope_rotary_cos_sin` / `mrope_position_deltas`
  (`generation_mixin.prepare_basic_inputs`), which TensorRT-LLM's builder only requests for the
  Qwen2-VL architecture names; the host builds the table (llm_inputs.engine_mrope_rotary_cos_sin)
  with Qwen3-VL's interleaved sections, so the attention plugin's mrope path applies it as is.

The module imports without TensorRT-LLM (the class is then absent and `TRTLLM_IMPORT_ERROR` says
why); `qwen3vl-trt build-llm-engine` loads it in the trtllm-build process. Imports are absolute
because trtllm-build may load this file by path.
"""

from __future__ import annotations

from typing import Any

from qwen3vl_trt.llm.checkpoint_format import ARCHITECTURE
from qwen3vl_trt.llm.inputs import prompt_table_row

__all__ = ["ARCHITECTURE", "TRTLLM_IMPORT_ERROR", "prompt_table_row"]

TRTLLM_IMPORT_ERROR: str | None = None
try:
    from tensorrt_llm.functional import Tensor, embedding, expand, shape, unsqueeze, where
    from tensorrt_llm.models.modeling_utils import DecoderLayerList
    from tensorrt_llm.models.qwen.model import QWenDecoderLayer, QWenForCausalLM, QWenModel
except ImportError as e:  # CPU machines: the reference runtime stands in for the engine
    TRTLLM_IMPORT_ERROR = f"{type(e).__name__}: {e}"
else:
    __all__ += ["Qwen3VLDecoderLayer", "Qwen3VLModel", "Qwen3VLForCausalLM"]

    class _VisualTokens:
        """The prompt-table inputs of the graph being built, as the stock lookup receives them."""

        def __init__(self, input_ids: Tensor, table: Tensor, tasks: Tensor, task_vocab_size: Tensor, vocab_size: int):
            self.input_ids, self.table, self.vocab_size = input_ids, table, vocab_size
            # Same test as PromptTuningEmbedding ("do not use >=": it runs on floating point inside).
            self.mask = input_ids > (vocab_size - 1)
            self.task_offset = tasks * task_vocab_size

        def add_feature(self, hidden_states: Tensor, layer: int) -> Tensor:
            rows = where(self.mask, prompt_table_row(self.input_ids, self.vocab_size, layer), 0)
            rows = rows + expand(self.task_offset, shape(rows))
            feature = embedding(rows, self.table)
            return where(unsqueeze(self.mask, -1), hidden_states + feature, hidden_states)

    class Qwen3VLDecoderLayer(QWenDecoderLayer):
        """A Qwen3 decoder layer that adds its DeepStack feature to its output at visual positions."""

        def __init__(self, config: Any, layer_idx: int):
            super().__init__(config, layer_idx)
            self.global_layer_idx = layer_idx  # DecoderLayerList passes the global index
            self.deepstack = layer_idx < config.qwen3_vl["deepstack_count"]
            self.visual: _VisualTokens | None = None  # set by Qwen3VLModel.forward while the graph is built

        def forward(self, hidden_states: Tensor, *args: Any, use_cache: bool = False, **kwargs: Any) -> Any:
            out = super().forward(hidden_states, *args, use_cache=use_cache, **kwargs)
            if not self.deepstack or self.visual is None:
                return out
            if use_cache:
                hidden, presents = out
                return self.visual.add_feature(hidden, self.global_layer_idx), presents
            return self.visual.add_feature(out, self.global_layer_idx)

    class Qwen3VLModel(QWenModel):
        def __init__(self, config: Any):
            super().__init__(config)
            self.layers = DecoderLayerList(Qwen3VLDecoderLayer, config)
            self.text_vocab_size = config.vocab_size

        def forward(self, input_ids: Tensor, *args: Any, **kwargs: Any) -> Any:
            table = kwargs.get("prompt_embedding_table")
            visual = None
            if table is not None:
                visual = _VisualTokens(
                    input_ids, table, kwargs["prompt_tasks"], kwargs["prompt_vocab_size"], self.text_vocab_size
                )
            for layer in self.layers:
                layer.visual = visual
            try:
                return super().forward(input_ids, *args, **kwargs)
            finally:
                for layer in self.layers:
                    layer.visual = None

    class Qwen3VLForCausalLM(QWenForCausalLM):
        """`architecture` Qwen3VLForCausalLM in checkpoints written by `qwen3vl-trt convert-llm`."""

        def __init__(self, config: Any):
            super().__init__(config)
            self.transformer = Qwen3VLModel(config)

        def prepare_inputs(self, *args: Any, **kwargs: Any) -> Any:
            # Per request: max_position_embeddings x rotary_dim float32 (cos, sin) pairs.
            kwargs["mrope_rotary_cos_sin_size"] = self.config.max_position_embeddings * self.config.rotary_embedding_dim
            return super().prepare_inputs(*args, **kwargs)
