"""tensorrt_llm/models/__init__.py: MODEL_MAP is a plain dict of the architectures TensorRT-LLM knows (its Qwen keys
here); nothing registers ours."""

from .modeling_utils import PretrainedConfig, PretrainedModel
from .qwen.model import QWenForCausalLM

MODEL_MAP = {
    "QWenLMHeadModel": QWenForCausalLM,
    "QWenForCausalLM": QWenForCausalLM,
    "Qwen2ForCausalLM": QWenForCausalLM,
    "Qwen2MoeForCausalLM": QWenForCausalLM,
    "Qwen2ForSequenceClassification": QWenForCausalLM,
    "Qwen2VLForConditionalGeneration": QWenForCausalLM,
    "Qwen2VLModel": QWenForCausalLM,
    "Qwen3ForCausalLM": QWenForCausalLM,
}

__all__ = ["MODEL_MAP", "PretrainedConfig", "PretrainedModel", "QWenForCausalLM"]
