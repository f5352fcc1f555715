"""GPU memory of the GPU target: placement, the KV cache budget and Triton's CUDA memory pool, from the build's
limits and engines.

Placement. The LLM's rank r runs on GPU r: the tensorrtllm backend passes `gpu_device_ids` to the executor, whose
WorldConfig gives rank r device ids[r % len(ids)] and, without them, ids 0 .. gpus_per_node - 1 (NVIDIA/TensorRT-LLM
triton_backend/inflight_batcher_llm/src/model_state.cc LoadParameters and model_instance_state.cc at 0c8de69a, 1.2.0rc8;
cpp/tensorrt_llm/executor/executorImpl.cpp loadModel at 036a60f7; runtime/worldConfig.cpp and worldConfig.h
getDevice). The repository writes that default out (trtllm_config), so the plan and the placement agree. A KIND_GPU
instance group without `gpus` gets one instance on every visible GPU (Triton's model_configuration.md; under the MPI
launch rank 0 sees every GPU), so the python models' groups name one GPU (`python_models_gpu`, default 0, rank 0's),
and each model uses its `model_instance_device_id`.

CUDA contexts. Every rank's tritonserver holds one on every GPU it sees (Triton core creates its default 64 MiB CUDA
memory pool on each: triton-inference-server/core r26.04 src/server.cc InferenceServer::Init), and the python stubs of
preprocessing and vision_encoder one each on theirs.

The KV cache. Each TensorRT-LLM rank gives its KV cache `kv_cache_free_gpu_mem_fraction` of the memory free when it
loads (tensorrtllm backend docs/model_config.md: "fraction of GPU memory (after loading the model)"), every rank the
same fraction. It is planned on the GPU of the rank beside the python models, or rank 0's when they have a GPU of
their own. Triton loads models concurrently, so beside the python models the LLM may load before or after them.
Planned for the worse case, the LLM first:

    free   = total - CUDA contexts - LLM engine (the rank's weights)
             - the engine's activations - the prompt-table buffer
    python = vision engine (weights + its activations at the profile's largest run)
             + decoding and resizing a full batch of the largest images + the CUDA memory pool
    fraction = min(0.9, (free - python - mrope tables - margin) / free)

(python: 0 on a GPU without the python models; margin: 5% of the GPU for allocator fragmentation and cuBLAS/cuDNN
workspaces). The rank allocates its activations (createRuntimeContexts) and its runtime buffers, the prompt-table
buffer among them (createBuffers), before it reads the free memory its KV cache takes the fraction of
(BaseKVCacheManager::calculateFreeMemBytes), so they come off `free`; the per-request mrope tables are sized on the
first steps (RuntimeBuffers::reshape), after the KV cache, so they share the rest with the python models
(NVIDIA/TensorRT-LLM cpp/tensorrt_llm/batch_manager/: trtGptModelInflightBatching.cpp's constructor at b35ac1b6,
1.2.0rc2; runtimeBuffers.cpp and promptTuningBuffers.cpp at 2a9abd95). Were the python models first, the LLM's share
of what is then free is smaller still, so the plan holds both ways. On a GPU of their own the python models must fit
beside the contexts and the margin.

The CUDA memory pool. Device tensors that pass between models (pixels and their metadata from preprocessing to
vision_encoder and its rows back, by BLS; prompt tables from preprocessing to llm) come from Triton's CUDA memory
pool of that GPU. When it is exhausted, python_backend hands its outputs over by CUDA IPC (r26.04
src/infer_response.cc) and Triton core places the ensemble's tensors in pinned host memory (core memory.cc): a
device-host-device round trip per request. The pool holds two full batches of both: the batch in flight between two
models, and the contiguous copy the next model's dynamic batcher makes of it (python_be.cc gathers a batch's GPU
inputs into pool memory). `serve` passes
`--cuda-memory-pool-byte-size=<gpu>:<bytes>` to the server (rank 0 under MPI, as TensorRT-LLM's
launch_triton_server.py passes --multimodal_gpu0_cuda_mem_pool_bytes).

A replica that leaves its images to a vision pool (`serve --role language`) loads no vision encoder and decodes
nothing: its plan (plan(encodes=False)) has one python stub, no vision engine or decoding, and no CUDA memory pool
beyond Triton's default (nothing it sends is in device memory), so its KV cache takes what the vision side took. The
repository writes that plan's llm and preprocessing configs as `configs/language.pbtxt` beside their config.pbtxt,
which tritonserver reads instead under `--model-config-name=language` (every rank).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from ...common.fsutil import json_entry, read_json
from ...common.limits import EngineLimits, ImageLimits
from ...errors import CheckpointError, LimitsError
from ...llm.checkpoint_format import LLMConfig

KV_CACHE_FRACTION_CEILING = 0.9  # the tensorrtllm backend's default
MARGIN_FRACTION = 0.05
# A CUDA context with cuBLAS/cuDNN handles (measured 500-600 MiB on Hopper with CUDA 12-13); one per process using the
# GPU (see CUDA contexts above).
CUDA_CONTEXT_BYTES = 600 * 2**20
PYTHON_STUBS = 2  # preprocessing's and vision_encoder's (a replica that leaves its images to a vision pool: 1)
_BATCHES_IN_POOL = 2
PATCH_PIXELS = 16 * 16  # released Qwen3-VL: patch 16, so one patch is 16 x 16 pixels (x 2 temporal copies)
# Per patch on the way from preprocessing to vision_encoder (serving.interface.VISION_REQUEST): fp32 pixels
# [patch_dim], int32 pos_embed_idx [4], fp32 pos_embed_w [4], int32 rotary_pos [2], int32 segment_start.
_METADATA_BYTES_PER_PATCH = 4 * 4 + 4 * 4 + 2 * 4 + 4
_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
# Decoding and resizing on the GPU, per request of a full batch: one decoded RGB uint8 frame of the largest size
# decoding accepts, and the request's resized pixels in float32 twice (resize output and normalized copy).
_RESIZED_COPIES_BYTES_PER_PIXEL = 3 * 4 * 2
# The LLM engine's activations. TensorRT sizes them at build time for the largest profile, "close to max number of
# input tokens * some constant factor" (NVIDIA/TensorRT-LLM docs/source/reference/memory.md, "Activation size", at
# 5a211b91); the rank logs the exact figure when it loads. The factor per token: a decoder block's live set, the
# residual, the normed input and the attention output (3 x hidden) and the MLP's fused gate/up output with its
# activated half (3 x the rank's intermediate size), in the engine's dtype.
_ACTIVATION_HIDDEN_COPIES = 3
_ACTIVATION_INTERMEDIATE_COPIES = 3
# trtllm-build writes it from rank 0 beside the rank{r}.engine files.
ENGINE_CONFIG_FILE = "config.json"


@dataclass(frozen=True)
class LLMEngineBuild:
    """What serving reads from the LLM engine's config.json, at the keys TensorRT-LLM's runtime reads
    (cpp/tensorrt_llm/runtime/gptJsonConfig.cpp parseJson and parsePluginConfig: build_config.max_num_tokens,
    build_config.plugin_config.use_paged_context_fmha). max_num_tokens is the engine's own: on engines without context
    FMHA (fp32) trtllm-build raises it to max_input_len (tensorrt_llm/_common.py check_max_num_tokens, at 0fccc5b9)."""

    max_num_tokens: int
    paged_context_fmha: bool
    gather_generation_logits: bool = False

    @classmethod
    def read(cls, engine_dir: Path) -> LLMEngineBuild:
        path = engine_dir / ENGINE_CONFIG_FILE
        content = read_json(path, f"{path} does not exist: build the LLM engine first")
        fix = "rebuild the LLM engine (qwen3vl-trt build-llm-engine)"
        max_num_tokens = json_entry(content, "build_config.max_num_tokens", int, str(path), fix)
        plugins = json_entry(content, "build_config.plugin_config", dict, str(path), fix)
        paged = plugins.get("use_paged_context_fmha")
        if not isinstance(paged, bool):
            raise CheckpointError(
                f"{path}: 'build_config.plugin_config.use_paged_context_fmha' must be a boolean; {fix}"
            )
        # gptJsonConfig.cpp: parseJsonFieldOr(builderConfig, "gather_generation_logits", false).
        gather = bool(json_entry(content, "build_config", dict, str(path), fix).get("gather_generation_logits", False))
        return cls(max_num_tokens=max_num_tokens, paged_context_fmha=paged, gather_generation_logits=gather)


@dataclass(frozen=True)
class GpuMemoryPlan:
    gpu: int  # the python models'
    llm_gpus: tuple[int, ...]  # rank r's at [r]: the llm's gpu_device_ids
    gpu_bytes: int  # each GPU's memory
    llm_engine_bytes: int  # the weights of the rank the KV cache is planned for (llm_rank)
    vision_engine_bytes: int
    vision_activation_bytes: int
    decode_bytes: int
    transfer_pool_bytes: int
    # The rank's allocations besides its weights: before its KV cache is sized (activations, the prompt-table buffer),
    # and after it (the mrope tables); plan() fills them in from the engine.
    llm_activation_bytes: int
    prompt_table_buffer_bytes: int
    mrope_tables_bytes: int
    # The engine's use_paged_context_fmha (LLMEngineBuild), read here with its sizes: the llm model's KV-cache reuse
    # and chunked context need it.
    llm_paged_context_fmha: bool
    # The generation logits' buffers of an engine built to return them (max_top_logprobs), before its KV cache.
    generation_logits_bytes: int = 0
    # Whether the python models decode and encode images (False: a replica of `serve --role language`, which leaves
    # them to a vision pool: no vision engine, no decoding, no CUDA memory pool; plan(encodes=False)).
    encodes: bool = True

    @property
    def shares_llm_gpu(self) -> bool:
        """Whether the python models run beside an LLM rank."""
        return self.gpu in self.llm_gpus

    @property
    def llm_rank(self) -> int:
        """The rank whose GPU the KV cache is planned on: the one beside the python models, else rank 0."""
        return self.llm_gpus.index(self.gpu) if self.shares_llm_gpu else 0

    @property
    def llm_gpu(self) -> int:
        return self.llm_gpus[self.llm_rank]

    @property
    def python_stubs(self) -> int:
        return PYTHON_STUBS if self.encodes else 1

    def _contexts_bytes(self, python_models: bool) -> int:
        return (len(self.llm_gpus) + (self.python_stubs if python_models else 0)) * CUDA_CONTEXT_BYTES

    @property
    def python_models_bytes(self) -> int:
        return self.vision_engine_bytes + self.vision_activation_bytes + self.decode_bytes + self.transfer_pool_bytes

    @property
    def margin_bytes(self) -> int:
        return int(MARGIN_FRACTION * self.gpu_bytes)

    @property
    def free_at_llm_load(self) -> int:
        return self.gpu_bytes - self._contexts_bytes(self.shares_llm_gpu) - self.llm_engine_bytes

    @property
    def free_at_kv_cache(self) -> int:
        """What the rank finds free when it sizes its KV cache: the fraction applies to this."""
        return (
            self.free_at_llm_load
            - self.llm_activation_bytes
            - self.prompt_table_buffer_bytes
            - self.generation_logits_bytes
        )

    @property
    def python_gpu_left_bytes(self) -> int:
        """What the python models' GPU keeps beside them, their stubs' contexts and the margin, when no rank is on it
        (beside a rank, the KV cache fraction leaves their room)."""
        return self.gpu_bytes - self._contexts_bytes(True) - self.python_models_bytes - self.margin_bytes

    def _fraction(self) -> float:
        beside = self.python_models_bytes if self.shares_llm_gpu else 0
        taken = beside + self.mrope_tables_bytes + self.margin_bytes
        return round(min(KV_CACHE_FRACTION_CEILING, (self.free_at_kv_cache - taken) / max(self.free_at_kv_cache, 1)), 3)

    def kv_cache_fraction(self) -> float:
        """The share of free memory the LLM's KV cache may take (at most 0.9), beside the python models when they
        share its GPU."""
        if self._fraction() < 0.05:
            beside = " and the python models" if self.shares_llm_gpu else ""
            raise LimitsError(
                f"GPU {self.llm_gpu} ({_gib(self.gpu_bytes)}) has no room for a KV cache beside the LLM engine{beside}:"
                f"\n{self.describe()}\nlower --max-batch-size or --max-visual-tokens, or use a larger GPU"
            )
        return self._fraction()

    def check_python_models_gpu(self) -> None:
        """Refuses python models that do not fit on a GPU of their own."""
        if not self.shares_llm_gpu and self.python_gpu_left_bytes < 0:
            raise LimitsError(
                f"GPU {self.gpu} ({_gib(self.gpu_bytes)}) has no room for the python models:\n{self.describe()}\n"
                "lower --max-batch-size or --max-visual-tokens, or use a larger GPU"
            )

    def describe(self) -> str:
        """The arithmetic, line by line, as write-repo prints it."""
        shared = self.shares_llm_gpu
        servers = len(self.llm_gpus)
        python = [
            f"    vision engine {_gib(self.vision_engine_bytes)}"
            f" + its activations {_gib(self.vision_activation_bytes)}",
            f"    decoding a full batch {_gib(self.decode_bytes)}",
            f"    CUDA memory pool (tensors between models, two full batches) {_gib(self.transfer_pool_bytes)}",
        ]
        if not self.encodes:
            python = ["    no vision engine, no decoding, no CUDA memory pool (tables reach the llm in host memory)"]
        role = "" if self.encodes else " with --role language (images encoded by a vision pool)"
        lines = [
            f"GPU {self.llm_gpu} (LLM rank {self.llm_rank}{', python models' if shared else ''}){role}: "
            f"{_gib(self.gpu_bytes)}",
            f"  - CUDA contexts ({servers + (self.python_stubs if shared else 0)} processes): "
            f"{_gib(self._contexts_bytes(shared))}",
            f"  - LLM engine, rank {self.llm_rank}: {_gib(self.llm_engine_bytes)}",
            f"  = free when the LLM loads: {_gib(self.free_at_llm_load)}",
            f"  - its activations (estimated from max_num_tokens): {_gib(self.llm_activation_bytes)}",
            f"  - its prompt-table buffer: {_gib(self.prompt_table_buffer_bytes)}",
            *(
                [f"  - its generation logits' buffers: {_gib(self.generation_logits_bytes)}"]
                if self.generation_logits_bytes
                else []
            ),  # fmt: skip
            f"  = free when it sizes its KV cache: {_gib(self.free_at_kv_cache)}",
            *([f"  python models: {_gib(self.python_models_bytes)}", *python] if shared else []),
            f"  LLM mrope tables of a full batch: {_gib(self.mrope_tables_bytes)}",
            f"  margin {MARGIN_FRACTION:.0%} of the GPU",
        ]
        fraction = self._fraction()
        lines.append(
            f"  kv_cache_free_gpu_mem_fraction = {fraction}" if fraction >= 0.05 else "  no room for a KV cache"
        )
        if not shared:
            left = self.python_gpu_left_bytes
            lines += [
                f"GPU {self.gpu} (python models): {_gib(self.gpu_bytes)}",
                f"  - CUDA contexts ({servers + self.python_stubs} processes): {_gib(self._contexts_bytes(True))}",
                f"  - python models: {_gib(self.python_models_bytes)}",
                *python,
                f"  - margin {MARGIN_FRACTION:.0%} of the GPU",
                f"  = left: {_gib(left)}" if left >= 0 else "  no room for the python models",
            ]
        return "\n".join(lines)

    def as_record(self) -> dict[str, object]:
        return asdict(self)


def transfer_pool_bytes(
    limits: EngineLimits, patch_dim: int, merge_unit: int, prompt_table_row_bytes: int, encodes: bool = True
) -> int:
    """Device bytes between the models for two full batches of requests with the most visual tokens each (one in
    flight, one gathered by the next model's batcher): per-patch inputs of the vision encoder, and prompt tables
    ((K+1) rows per visual token) twice: the vision encoder's rows back to preprocessing, the request's table on to
    the llm. Without encodes none: a vision pool's rows arrive in host memory and the request's table leaves
    preprocessing as a host tensor (the tensorrtllm backend copies it to the device through its pinned pool:
    triton_backend inflight_batcher_llm/src/utils.cc readInputsTensors), so python_backend takes nothing from the
    pool (r26.04 src/infer_response.cc: only GPU outputs do), which Triton reserves whole at start."""
    if not encodes:
        return 0
    tables = limits.max_visual_tokens * prompt_table_row_bytes
    patches = limits.max_visual_tokens * merge_unit
    per_request = patches * (patch_dim * 4 + _METADATA_BYTES_PER_PATCH) + 2 * tables
    return _BATCHES_IN_POOL * limits.max_batch_size * per_request


def decode_bytes(limits: EngineLimits, images: ImageLimits | None = None) -> int:
    """Working memory of decoding and resizing a full batch on the GPU."""
    images = images or ImageLimits()
    resized_pixels = limits.max_visual_tokens * 4 * PATCH_PIXELS  # 4 patches per visual token (2 x 2 merge)
    per_request = images.max_decode_pixels * 3 + resized_pixels * _RESIZED_COPIES_BYTES_PER_PIXEL
    return limits.max_batch_size * per_request


def plan(
    gpu: int,
    llm_gpus: tuple[int, ...],
    gpu_bytes: int,
    limits: EngineLimits,
    llm_engine_dir: Path,
    vision_engine_file: Path,
    vision_activation_bytes: int,
    patch_dim: int,
    merge_unit: int,
    llm: LLMConfig,
    encodes: bool = True,
) -> GpuMemoryPlan:
    """The plan for a build's engines (the LLM engine's config.json and the file of the rank the KV cache is planned
    for, the vision plan), the python models on GPU `gpu` and rank r on llm_gpus[r], each GPU of gpu_bytes; `llm` is
    the LLM checkpoint's configuration. encodes False: the plan of a replica that leaves its images to a vision pool
    (GpuMemoryPlan.encodes)."""
    rank = llm_gpus.index(gpu) if gpu in llm_gpus else 0
    weights = llm_engine_dir / f"rank{rank}.engine"
    if not weights.is_file():
        raise LimitsError(f"{weights} does not exist: build the LLM engine first")
    engine = LLMEngineBuild.read(llm_engine_dir)
    if limits.max_top_logprobs and not engine.gather_generation_logits:
        raise LimitsError(
            f"max_top_logprobs is {limits.max_top_logprobs} but the LLM engine in {llm_engine_dir} was built without "
            "--gather_generation_logits: build it again with these limits (qwen3vl-trt build-llm-engine "
            f"--max-top-logprobs {limits.max_top_logprobs})"
        )
    row_bytes = prompt_table_token_bytes(llm.dtype, llm.hidden_size, llm.deepstack_count)
    return GpuMemoryPlan(
        gpu=gpu,
        llm_gpus=llm_gpus,
        gpu_bytes=gpu_bytes,
        llm_engine_bytes=weights.stat().st_size,
        vision_engine_bytes=vision_engine_file.stat().st_size if encodes else 0,
        vision_activation_bytes=vision_activation_bytes if encodes else 0,
        decode_bytes=decode_bytes(limits) if encodes else 0,
        transfer_pool_bytes=transfer_pool_bytes(limits, patch_dim, merge_unit, row_bytes, encodes),
        llm_activation_bytes=llm_activation_bytes(engine.max_num_tokens, llm),
        prompt_table_buffer_bytes=prompt_table_buffer_bytes(limits, llm),
        mrope_tables_bytes=mrope_tables_bytes(limits, llm),
        llm_paged_context_fmha=engine.paged_context_fmha,
        generation_logits_bytes=generation_logits_bytes(limits, llm) if limits.max_top_logprobs else 0,
        encodes=encodes,
    )


def llm_activation_bytes(max_num_tokens: int, llm: LLMConfig) -> int:
    """The estimate of the engine's activations on one rank: max_num_tokens tokens of a decoder block's live set
    (see _ACTIVATION_HIDDEN_COPIES); an MoE layer's MLP runs each token through top_k experts."""
    intermediate = llm.intermediate_size if llm.moe is None else llm.moe.top_k * llm.moe.intermediate_size
    per_token = (
        _ACTIVATION_HIDDEN_COPIES * llm.hidden_size
        + _ACTIVATION_INTERMEDIATE_COPIES * intermediate // llm.mapping.tp_size
    )
    return max_num_tokens * per_token * _DTYPE_BYTES[llm.dtype]


