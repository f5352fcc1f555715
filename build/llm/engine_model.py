"""The Qwen3-VL language model for TensorRT-LLM 1.2.1's engine flow (trtllm-build).

Extends `tensorrt_llm/models/qwen/model.py` (QWenForCausalLM, QWenModel, QWenDecoderLayer) with
qwen_type qwen3 / qwen3_moe, which already gives the q/k RMSNorm, GQA and MoE layers. What it adds:

- DeepStack: Qwen3VLModel.forward is QWenModel.forward with the decoder loop written out (the way
  vLLM's qwen3_vl model loops over its layers): after decoder layer j < K, each visual position gets
  row `prompt_table_row(id, vocab_size, j)` of the request's prompt-embedding table added to its
  hidden state, with the masking and task offsets of the stock lookup (`layers/embedding.py`,
  PromptTuningEmbedding.forward), which already put row `prompt_table_row(id, vocab_size)` there.
  The tensorrtllm backend's C++ executor passes the table unchanged, so no new engine inputs.
  Only the first pipeline stage has `input_ids` (later stages get `hidden_states_input`:
  `models/generation_mixin.py`, prepare_basic_inputs), so DeepStack is added there only, and the
  split must keep all K DeepStack layers on that stage (checkpoint_format.check_deepstack_stage).
- q/k RMSNorm epsilon: QWenDecoderLayer builds `Attention(qk_layernorm=True)` without an eps, so
  its q/k norms get Attention's default 1e-5 (`layers/attention.py`); the checkpoint's
  norm_epsilon (transformers' rms_norm_eps, 1e-6 on released models) is set on them here.
- MRoPE: the engine declares `mrope_rotary_cos_sin` / `mrope_position_deltas`
  (`generation_mixin.prepare_basic_inputs`), which TensorRT-LLM's builder requests for the Qwen2-VL
  architecture names only (`builder.py`, build); the host builds the table
  (llm.inputs.engine_mrope_rotary_cos_sin) with Qwen3-VL's interleaved sections, so the attention
  plugin's mrope path applies it as is.
- Weight-only checkpoints (quant_algo W8A16 / W4A16) store int8 values in the layout upstream's quantizer
  makes before its SM-specific step (llm/weight_only.py); from_checkpoint's `preprocess_weights_hook`
  (`models/modeling_utils.py`, PretrainedModel.from_checkpoint: it runs before preprocess_weights, which
  leaves int8 weights as they are) applies that step, `preprocess_weights_for_mixed_gemm`
  (`quantization/functional.py`) for this GPU, to each quantized weight. The builder then turns on the
  weight-only GEMM plugin itself (`builder.py`, build, unless disable_weight_only_quant_plugin).

The module imports without TensorRT-LLM (the classes are then absent and `TRTLLM_IMPORT_ERROR` says
why); engine_build's launcher passes Qwen3VLForCausalLM to TensorRT-LLM's parallel_build. Imports
are absolute so that the module also loads by path.
"""

from __future__ import annotations

import copy
from typing import Any

from qwen3vl_trt.errors import UnsupportedModelError
from qwen3vl_trt.llm.checkpoint_format import ARCHITECTURE, ParallelLayout, check_deepstack_stage, read_trtllm_config
from qwen3vl_trt.llm.inputs import prompt_table_row
from qwen3vl_trt.llm.weight_only import QUANT_ALGO_SCHEMES, SCALE_NAME

__all__ = ["ARCHITECTURE", "TRTLLM_IMPORT_ERROR", "prompt_table_row"]

TRTLLM_IMPORT_ERROR: str | None = None
try:
    from tensorrt_llm.functional import Tensor, embedding, expand, recv, send, shape, unsqueeze, where
    from tensorrt_llm.models.qwen.model import QWenForCausalLM, QWenModel
except ImportError as e:  # CPU machines: the reference runtime stands in for the engine
    TRTLLM_IMPORT_ERROR = f"{type(e).__name__}: {e}"
