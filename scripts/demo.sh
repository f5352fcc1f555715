#!/usr/bin/env bash
# The main job on the embedded default: a tiny random-weight Qwen3-VL checkpoint, then
# `qwen3vl-trt build` on it (vision encoder ONNX export, verified against transformers).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
out=${1:-runs/demo}
.venv/bin/qwen3vl-trt make-tiny --output "$out/checkpoint" --force
.venv/bin/qwen3vl-trt build --model "$out/checkpoint" --output "$out/build" --force
