"""The Triton deployment's tensors and model names, declared once.

The ensemble `qwen3vl` takes the generation request's inputs (serving.request, which declares them) and runs
preprocessing -> llm -> postprocessing, answering text. The ensemble `qwen3vl_tokens` takes the same inputs and runs
preprocessing -> llm, answering the llm's token ids as they come: for clients that decode the ids themselves (the
gRPC client and the OpenAI gateway, qwen3vl_trt.decoding.detokenize), with no python step per streamed token in the
server.
Preprocessing calls vision_encoder itself (BLS) for the images that the visual-feature cache does not hold, so a
request whose images all hit runs no vision encoder. Between the models, tensors carry the names of the contracts
they implement: the vision encoder's inputs (contracts.VISION_INPUTS) and the TensorRT-LLM backend's `tensorrt_llm`
model inputs, which the CPU target's `llm` declares too, so both targets route the same ensemble. Dims exclude the
batch dimension (every model batches); scalar per-request inputs of `llm` are reshaped to [] as the tensorrt_llm
backend declares them.

A tensor that implements a contract takes its name, dims and type from it (`_implementing`); where the receiving
backend declares another type, the deployment carries the backend's (BACKEND_DATA_TYPES) and `Tensor.to_triton`
converts the contract's arrays to it.
"""

from __future__ import annotations

from ..common.contracts import (
    LLM_INPUT_IDS,
    MROPE_POSITION_DELTAS,
    MROPE_ROTARY_COS_SIN,
    PIXEL_VALUES,
    POS_EMBED_IDX,
    POS_EMBED_W,
    PROMPT_EMBEDDING_TABLE,
    PROMPT_TABLE_EXTRA_IDS,
    ROTARY_POS,
    SEGMENT_START,
    TensorSpec,
)
from .request import ENGINE_OPTIONS
from .tensors import TRITON_DATA_TYPES, Tensor, scalar_tensor

PREPROCESSING, VISION_ENCODER, LLM, POSTPROCESSING, ENSEMBLE, TOKENS_ENSEMBLE = (
    "preprocessing",
    "vision_encoder",
    "llm",
    "postprocessing",
    "qwen3vl",
    "qwen3vl_tokens",
)
MODELS = (PREPROCESSING, VISION_ENCODER, LLM, POSTPROCESSING, ENSEMBLE, TOKENS_ENSEMBLE)
# Models that other models call themselves (BLS), by their callers: not steps of the ensemble, so Triton does not
# turn the ensemble not ready while one is unloaded; its callers are unloaded with it instead
# (serving.server.supervisor).
CALLED_BY = {VISION_ENCODER: (PREPROCESSING,)}


# Contract tensors that a backend declares with a type of its own, by name. TensorRT-LLM 1.2.1's engine takes
# mrope_position_deltas as int32 (contracts), but the tensorrtllm backend's tensorrt_llm model declares it
# TYPE_INT64 (triton_backend/all_models/inflight_batcher_llm/tensorrt_llm/config.pbtxt) and reads it back as
# the engine's int32 (utils.cc getMropeConfigFromTensors: extractSingleton<SizeType32>, the low half on
# little-endian hosts): the ensemble, and the CPU target's llm that stands in for that model, carry INT64.
BACKEND_DATA_TYPES = {MROPE_POSITION_DELTAS.name: "INT64"}


def _implementing(spec: TensorSpec, optional: bool = False) -> Tensor:
    """The tensor that carries a contract between models: its name, its type (the backend's, where it declares
    another) and its dims, the contract's symbolic ones variable (-1)."""
    dims = tuple(-1 if isinstance(d, str) else d for d in spec.shape)
    data_type = BACKEND_DATA_TYPES.get(spec.name, TRITON_DATA_TYPES[spec.dtype])
    return Tensor(spec.name, data_type, dims, optional=optional, contract=spec)


TEXT_OUTPUT = Tensor("text_output", "STRING", (-1,))
OUTPUT_IDS_OUT = Tensor("output_ids", "INT32", (-1,))
LOG_PROBS_OUT = Tensor("output_log_probs", "FP32", (-1,))  # one per id of output_ids, when asked for
# With top_logprobs k: each id's k likeliest alternatives and their log probabilities, [ids, k].
TOP_IDS_OUT = Tensor("output_top_ids", "INT32", (-1, -1))
TOP_LOG_PROBS_OUT = Tensor("output_top_log_probs", "FP32", (-1, -1))
REQUEST_OUTPUTS: tuple[Tensor, ...] = (TEXT_OUTPUT, OUTPUT_IDS_OUT, LOG_PROBS_OUT, TOP_IDS_OUT, TOP_LOG_PROBS_OUT)

