"""The metrics the deployment's python models publish on Triton's metrics port, next to Triton's own
nv_* metrics: what each is (its # HELP line says it too), and which models publish which. Every series
is labelled with its model's name (`model`) and its python stub's pid (`stub_pid`; sum over it). The python
backend adapters (triton_adapters) publish them, counting neither serve's warm-up requests (interface.is_warmup)
nor Triton's model_warmup samples.
"""

from __future__ import annotations

import urllib.request
from dataclasses import dataclass
from enum import Enum
from typing import Protocol

from prometheus_client.parser import text_string_to_metric_families


class Kind(Enum):
    COUNTER = "counter"
    HISTOGRAM = "histogram"


@dataclass(frozen=True)
class Metric:
    name: str
    description: str
    kind: Kind = Kind.COUNTER
    buckets: tuple[float, ...] = ()  # a histogram's upper bounds


class MetricSink(Protocol):
    """Where a stage's metrics go (triton_adapters publishes them; tests count them)."""

    def add(self, metric: Metric, value: float) -> None: ...

    def observe(self, metric: Metric, value: float) -> None: ...


MODEL_LABEL = "model"
STUB_LABEL = "stub_pid"  # the python stub that counted (a reloaded model's instances overlap: see triton_adapters)

REQUESTS = Metric("qwen3vl_requests_total", "Requests the model executed")
REQUEST_ERRORS = Metric("qwen3vl_request_errors_total", "Requests the model answered with an error")
IMAGES_DECODED = Metric("qwen3vl_images_decoded_total", "Images decoded into patches")
VIDEOS_DECODED = Metric("qwen3vl_videos_decoded_total", "Videos decoded into patches (their sampled frames)")
PREPROCESS_SECONDS = Metric(
    "qwen3vl_preprocess_batch_seconds",
    "Seconds preprocessing spends on a batch before the vision encoder: tokenizing, the visual cache's lookup, "
    "decoding images and videos",
    Kind.HISTOGRAM,
    (0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0),
)
PATCHES_ENCODED = Metric("qwen3vl_patches_encoded_total", "Patches through the vision encoder")
VISION_RUN_PATCHES = Metric(
    "qwen3vl_vision_run_patches",
    "Patches of each vision encoder run",
    Kind.HISTOGRAM,
    (16, 64, 256, 1024, 4096, 16384, 65536),
)
VISION_RUN_IMAGES = Metric(
    "qwen3vl_vision_run_images", "Images of each vision encoder run", Kind.HISTOGRAM, (1, 2, 4, 8, 16, 32)
)
VISION_RUN_SECONDS = Metric(
    "qwen3vl_vision_run_seconds",
    "Seconds of each vision encoder run (ONNX Runtime only: the TensorRT engine's runs end on a CUDA stream)",
    Kind.HISTOGRAM,
    (0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0),
)
ENCODES_JOINED = Metric(
    "qwen3vl_visual_encodes_joined_total",
    "Images an earlier batch was encoding when they came: waited for, neither decoded nor encoded again",
)
VISUAL_CACHE_HITS = Metric(
    "qwen3vl_visual_cache_hits_total", "Images whose features the visual cache held: neither decoded nor encoded"
)
VISUAL_CACHE_MISSES = Metric("qwen3vl_visual_cache_misses_total", "Images the visual cache did not hold")
VISUAL_CACHE_STORES = Metric("qwen3vl_visual_cache_stores_total", "Images' features stored in the visual cache")
VISUAL_CACHE_STORED_BYTES = Metric("qwen3vl_visual_cache_stored_bytes_total", "Bytes of entries stored")
VISUAL_CACHE_EVICTIONS = Metric(
    "qwen3vl_visual_cache_evictions_total",
    "Entries the in-process visual cache evicted for room (Redis counts its own: INFO stats evicted_keys)",
)
VISUAL_CACHE_REJECTED = Metric(
    "qwen3vl_visual_cache_rejected_total",
    "Entries dropped because their header or checksum did not match this deployment (recomputed instead)",
)
VISUAL_CACHE_BACKEND_ERRORS = Metric(
    "qwen3vl_visual_cache_backend_errors_total",
    "Visual cache store calls that failed (down, slow or full); the cache is bypassed for a backoff after each",
)
VISION_POOL_ENCODES = Metric(
    "qwen3vl_vision_pool_encodes_total", "Images and videos a vision pool member decoded and encoded for this replica"
)
VISION_POOL_REQUESTS = Metric("qwen3vl_vision_pool_requests_total", "Requests sent to vision pool members, retries too")
VISION_POOL_RETRIES = Metric(
    "qwen3vl_vision_pool_retries_total", "Pool requests sent again to another member after one failed"
)
VISION_POOL_FALLBACKS = Metric(
    "qwen3vl_vision_pool_fallbacks_total", "Images and videos encoded here because no pool member answered"
)
VISION_POOL_BYTES = Metric(
    "qwen3vl_vision_pool_bytes_total", "Bytes sent to and received from vision pool members (files and rows)"
)
VISION_POOL_SECONDS = Metric(
    "qwen3vl_vision_pool_seconds",
    "Seconds of each answered pool request, from sending the files to holding their rows",
    Kind.HISTOGRAM,
    (0.003, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0),
)
TOKENS_GENERATED = Metric("qwen3vl_tokens_generated_total", "Tokens generated and sent (an echoed prompt not counted)")

# What each kind of model publishes, besides REQUESTS and REQUEST_ERRORS.
VISUAL_CACHE = (
    VISUAL_CACHE_HITS,
    VISUAL_CACHE_MISSES,
    VISUAL_CACHE_STORES,
    VISUAL_CACHE_STORED_BYTES,
    VISUAL_CACHE_EVICTIONS,
    VISUAL_CACHE_REJECTED,
    VISUAL_CACHE_BACKEND_ERRORS,
)
VISION_POOL = (
    VISION_POOL_ENCODES,
    VISION_POOL_REQUESTS,
    VISION_POOL_RETRIES,
    VISION_POOL_FALLBACKS,
    VISION_POOL_BYTES,
    VISION_POOL_SECONDS,
)
PREPROCESSING = (IMAGES_DECODED, VIDEOS_DECODED, PREPROCESS_SECONDS, ENCODES_JOINED, *VISUAL_CACHE, *VISION_POOL)
VISION_ENCODER = (PATCHES_ENCODED, VISION_RUN_PATCHES, VISION_RUN_IMAGES, VISION_RUN_SECONDS)
LLM = (TOKENS_GENERATED,)


def read(metrics_url: str, timeout_s: float = 10.0) -> dict[tuple[str, str], float]:
    """The qwen3vl_ samples a server publishes (its metrics port's /metrics URL), by (sample name, model label),
    summed over the stubs; a histogram's _count and _sum, not its buckets."""
    with urllib.request.urlopen(metrics_url, timeout=timeout_s) as reply:
        text = reply.read().decode()
    samples: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if family.name.startswith("qwen3vl_") and "le" not in sample.labels:
                key = (sample.name, sample.labels.get(MODEL_LABEL, ""))
                samples[key] = samples.get(key, 0.0) + sample.value
    return samples