else:
    __all__ += ["Qwen3VLModel", "Qwen3VLForCausalLM"]

    class _VisualTokens:
        """The prompt-table inputs of one graph, as the stock lookup receives them."""

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

    class Qwen3VLModel(QWenModel):
        def __init__(self, config: Any):
            super().__init__(config)
            self.text_vocab_size = config.vocab_size
            self.deepstack_count = config.qwen3_vl["deepstack_count"]
            mapping = ParallelLayout(config.mapping.tp_size, config.mapping.pp_size)
            check_deepstack_stage(config.num_hidden_layers, self.deepstack_count, mapping)
            for layer in self.layers:
                layer.attention.q_layernorm.eps = config.norm_epsilon
                layer.attention.k_layernorm.eps = config.norm_epsilon

        def forward(
            self,
            input_ids: Tensor | None,
            position_ids: Tensor | None = None,
            use_cache: bool = False,
            spec_decoding_params: Any = None,
            attention_mask: Tensor | None = None,
            kv_cache_params: Any = None,
            attention_params: Any = None,
            mrope_params: Any = None,
            hidden_states: Tensor | None = None,
            prompt_embedding_table: Tensor | None = None,
            prompt_tasks: Tensor | None = None,
            prompt_vocab_size: Tensor | None = None,
            lora_params: Any = None,
        ) -> Any:
            if lora_params is not None:
                raise UnsupportedModelError("the Qwen3-VL engine model has no LoRA support; build without lora_plugin")
            visual = None
            if not self.mapping.is_first_pp_rank():
                hidden_states = recv(hidden_states, self.mapping.prev_pp_rank())
            elif prompt_embedding_table is None:
                hidden_states = self.vocab_embedding(input_ids)
            else:
                ptuning = (prompt_embedding_table, prompt_tasks, prompt_vocab_size)
                hidden_states = self.vocab_embedding(input_ids, *ptuning)
                visual = _VisualTokens(input_ids, *ptuning, self.text_vocab_size)

            kv_cache_params.fill_none_tensor_list(len(self.layers))
            presents = []
            for layer, past in zip(self.layers, kv_cache_params.past_key_value, strict=True):
                layer_cache = copy.copy(kv_cache_params)  # as DecoderLayerList.forward: this layer's past only
                layer_cache.past_key_value = [past]
                out = layer(
                    hidden_states,
                    use_cache=use_cache,
                    attention_mask=attention_mask,
                    kv_cache_params=layer_cache,
                    attention_params=attention_params,
                    spec_decoding_params=spec_decoding_params,
                    mrope_params=mrope_params,
                )
                if use_cache:
                    out, present = out
                    presents.append(present)
                hidden_states = out
                if visual is not None and layer.layer_idx < self.deepstack_count:
                    hidden_states = visual.add_feature(hidden_states, layer.layer_idx)

            if self.mapping.is_last_pp_rank():
                hidden_states = self.ln_f(hidden_states)
            else:
                hidden_states = send(hidden_states, self.mapping.next_pp_rank())
            return (hidden_states, tuple(presents)) if use_cache else hidden_states

    class Qwen3VLForCausalLM(QWenForCausalLM):
        """`architecture` Qwen3VLForCausalLM in checkpoints written by `qwen3vl-trt convert-llm`."""

        def __init__(self, config: Any):
            super().__init__(config)
            # QWenForCausalLM builds its QWenModel itself; ours replaces it before weights are loaded.
            self.transformer = Qwen3VLModel(config)

        @classmethod
        def from_checkpoint(
            cls, ckpt_dir: str, rank: int | None = None, config: Any = None, *, preprocess_weights_hook: Any = None
        ) -> Any:
            if config is None:  # upstream reads config.json through MODEL_MAP, which lacks our architecture
                config = cls.config_class(**read_trtllm_config(ckpt_dir)[0])
            quant_algo = config.quantization.quant_algo
            hook = preprocess_weights_hook
            if quant_algo in QUANT_ALGO_SCHEMES:
                hook = _cutlass_layout(quant_algo, config.dtype, preprocess_weights_hook)
            return super().from_checkpoint(ckpt_dir, rank, config, preprocess_weights_hook=hook)

        def prepare_inputs(self, *args: Any, **kwargs: Any) -> Any:
            # Per request: max_position_embeddings x rotary_dim float32 (cos, sin) pairs.
            kwargs["mrope_rotary_cos_sin_size"] = self.config.max_position_embeddings * self.config.rotary_embedding_dim
            return super().prepare_inputs(*args, **kwargs)

    def _cutlass_layout(quant_algo: str, dtype: str, then: Any) -> Any:
        """A preprocess_weights_hook giving each stored weight-only weight (an int8 `weight` beside its
        `per_channel_scale`) the CUTLASS mixed-GEMM layout of this GPU, after the hook it was given."""
        import torch
        from tensorrt_llm._utils import str_dtype_to_torch
        from tensorrt_llm.quantization.functional import preprocess_weights_for_mixed_gemm

        kind = torch.int8 if QUANT_ALGO_SCHEMES[quant_algo].bits == 8 else torch.quint4x2

        def hook(weights: dict) -> dict:
            if then is not None:
                weights = then(weights)
            for name in [n for n in weights if n.endswith(".weight")]:
                if weights[name].dtype == torch.int8 and name.removesuffix("weight") + SCALE_NAME in weights:
                    weights[name] = preprocess_weights_for_mixed_gemm(weights[name], kind, str_dtype_to_torch(dtype))
            return weights

        return hook
