"""The language-model stage: engine inputs, the TensorRT-LLM checkpoint format, conversion with the engine's
precision (weight-only INT8/INT4, FP8, a quantized KV cache; which mode for which GPU), the engine model and the
engine build. The calibration pass that FP8 and quantized KV caches take their scales from runs above it
(qwen3vl_trt.pipeline.calibration)."""
