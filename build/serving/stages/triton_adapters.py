"""Triton python-backend models over the serving components; the repository's model.py files are
one import of these. Importable only inside Triton's python backend (triton_python_backend_utils).

Tensors are read as numpy arrays without their batch dimension (bf16 and device tensors through
DLPack, as torch tensors) and written back with it. Each model's parameters come from its
config.pbtxt, which the repository writer fills from the build. Each model publishes its
stage metrics (stages.metrics) on Triton's metrics port, measured here around the components.
"""

from __future__ import annotations

import ctypes
import gc
import json
import logging
import os
import threading
from collections import Counter
from collections.abc import Callable, Coroutine, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
import triton_python_backend_utils as pb_utils  # type: ignore[import-not-found]

from ...errors import Qwen3VLTrtError, RequestError, StageError
from .. import interface
from ..backpressure import BackPressure
from ..parameters import (
    LLMParameters,
    PostprocessingParameters,
    PreprocessingParameters,
    VisionEncoderParameters,
)
from ..tensors import Tensor
from . import metrics as stage_metrics
from . import visual_cache

_DLPACK_TYPES = {"TYPE_BF16"}


class _TritonLog(logging.Handler):
    """The package's log records, written to Triton's log."""

    def emit(self, record: logging.LogRecord) -> None:
        message = self.format(record)
        if record.levelno >= logging.ERROR:
            pb_utils.Logger.log_error(message)
        elif record.levelno >= logging.WARNING:
            pb_utils.Logger.log_warn(message)
        else:
            pb_utils.Logger.log_info(message)


def _log_to_triton() -> None:
    package = logging.getLogger("qwen3vl_trt")
    if not any(isinstance(h, _TritonLog) for h in package.handlers):
        package.addHandler(_TritonLog())
        package.setLevel(logging.INFO)


class _Metrics:
    """One model's stage_metrics, through the python backend's custom metrics API (python_backend r24.10
    src/pb_stub.cc: MetricFamily of kind COUNTER, GAUGE or HISTOGRAM, the last with its buckets given to
    each Metric; Metric.increment and .observe). Families of one name are shared by the models (one
    underlying family, r24.10 examples/custom_metrics), told apart by the model label, and by the stub's pid:
    Triton shares a metric of identical labels between MetricFamily objects and deletes it when either
    instance ends (core r26.04 src/metric_family.cc, prometheus-cpp Family::Remove), and a reloaded model's
    old and new instances overlap, so each instance writes series of its own."""

    def __init__(self, model: str, metrics: Sequence[stage_metrics.Metric]):
        self._families: list[Any] = []
        self._metrics: dict[str, Any] = {}
        labels = {stage_metrics.MODEL_LABEL: model, stage_metrics.STUB_LABEL: str(os.getpid())}
        for metric in metrics:
            if metric.kind is stage_metrics.Kind.HISTOGRAM:
                family = pb_utils.MetricFamily(metric.name, metric.description, pb_utils.MetricFamily.HISTOGRAM)
                self._metrics[metric.name] = family.Metric(labels=labels, buckets=[float(b) for b in metric.buckets])
            else:
                family = pb_utils.MetricFamily(metric.name, metric.description, pb_utils.MetricFamily.COUNTER)
                self._metrics[metric.name] = family.Metric(labels=labels)
            self._families.append(family)

    def add(self, metric: stage_metrics.Metric, value: float) -> None:
        if value:
            self._metrics[metric.name].increment(float(value))

    def observe(self, metric: stage_metrics.Metric, value: float) -> None:
        self._metrics[metric.name].observe(float(value))

    def close(self) -> None:
        # Metrics before their families: a Metric outliving its MetricFamily fails (r24.10 src/metric.cc).
        self._metrics.clear()
        self._families.clear()


COMPUTING_MODELS = 3
"""Python models whose stubs compute on the host's cores at once: preprocessing, vision_encoder, llm."""


