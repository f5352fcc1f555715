"""Build time (`qwen3vl-trt build`, `write-repo`): the Triton model repository, each model's config.pbtxt as a
ModelConfig protobuf, the tensorrtllm backend's `llm` configuration, and the GPU target's memory plan.
Nothing here runs inside Triton; it never imports `stages`."""
