"""The GPU image's versions (build/gpu_image.py): one table that the Dockerfile, the packaging and the test
environment of those versions all read, and a pass of the GPU-side tests that really runs at them."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
from qwen3vl_trt import gpu_image

ROOT = Path(__file__).resolve().parents[1]
IMAGE_PASS = os.environ.get("QWEN3VL_GPU_IMAGE_PASS") == "1"

pytestmark = [pytest.mark.once, pytest.mark.gpu_image]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(ROOT / "build" / "gpu_image.py"), *args], capture_output=True, text=True)


@pytest.mark.skipif(not IMAGE_PASS, reason="the GPU image's versions pass only (scripts/test.sh)")
def test_this_pass_runs_at_the_image_versions():
    """The overlay is in effect: every package the table marks as tested here is at the image's version."""
    assert gpu_image.mismatches(tuple(e for e in gpu_image.IMAGE_PACKAGES if e.tested_here)) == []
    import triton
    from triton.backends.nvidia.compiler import get_ptxas

    assert triton.__version__ == gpu_image.package("triton").version
    # The 3.5.1 API the plugin's AOT path must work with (newer versions take the compute capability).
    assert not inspect.signature(get_ptxas).parameters


def test_the_dockerfile_checks_the_image_against_the_table():
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert f"ARG TRITON_TAG={gpu_image.TRITON_TAG}" in dockerfile
    assert "COPY build/gpu_image.py /tmp/gpu_image.py" in dockerfile
    assert dockerfile.index("gpu_image.py check image") < dockerfile.index("pip install --no-cache-dir -c")
    assert "gpu_image.py requirements > /tmp/qwen3vl-trt-requirements.txt" in dockerfile
    assert "-c /tmp/image-constraints.txt -r /tmp/qwen3vl-trt-requirements.txt ." in dockerfile
    assert "gpu_image.py check all" in dockerfile


def test_the_gpu_extra_agrees_with_the_table():
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["gpu"]
    assert f"tensorrt-llm=={gpu_image.package('tensorrt_llm').version}" in extra
    tensorrt = gpu_image.package("tensorrt").version.split(".")
    assert f"tensorrt~={'.'.join(tensorrt[:3])}" in extra
    assert any(spec.startswith("nvidia-nvimgcodec-cu13") for spec in extra)
    assert gpu_image.package("nvidia-nvjpeg").pip_spec in extra


def test_nvjpeg_is_pinned_to_the_image_cuda():
    """nvImageCodec's [nvjpeg] extra names nvidia-nvjpeg without a version, so pip would take the newest (a CUDA
    13.2 or 13.3 build); the table pins the nvJPEG of CUDA 13.1, the image's, and the image installs it."""
    nvjpeg = gpu_image.package("nvidia-nvjpeg")
    assert nvjpeg.provider == "qwen3vl-trt" and nvjpeg.version.startswith("13.0.")
    assert "13.1" in gpu_image.package("nvidia-nvimgcodec-cu13").source


def test_requirements_pin_what_qwen3vl_trt_brings_and_overlay_what_installs_here():
    requirements = _run("requirements")
    assert requirements.returncode == 0
    assert requirements.stdout.split() == [
        "nvidia-nvimgcodec-cu13[nvjpeg]==0.9.0.20",
        "nvidia-nvjpeg==13.0.2.28",
        "PyNvVideoCodec==2.2.4",
    ]
    overlay = _run("overlay").stdout.split()
    assert {"triton==3.5.1", "tritonclient==2.68.0", "protobuf==6.33.5", "nvidia-nvjpeg==13.0.2.28"} <= set(overlay)


def test_protobuf_is_the_oldest_tensorrt_llm_takes():
    """TensorRT-LLM 1.2.1 requires protobuf>=6.33.5 (its PKG-INFO), so the image never runs an older one: the config
    generation tests run at that version, which tritonclient 2.68.0's grpc extra (>=6.30.0,<7) also takes."""
    protobuf = gpu_image.package("protobuf")
    assert protobuf.version == "6.33.5" and "protobuf>=6.33.5" in protobuf.source and protobuf.tested_here


def test_check_stops_on_another_image():
    """Here (no TensorRT-LLM, another Python): the check fails, naming what differs and what to do."""
    result = _run("check", "image")
    assert result.returncode == 1
    assert "tensorrt_llm is not installed (the GPU image has 1.2.1)" in result.stderr
    assert "choose another TRITON_TAG" in result.stderr
    assert _run("nonsense").returncode == 2


def test_local_labels_do_not_count():
    assert gpu_image.base_version("3.5.1+gitbfeb0668.nv25.12") == "3.5.1"
    assert gpu_image.base_version("2.10.0a0+b4e4ee81d3.nv25.12") == "2.10.0a0"
    with pytest.raises(KeyError):
        gpu_image.package("no-such-package")
