"""The python-backend adapters (serving.stages.triton_adapters) where they meet Triton's buffers: the prompt table
preprocessing gets back from the vision encoder (BLS) is copied before the response's buffer goes back to Triton.

The adapters import triton_python_backend_utils, which only Triton's python stub has. A stand-in gives the names the
BLS call uses, as python_backend r26.04 has them (README "Business Logic Scripting": InferenceRequest, its
async_exec, get_output_tensor_by_name; src/pb_tensor.cc PbTensor::ToDLPack). Only what needs CUDA stands in for torch
on the device path: a tensor that says it is on a GPU, and torch.cuda's current stream, which records its
synchronize.
"""

from __future__ import annotations

import asyncio
import importlib
import sys
import types
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.once

ADAPTERS = "qwen3vl_trt.serving.stages.triton_adapters"


class _Answer:
    """A BLS response without error, holding one output."""

    def __init__(self, output: Any):
        self.output = output

    def has_error(self) -> bool:
        return False


def _pb_utils(output: Any) -> types.ModuleType:
    """triton_python_backend_utils whose every BLS request is answered with `output` as its one output."""
    module = types.ModuleType("triton_python_backend_utils")

    class InferenceRequest:
        def __init__(self, model_name, inputs, requested_output_names, request_id=""):
            pass

        async def async_exec(self) -> _Answer:
            return _Answer(output)

    module.InferenceRequest = InferenceRequest  # type: ignore[attr-defined]
    module.get_output_tensor_by_name = lambda answer, _name: answer.output  # type: ignore[attr-defined]
    return module


@pytest.fixture
def adapters():
    """The adapters module imported beside a stand-in triton_python_backend_utils (each test's BLS answer is given by
    _encoded), and forgotten afterwards."""
    from qwen3vl_trt.serving import stages

    saved = {name: sys.modules.get(name) for name in (ADAPTERS, "triton_python_backend_utils")}
    attribute = stages.__dict__.get("triton_adapters")
    sys.modules.pop(ADAPTERS, None)
    sys.modules["triton_python_backend_utils"] = _pb_utils(None)
    try:
        yield importlib.import_module(ADAPTERS)
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
        if attribute is None:
            stages.__dict__.pop("triton_adapters", None)
        else:
            stages.triton_adapters = attribute


def _encoded(adapters, output: Any) -> Any:
    """What preprocessing's BLS call to the vision encoder returns when the response carries `output`."""
    adapters.pb_utils = _pb_utils(output)
    model = object.__new__(adapters.PreprocessingModel)
    return asyncio.run(model._encode({}, False))


class _Output:
    """A python-backend tensor (pb_utils.Tensor) of host memory: to_dlpack as python_backend's PbTensor::ToDLPack."""

    def __init__(self, value: torch.Tensor):
        self.value = value

    def to_dlpack(self):
        return torch.utils.dlpack.to_dlpack(self.value)


def test_a_host_output_is_copied_without_cuda_calls(adapters, monkeypatch):
    def no_cuda(*_args):
        raise AssertionError("a host tensor's copy needs no CUDA call")

    monkeypatch.setattr(torch.cuda, "current_stream", no_cuda)
    value = torch.arange(6, dtype=torch.bfloat16).reshape(1, 3, 2)
    copy = _encoded(adapters, _Output(value))
    assert torch.equal(copy, value[0]) and copy.data_ptr() != value.data_ptr()


class _DeviceTensor:
    """What torch.from_dlpack gives for a Triton CUDA-pool buffer: `[0]` is a view of the buffer, which Triton may
    reuse once the last view is gone (log: "released"); clone queues a copy on the current stream."""

    is_cuda = True
    device = "cuda:1"

    def __init__(self, log: list[str], view: bool = False):
        self.log, self.view = log, view

    def __getitem__(self, _index) -> _DeviceTensor:
        return _DeviceTensor(self.log, view=True)

    def clone(self) -> _DeviceTensor:
        self.log.append("copy queued")
        return _DeviceTensor([])

    def __del__(self):
        if self.view:
            self.log.append("released")


class _Cuda:
    """torch.cuda's current_stream, recording which device's stream is synchronized."""

    def __init__(self, log: list[str]):
        self.log = log

    def current_stream(self, device):
        return types.SimpleNamespace(synchronize=lambda: self.log.append(f"synchronized {device}"))


def test_a_device_output_is_copied_before_its_buffer_goes_back(adapters, monkeypatch):
    """The copy runs on the current CUDA stream: the stream is synchronized before the view of Triton's buffer is
    dropped, else the pool may hand the block to another tensor while the copy still reads it."""
    log: list[str] = []
    stand_in = types.SimpleNamespace(from_dlpack=lambda _capsule: _DeviceTensor(log), cuda=_Cuda(log))
    monkeypatch.setattr(adapters, "torch", stand_in)
    copy = _encoded(adapters, types.SimpleNamespace(to_dlpack=lambda: "capsule"))
    assert copy.is_cuda and log == ["copy queued", "synchronized cuda:1", "released"]
