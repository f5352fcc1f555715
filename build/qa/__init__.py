"""Quality assurance, apart from the product's stages: the GPU acceptance run and device checks (`acceptance`),
random-weight checkpoints in the released formats (`tiny`, `quantized`; `make-tiny`), Qwen's tokenizer files, and
helpers that start real servers for tests and benchmarks (`redis_server`, `ports`). Nothing the deployment runs
imports it."""
