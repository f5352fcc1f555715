"""qwen3vl-trt: Qwen3-VL as TensorRT engines behind Triton Inference Server."""

__version__ = "0.1.0"
