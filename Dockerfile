# GPU-host image for qwen3vl-trt: the toolchain on top of NVIDIA's Triton + TensorRT-LLM container.
# Placeholder until the deployment work: set BASE_IMAGE to the Triton release that ships
# TensorRT-LLM 1.2.1 (TensorRT ~= 10.14.1), the stack this project pins.
ARG BASE_IMAGE
FROM ${BASE_IMAGE}
WORKDIR /opt/qwen3vl-trt
COPY pyproject.toml README.md ./
COPY build ./build
RUN pip install --no-cache-dir .
ENTRYPOINT ["qwen3vl-trt"]
