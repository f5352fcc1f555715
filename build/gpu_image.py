"""The GPU image's own versions: what the GPU-side code runs with, recorded once, with where each was read.

The GPU code path (the plugin's AOT compile, the TensorRT-LLM launcher, the tensorrtllm config, nvImageCodec decoding)
must be checked at these versions, not at the development environment's: the tests run the parts whose wheels install
on a CPU machine again in an environment of these versions (scripts/test.sh, `python -m qwen3vl_trt.gpu_image
overlay`), and the Dockerfile stops when the image it builds on has others (`python3 gpu_image.py check`).

Standard library only: the Dockerfile runs this file by path before the package is installed.

Image: nvcr.io/nvidia/tritonserver:26.04-trtllm-python-py3 (TensorRT-LLM 1.2.1; 26.05-26.07 have the same row in
Triton's compatibility matrix, 26.03 ships 1.2.0).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from importlib import metadata

TRITON_TAG = "26.04"

_MATRIX = "triton-inference-server/server r26.04 docs/introduction/compatibility.md (trtllm-python-py3 table)"
_BACKEND_DOCKERFILE = "triton-inference-server/tensorrtllm_backend r26.04 dockerfile/Dockerfile.triton.trt_llm_backend"


@dataclass(frozen=True)
class ImagePackage:
    """One Python distribution of the GPU image. provider "image": the base image installs it and the Dockerfile
    keeps it (pip constraints); "qwen3vl-trt": our Dockerfile installs it at this version; "resolved": neither pins
    it, pip resolves it within its dependents' bounds, and the tests take the bound recorded here."""

    distribution: str
    version: str
    source: str
    provider: str = "image"
    # Other names the same code is installed under (the image copies PyTorch's Triton as pytorch-triton).
    aliases: tuple[str, ...] = ()
    # Whether the CPU test environment of these versions installs it (a wheel that works without a GPU).
    tested_here: bool = False
    # The extras the image installs it with (nvImageCodec's [nvjpeg] brings the CUDA JPEG decoder).
    extras: str = ""

    @property
    def pip_spec(self) -> str:
        return f"{self.distribution}{self.extras}=={self.version}"


IMAGE_PACKAGES: tuple[ImagePackage, ...] = (
    ImagePackage("tensorrt_llm", "1.2.1", f"{_MATRIX}; {_BACKEND_DOCKERFILE}: TENSORRTLLM_VER=1.2.1"),
    ImagePackage("tensorrt", "10.14.1.48", f"{_MATRIX}; {_BACKEND_DOCKERFILE}: TRT_VER=10.14.1.48 (CUDA 13.0 tarball)"),
    ImagePackage(
        "triton",
        "3.5.1",
        f"{_BACKEND_DOCKERFILE}: PIP_WHL_VER_PYTORCH_TRITON=3.5.1+gitbfeb0668.nv25.12 (copied from pytorch:25.12-py3)",
        aliases=("pytorch-triton",),
        tested_here=True,
    ),
    ImagePackage(
        "torch", "2.10.0a0", f"{_MATRIX}; {_BACKEND_DOCKERFILE}: PIP_WHL_VER_TORCH=2.10.0a0+b4e4ee81d3.nv25.12"
    ),
    ImagePackage("transformers", "4.57.3", "TensorRT-LLM 1.2.1 requirements.txt (transformers==4.57.3)"),
    # The grammar library of guided decoding, in the executor (3rdparty/fetch_content.json) and in Python: 1.2.0 pinned
    # 0.1.25; "[None][infra] Bump xgrammar" (NVIDIA/TensorRT-LLM #12811, merged 2026-04-07, the 1.2.1 release's
    # infra work) moved requirements.txt and the C++ fetch to 0.1.32. The gateway and the CPU runtime build and run
    # the same grammars at this version (0.1.25 masks bounded strings hundreds of times slower).
    ImagePackage(
        "xgrammar",
        "0.1.32",
        "TensorRT-LLM #12811 (requirements.txt and 3rdparty/fetch_content.json: xgrammar 0.1.25 -> 0.1.32)",
        tested_here=True,
    ),
    # Not pinned by the image (neither its Dockerfile nor Triton's build.py installs it), nor by us: each tritonclient
    # release pins a grpcio range (2.68.0: <1.68; 2.73.0: >=1.81.1), so the image build lets pip take the one that
    # fits the image's grpcio. Tested here: the release of the 26.04 server.
    ImagePackage(
        "tritonclient",
        "2.68.0",
        "Triton 2.68.0 is the 26.04 server (triton-inference-server/server r26.04 build.py release_version)",
        provider="resolved",
        tested_here=True,
    ),
    # Not pinned by the image either, but bounded below by TensorRT-LLM 1.2.1 itself (its PKG-INFO: Requires-Dist
    # protobuf>=6.33.5), above onnx's generated code (onnx 1.19 and later refuse a runtime older than 6.31.1) and within
    # tritonclient 2.68.0's grpc extra (protobuf >=6.30.0,<7): the oldest protobuf the image can have is tested.
    ImagePackage(
        "protobuf",
        "6.33.5",
        "tensorrt_llm 1.2.1 PKG-INFO: protobuf>=6.33.5; tritonclient 2.68.0 METADATA: protobuf <7.0,>=6.30.0",
        provider="resolved",
        tested_here=True,
    ),
    ImagePackage(
        "grpcio",
        "1.67.1",
        "tritonclient 2.68.0 METADATA: grpcio <1.68,>=1.63.0 (grpc extra); the newest it allows",
        provider="resolved",
        tested_here=True,
    ),
    # Not a TensorRT-LLM dependency: our gpu extra installs it.
    ImagePackage(
        "nvidia-nvimgcodec-cu13",
        "0.9.0.20",
        "pyproject.toml gpu extra (CUDA 13 build; the image's CUDA is 13.1)",
        provider="qwen3vl-trt",
        tested_here=True,
        extras="[nvjpeg]",
    ),
    # What nvImageCodec's [nvjpeg] extra asks for, unversioned (its METADATA: Requires-Dist nvidia-nvjpeg): pip would
    # take the newest, built for a newer CUDA than the image's. CUDA 13.1.0's nvJPEG, the oldest of the image's minor
    # release, so the driver of any 13.1 update runs it (NVIDIA conda channel, libnvjpeg-dev labels: cuda-13.1.0
    # 13.0.2.28, cuda-13.1.1 13.0.3.75).
    ImagePackage(
        "nvidia-nvjpeg",
        "13.0.2.28",
        "nvidia-nvimgcodec-cu13 0.9.0.20 [nvjpeg] extra; nvJPEG of CUDA 13.1.0 (the image's CUDA is 13.1)",
        provider="qwen3vl-trt",
        tested_here=True,
    ),
    # Not a TensorRT-LLM dependency either. Its wheel installs on CPU machines but its import loads the driver's
    # libnvcuvid/libnvidia-encode, so only GPU hosts test it (tests/test_video_cuda.py).
    ImagePackage(
        "PyNvVideoCodec",
        "2.2.4",
        "pyproject.toml gpu extra (NVDEC into device memory; SimpleDecoder reads bytes in memory since 2.2)",
        provider="qwen3vl-trt",
    ),
)
PYTHON_VERSION = "3.12"  # the image's /opt/venv-tritonserver (python3.12 -m venv): _BACKEND_DOCKERFILE


