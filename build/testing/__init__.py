"""Fixtures `make-tiny`, the tests and the benchmarks use: random-weight checkpoints in the released
format, Qwen's tokenizer files, and helpers that run the transformers reference. Not serving code."""
