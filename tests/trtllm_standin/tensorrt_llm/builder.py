"""tensorrt_llm/builder.py after PR #8330: BuildConfig is a pydantic model built with keyword arguments (no
from_dict; every limit has a default); build() stands in for the TensorRT build: it asks the model for its inputs
as upstream does and returns an engine that saves what it was given. The timing cache is written as upstream's
build() writes it (`Builder.save_timing_cache` to build_config.output_timing_cache, default "model.cache", from rank
0; builder.py read at 008b2b8d), with placeholder bytes for TensorRT's serialized cache."""

import json
import os

from pydantic import BaseModel, ConfigDict, Field

from .llmapi.kv_cache_type import KVCacheType
from .plugin import PluginConfig


class BuildConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_input_len: int = 1024
    max_seq_len: int | None = None
    max_batch_size: int = 2048
    max_beam_width: int = 1
    max_num_tokens: int = 8192
    opt_num_tokens: int | None = None
    max_prompt_embedding_table_size: int = 0
    kv_cache_type: KVCacheType | None = None
    strongly_typed: bool = True
    output_timing_cache: str | None = "model.cache"  # relative to the working directory, as upstream's default
    gather_generation_logits: bool = False
    use_mrope: bool = False
    plugin_config: PluginConfig = Field(default_factory=PluginConfig)


class Engine:
    def __init__(self, config, inputs):
        self.config, self.inputs = config, inputs

    def save(self, engine_dir):
        os.makedirs(engine_dir, exist_ok=True)
        rank = self.config["pretrained_config"]["mapping"]["rank"]
        if rank == 0:  # upstream writes config.json from rank 0
            config = json.loads(json.dumps(self.config))
            config["pretrained_config"]["mapping"].pop("rank")
            with open(os.path.join(engine_dir, "config.json"), "w") as f:
                json.dump(config, f, indent=2)
        with open(os.path.join(engine_dir, f"rank{rank}.engine"), "w") as f:
            json.dump({"inputs": self.inputs, "model_class": self.model_class, "gpu_id": self.gpu_id}, f)


def build(model, build_config):
    inputs = model.prepare_inputs(
        max_batch_size=build_config.max_batch_size,
        max_input_len=build_config.max_input_len,
        max_seq_len=build_config.max_seq_len,
        use_cache=True,
        max_beam_width=build_config.max_beam_width,
        max_num_tokens=build_config.max_num_tokens,
        prompt_embedding_table_size=build_config.max_prompt_embedding_table_size,
    )
    pretrained = model.config.to_dict()
    pretrained["mapping"]["rank"] = model.config.mapping.rank
    declared = {
        name: (str(value) if isinstance(value, str) else type(value).__name__) for name, value in inputs.items()
    }
    if "mrope_params" in inputs:
        declared["mrope_rotary_cos_sin_size"] = inputs["mrope_params"].size
    engine = Engine({"pretrained_config": pretrained, "build_config": build_config.model_dump(mode="json")}, declared)
    engine.model_class = f"{type(model).__module__}.{type(model).__qualname__}"
    engine.gpu_id = None
    # Upstream saves the builder's timing cache from rank 0 here, after TensorRT built and before the engine is saved.
    if build_config.output_timing_cache is not None and model.config.mapping.rank == 0:
        with open(build_config.output_timing_cache, "wb") as f:
            f.write(b"timing cache")
    return engine
