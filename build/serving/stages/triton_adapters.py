"""Triton python-backend models over the serving components; the repository's model.py files are
one import of these. Importable only inside Triton's python backend (triton_python_backend_utils).

Tensors are read as numpy arrays without their batch dimension (bf16 and device tensors through
DLPack, as torch tensors) and written back with it. Each model's parameters come from its
config.pbtxt, which the repository writer fills from the build. Each model publishes its
stage_metrics on Triton's metrics port, measured here around the components.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import triton_python_backend_utils as pb_utils  # type: ignore[import-not-found]

from ...errors import Qwen3VLTrtError, RequestError, StageError
from ...limits import EngineLimits
from .. import interface
from . import metrics as stage_metrics
from . import visual_cache

_DLPACK_TYPES = {"TYPE_BF16"}
_log = logging.getLogger(__name__)


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
    memory arena is off, see vision.runner) took 7,000-15,000 minor page faults and 1.3-1.7x the time of
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
        self.params = {key: value["string_value"] for key, value in config.get("parameters", {}).items()}
        self.inputs = {spec["name"]: spec["data_type"] for spec in config["input"]}
        self.device_id = int(args.get("model_instance_device_id", 0))
        self.metrics = _Metrics(
            args["model_name"], (stage_metrics.REQUESTS, stage_metrics.REQUEST_ERRORS, *self.metrics_published)
        )
        self.load()

    def load(self) -> None:
        raise NotImplementedError

    def finalize(self) -> None:
        self.metrics.close()

    def param_path(self, key: str) -> Path:
        return Path(self.params[key])

    def limits(self) -> EngineLimits:
        return EngineLimits(**json.loads(self.params["limits"]))

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
            # The tensor itself, not a capsule: python_backend calls its __dlpack__(stream) and synchronizes that
            # stream before the tensor leaves the model (r26.04 src/pb_tensor.cc, FromDLPack); a capsule is taken as
            # it is, with the work that produced it maybe still in flight on another stream.
            return pb_utils.Tensor.from_dlpack(name, value[None].contiguous())
        if value.dtype != torch.bfloat16:
            return pb_utils.Tensor(name, np.ascontiguousarray(value.numpy()[None]))
        return pb_utils.Tensor.from_dlpack(name, torch.utils.dlpack.to_dlpack(value[None].contiguous()))
    return pb_utils.Tensor(name, np.ascontiguousarray(np.asarray(value)[None]))


def response(outputs: Mapping[str, Any]) -> Any:
    return pb_utils.InferenceResponse(output_tensors=[_tensor(name, value) for name, value in outputs.items()])


def error_response(error: Exception) -> Any:
    message = f"{interface.REJECTED_REQUEST}: {error}" if isinstance(error, RequestError) else str(error)
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
        """The responses to a batch from its results (or each its error when the call raises one), counted."""
        self.metrics.add(stage_metrics.REQUESTS, len(requests))
        try:
            answered = results()
        except Qwen3VLTrtError as e:
            self.metrics.add(stage_metrics.REQUEST_ERRORS, len(requests))
            # One response object per request: python_backend rebuilds each returned response's shared memory and
            # frees the block a repeated object had (r26.04 src/pb_stub.cc ProcessReturnedResponses).
            return [error_response(e) for _ in requests]
        self.metrics.add(stage_metrics.REQUEST_ERRORS, sum(isinstance(r, Exception) for r in answered))
        self.count(answered)
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


class Preprocessing(_Model):
    """Decoupled, with an async execute (python_backend r24.05+, "Decoupled Async Execute"): a batch is prepared,
    its requests that need no vision encoder (all images in the visual cache, text only, refused) are answered at
    once, and its images the cache did not hold go to `vision_encoder` as one request (BLS, async_exec: a batch
    whose images all hit runs no vision encoder, and Triton's statistics show it). While a batch waits for the
    vision encoder, the next ones are prepared and answered: a hit never waits for another request's miss.

    The stub runs a coroutine that execute returns on an event loop of its own and hands the instance its next
    batch at once, with no bound on the coroutines (python_backend r24.10 and r26.04 src/pb_stub.cc
    ProcessRequests, RunCoroutine in background), so Triton's queue bound no longer holds requests back. execute
    therefore admits a batch on the stub's own thread before returning the coroutine: beyond the queue policy's
    max_queue_size plus one batch in flight it refuses a request at once with the dynamic batcher's own message
    (interface.QUEUE_FULL). Each request gets exactly one final response, whatever is raised: the stub only logs
    an exception that a coroutine raises."""

    metrics_published = stage_metrics.PREPROCESSING

    def load(self) -> None:
        from .preprocessing import Preprocessing as Component

        # The backend passes the instance's GPU as model_instance_device_id and sets no current device
        # (python_backend r26.04 src/stub_launcher.cc): "cuda" alone would put every instance on GPU 0.
        device = f"cuda:{self.device_id}" if self.params["device"] == "cuda" else self.params["device"]
        limits = self.limits()
        self.component = Component(
            self.param_path("model_dir"),
            limits,
            getattr(torch, self.params["llm_dtype"]),
            int(self.params["llm_hidden_size"]),
            mrope_positions=int(self.params["mrope_positions"]),
            device=device,
        )
        engine_dir = self.params.get("vision_engine_dir") or None
        scope = self.component.feature_scope(self.param_path("vision_dir"), Path(engine_dir) if engine_dir else None)
        self.cache_counts = _CacheCounts()
        self.component.cache = visual_cache.open_cache(
            self.params[visual_cache.VISUAL_CACHE_PARAMETER],
            scope,
            int(self.params["visual_cache_bytes"]),
            int(self.params["visual_cache_ttl_s"]),
            observer=self.cache_counts.add,
        )
        queue = int(self.config.get("dynamic_batching", {}).get("default_queue_policy", {}).get("max_queue_size", 0))
        self.in_flight_limit = queue + limits.max_batch_size if queue else None
        self.in_flight = 0  # requests admitted and not yet answered
        self.in_flight_lock = threading.Lock()  # execute admits on the stub's thread, the loop's thread answers
        # Images being encoded now, by digest: a later batch's request for one waits for it (on the loop's thread).
        self.encoding: dict[bytes, asyncio.Future[torch.Tensor | Exception]] = {}

    def finalize(self) -> None:
        if self.component.cache is not None:
            self.component.cache.close()
        super().finalize()

    def execute(self, requests: Sequence[Any]) -> Coroutine[Any, Any, None]:
        self.metrics.add(stage_metrics.REQUESTS, len(requests))
        senders = [r.get_response_sender() for r in requests]
        with self.in_flight_lock:
            room = len(requests) if self.in_flight_limit is None else max(0, self.in_flight_limit - self.in_flight)
            admitted = min(room, len(requests))
            self.in_flight += admitted
        refusal = StageError(f"{interface.QUEUE_FULL} of preprocessing: {self.in_flight_limit} requests in flight")
        for sender in senders[admitted:]:
            self._answer(sender, refusal, admitted=False)
        return self._serve(requests[:admitted], senders[:admitted])

    async def _serve(self, requests: Sequence[Any], senders: Sequence[Any]) -> None:
        from .preprocessing import Prepared

        answered: set[int] = set()

        def answer(i: int, result: Mapping[str, Any] | Exception) -> None:
            answered.add(i)
            self._answer(senders[i], result)

        try:
            if self.component.pre.device.type == "cuda":
                # The event loop's thread: BLS tensors' proxy streams are looked up by the current device.
                torch.cuda.set_device(self.component.pre.device)
            started = time.perf_counter()
            try:
                outcomes: list[Prepared | Exception] = self.component.execute(
                    [self.read(r) for r in requests], encoding=self.encoding.keys()
                )
            except Qwen3VLTrtError as e:
                outcomes = [e] * len(requests)
            self.metrics.observe(stage_metrics.PREPROCESS_SECONDS, time.perf_counter() - started)
            waiting: list[tuple[int, Prepared]] = []
            for i, outcome in enumerate(outcomes):
                if isinstance(outcome, Prepared) and outcome.pending:
                    waiting.append((i, outcome))
                else:
                    answer(i, outcome if isinstance(outcome, Exception) else self._finish(outcome, {}))
            self._publish_cache_counts()
            if waiting:
                rows = await self._rows([image for _, outcome in waiting for image in outcome.pending])
                for i, outcome in waiting:
                    failed = next(
                        (rows[image.digest] for image in outcome.pending if isinstance(rows[image.digest], Exception)),
                        None,
                    )
                    answer(i, failed if failed is not None else self._finish(outcome, rows))  # type: ignore[arg-type]
                self._publish_cache_counts()
        except Exception as e:  # a bug or a failed transfer: still one final response per request
            _log.exception("preprocessing failed a batch")
            failure = StageError(f"preprocessing failed: {type(e).__name__}: {e}")
            for i in range(len(senders)):
                if i not in answered:
                    try:
                        answer(i, failure)
                    except Exception:  # the response itself could not be sent; nothing more to do for it
                        _log.exception("preprocessing could not answer a request")

    async def _rows(self, images: Sequence[Any]) -> dict[bytes, torch.Tensor | Exception]:
        """The prompt-table rows of a batch's pending images, by digest: those it decoded go to the vision encoder
        as one request, each image once (a popular one may be in the batch twice before its first encode is
        cached); those an earlier batch is encoding now are waited for (`self.encoding`). An image's rows are the
        encoder's error when it failed."""
        own = {image.digest: image for image in images if image.vision_inputs is not None}
        joined = {image.digest: self.encoding[image.digest] for image in images if image.digest not in own}
        decoded = Counter(image.kind for image in images if image.vision_inputs is not None)
        self.metrics.add(stage_metrics.IMAGES_DECODED, decoded["image"])
        self.metrics.add(stage_metrics.VIDEOS_DECODED, decoded["video"])
        self.metrics.add(stage_metrics.ENCODES_JOINED, len(images) - sum(i.vision_inputs is not None for i in images))
        loop = asyncio.get_running_loop()
        mine = {digest: loop.create_future() for digest in own}
        self.encoding.update(mine)
        try:
            if own:
                encoded = await self._encode(list(own.values()))
                for digest, future in mine.items():
                    future.set_result(encoded if isinstance(encoded, Exception) else encoded[digest])
        finally:
            for digest, future in mine.items():
                del self.encoding[digest]
                if not future.done():
                    future.set_result(StageError("preprocessing failed while encoding this image"))
        return {digest: future.result() for digest, future in mine.items()} | {
            digest: await future for digest, future in joined.items()
        }

    async def _encode(self, images: Sequence[Any]) -> dict[bytes, torch.Tensor] | StageError:
        """The images' prompt-table rows by digest from one vision encoder request, or the error it answered."""
        request = pb_utils.InferenceRequest(
            model_name=interface.VISION_ENCODER,
            inputs=[_tensor(name, value) for name, value in self.component.vision_request(images).items()],
            requested_output_names=[interface.PROMPT_TABLE.name],
        )
        answer = await request.async_exec()
        if answer.has_error():
            return StageError(f"the vision encoder failed: {answer.error().message()}")
        output = pb_utils.get_output_tensor_by_name(answer, interface.PROMPT_TABLE.name)
        # A copy of its own, so the response's buffer (on the GPU target a block of Triton's CUDA memory pool, which
        # the DLPack capsule would hold) goes back at once.
        table = torch.from_dlpack(output.to_dlpack())[0].clone()
        try:
            return self.component.split_rows(table, images)
        except StageError as e:
            return e

    def _finish(self, prepared: Any, rows: Mapping[bytes, Any]) -> Mapping[str, Any] | Exception:
        try:
            return self.component.finish(prepared, rows)
        except Qwen3VLTrtError as e:
            return e

    def _answer(self, sender: Any, result: Mapping[str, Any] | Exception, admitted: bool = True) -> None:
        """Sends a request its one final response; an admitted request stops counting as in flight."""
        try:
            if isinstance(result, Exception):
                self.metrics.add(stage_metrics.REQUEST_ERRORS, 1)
            reply = error_response(result) if isinstance(result, Exception) else response(result)
            sender.send(reply, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        finally:
            if admitted:
                with self.in_flight_lock:
                    self.in_flight -= 1

    def _publish_cache_counts(self) -> None:
        for event, count in self.cache_counts.take().items():
            self.metrics.add(_CACHE_METRICS[event], count)


class VisionEncoder(_BatchModel):
    metrics_published = stage_metrics.VISION_ENCODER

    def load(self) -> None:
        from .vision_batching import VisionBatching

        self.component = VisionBatching(
            self.param_path("vision_dir"),
            getattr(torch, self.params["llm_dtype"]),
            int(self.params["llm_hidden_size"]),
            int(self.params["attention_budget_bytes"]),
            engine_dir=self.params.get("vision_engine_dir") or None,  # repositories of earlier versions have none
            device=self.device_id,
            on_run=self._encoded,
            intra_op_threads=self.threads,
        )
        self.component.warm_up()

    def _encoded(self, images: int, patches: int, seconds: float | None) -> None:
        self.metrics.add(stage_metrics.PATCHES_ENCODED, patches)
        self.metrics.observe(stage_metrics.VISION_RUN_PATCHES, patches)
        self.metrics.observe(stage_metrics.VISION_RUN_IMAGES, images)
        if seconds is not None:
            self.metrics.observe(stage_metrics.VISION_RUN_SECONDS, seconds)


class Postprocessing(_BatchModel):
    def load(self) -> None:
        from .postprocessing import Detokenizing

        self.component = Detokenizing(self.param_path("model_dir"))

    def execute(self, requests: Sequence[Any]) -> list[Any]:
        inputs = [self.read(r) for r in requests]
        return self.respond(requests, lambda: self.component.execute(inputs, [r.request_id() for r in requests]))


class _ResponseStream:
    """A TokenStream over a decoupled request's response sender; counts the tokens generated and the
    request's error."""

    def __init__(self, sender: Any, metrics: _Metrics, echoed: int):
        """echoed: prompt ids that lead the tokens sent, not generated ones."""
        self.sender = sender
        self.metrics = metrics
        self.echoed = echoed
        # Counted once the request ends: each metric update is a round trip to the server process
        # (python_backend src/metric.cc SendMessage), too dear for every streamed token.
        self.generated = 0

    def send(self, tokens: list[int], final: bool) -> None:
        outputs = {
            interface.LLM_OUTPUT_IDS.name: np.array([tokens], dtype=np.int32),
            interface.SEQUENCE_LENGTH.name: np.array([len(tokens)], dtype=np.int32),
        }
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
        self.metrics.add(stage_metrics.REQUEST_ERRORS, 1)
        self._count()

    def _count(self) -> None:
        self.metrics.add(stage_metrics.TOKENS_GENERATED, self.generated)
        self.generated = 0

    def cancelled(self) -> bool:
        return bool(self.sender.is_cancelled())


class CpuLLM(_Model):
    """Decoupled: execute hands the requests to the inflight batcher and returns at once."""

    metrics_published = stage_metrics.LLM

    def load(self) -> None:
        from ...runtime.local import generation_end_ids
        from .cpu_llm import InflightLLM

        self.engine = InflightLLM(
            self.param_path("checkpoint_dir"),
            generation_end_ids(self.param_path("model_dir")),
            self.limits().max_batch_size,
        )
        self.engine.warm_up()
        self.engine.start()

    def execute(self, requests: Sequence[Any]) -> None:
        self.metrics.add(stage_metrics.REQUESTS, len(requests))
        for request in requests:
            inputs = self.read(request)
            stream = _ResponseStream(request.get_response_sender(), self.metrics, _echoed_prompt(inputs))
            self.engine.submit(inputs, stream, request.request_id())

    def finalize(self) -> None:
        self.engine.close()
        super().finalize()


def _echoed_prompt(inputs: Mapping[str, Any]) -> int:
    """The prompt ids an llm response leads with: the tensorrt_llm backend's output_ids hold the prompt
    unless the request streams or sets exclude_input_in_output (tensorrtllm_backend inflight_batcher_llm)."""

    def flag(tensor: interface.Tensor) -> bool:
        value = inputs.get(tensor.name)
        return value is not None and bool(np.asarray(value).reshape(-1)[0])

    if flag(interface.STREAMING) or flag(interface.EXCLUDE_INPUT):
        return 0
    return int(np.asarray(inputs.get(interface.INPUT_IDS.name, ())).size)
