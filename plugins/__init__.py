"""TensorRT plugins of the vision engine (Triton-language kernels and their `tensorrt.plugin` registration).

Importing this package never needs TensorRT or a GPU."""

# The TensorRT plugin the plugin ONNX variant's attention nodes resolve to.
PLUGIN_NAMESPACE = "qwen3vl_trt"
PLUGIN_NAME = "varlen_attention"
PLUGIN_VERSION = "1"


def __getattr__(name: str) -> object:
    # The entry point is imported on first use: it needs torch and the Triton language, which the ONNX export (a user
    # of the names above) does not.
    if name == "varlen_attention":
        from .varlen_kernel import varlen_attention

        return varlen_attention
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
