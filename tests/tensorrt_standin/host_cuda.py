"""CUDA on the host, for running the GPU target's code on a machine without a GPU (tests only).

`host_cuda()` makes torch's CUDA device host memory for as long as it is active: `torch.device("cuda")` stays a
CUDA device (code branches on its type as on a GPU host), but tensors made on or moved to it are CPU tensors (so
`data_ptr()` is a host address the TensorRT stand-in reads and writes through), and torch.cuda's device and stream
functions are stand-ins that run work at once. Streams keep a timeline of what was ordered on them (waits between
streams, tensors recorded on a stream, and what `note` adds, e.g. an engine's enqueue), so a test can check the
ordering a GPU would rely on. The device reports itself as an H100 (sm_90).
`install_host_cuda()` does the same for the rest of a process (a tritonserver python stub: stub_gpu.py).
torch function modes are per thread: the device is host memory on the thread that activated it.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

DEVICE_NAME = "NVIDIA H100 80GB HBM3"
CAPABILITY = (9, 0)


def _on_host(value: Any) -> Any:
    if isinstance(value, torch.device) and value.type == "cuda":
        return torch.device("cpu")
    if isinstance(value, str) and value.split(":")[0] == "cuda":
        return "cpu"
    return value


class HostCuda(TorchFunctionMode):
    """The CUDA device as host memory, and a timeline of stream events: ("wait", waiter, waited), ("record", tensor
    address, stream), or what note() adds; streams appear by their handle (0 is the default stream)."""

    def __init__(self) -> None:
        super().__init__()
        self.timeline: list[tuple[Any, ...]] = []
        handles = itertools.count(1)
        timeline = self.timeline

        class Stream(torch.Stream):
            """torch.cuda.Stream: a torch.Stream of the CPU (Tensor.record_stream takes only torch streams) with a
            `cuda_stream` handle, as execute_async_v3 receives it."""

            def __new__(cls, device: Any = None, priority: int = 0, **kwargs: Any) -> Stream:
                return super().__new__(cls, device="cpu")

            def __init__(self, device: Any = None, priority: int = 0, *, handle: int | None = None) -> None:
                self.cuda_stream = next(handles) if handle is None else handle

            def wait_stream(self, stream: Stream) -> None:
                timeline.append(("wait", self.cuda_stream, stream.cuda_stream))

            def synchronize(self) -> None:
                pass

        self.Stream = Stream
        self.default_stream = Stream(handle=0)
        self.current = self.default_stream

    def note(self, *event: Any) -> None:
        self.timeline.append(event)

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func is torch.device:  # a CUDA device stays one, so code that branches on its type takes its CUDA path
            return func(*args, **(kwargs or {}))
        if func is torch.Tensor.record_stream:
            tensor, stream = args
            self.timeline.append(("record", tensor.data_ptr(), stream.cuda_stream))
            return None
        args = tuple(_on_host(a) for a in args)
        kwargs = {k: _on_host(v) for k, v in (kwargs or {}).items()}
        return func(*args, **kwargs)

    def current_stream(self, device: Any = None) -> Any:
        return self.current

    @contextlib.contextmanager
    def stream(self, stream: Any) -> Iterator[None]:
        previous, self.current = self.current, stream or self.current
        try:
            yield
        finally:
            self.current = previous

    def functions(self) -> dict[str, Any]:
        """torch.cuda's functions that need a driver, as this host device's."""
        return {
            "is_available": lambda: True,
            "device_count": lambda: 1,
            "current_device": lambda: 0,
            "get_device_capability": lambda device=None: CAPABILITY,
            "get_device_name": lambda device=None: DEVICE_NAME,
            "device": lambda device=None: contextlib.nullcontext(),
            "synchronize": lambda device=None: None,
            "Stream": self.Stream,
            "current_stream": self.current_stream,
            "stream": self.stream,
        }


@contextlib.contextmanager
def host_cuda() -> Iterator[HostCuda]:
    """torch's CUDA device as host memory while active (see the module doc)."""
    import pytest

    with pytest.MonkeyPatch.context() as monkeypatch:
        cuda = HostCuda()
        for name, value in cuda.functions().items():
            monkeypatch.setattr(torch.cuda, name, value)
        with cuda:
            yield cuda


def install_host_cuda() -> HostCuda:
    """torch's CUDA device as host memory for the rest of the process, on the calling thread."""
    cuda = HostCuda()
    for name, value in cuda.functions().items():
        setattr(torch.cuda, name, value)
    cuda.__enter__()
    return cuda
