"""The Triton python-backend model files that `qwen3vl-trt write-repo` copies into a repository."""