def usable_cores() -> int:
    """The cores this process may use: its CPU affinity, capped by a cgroup v2 CPU quota (a container's
    `--cpus`), which the affinity does not show."""
    cores = len(os.sched_getaffinity(0))
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
    except (OSError, ValueError):
        return cores
    return cores if quota == "max" else max(1, min(cores, int(quota) // int(period)))


def intra_op_threads() -> int:
    """Threads for one model instance's torch and ONNX Runtime ops: its share of the cores this process
    may use. Each python model is its own stub process; one with more threads than its share makes
    its OpenMP/ORT threads wait at every op for threads that the other stubs keep off the cores (on
    2 cores with the other stubs busy, preprocessing took 10x longer with 2 threads than with 1)."""
    return max(1, usable_cores() // COMPUTING_MODELS)


# glibc's mallopt parameters (malloc/malloc.h) and the largest mmap threshold it accepts on 64-bit hosts
# (malloc/malloc.c, DEFAULT_MMAP_THRESHOLD_MAX).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD_BYTES = 32 << 20
TRIM_THRESHOLD_BYTES = 256 << 20


def keep_freed_memory() -> None:
    """Lets a stub reuse the buffers its ops free instead of returning them to the kernel and
    page-faulting them in again on the next request: in the vision stub, every ONNX Runtime run (its
    memory arena is off, see vision.onnx_runner) took 7,000-15,000 minor page faults and 1.3-1.7x the time of
    the same run in one process; with these settings none. Freed memory up to TRIM_THRESHOLD_BYTES stays
    with the process. A no-op where the C library has no mallopt (not glibc)."""
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is not None:
        mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)


class _Model:
    """Reads a model's configuration and moves tensors between Triton and the components."""

    metrics_published: tuple[stage_metrics.Metric, ...] = ()  # besides REQUESTS and REQUEST_ERRORS

    def initialize(self, args: Mapping[str, str]) -> None:
        _log_to_triton()
        keep_freed_memory()
        self.threads = intra_op_threads()
        torch.set_num_threads(self.threads)
        self.config = config = json.loads(args["model_config"])
        self.inputs = {spec["name"]: spec["data_type"] for spec in config["input"]}
        self.device_id = int(args.get("model_instance_device_id", 0))
        self.metrics = _Metrics(
            args["model_name"], (stage_metrics.REQUESTS, stage_metrics.REQUEST_ERRORS, *self.metrics_published)
        )
        # Triton runs a model's model_warmup samples on each instance right after its initialize and before the
        # model is ready (core r24.10 src/backend_model_instance.cc: InitAndWarmUpModelInstance, WarmUp; each
        # sample batch_size requests, max(count, 1) times): an instance's first requests are those samples.
        self.warmup_samples_left = sum(
            int(sample.get("batch_size", 0)) * max(1, int(sample.get("count", 0)))
            for sample in config.get("model_warmup", [])
        )
        self.counting = True  # whether the batch being executed holds a request the metrics count
        self.load()

    def load(self) -> None:
        raise NotImplementedError

    def counted(self, requests: Sequence[Any]) -> list[bool]:
        """Which requests of a batch the stage metrics count: neither Triton's model_warmup samples nor serve's
        warm-up requests (interface.is_warmup)."""
        flags = []
        for request in requests:
            if self.warmup_samples_left > 0:
                self.warmup_samples_left -= 1
                flags.append(False)
            else:
                flags.append(not interface.is_warmup(request.request_id()))
        self.counting = any(flags)
        return flags

    def finalize(self) -> None:
        self.metrics.close()
        # The stub exits after finalize, and the interpreter's last collection walks every object torch and the
        # model loaded: 6-11 s per stub on 2 busy cores, which tritonserver waits out before it exits, so a stop
        # could outlast its grace. Frozen objects are skipped by every later collection (CPython's gc.freeze);
        # the process frees them as it ends.
        gc.freeze()

    def read(self, request: Any) -> dict[str, Any]:
        values: dict[str, Any] = {}
        for name, data_type in self.inputs.items():
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            if tensor is None:
                continue
            if data_type in _DLPACK_TYPES or not tensor.is_cpu():
                values[name] = torch.from_dlpack(tensor.to_dlpack())[0]
            else:
                values[name] = tensor.as_numpy()[0]
        return values


def _tensor(name: str, value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        if value.device.type != "cpu":
            # The tensor itself, not a capsule: python_backend r26.04 (src/pb_tensor.cc PbTensor::FromDLPack, at
            # 47f9e030) passes its per-device proxy stream (src/pb_stub.cc Stub::GetProxyStream) to __dlpack__(stream=),
            # where torch makes that stream wait on the current stream (torch.Tensor.__dlpack__), and then
            # synchronizes the proxy stream: work queued on the current torch stream, default or not, is done before
            # the tensor leaves the model. A capsule is taken as it is, its producer maybe still running.
            return pb_utils.Tensor.from_dlpack(name, value[None].contiguous())
        if value.dtype != torch.bfloat16:
            return pb_utils.Tensor(name, np.ascontiguousarray(value.numpy()[None]))
        return pb_utils.Tensor.from_dlpack(name, torch.utils.dlpack.to_dlpack(value[None].contiguous()))
    return pb_utils.Tensor(name, np.ascontiguousarray(np.asarray(value)[None]))


def owned_copy(tensor: Any) -> torch.Tensor:
    """A copy of a python-backend tensor (a BLS response's output) without its batch dimension, which outlives the
    tensor. The tensor's buffer goes back to Triton for reuse as soon as the tensor is gone (python_backend r24.10 and
    r26.04: src/pb_memory.cc PbMemory's release callback; README, the BLS output tensors' lifetime), which the DLPack
    view delays only until it is dropped on return; a device copy is merely queued on the current CUDA stream by
    then, so that stream is synchronized first. A host copy is done when clone returns."""
    view = torch.from_dlpack(tensor.to_dlpack())[0]
    copy = view.clone()
    if copy.is_cuda:
        torch.cuda.current_stream(copy.device).synchronize()
    return copy


def response(outputs: Mapping[str, Any]) -> Any:
    return pb_utils.InferenceResponse(output_tensors=[_tensor(name, value) for name, value in outputs.items()])


def error_response(error: Exception) -> Any:
    # The refusal's kind in brackets: the gateway answers each kind with its error code (client.RequestRejectedError).
    rejected = f"{interface.REJECTED_REQUEST} [{type(error).__name__}]: {error}"
    message = rejected if isinstance(error, RequestError) else str(error)
    return pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(message))


class _BatchModel(_Model):
    """A model that answers every request of a batch from one call of its component."""

    component: Any

    def execute(self, requests: Sequence[Any]) -> list[Any]:
        inputs = [self.read(r) for r in requests]
        return self.respond(requests, lambda: self.component.execute(inputs))

    def respond(
        self, requests: Sequence[Any], results: Callable[[], Sequence[Mapping[str, Any] | Exception]]
    ) -> list[Any]:
        """The responses to a batch from its results (or each its error when the call raises one), counted in the
        metrics but for warm-up requests."""
        counted = self.counted(requests)
        self.metrics.add(stage_metrics.REQUESTS, sum(counted))
        try:
            answered = results()
        except Qwen3VLTrtError as e:
            self.metrics.add(stage_metrics.REQUEST_ERRORS, sum(counted))
            # One response object per request: python_backend rebuilds each returned response's shared memory and
            # frees the block a repeated object had (r26.04 src/pb_stub.cc ProcessReturnedResponses).
            return [error_response(e) for _ in requests]
        mine = [result for result, count in zip(answered, counted, strict=True) if count]
        self.metrics.add(stage_metrics.REQUEST_ERRORS, sum(isinstance(r, Exception) for r in mine))
        self.count(mine)
        return [error_response(r) if isinstance(r, Exception) else response(r) for r in answered]

    def count(self, results: Sequence[Mapping[str, Any] | Exception]) -> None:
        """Publishes what a batch's results say (the model's own metrics)."""


class _CacheCounts:
    """The visual cache's events, added up where they happen (its Redis writer is a thread of its own) and
    published from execute: a metric update is a message to the server process, sent from the model's thread."""

    def __init__(self) -> None:
        self._counts: Counter[visual_cache.Event] = Counter()
        self._lock = threading.Lock()

    def add(self, event: visual_cache.Event, count: int) -> None:
        with self._lock:
            self._counts[event] += count

    def take(self) -> Counter[visual_cache.Event]:
        with self._lock:
            counts, self._counts = self._counts, Counter()
        return counts


_CACHE_METRICS = {
    visual_cache.Event.HIT: stage_metrics.VISUAL_CACHE_HITS,
    visual_cache.Event.MISS: stage_metrics.VISUAL_CACHE_MISSES,
    visual_cache.Event.STORE: stage_metrics.VISUAL_CACHE_STORES,
    visual_cache.Event.STORED_BYTES: stage_metrics.VISUAL_CACHE_STORED_BYTES,
    visual_cache.Event.EVICTION: stage_metrics.VISUAL_CACHE_EVICTIONS,
    visual_cache.Event.REJECTED: stage_metrics.VISUAL_CACHE_REJECTED,
    visual_cache.Event.BACKEND_ERROR: stage_metrics.VISUAL_CACHE_BACKEND_ERRORS,
}


class _Received(NamedTuple):
    """An admitted or refused request and its response sender, taken on the stub's thread, and whether the metrics
    count it (not a warm-up request)."""

    request: Any
    sender: Any
    counted: bool


class PreprocessingModel(_Model):
    """Decoupled, with an async execute (python_backend r24.05+, "Decoupled Async Execute"): execute hands a batch
    to the scheduler (scheduler.PreprocessingScheduler: admission, the batch flow, joining images being encoded)
    and returns the coroutine that serves it. This adapter reads the requests' tensors, sends a batch's images to
    `vision_encoder` as one BLS request (async_exec: a batch whose images all hit runs no vision encoder, and
    Triton's statistics show it), turns results into responses and publishes the stage's metrics."""

    metrics_published = stage_metrics.PREPROCESSING

    def load(self) -> None:
        from .preprocessing import Preprocessing
        from .scheduler import PreprocessingScheduler

        # The backend passes the instance's GPU as model_instance_device_id and sets no current device
        # (python_backend r26.04 src/stub_launcher.cc): "cuda" alone would put every instance on GPU 0.
        params = PreprocessingParameters.from_stub_config(self.config)
        device = f"cuda:{self.device_id}" if params.preprocess_device == "cuda" else params.preprocess_device
        limits = params.limits
        self.component = Preprocessing(
            params.model_dir,
            limits,
            getattr(torch, params.llm_dtype),
            params.llm_hidden_size,
            mrope_positions=params.mrope_positions,
            device=device,
        )
        scope = self.component.feature_scope(params.vision_dir, params.vision_engine_dir)
        self.cache_counts = _CacheCounts()
        self.component.cache = visual_cache.open_cache(
            params.visual_cache,
            scope,
            params.visual_cache_bytes,
            params.visual_cache_ttl_s,
            observer=self.cache_counts.add,
        )
        pool = None
        if params.vision_pool:
            from .vision_pool import VisionPool

            pool = VisionPool(params.vision_pool, params, self.metrics)
            self.component.pooled = True
        queue = int(self.config.get("dynamic_batching", {}).get("default_queue_policy", {}).get("max_queue_size", 0))
        self.scheduler = PreprocessingScheduler[_Received](
            self.component,
            read=lambda received: self.read(received.request),
            encode=self._encode,
            answer=self._answer,
            metrics=self.metrics,
            published=self._publish_cache_counts,
            # A repository without a queue policy bounds nothing, nor does the stage then.
            in_flight_limit=BackPressure.plan(limits, queue).preprocessing_in_flight if queue else None,
            warm_up=lambda received: not received.counted,
            pool=pool,
        )

    def finalize(self) -> None:
        if self.component.cache is not None:
            self.component.cache.close()
        super().finalize()

    def execute(self, requests: Sequence[Any]) -> Coroutine[Any, Any, None]:
        counted = self.counted(requests)
        self.metrics.add(stage_metrics.REQUESTS, sum(counted))
        received = [_Received(r, r.get_response_sender(), c) for r, c in zip(requests, counted, strict=True)]
        return self.scheduler.admit(received)

    async def _encode(self, inputs: Mapping[str, Any], warm_up: bool) -> torch.Tensor | StageError:
        """The prompt table of one vision encoder request (BLS, async_exec), or the error it answered; one of warm-up
        requests' images alone carries a warm-up request id, which the vision encoder does not count either."""
        request = pb_utils.InferenceRequest(
            model_name=interface.VISION_ENCODER,
            inputs=[_tensor(name, value) for name, value in inputs.items()],
            requested_output_names=[interface.PROMPT_TABLE.name],
            request_id=f"{interface.WARMUP_REQUEST_PREFIX}{interface.VISION_ENCODER}" if warm_up else "",
        )
        answer = await request.async_exec()
        if answer.has_error():
            return StageError(f"the vision encoder failed: {answer.error().message()}")
        # A copy of its own, so the response's buffer (on the GPU target a block of Triton's CUDA memory pool, which
        # the DLPack capsule would hold) goes back at once.
        return owned_copy(pb_utils.get_output_tensor_by_name(answer, interface.PROMPT_TABLE.name))

    def _answer(self, received: _Received, result: Mapping[str, Any] | Exception) -> None:
        if isinstance(result, Exception) and received.counted:
            self.metrics.add(stage_metrics.REQUEST_ERRORS, 1)
        reply = error_response(result) if isinstance(result, Exception) else response(result)
        received.sender.send(reply, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def _publish_cache_counts(self) -> None:
        for event, count in self.cache_counts.take().items():
            self.metrics.add(_CACHE_METRICS[event], count)


class VisionEncoderModel(_BatchModel):
    metrics_published = stage_metrics.VISION_ENCODER

    def load(self) -> None:
        from .vision_batching import VisionBatching

        params = VisionEncoderParameters.from_stub_config(self.config)
        self.component = VisionBatching(
            params.vision_dir,
            getattr(torch, params.llm_dtype),
            params.llm_hidden_size,
            params.attention_budget_bytes,
            engine_dir=params.vision_engine_dir,
            device=self.device_id,
            on_run=self._encoded,
            intra_op_threads=self.threads,
        )
        self.component.warm_up()

    def _encoded(self, images: int, patches: int, seconds: float | None) -> None:
        if not self.counting:  # a run of warm-up requests alone
            return
        self.metrics.add(stage_metrics.PATCHES_ENCODED, patches)
        self.metrics.observe(stage_metrics.VISION_RUN_PATCHES, patches)
        self.metrics.observe(stage_metrics.VISION_RUN_IMAGES, images)
        if seconds is not None:
            self.metrics.observe(stage_metrics.VISION_RUN_SECONDS, seconds)


class PostprocessingModel(_BatchModel):
    def load(self) -> None:
        from .postprocessing import Detokenizing

        parameters = PostprocessingParameters.from_stub_config(self.config)
        self.component = Detokenizing(parameters.model_dir, top_logprobs=parameters.limits.max_top_logprobs)

    def execute(self, requests: Sequence[Any]) -> list[Any]:
        inputs = [self.read(r) for r in requests]
        return self.respond(requests, lambda: self.component.execute(inputs, [r.request_id() for r in requests]))


class _ResponseStream:
    """A TokenStream over a decoupled request's response sender; counts the tokens generated and the
    request's error (in `metrics`; None for a warm-up request)."""

    def __init__(self, sender: Any, metrics: _Metrics | None, echoed: int):
        """echoed: prompt ids that lead the tokens sent, not generated ones."""
        self.sender = sender
        self.metrics = metrics
        self.echoed = echoed
        # Counted once the request ends: each metric update is a round trip to the server process
        # (python_backend src/metric.cc SendMessage), too dear for every streamed token.
        self.generated = 0

    def send(
        self, tokens: list[int], final: bool, log_probs: list[float] | None = None, generation_logits: Any = None
    ) -> None:
        outputs = {
            interface.LLM_OUTPUT_IDS.name: np.array([tokens], dtype=np.int32),
            interface.SEQUENCE_LENGTH.name: np.array([len(tokens)], dtype=np.int32),
        }
        # As the tensorrtllm backend (model_instance_state.cc fillTritonResponse): output_log_probs [1, beams, k]
        # only with return_log_probs, generation_logits only with return_generation_logits.
        if log_probs is not None:
            outputs[interface.OUTPUT_LOG_PROBS.name] = np.array([log_probs], dtype=np.float32)
        if generation_logits is not None:
            outputs[interface.GENERATION_LOGITS.name] = generation_logits
        self.sender.send(response(outputs), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0)
        self.generated += len(tokens) - self.echoed
        self.echoed = 0  # only a request's one response when not streaming holds the prompt
        if final:
            self._count()

    def finish(self) -> None:
        self.sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        self._count()

    def fail(self, error: Exception) -> None:
        self.sender.send(error_response(error), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        if self.metrics is not None:
            self.metrics.add(stage_metrics.REQUEST_ERRORS, 1)
        self._count()

    def _count(self) -> None:
        if self.metrics is not None:
            self.metrics.add(stage_metrics.TOKENS_GENERATED, self.generated)
        self.generated = 0

    def cancelled(self) -> bool:
        return bool(self.sender.is_cancelled())


class LLMModel(_Model):
    """Decoupled: execute hands the requests to the inflight batcher and returns at once."""

    metrics_published = stage_metrics.LLM

    def load(self) -> None:
        from ...hf.checkpoint import generation_end_ids
        from ...llm.checkpoint_format import TOKENIZER_INFO_FILE
        from .cpu_llm import InflightLLM

        params = LLMParameters.from_stub_config(self.config)
        self.engine = InflightLLM(
            params.checkpoint_dir,
            generation_end_ids(params.model_dir),
            params.limits.max_batch_size,
            tokenizer_info_path=params.checkpoint_dir / TOKENIZER_INFO_FILE,
        )
        self.engine.warm_up()
        self.engine.start()

    def execute(self, requests: Sequence[Any]) -> None:
        counted = self.counted(requests)
        self.metrics.add(stage_metrics.REQUESTS, sum(counted))
        for request, count in zip(requests, counted, strict=True):
            inputs = self.read(request)
            metrics = self.metrics if count else None
            stream = _ResponseStream(request.get_response_sender(), metrics, _echoed_prompt(inputs))
            self.engine.submit(inputs, stream, request.request_id())

    def finalize(self) -> None:
        self.engine.close()
        super().finalize()


def _echoed_prompt(inputs: Mapping[str, Any]) -> int:
    """The prompt ids an llm response leads with: the tensorrt_llm backend's output_ids hold the prompt
    unless the request streams or sets exclude_input_in_output (tensorrtllm_backend inflight_batcher_llm)."""

    def flag(tensor: Tensor) -> bool:
        value = inputs.get(tensor.name)
        return value is not None and bool(np.asarray(value).reshape(-1)[0])

    if flag(interface.STREAMING) or flag(interface.EXCLUDE_INPUT):
        return 0
    return int(np.asarray(inputs.get(interface.INPUT_IDS.name, ())).size)
