"""tensorrt_llm/llmapi/kv_cache_type.py (PR #8330, NVIDIA/TensorRT-LLM 18836202): the KV cache type as a string enum
that takes its values in any case."""

from enum import Enum


class KVCacheType(str, Enum):
    CONTINUOUS = "continuous"
    PAGED = "paged"
    DISABLED = "disabled"

    @classmethod
    def _missing_(cls, value):
        if isinstance(value, str):
            for member in cls:
                if member.value == value.lower():
                    return member
        return None
