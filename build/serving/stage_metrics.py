"""The metrics the deployment's python models publish on Triton's metrics port, next to Triton's own
nv_* metrics: what each is (its # HELP line says it too), and which models publish which. Every series
is labelled with its model's name (`model`) and its python stub's pid (`stub_pid`; sum over it). The python
backend adapter (triton_python) publishes them.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Kind(Enum):
    COUNTER = "counter"
    HISTOGRAM = "histogram"


@dataclass(frozen=True)
class Metric:
    name: str
    description: str
    kind: Kind = Kind.COUNTER
    buckets: tuple[float, ...] = ()  # a histogram's upper bounds


MODEL_LABEL = "model"
STUB_LABEL = "stub_pid"  # the python stub that counted (a reloaded model's instances overlap: see triton_python)

REQUESTS = Metric("qwen3vl_requests_total", "Requests the model executed")
REQUEST_ERRORS = Metric("qwen3vl_request_errors_total", "Requests the model answered with an error")
IMAGES_DECODED = Metric("qwen3vl_images_decoded_total", "Images decoded into patches")
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
TOKENS_GENERATED = Metric("qwen3vl_tokens_generated_total", "Tokens generated and sent (an echoed prompt not counted)")

# What each kind of model publishes, besides REQUESTS and REQUEST_ERRORS.
PREPROCESSING = (IMAGES_DECODED,)
VISION_ENCODER = (PATCHES_ENCODED, VISION_RUN_PATCHES, VISION_RUN_IMAGES, VISION_RUN_SECONDS)
LLM = (TOKENS_GENERATED,)