def generation_logits_bytes(limits: EngineLimits, llm: LLMConfig) -> int:
    """What an engine that gathers generation logits allocates for them on its last pipeline rank, per runtime buffer
    set: [kCACHE_LENGTH = 8, max_batch_size x beams, V] and [beams, 8, V] in the logits' dtype (float32: the
    checkpoint's logits_dtype), V the vocabulary padded to a multiple of the world size
    (batch_manager/runtimeBuffers.cpp at 092a5a15, GenerationLogitsCache; runtime/modelConfig.h getVocabSizePadded)."""
    world = llm.mapping.world_size
    vocab = -(-llm.vocab_size // world) * world
    return llm.mapping.pp_size * (8 * limits.max_batch_size + 8) * vocab * 4


def prompt_table_buffer_bytes(limits: EngineLimits, llm: LLMConfig) -> int:
    """A rank's prompt-table buffer: PromptTuningBuffers allocates max_prompt_embedding_table_size rows of the whole
    hidden size (hidden x TP) in the model's dtype, once per runtime buffer set; the fused in-flight batcher keeps one
    set per micro-batch, as many as pipeline stages (trtGptModelInflightBatching.cpp mNumBuffers, TRT overlap off)."""
    rows = limits.prompt_table_rows(llm.deepstack_count)
    return llm.mapping.pp_size * rows * llm.hidden_size * _DTYPE_BYTES[llm.dtype]


def mrope_tables_bytes(limits: EngineLimits, llm: LLMConfig) -> int:
    """The runtime's mrope inputs for a full batch, per runtime buffer set: max_position_embeddings (the engine's is
    max_seq_len, llm.engine_build) x rotary_dim float32 cos/sin values and one int32 position delta per request
    (runtimeBuffers.cpp reshape)."""
    per_request = limits.max_seq_len * llm.rotary_dim * 4 + 4
    return llm.mapping.pp_size * limits.max_batch_size * per_request


def prompt_table_token_bytes(llm_dtype: str, hidden_size: int, deepstack_count: int) -> int:
    """Bytes of one visual token's prompt-table rows: K+1 rows of hidden_size in the LLM's dtype."""
    return (deepstack_count + 1) * hidden_size * _DTYPE_BYTES[llm_dtype]


def device_memory_bytes(gpu: int) -> int | None:
    """The total memory of a visible GPU, or None where torch sees none."""
    import torch

    if not torch.cuda.is_available() or gpu >= torch.cuda.device_count():
        return None
    return int(torch.cuda.get_device_properties(gpu).total_memory)


def _gib(value: int) -> str:
    return f"{value / 2**30:.2f} GiB"
