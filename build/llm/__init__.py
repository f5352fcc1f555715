"""The language-model stage: engine inputs, the TensorRT-LLM checkpoint format, conversion with the engine's
precision (weight-only INT8/INT4, FP8, a quantized KV cache; which mode for which GPU; calibration), the engine
model and the engine build."""