# -- preprocessing -> vision_encoder (BLS, one request per image the visual cache did not hold) ----------
VISION_PIXELS = _implementing(PIXEL_VALUES)
VISION_POS_EMBED_IDX = _implementing(POS_EMBED_IDX)
VISION_POS_EMBED_W = _implementing(POS_EMBED_W)
VISION_ROTARY_POS = _implementing(ROTARY_POS)
VISION_SEGMENT_START = _implementing(SEGMENT_START)
IMAGE_GRID_THW = Tensor("image_grid_thw", "INT64", (-1, 3))
VISUAL_TOKEN_COUNT = scalar_tensor("visual_token_count", "INT32", optional=False)
VISION_REQUEST: tuple[Tensor, ...] = (
    VISION_PIXELS,
    VISION_POS_EMBED_IDX,
    VISION_POS_EMBED_W,
    VISION_ROTARY_POS,
    VISION_SEGMENT_START,
    IMAGE_GRID_THW,
    VISUAL_TOKEN_COUNT,
)

# -- vision_encoder -> preprocessing (an image's rows), preprocessing -> llm (the request's table) ----
# (dtype: the LLM checkpoint's)
PROMPT_TABLE = _implementing(PROMPT_EMBEDDING_TABLE, optional=True)

# -- preprocessing -> llm: the tensorrt_llm backend's input names ---------------------------------
INPUT_IDS = _implementing(LLM_INPUT_IDS)
INPUT_LENGTHS = scalar_tensor("input_lengths", "INT32", optional=False)
REQUEST_OUTPUT_LEN = scalar_tensor("request_output_len", "INT32", optional=False)
END_ID = scalar_tensor("end_id", "INT32")
PAD_ID = scalar_tensor("pad_id", "INT32")
RUNTIME_TOP_K = scalar_tensor("runtime_top_k", "INT32")
RUNTIME_TOP_P = scalar_tensor("runtime_top_p", "FP32")
TEMPERATURE = scalar_tensor("temperature", "FP32")
SEED = scalar_tensor("seed", "UINT64")
MIN_TOKENS = scalar_tensor("min_tokens", "INT32")
STREAMING = scalar_tensor("streaming", "BOOL")
EXCLUDE_INPUT = scalar_tensor("exclude_input_in_output", "BOOL")
STOP_WORDS_LIST = Tensor("stop_words_list", "INT32", (2, -1), optional=True)
BAD_WORDS_LIST = Tensor("bad_words_list", "INT32", (2, -1), optional=True)
EMBEDDING_BIAS = Tensor("embedding_bias", "FP32", (-1,), optional=True)  # [vocab_size], added to the logits
# The engine's logits of every generated token in the responses (GENERATION_LOGITS), for a request's top_logprobs.
RETURN_GENERATION_LOGITS = scalar_tensor("return_generation_logits", "BOOL")
MROPE_COS_SIN = _implementing(MROPE_ROTARY_COS_SIN, optional=True)
MROPE_DELTAS = _implementing(MROPE_POSITION_DELTAS, optional=True)
EXTRA_IDS = _implementing(PROMPT_TABLE_EXTRA_IDS, optional=True)
LLM_REQUEST: tuple[Tensor, ...] = (
    INPUT_IDS,
    INPUT_LENGTHS,
    REQUEST_OUTPUT_LEN,
    END_ID,
    PAD_ID,
    RUNTIME_TOP_K,
    RUNTIME_TOP_P,
    TEMPERATURE,
    SEED,
    MIN_TOKENS,
    STREAMING,
    EXCLUDE_INPUT,
    STOP_WORDS_LIST,
    BAD_WORDS_LIST,
    EMBEDDING_BIAS,
    RETURN_GENERATION_LOGITS,
    *ENGINE_OPTIONS,  # passed on from the request as they are (serving.request)
    MROPE_COS_SIN,
    MROPE_DELTAS,
    EXTRA_IDS,
)
# A request with stop true ends the request in flight that has the same request id: the tensorrt_llm
# backend's cancellation, which clients use because Triton's ensembles do not pass a cancelled stream on
# to the llm step in flight.
STOP = scalar_tensor("stop", "BOOL")
LLM_INPUTS: tuple[Tensor, ...] = (*LLM_REQUEST, PROMPT_TABLE, STOP)

