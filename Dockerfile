# GPU-host image: qwen3vl-trt on NVIDIA's Triton container with TensorRT-LLM 1.2.1 (TensorRT ~= 10.14.1),
# the stack this project pins. It builds and runs on a GPU host only (NVIDIA driver, NVIDIA Container
# Toolkit); a CPU-only machine serves with the nvidia-pytriton server instead (README, "Serving").
#
# TRITON_TAG: the Triton release whose trtllm-python-py3 image ships TensorRT-LLM 1.2.1. NVIDIA's
# compatibility matrix (docs.nvidia.com/deeplearning/triton-inference-server/user-guide/docs/introduction/
# compatibility.html) lists 1.1.0 for 25.12; third-party deployment notes report 1.2.0 for 26.03 and 1.2.1
# for 26.04 (CUDA 13.2.1), which we could not confirm in the 26.04 release notes themselves. The first RUN
# below stops the build when the image's TensorRT-LLM is not 1.2.1, so a wrong tag cannot pass unnoticed.
ARG TRITON_TAG=26.04
FROM nvcr.io/nvidia/tritonserver:${TRITON_TAG}-trtllm-python-py3

# The image's packages live in Ubuntu 24.04's system Python, which refuses pip installs by default (PEP 668).
ENV PIP_BREAK_SYSTEM_PACKAGES=1

RUN python3 -c "from importlib.metadata import version; v = version('tensorrt_llm'); \
assert v.split('+')[0] == '1.2.1', f'this image has TensorRT-LLM {v}, not 1.2.1: choose another TRITON_TAG'"

WORKDIR /opt/qwen3vl-trt
COPY pyproject.toml README.md ./
COPY build ./build
COPY triton_models ./triton_models

# The image's own packages (torch, tensorrt, tensorrt_llm, transformers, ...) become constraints, so pip
# adds what qwen3vl-trt needs around them and never replaces one: the gpu extra's tensorrt and
# tensorrt-llm pins are met by the image's installs, and a version conflict fails the build.
RUN python3 -m pip list --format=freeze | grep -viE '^(pip|setuptools|wheel)==' > /tmp/image-constraints.txt \
 && python3 -m pip install --no-cache-dir -c /tmp/image-constraints.txt ".[gpu]" \
 && rm /tmp/image-constraints.txt

# HTTP, gRPC, metrics (serve binds loopback unless given --address 0.0.0.0).
EXPOSE 8000 8001 8002
ENTRYPOINT ["qwen3vl-trt"]
CMD ["--help"]
