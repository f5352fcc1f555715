#!/usr/bin/env bash
# What a GPU host runs first (docs/gpu-hosts.md): tiny dense and MoE checkpoints through every stage of
# `qwen3vl-trt build` (plugin vision engine, trtllm-build LLM engine, GPU repository), served on tritonserver, with
# one table of PASS / FAIL / SKIPPED rows and their figures, and acceptance.json to send back. Nothing is downloaded.
# Exit 0: every row passed; 1: a row failed; 3: none failed but some were skipped (no GPU, no TensorRT, ...).
#   scripts/gpu_acceptance.sh [--output DIR] [--work DIR]
# In the image: docker run --gpus 1 -v "$PWD/out:/out" IMAGE gpu-acceptance --output /out
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && python=.venv/bin/python
exec "$python" -m qwen3vl_trt.cli gpu-acceptance "$@"
