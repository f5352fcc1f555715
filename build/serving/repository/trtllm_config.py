"""The GPU target's `llm` model: TensorRT-LLM's tensorrtllm Triton backend over the LLM engine.

Every choice below comes from TensorRT-LLM's `triton_backend/` on the 1.2 release line that 1.2.1
belongs to (read at NVIDIA/TensorRT-LLM commit 0c8de69a, tensorrt_llm/version.py 1.2.0rc8):

- inflight_batcher_llm/src/model_state.cc, GetParameter<std::string>: every parameter is a string;
  a missing key throws. model_instance_state.cc catches that for most keys and falls back to a
  default, but reads gpt_model_type (getBatchingTypeFromParams) and tokenizer_dir,
  xgrammar_tokenizer_info_path and guided_decoding_backend (getGuidedDecodingConfigFromParams)
  outside any try: without them the model does not load. gpt_model_path falls back to "", which
  then fails the "Both encoder and decoder model paths are empty" check for a decoder-only engine.
- Guided decoding is off when guided_decoding_backend or xgrammar_tokenizer_info_path is empty; it is on, with
  xgrammar over the converted checkpoint's tokenizer info (guided_decoding.py says what reads it and how).
  tokenizer_dir is only logged as unused by the C++ flow, so it carries the checkpoint directory.
- normalize_log_probs: read with GetParameter<bool>, default true (model_instance_state.cc).
- Booleans parse from true/false/1/0 (GetParameter<bool>); enable_kv_cache_reuse defaults to true,
  enable_chunked_context to false (getKvCacheConfigFromParams, getExecutorConfigFromParams). Both are
  written from the engine's build_config.plugin_config.use_paged_context_fmha (gpu_memory.LLMEngineBuild),
  which fp32 engines lack (llm.engine_build): block reuse without it is switched off with a warning
  (cpp/tensorrt_llm/batch_manager/trtGptModelInflightBatching.cpp fixExecutorConfig, applied by
  trtGptModelFactory.h; 1.2 line at b35ac1b6, 1.2.0rc2), chunked context without it stops the load
  ("Chunked context requires context FMHA, paged kv_cache and paged context FMHA", same constructor).
  Chunked context lets a prompt longer than the engine's max_num_tokens (up to max_input_len) be
  prefilled in chunks; without it a context longer than max_num_tokens fails the request
  (microBatchScheduler.cpp: "The number of context tokens (%d) exceeds the limit value (%d)").
  Engines without context FMHA need no chunks: trtllm-build raises their max_num_tokens to
  max_input_len (tensorrt_llm/_common.py check_max_num_tokens).
  Reuse is safe here because preprocessing sends one prompt_table_extra_ids value per prompt token
  (contracts.PROMPT_TABLE_EXTRA_IDS); utils.cc getPromptTuningConfigFromTensors drops the extra ids
  silently unless their count equals the input length.
- Prompt-table offloading: the backend reads no key for it and builds its ExecutorConfig without
  it (getExecutorConfigFromParams), so it keeps ExecutorConfig's default, false
  (cpp/include/tensorrt_llm/executor/executor.h): there is nothing to set.
- all_models/inflight_batcher_llm/tensorrt_llm/config.pbtxt: input names, types, dims, the
  `reshape: { shape: [ ] }` of per-request scalars and allow_ragged_batch; instance_group KIND_CPU
  count 1 (the backend places the engine on its devices itself, gpu_device_ids).
- gpu_device_ids (model_state.cc LoadParameters): `;` separates model instances, `,` the devices of
  one instance's ranks; ModelInstanceState hands instance i its list (i modulo their count) as the
  executor's ParallelConfig device ids, and rank r runs on ids[r % len(ids)]. Without the key the
  executor's WorldConfig takes 0 .. gpus_per_node - 1, so rank r runs on GPU r (executorImpl.cpp
  loadModel at 036a60f7; runtime/worldConfig.cpp and worldConfig.h getDevice).
- exclude_input_in_output: the request input of that name overrides the parameter whenever it is sent
  (utils.cc: "If specified in request, set from request"), and preprocessing always sends it (the client's
  value, default false), so no parameter is written.
- Outputs: fillTritonResponse throws unless output_ids and sequence_length are both requested, so a
  caller (the ensemble) must ask for both.
- utils.cc getMropeConfigFromTensors uses mrope inputs only when both are sent, and reads the INT64
  mrope_position_deltas as an int32 (the low half on little-endian hosts; deltas fit).
- utils.cc createRequestsFromInputTensors: more than one request per execute and streaming both
  need the decoupled transaction policy; `streaming` is read from CPU memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from tritonclient.grpc import model_config_pb2 as mc

from ...common.limits import EngineLimits
from ...errors import LimitsError, Qwen3VLTrtError, UnsupportedModelError
from .. import interface
from ..request import GUIDE_TEXT, GUIDE_TYPE
from ..tensors import Tensor
from .model_config import MODEL_DATA_TYPES, instance_group, model_input, model_output, parameters

BACKEND = "tensorrtllm"

_SOURCE = "triton_backend/inflight_batcher_llm/src/model_instance_state.cc"
# Keys whose absence stops the model from loading: (key, where the backend reads it).
REQUIRED_PARAMETERS: tuple[tuple[str, str], ...] = (
    ("gpt_model_type", f"{_SOURCE}: getBatchingTypeFromParams"),
    ("gpt_model_path", f"{_SOURCE}: ModelInstanceState::ModelInstanceState"),
    ("tokenizer_dir", f"{_SOURCE}: getGuidedDecodingConfigFromParams"),
    ("xgrammar_tokenizer_info_path", f"{_SOURCE}: getGuidedDecodingConfigFromParams"),
    ("guided_decoding_backend", f"{_SOURCE}: getGuidedDecodingConfigFromParams"),
)

# getSchedulerConfigFromParams: anything else logs a warning and means guaranteed_no_evict.
BATCH_SCHEDULER_POLICIES = ("guaranteed_no_evict", "max_utilization")

# Inputs the upstream tensorrt_llm config.pbtxt declares with allow_ragged_batch.
_RAGGED = frozenset(
    t.name
    for t in (
        interface.INPUT_IDS,
        interface.STOP_WORDS_LIST,
        interface.BAD_WORDS_LIST,
        interface.PROMPT_TABLE,
        interface.EXTRA_IDS,
        interface.EMBEDDING_BIAS,
        GUIDE_TYPE,
        GUIDE_TEXT,
    )
)


def _input(tensor: Tensor, model_data_type: str) -> mc.ModelInput:
    spec = model_input(tensor, model_data_type, ragged=tensor.name in _RAGGED)
    if tensor.scalar:
        spec.reshape.SetInParent()  # reshape { shape: [] }: the backend takes per-request scalars unbatched
    return spec


def tensorrt_llm_model_config(
    engine_dir: Path,
    limits: EngineLimits,
    model_data_type: str,
    tokenizer_dir: Path,
    tokenizer_info: Path,
    max_queue_delay_us: int,
    paged_context_fmha: bool,
    kv_cache_free_gpu_mem_fraction: float = 0.9,
    rank_gpus: Sequence[int] = (),
    batch_scheduler_policy: str = "guaranteed_no_evict",
) -> mc.ModelConfig:
    """The `llm` model for the tensorrtllm backend. model_data_type: the LLM's Triton dtype (FP16,
    BF16, FP32), the prompt table's. rank_gpus: rank r's GPU at [r], the one instance's gpu_device_ids;
    empty lets the backend choose (rank r on GPU r). paged_context_fmha: the engine's
    (gpu_memory.LLMEngineBuild), which KV-cache reuse and chunked context need. tokenizer_info: the
    xgrammar tokenizer info file guided decoding reads (llm.checkpoint_format.TOKENIZER_INFO_FILE).
    Paths are written absolute: the backend resolves them against tritonserver's working directory."""
    if model_data_type not in MODEL_DATA_TYPES.values():
        raise UnsupportedModelError(
            f"LLM data type {model_data_type!r} has no TensorRT-LLM prompt table type; "
            f"expected one of {', '.join(sorted(MODEL_DATA_TYPES.values()))}"
        )
    if not 0.0 < kv_cache_free_gpu_mem_fraction <= 1.0:
        raise LimitsError(f"kv_cache_free_gpu_mem_fraction must be in (0, 1], got {kv_cache_free_gpu_mem_fraction!r}")
    if isinstance(max_queue_delay_us, bool) or not isinstance(max_queue_delay_us, int) or max_queue_delay_us < 0:
        raise LimitsError(f"max_queue_delay_us must be a non-negative integer, got {max_queue_delay_us!r}")
    if batch_scheduler_policy not in BATCH_SCHEDULER_POLICIES:
        raise Qwen3VLTrtError(
            f"batch_scheduler_policy {batch_scheduler_policy!r} is not one of {', '.join(BATCH_SCHEDULER_POLICIES)}"
        )
    gpus = list(rank_gpus)
    if any(isinstance(g, bool) or not isinstance(g, int) or g < 0 for g in gpus) or len(set(gpus)) != len(gpus):
        raise Qwen3VLTrtError(f"rank_gpus must be distinct non-negative device ids, got {gpus!r}")

    config = mc.ModelConfig(name=interface.LLM, backend=BACKEND, max_batch_size=limits.max_batch_size)
    config.model_transaction_policy.decoupled = True
    config.dynamic_batching.SetInParent()
    config.dynamic_batching.max_queue_delay_microseconds = max_queue_delay_us
    config.input.extend(_input(t, model_data_type) for t in interface.LLM_INPUTS)
    config.output.extend(model_output(t) for t in interface.LLM_OUTPUTS)
    config.instance_group.append(instance_group("CPU"))
    values: dict[str, object] = {
        "gpt_model_type": "inflight_fused_batching",
        "gpt_model_path": engine_dir.absolute(),
        "tokenizer_dir": tokenizer_dir.absolute(),
        "guided_decoding_backend": "xgrammar",
        "xgrammar_tokenizer_info_path": tokenizer_info.absolute(),
        # Each token's log probability over the whole vocabulary (after the penalties and the temperature), as the
        # reference runtime and OpenAI's logprobs give it; the backend's default renormalizes over the top-k
        # candidates, which makes every greedy token's 0 (tensorrtllm_backend#276; samplingTopKKernels.cu).
        "normalize_log_probs": False,
        "kv_cache_free_gpu_mem_fraction": kv_cache_free_gpu_mem_fraction,
        "enable_kv_cache_reuse": paged_context_fmha,
        "enable_chunked_context": paged_context_fmha,
        "batch_scheduler_policy": batch_scheduler_policy,
        "max_beam_width": 1,
        "FORCE_CPU_ONLY_INPUT_TENSORS": "no",
    }
    if gpus:
        values["gpu_device_ids"] = ",".join(map(str, gpus))
    parameters(config, values)
    return config