def package(distribution: str) -> ImagePackage:
    for entry in IMAGE_PACKAGES:
        if entry.distribution == distribution:
            return entry
    raise KeyError(distribution)


def base_version(version: str) -> str:
    """'3.5.1+gitbfeb0668.nv25.12' -> '3.5.1': local labels name the build, not the release."""
    return version.split("+", 1)[0]


def installed_version(entry: ImagePackage) -> str | None:
    for name in (entry.distribution, *entry.aliases):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def mismatches(entries: tuple[ImagePackage, ...] = IMAGE_PACKAGES) -> list[str]:
    """What is installed here at another version than the image's (missing packages included)."""
    problems = []
    for entry in entries:
        found = installed_version(entry)
        if found is None:
            problems.append(f"{entry.distribution} is not installed (the GPU image has {entry.version})")
        elif base_version(found) != entry.version:
            problems.append(f"{entry.distribution} is {found}, the GPU image's is {entry.version} ({entry.source})")
    return problems


def _main(argv: list[str]) -> int:
    usage = (
        "usage: gpu_image.py check [image|all] | requirements | overlay\n"
        "  check image: the base image's packages are the recorded ones (before qwen3vl-trt is installed)\n"
        "  check all: the image's and ours still are (after), and what pip resolved\n"
        "  requirements: what qwen3vl-trt pins into the image, besides itself\n"
        "  overlay: pip requirements of the CPU test environment at the image's versions"
    )
    if not argv or argv[0] not in ("check", "requirements", "overlay"):
        print(usage, file=sys.stderr)
        return 2
    if argv[0] == "requirements":
        print("\n".join(e.pip_spec for e in IMAGE_PACKAGES if e.provider == "qwen3vl-trt"))
        return 0
    if argv[0] == "overlay":
        print("\n".join(e.pip_spec for e in IMAGE_PACKAGES if e.tested_here))
        return 0
    scope = argv[1] if len(argv) > 1 else "all"
    pinned = ("image", "qwen3vl-trt") if scope == "all" else ("image",)
    entries = tuple(e for e in IMAGE_PACKAGES if e.provider in pinned)
    problems = mismatches(entries)
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    if python != PYTHON_VERSION:
        problems.append(f"Python is {python}, the GPU image's is {PYTHON_VERSION}")
    for problem in problems:
        print(f"gpu_image: {problem}", file=sys.stderr)
    if problems:
        print(
            f"gpu_image: this is not the image qwen3vl-trt is built for (tritonserver:{TRITON_TAG}-trtllm-python-py3); "
            "choose another TRITON_TAG or update build/gpu_image.py after checking the code against the new versions",
            file=sys.stderr,
        )
        return 1
    print(f"gpu_image: {len(entries)} packages at the recorded versions")
    if scope == "all":
        for entry in IMAGE_PACKAGES:
            if entry.provider == "resolved":
                found = installed_version(entry) or "absent"
                print(f"gpu_image: {entry.distribution} {found} (resolved by pip; the tests run {entry.version})")
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