# -- llm -> postprocessing ----------------------------------------------------------------------
LLM_OUTPUT_IDS = Tensor("output_ids", "INT32", (-1, -1))  # [beams, tokens]
SEQUENCE_LENGTH = Tensor("sequence_length", "INT32", (-1,))  # per beam
# [beams, tokens]: the log probability of each token a response carries, when the request asked (return_log_probs)
OUTPUT_LOG_PROBS = Tensor("output_log_probs", "FP32", (-1, -1), optional=True)
# With return_generation_logits: the raw logits of the tokens a response carries, float32 (the checkpoint's
# logits_dtype), the vocabulary padded to a multiple of the TP size. The tensorrtllm backend answers [n, beams, V] when
# streaming (the response's n new tokens) and [beams, max_tokens, V] otherwise, whose rows past the generated tokens
# mean nothing (model_instance_state.cc fillTritonResponse; batch_manager/llmRequest.h, the generation logits host
# buffer; llmRequest.cpp createResult); detokenize.TextStream reads either.
GENERATION_LOGITS = Tensor("generation_logits", "FP32", (-1, -1, -1), optional=True)
LLM_OUTPUTS: tuple[Tensor, ...] = (LLM_OUTPUT_IDS, SEQUENCE_LENGTH, OUTPUT_LOG_PROBS, GENERATION_LOGITS)
# Triton ensembles let a step after a decoupled model read only what that model produced, so
# postprocessing gets the llm's outputs alone (and the request id, which the ensemble passes on).
# The tokens ensemble answers them under their own names: what its clients decode (qwen3vl_trt.decoding.detokenize).

PREPROCESSING_OUTPUTS: tuple[Tensor, ...] = (*LLM_REQUEST, PROMPT_TABLE)

# Error messages of requests the deployment refuses as sent start with this: gRPC stream responses carry
# a message and no status code, and clients (the OpenAI gateway: HTTP 400) tell these from failures.
REJECTED_REQUEST = "request rejected"

# Triton core's dynamic batcher refuses a request over its queue policy's max_queue_size, or one that waited past
# its queue timeout, with these messages (core r24.10 and r26.04 src/scheduler_utils.cc and
# src/dynamic_batch_scheduler.cc, status UNAVAILABLE); on a stream they arrive as the response's error_message,
# without the status. Preprocessing, which bounds its own waiting requests, refuses with the first too.
QUEUE_FULL = "Exceeds maximum queue size"
QUEUE_TIMEOUT = "Request timeout expired"

# A stopping tritonserver refuses what arrives with messages that hold this (r26.04 src/grpc/stream_infer_handler.cc:
# "GRPC server is shutting down and has stopped accepting new requests."; core r24.10 dynamic_batch_scheduler.cc:
# "Server is stopping, scheduler for model has stopped accepting new inference requests"), also in-band on a stream.
SERVER_STOPPING = "stopped accepting new"

# The requests `serve` sends to warm the deployment up before it reports ready (serving.server.warmup) carry request
# ids that start with this. Triton passes a request's id on to every step of the ensemble (core r24.10
# src/ensemble_scheduler/ensemble_scheduler.cc, SetId) and preprocessing passes it on to its vision_encoder
# requests: every stage keeps these requests out of its metrics, and preprocessing keeps their images out of the
# visual cache (neither looked up nor stored), so warming up leaves nothing behind but Triton's own nv_* counts.
WARMUP_REQUEST_PREFIX = "qwen3vl-warmup-"


# The largest warm-up image, in visual tokens, of serve's requests and of the GPU vision encoder's model_warmup
# samples: what runs the first time (CUDA's lazily loaded kernels, TensorRT's execution context, ONNX Runtime's arena,
# the stubs' imports) is per kernel and buffer, not per size; images of thousands of tokens take minutes on a CPU
# target's real vision tower (a 2500-token one: 190 s for 2B's), and a model_warmup sample's host tensors pass
# through the stub's shared memory (hundreds of MiB at 8192 tokens: more than a container's default /dev/shm).
MAX_WARMUP_TOKENS = 256


def is_warmup(request_id: str) -> bool:
    return request_id.startswith(WARMUP_REQUEST_PREFIX)
