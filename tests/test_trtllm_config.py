"""The GPU target's `llm` config against what TensorRT-LLM's tensorrtllm backend reads.

The tables below are written down from TensorRT-LLM's triton_backend on the 1.2 release line
(NVIDIA/TensorRT-LLM commit 0c8de69a, tensorrt_llm/version.py 1.2.0rc8), independently of the module
under test, so a change on either side shows up here.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from qwen3vl_trt.common.contracts import LLM_INPUTS, MROPE_POSITION_DELTAS, VISION_INPUTS
from qwen3vl_trt.common.limits import EngineLimits
from qwen3vl_trt.errors import LimitsError, Qwen3VLTrtError, UnsupportedModelError
from qwen3vl_trt.serving import interface
from qwen3vl_trt.serving.repository.model_config import parse, to_text
from qwen3vl_trt.serving.repository.trtllm_config import REQUIRED_PARAMETERS, tensorrt_llm_model_config
from qwen3vl_trt.serving.request import REQUEST_INPUTS
from qwen3vl_trt.serving.tensors import TRITON_DATA_TYPES
from tritonclient.grpc import model_config_pb2 as mc

# Config generation runs again at the GPU image's tritonclient and protobuf (build/gpu_image.py).
pytestmark = pytest.mark.gpu_image

INSTANCE = "triton_backend/inflight_batcher_llm/src/model_instance_state.cc"
CONFIG = "triton_backend/all_models/inflight_batcher_llm/tensorrt_llm/config.pbtxt"

# Parameters the backend cannot load without: ModelState::GetParameter<std::string> throws "Cannot find
# parameter with name" (model_state.cc), and these reads are outside any try.
NO_FALLBACK = {
    "gpt_model_type": f"{INSTANCE} getBatchingTypeFromParams",
    "tokenizer_dir": f"{INSTANCE} getGuidedDecodingConfigFromParams",
    "xgrammar_tokenizer_info_path": f"{INSTANCE} getGuidedDecodingConfigFromParams",
    "guided_decoding_backend": f"{INSTANCE} getGuidedDecodingConfigFromParams",
    # read in a try that falls back to "", then TLLM_CHECK "Both encoder and decoder model paths are empty"
    "gpt_model_path": f"{INSTANCE} ModelInstanceState::ModelInstanceState",
}
GPT_MODEL_TYPES = {"V1", "v1", "inflight_batching", "inflight_fused_batching"}  # else: throws
BATCH_SCHEDULER_POLICIES = {"max_utilization", "guaranteed_no_evict"}  # getSchedulerConfigFromParams
TRUE = {"True", "true", "TRUE", "1"}  # ModelState::GetParameter<bool>
FALSE = {"False", "false", "FALSE", "0"}

# Upstream inputs, config.pbtxt: name -> (data_type, dims, reshape to [], optional, allow_ragged_batch).
# "MODEL" is ${prompt_embedding_table_data_type}: the engine's dtype.
UPSTREAM_INPUTS = {
    "input_ids": ("TYPE_INT32", [-1], False, True, True),
    "input_lengths": ("TYPE_INT32", [1], True, False, False),
    "request_output_len": ("TYPE_INT32", [1], True, False, False),
    "end_id": ("TYPE_INT32", [1], True, True, False),
    "pad_id": ("TYPE_INT32", [1], True, True, False),
    "stop_words_list": ("TYPE_INT32", [2, -1], False, True, True),
    "bad_words_list": ("TYPE_INT32", [2, -1], False, True, True),
    "temperature": ("TYPE_FP32", [1], True, True, False),
    "runtime_top_k": ("TYPE_INT32", [1], True, True, False),
    "runtime_top_p": ("TYPE_FP32", [1], True, True, False),
    "min_tokens": ("TYPE_INT32", [1], True, True, False),
    "seed": ("TYPE_UINT64", [1], True, True, False),
    "exclude_input_in_output": ("TYPE_BOOL", [1], True, True, False),
    "streaming": ("TYPE_BOOL", [1], True, True, False),
    "presence_penalty": ("TYPE_FP32", [1], True, True, False),
    "frequency_penalty": ("TYPE_FP32", [1], True, True, False),
    "repetition_penalty": ("TYPE_FP32", [1], True, True, False),
    "return_log_probs": ("TYPE_BOOL", [1], True, True, False),
    "return_generation_logits": ("TYPE_BOOL", [1], True, True, False),
    "embedding_bias": ("TYPE_FP32", [-1], False, True, True),
    "guided_decoding_guide_type": ("TYPE_STRING", [1], False, True, True),
    "guided_decoding_guide": ("TYPE_STRING", [1], False, True, True),
    "stop": ("TYPE_BOOL", [1], True, True, False),
    "prompt_embedding_table": ("MODEL", [-1, -1], False, True, True),
    "prompt_table_extra_ids": ("TYPE_UINT64", [-1], False, True, True),
    "mrope_rotary_cos_sin": ("TYPE_FP32", [-1], False, True, False),
    "mrope_position_deltas": ("TYPE_INT64", [1], False, True, False),
}
# fillTritonResponse (model_instance_state.cc) throws unless both are requested.
UPSTREAM_OUTPUTS = {
    "output_ids": ("TYPE_INT32", [-1, -1]),
    "sequence_length": ("TYPE_INT32", [-1]),
    "output_log_probs": ("TYPE_FP32", [-1, -1]),
    # ${logits_datatype}: the engine's logits dtype, float32 as convert-llm writes logits_dtype (model_state.cc checks
    # a response's logits against it).
    "generation_logits": ("TYPE_FP32", [-1, -1, -1]),
}


def _config(tmp_path: Path, model_data_type: str = "BF16", paged_context_fmha: bool = True, **kwargs) -> mc.ModelConfig:
    limits = EngineLimits(max_batch_size=4)
    engine = tmp_path / "engine"
    return tensorrt_llm_model_config(
        engine, limits, model_data_type, tmp_path / "hf", tmp_path / "info.json", 500, paged_context_fmha, **kwargs
    )


def _params(config: mc.ModelConfig) -> dict[str, str]:
    return {key: value.string_value for key, value in config.parameters.items()}


def test_round_trips_through_text_format(tmp_path):
    config = _config(tmp_path)
    assert parse(to_text(config)) == config
    assert config.name == interface.LLM and config.backend == "tensorrtllm" and config.max_batch_size == 4


def test_parameters_the_backend_cannot_load_without(tmp_path):
    params = _params(_config(tmp_path))
    assert NO_FALLBACK.keys() <= params.keys()
    assert {key for key, _ in REQUIRED_PARAMETERS} == NO_FALLBACK.keys()
    assert params["gpt_model_type"] == "inflight_fused_batching" and params["gpt_model_type"] in GPT_MODEL_TYPES
    assert params["gpt_model_path"] == str((tmp_path / "engine").absolute())
    assert params["tokenizer_dir"] == str((tmp_path / "hf").absolute())
    # Guided decoding is on with both set (getGuidedDecodingConfigFromParams; "xgrammar" is the backend's name).
    assert params["guided_decoding_backend"] == "xgrammar"
    assert params["xgrammar_tokenizer_info_path"] == str((tmp_path / "info.json").absolute())
    # Log probabilities over the whole vocabulary, not renormalized over the top-k (GetParameter<bool>).
    assert params["normalize_log_probs"] in FALSE


def test_parameters_with_fallbacks_are_set_to_values_that_parse(tmp_path):
    params = _params(_config(tmp_path, kv_cache_free_gpu_mem_fraction=0.85))
    assert params["enable_kv_cache_reuse"] in TRUE  # safe: one extra id per prompt token (test_extra_ids.py)
    assert params["enable_chunked_context"] in TRUE
    # The request input overrides this parameter whenever sent (utils.cc), and preprocessing always sends it.
    assert "exclude_input_in_output" not in params
    assert interface.EXCLUDE_INPUT in interface.LLM_REQUEST
    assert params["batch_scheduler_policy"] in BATCH_SCHEDULER_POLICIES
    assert float(params["kv_cache_free_gpu_mem_fraction"]) == 0.85
    assert int(params["max_beam_width"]) == 1
    assert params["FORCE_CPU_ONLY_INPUT_TENSORS"] == "no"
    assert "gpu_device_ids" not in params  # the backend chooses (model_state.cc LoadParameters)
    assert _params(_config(tmp_path, rank_gpus=[2, 3]))["gpu_device_ids"] == "2,3"


def test_reuse_and_chunked_context_follow_the_engine_paged_context_fmha(tmp_path):
    """Both need an engine built with paged context FMHA, which fp32 engines lack: without it the runtime turns block
    reuse off (trtGptModelInflightBatching.cpp fixExecutorConfig) and refuses chunked context ("Chunked context
    requires context FMHA, paged kv_cache and paged context FMHA"); with it, chunked context prefills a prompt longer
    than max_num_tokens in chunks (off by default: model_instance_state.cc getExecutorConfigFromParams)."""
    without = _params(_config(tmp_path, "FP32", paged_context_fmha=False))
    assert without["enable_kv_cache_reuse"] in FALSE and without["enable_chunked_context"] in FALSE
    with_fmha = _params(_config(tmp_path, "FP32", paged_context_fmha=True))
    assert with_fmha["enable_kv_cache_reuse"] in TRUE and with_fmha["enable_chunked_context"] in TRUE


def test_prompt_table_offloading_stays_off(tmp_path):
    # The backend reads no offloading key and never sets ExecutorConfig's promptTableOffloading, whose
    # default is false (cpp/include/tensorrt_llm/executor/executor.h); no parameter here may suggest one.
    assert not [key for key in _params(_config(tmp_path)) if "offload" in key.lower()]


def test_batching_and_streaming(tmp_path):
    config = _config(tmp_path)
    assert config.model_transaction_policy.decoupled  # batch > 1 and streaming need it (utils.cc)
    assert config.HasField("dynamic_batching") and config.dynamic_batching.max_queue_delay_microseconds == 500
    assert [(g.kind, g.count) for g in config.instance_group] == [(mc.ModelInstanceGroup.KIND_CPU, 1)]


@pytest.mark.parametrize("model_data_type", ["FP16", "BF16", "FP32"])
def test_inputs_are_upstreams(tmp_path, model_data_type):
    inputs = {spec.name: spec for spec in _config(tmp_path, model_data_type).input}
    assert inputs.keys() == {t.name for t in interface.LLM_INPUTS} and inputs.keys() <= UPSTREAM_INPUTS.keys()
    for name, spec in inputs.items():
        data_type, dims, reshaped, optional, ragged = UPSTREAM_INPUTS[name]
        data_type = f"TYPE_{model_data_type}" if data_type == "MODEL" else data_type
        assert mc.DataType.Name(spec.data_type) == data_type, name
        assert list(spec.dims) == dims, name
        assert spec.HasField("reshape") == reshaped and not spec.reshape.shape, name
        assert spec.allow_ragged_batch == ragged, name
        assert optional or not spec.optional, f"{name} is required upstream"
    assert not inputs["input_lengths"].optional and not inputs["request_output_len"].optional


def test_contract_tensors_take_the_engine_type_unless_the_backend_declares_another():
    """The engine contract (TensorRT-LLM 1.2.1's inputs), the ensemble's tensors and the backend's config.pbtxt
    agree: each contract tensor the tensorrt_llm model takes is carried in the contract's type, except where
    upstream declares another; those, and only those, are recorded in BACKEND_DATA_TYPES."""
    carried = {t.name: t for t in interface.LLM_INPUTS if t.contract is not None}
    assert carried.keys() == {spec.name for spec in LLM_INPUTS}
    differing = {}
    for name, tensor in carried.items():
        assert tensor.contract is not None and tensor.contract.name == name
        upstream = UPSTREAM_INPUTS[name][0]
        engine = TRITON_DATA_TYPES[tensor.contract.dtype]
        assert f"TYPE_{tensor.data_type}" == upstream or tensor.data_type == upstream == "MODEL", name
        if upstream not in (f"TYPE_{engine}", engine):
            differing[name] = upstream.removeprefix("TYPE_")
    assert differing == interface.BACKEND_DATA_TYPES == {"mrope_position_deltas": "INT64"}
    # The engine's int32 deltas, negative ones included, cross the ensemble as INT64 unchanged.
    deltas = np.array([-1234, 0, 7], dtype=MROPE_POSITION_DELTAS.dtype)
    carried_deltas = interface.MROPE_DELTAS.to_triton(deltas)
    assert carried_deltas.dtype == np.int64 and carried_deltas.tolist() == [-1234, 0, 7]


def test_every_tensor_named_after_a_contract_carries_it():
    """No model declares a contract tensor by hand (its type or dims could drift from the contract's)."""
    contracts = {spec.name: spec for spec in (*VISION_INPUTS, *LLM_INPUTS)}
    tensors = {*REQUEST_INPUTS, *interface.PREPROCESSING_OUTPUTS, *interface.LLM_INPUTS}
    for tensor in tensors:
        if tensor.name in contracts:
            assert tensor.contract == contracts[tensor.name], tensor.name
            assert len(tensor.dims) == len(tensor.contract.shape), tensor.name


def test_outputs_are_upstreams(tmp_path):
    outputs = {spec.name: (mc.DataType.Name(spec.data_type), list(spec.dims)) for spec in _config(tmp_path).output}
    assert outputs == UPSTREAM_OUTPUTS


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        (dict(model_data_type="INT8"), UnsupportedModelError),
        (dict(kv_cache_free_gpu_mem_fraction=0.0), LimitsError),
        (dict(kv_cache_free_gpu_mem_fraction=1.5), LimitsError),
        (dict(batch_scheduler_policy="fifo"), Qwen3VLTrtError),
        (dict(rank_gpus=[0, 0]), Qwen3VLTrtError),
        (dict(rank_gpus=[-1]), Qwen3VLTrtError),
    ],
)
def test_bad_arguments_are_typed_errors(tmp_path, kwargs, error):
    with pytest.raises(error):
        _config(tmp_path, **kwargs)


def test_negative_queue_delay_is_refused(tmp_path):
    with pytest.raises(LimitsError, match="max_queue_delay_us"):
        tensorrt_llm_model_config(tmp_path, EngineLimits(), "FP16", tmp_path, tmp_path / "info.json", -1, True)
