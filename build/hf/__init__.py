"""The input: a Hugging Face Qwen3-VL checkpoint as released, read lazily (`checkpoint`), its quantized formats and
their exact dequantization (`quantization`), streaming safetensors I/O (`safetensors_io`), the released chat templates
(`chat_templates`), and transformers running it as the reference that exports and tests are checked against
(`reference`)."""
