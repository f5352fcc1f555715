# GPU-host image: qwen3vl-trt on NVIDIA's Triton container with TensorRT-LLM 1.2.1 (TensorRT ~= 10.14.1),
# the stack this project pins. It builds and runs on a GPU host only (NVIDIA driver, NVIDIA Container
# Toolkit); a CPU-only machine serves with the nvidia-pytriton server instead (README, "Serving").
#
# TRITON_TAG: the Triton release whose trtllm-python-py3 image ships TensorRT-LLM 1.2.1. Triton's compatibility
# matrix (triton-inference-server/server r26.04, docs/introduction/compatibility.md) lists TensorRT-LLM 1.2.1 with
# TensorRT 10.14.1.48 and CUDA 13.1 for 26.04 to 26.07 (26.03 ships 1.2.0). build/gpu_image.py records the image's
# versions with their sources; the first RUN stops the build when the image has others.
ARG TRITON_TAG=26.04
FROM nvcr.io/nvidia/tritonserver:${TRITON_TAG}-trtllm-python-py3

# The image's Python packages live in its virtual environment /opt/venv-tritonserver (python3.12 -m venv), first on
# PATH (tensorrtllm_backend r26.04 dockerfile/Dockerfile.triton.trt_llm_backend): python3 and pip below are its and
# install into it, which PEP 668 leaves alone (it guards the system Python only). The first RUN stops the build when
# python3 lacks the image's packages.
SHELL ["/bin/bash", "-o", "pipefail", "-c"]

WORKDIR /opt/qwen3vl-trt
COPY build/gpu_image.py /tmp/gpu_image.py
RUN python3 /tmp/gpu_image.py check image

# Exactly what pyproject.toml maps into the package (tests/test_dockerfile.py builds the wheel from this set).
COPY pyproject.toml README.md ./
COPY build ./build
COPY plugins ./plugins
COPY triton_models ./triton_models

# The image's own packages (torch, tensorrt, tensorrt_llm, transformers, grpcio, ...) become constraints, so pip
# adds what qwen3vl-trt needs around them and never replaces one; nvImageCodec comes at the version the tests check
# and with the nvJPEG of the image's CUDA (its [nvjpeg] extra names none), tritonclient at the release that fits the
# image's grpcio. Not ".[gpu]": TensorRT-LLM is installed already, and
# asking for it again makes pip prepare its direct-URL dependencies anew. A version conflict fails the build.
RUN python3 -m pip list --format=freeze | grep -viE '^(pip|setuptools|wheel)==' > /tmp/image-constraints.txt \
 && python3 /tmp/gpu_image.py requirements > /tmp/qwen3vl-trt-requirements.txt \
 && python3 -m pip install --no-cache-dir -c /tmp/image-constraints.txt -r /tmp/qwen3vl-trt-requirements.txt . \
 && python3 /tmp/gpu_image.py check all \
 && rm /tmp/image-constraints.txt /tmp/qwen3vl-trt-requirements.txt /tmp/gpu_image.py

# NVDEC (video decoding into device memory) needs the driver's video libraries (libnvcuvid), which the NVIDIA
# container runtime mounts only when the driver capabilities include "video".
ENV NVIDIA_DRIVER_CAPABILITIES=compute,utility,video

# HTTP, gRPC, metrics (serve binds loopback unless given --address 0.0.0.0).
EXPOSE 8000 8001 8002
ENTRYPOINT ["qwen3vl-trt"]
CMD ["--help"]
