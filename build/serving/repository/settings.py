"""The repository's serving choices that are not engine limits (RepositorySettings), which `build`, `write-repo`
and their command-line flags share; no protobuf or Triton import, so `--help` stays light."""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import LimitsError
from ..parameters import CACHE_MEMORY, CACHE_TTL_S, check_cache_setting

# The default in-process visual cache: the features of QUEUED_BATCHES full batches of the largest requests, within
# these bounds (a 2B model in bf16 keeps 16 KiB per visual token: 4 GiB is ~260 images of 1024 tokens).
VISUAL_CACHE_MIN_BYTES = 256 << 20
VISUAL_CACHE_MAX_BYTES = 4 << 30


@dataclass(frozen=True)
class RepositorySettings:
    """Serving choices that are not engine limits. max_queue_delay_us: how long a dynamic batcher
    waits to fill a batch. 0 (the default) executes what is queued as soon as the instance is free:
    under load requests queue while it executes, so batches still form, and an idle server adds no
    delay (each batched step would add the whole delay to every request otherwise);
    dynamic_batching False serves one request per execution (for comparison).
    max_queue_size: how many requests preprocessing and the python llm each hold waiting,
    beyond which Triton refuses at once (None: QUEUED_BATCHES full batches); queue_timeout_us: refuse a
    request that waited this long in such a queue (0: no limit but the queue's size).
    attention_budget_bytes: the vision encoder's attention memory per run (see vision_batching).
    visual_cache: where preprocessing keeps images' features (serving.stages.visual_cache): "memory" (an LRU in its
    process within visual_cache_bytes, None: sized from the build by visual_cache_bytes()), a Redis URL
    shared by replicas (entries expire after visual_cache_ttl_s), or "off".
    GPU target (repository.gpu_memory): python_models_gpu is the GPU of the python models' instances (the LLM's
    rank r runs on GPU r); kv_cache_free_gpu_mem_fraction None derives it from the GPU memory plan; gpu_memory_bytes
    None reads each GPU's memory where torch sees it (the smallest of those the plan covers)."""

    max_queue_delay_us: int = 0
    dynamic_batching: bool = True
    max_queue_size: int | None = None
    queue_timeout_us: int = 0
    attention_budget_bytes: int = 1 << 30
    visual_cache: str = CACHE_MEMORY
    visual_cache_bytes: int | None = None
    visual_cache_ttl_s: int = CACHE_TTL_S
    kv_cache_free_gpu_mem_fraction: float | None = None
    python_models_gpu: int = 0
    gpu_memory_bytes: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.python_models_gpu, bool) or not isinstance(self.python_models_gpu, int):
            raise LimitsError(f"python_models_gpu must be a GPU index, got {self.python_models_gpu!r}")
        if self.python_models_gpu < 0:
            raise LimitsError(f"python_models_gpu must be a GPU index, got {self.python_models_gpu!r}")
        if self.max_queue_size is not None and self.max_queue_size < 1:
            raise LimitsError(f"max_queue_size must be at least 1, got {self.max_queue_size!r}")
        if self.queue_timeout_us < 0:
            raise LimitsError(f"queue_timeout_us must not be negative, got {self.queue_timeout_us!r}")
        check_cache_setting(self.visual_cache)
        if self.visual_cache_bytes is not None and self.visual_cache_bytes < 1:
            raise LimitsError(f"the visual cache's byte budget must be positive, got {self.visual_cache_bytes!r}")
        if self.visual_cache_ttl_s < 1:
            raise LimitsError(f"the visual cache's TTL must be at least 1 s, got {self.visual_cache_ttl_s!r}")
        if self.gpu_memory_bytes is not None and self.gpu_memory_bytes <= 0:
            raise LimitsError(f"the GPU's memory must be positive, got {self.gpu_memory_bytes!r} bytes")
        fraction = self.kv_cache_free_gpu_mem_fraction
        if fraction is not None and not 0.0 < fraction <= 1.0:
            raise LimitsError(f"kv_cache_free_gpu_mem_fraction must be in (0, 1], got {fraction!r}")


DEFAULT_REPOSITORY_SETTINGS = RepositorySettings()
