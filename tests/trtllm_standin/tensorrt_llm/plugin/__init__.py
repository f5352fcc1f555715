"""tensorrt_llm/plugin/plugin.py after PR #8277 (pydantic): PluginConfig and the trtllm-build flags that
add_plugin_argument derives from its fields. Only the fields the launcher passes are modelled; the flag rules are
upstream's: bool fields take enable/disable, plugin dtypes take the dtype names or auto/disable, extra argparse keys
are ignored (extra="ignore"), from_arguments is `cls(**vars(args))`, validate an instance method."""

import argparse
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

_DTYPES = ("auto", "float16", "float32", "bfloat16", "int32")
PluginDtype = Literal["auto", "float16", "float32", "bfloat16", "int32"] | None


class PluginConfig(BaseModel):
    model_config = ConfigDict(validate_assignment=True, extra="ignore")

    dtype: str = Field(default="float16")
    gpt_attention_plugin: PluginDtype = "auto"
    gemm_plugin: PluginDtype = None
    moe_plugin: PluginDtype = "auto"
    context_fmha: bool = True
    use_paged_context_fmha: bool = True
    remove_input_padding: bool = True
    tokens_per_block: int = 32

    @field_validator("*", mode="before")
    @classmethod
    def convert_enable_disable(cls, value, info):
        if value == "enable":
            return True
        if value == "disable":
            return False if cls.model_fields[info.field_name].annotation is bool else None
        return value

    @classmethod
    def from_arguments(cls, args: argparse.Namespace):
        return cls(**vars(args))

    def validate(self):  # upstream: refuses plugins the build GPU's SM cannot run (none of ours)
        return None


def add_plugin_argument(parser):
    for name in ("gpt_attention_plugin", "gemm_plugin", "moe_plugin"):
        default = PluginConfig.model_fields[name].default
        parser.add_argument(f"--{name}", type=str, default=default, choices=[*_DTYPES, "disable"])
    for name in ("context_fmha", "use_paged_context_fmha", "remove_input_padding"):
        parser.add_argument(f"--{name}", type=str, default="enable", choices=["enable", "disable"])
    parser.add_argument("--tokens_per_block", type=int, default=32)
    return parser
