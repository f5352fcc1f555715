"""Stand-in for TensorRT-LLM 1.2.1 (tests only; README.md beside this package)."""

__version__ = "1.2.1"
