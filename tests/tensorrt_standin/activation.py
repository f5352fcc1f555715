"""The stand-ins switched on: for a block of a test process (`gpu_stack()`), or in a python stub of a repository the
tests serve (`gpu_in_stub()`)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from .host_cuda import HostCuda, host_cuda

STANDIN = Path(__file__).parent


def _tensorrt_modules() -> list[str]:
    return [name for name in sys.modules if name == "tensorrt" or name.startswith("tensorrt.")]


@contextlib.contextmanager
def gpu_stack() -> Iterator[HostCuda]:
    """While active, `import tensorrt` is the stand-in (a fresh one: its plugin registry empty, and qwen3vl_trt's
    plugin registration forgotten) and torch's CUDA device is host memory; yields the host device. torch.export does
    not run under the host device's function mode: export before."""
    from qwen3vl_trt.plugins import registration

    with pytest.MonkeyPatch.context() as patch:
        for name in _tensorrt_modules():
            patch.delitem(sys.modules, name)
        patch.syspath_prepend(str(STANDIN))
        patch.setattr(registration, "_registered_capability", None)
        try:
            with host_cuda() as cuda:
                yield cuda
        finally:
            for name in _tensorrt_modules():
                del sys.modules[name]


def gpu_in_stub(model_dir: Path) -> None:
    """Makes the python model in `model_dir` (a repository's model directory) import stub_gpu before its own code, so
    its stub runs with the TensorRT stand-in and CUDA on the host."""
    model = model_dir / "1" / "model.py"
    shim = f"import sys\n\nsys.path.insert(0, {str(STANDIN)!r})\nimport stub_gpu  # noqa: E402, F401\n\n"
    model.write_text(shim + model.read_text())
