"""The language-model stage: engine inputs, the TensorRT-LLM checkpoint format, conversion, the
engine model and the engine build."""
