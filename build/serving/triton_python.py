"""Triton python-backend models over the serving components; the repository's model.py files are
one import of these. Importable only inside Triton's python backend (triton_python_backend_utils).

Tensors are read as numpy arrays without their batch dimension (bf16 and device tensors through
DLPack, as torch tensors) and written back with it. Each model's parameters come from its
config.pbtxt, which the repository writer fills from the build.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import triton_python_backend_utils as pb_utils  # type: ignore[import-not-found]

from ..errors import Qwen3VLTrtError, RequestError
from ..limits import EngineLimits
from . import interface

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


COMPUTING_MODELS = 3
"""Python models whose stubs compute on the host's cores at once: preprocessing, vision_encoder, llm."""


def intra_op_threads() -> int:
    """Threads for one model instance's torch and ONNX Runtime ops: its share of the cores this process
    may run on. Each python model is its own stub process; one with more threads than its share makes
    its OpenMP/ORT threads wait at every op for threads that the other stubs keep off the cores (on
    2 cores with the other stubs busy, preprocessing took 10x longer with 2 threads than with 1)."""
    return max(1, len(os.sched_getaffinity(0)) // COMPUTING_MODELS)


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

    def initialize(self, args: Mapping[str, str]) -> None:
        _log_to_triton()
        keep_freed_memory()
        self.threads = intra_op_threads()
        torch.set_num_threads(self.threads)
        config = json.loads(args["model_config"])
        self.params = {key: value["string_value"] for key, value in config.get("parameters", {}).items()}
        self.inputs = {spec["name"]: spec["data_type"] for spec in config["input"]}
        self.device_id = int(args.get("model_instance_device_id", 0))
        self.load()

    def load(self) -> None:
        raise NotImplementedError

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


def _respond(results: Sequence[Mapping[str, Any] | Exception]) -> list[Any]:
    return [error_response(r) if isinstance(r, Exception) else response(r) for r in results]


class _BatchModel(_Model):
    """A model that answers every request of a batch from one call of its component."""

    component: Any

    def execute(self, requests: Sequence[Any]) -> list[Any]:
        inputs = [self.read(r) for r in requests]
        try:
            return _respond(self.component.execute(inputs))
        except Qwen3VLTrtError as e:
            # One response object per request: python_backend rebuilds each returned response's shared memory and
            # frees the block a repeated object had (r26.04 src/pb_stub.cc ProcessReturnedResponses).
            return [error_response(e) for _ in requests]


class Preprocessing(_BatchModel):
    def load(self) -> None:
        from .preprocessing import Preprocessing as Component

        # The backend passes the instance's GPU as model_instance_device_id and sets no current device
        # (python_backend r26.04 src/stub_launcher.cc): "cuda" alone would put every instance on GPU 0.
        device = f"cuda:{self.device_id}" if self.params["device"] == "cuda" else self.params["device"]
        self.component = Component(
            self.param_path("model_dir"),
            self.limits(),
            mrope_positions=int(self.params["mrope_positions"]),
            device=device,
        )


class VisionEncoder(_BatchModel):
    def load(self) -> None:
        from .vision_batching import VisionBatching

        self.component = VisionBatching(
            self.param_path("vision_dir"),
            getattr(torch, self.params["llm_dtype"]),
            int(self.params["llm_hidden_size"]),
            int(self.params["attention_budget_bytes"]),
            engine_dir=self.params.get("vision_engine_dir") or None,  # repositories of earlier versions have none
            device=self.device_id,
            intra_op_threads=self.threads,
        )
        self.component.warm_up()


class Postprocessing(_Model):
    def load(self) -> None:
        from .detokenize import Detokenizing

        self.component = Detokenizing(self.param_path("model_dir"))

    def execute(self, requests: Sequence[Any]) -> list[Any]:
        results = self.component.execute([self.read(r) for r in requests], [r.request_id() for r in requests])
        return _respond(results)


class _ResponseStream:
    """A TokenStream over a decoupled request's response sender."""

    def __init__(self, sender: Any):
        self.sender = sender

    def send(self, tokens: list[int], final: bool) -> None:
        outputs = {
            interface.LLM_OUTPUT_IDS.name: np.array([tokens], dtype=np.int32),
            interface.SEQUENCE_LENGTH.name: np.array([len(tokens)], dtype=np.int32),
        }
        self.sender.send(response(outputs), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0)

    def finish(self) -> None:
        self.sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def fail(self, error: Exception) -> None:
        self.sender.send(error_response(error), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def cancelled(self) -> bool:
        return bool(self.sender.is_cancelled())


class CpuLLM(_Model):
    """Decoupled: execute hands the requests to the inflight batcher and returns at once."""

    def load(self) -> None:
        from ..runtime.local import generation_end_ids
        from .cpu_llm import InflightLLM

        self.engine = InflightLLM(
            self.param_path("checkpoint_dir"),
            generation_end_ids(self.param_path("model_dir")),
            self.limits().max_batch_size,
        )
        self.engine.warm_up()
        self.engine.start()

    def execute(self, requests: Sequence[Any]) -> None:
        for request in requests:
            self.engine.submit(self.read(request), _ResponseStream(request.get_response_sender()), request.request_id())

    def finalize(self) -> None:
        self.engine.close()
