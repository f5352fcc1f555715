"""TensorRT plugins of the vision engine (Triton-language kernels and their `tensorrt.plugin` registration).

Importing this package never needs TensorRT or a GPU."""

# The TensorRT plugin the plugin ONNX variant's attention nodes resolve to.
PLUGIN_NAMESPACE = "qwen3vl_trt"
PLUGIN_NAME = "varlen_attention"
PLUGIN_VERSION = "1"
