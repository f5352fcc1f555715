#!/usr/bin/env bash
# The main job on the embedded default: a tiny random-weight Qwen3-VL checkpoint, then
# `qwen3vl-trt build` on it (vision encoder ONNX export verified against transformers, the LLM as a
# TensorRT-LLM checkpoint; the engine stage says it is skipped without a GPU), then the
# preprocessing of one chat request with a 1280x720 JPEG, and its answer from the CPU chain
# (vision encoder on ONNX Runtime, the converted LLM on the reference runtime; random weights, so
# the words are noise, but every stage runs).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
out=${1:-runs/demo}
.venv/bin/qwen3vl-trt make-tiny --output "$out/checkpoint" --force
.venv/bin/qwen3vl-trt build --model "$out/checkpoint" --output "$out/build" --force
# What one chat request with an image becomes for the engines (ids, grid, positions, table rows).
.venv/bin/python -c "from qwen3vl_trt.testing.tiny import synthetic_jpeg; import sys; open(sys.argv[1], 'wb').write(synthetic_jpeg(720, 1280))" "$out/photo.jpg"
.venv/bin/qwen3vl-trt preprocess --model "$out/checkpoint" --image "$out/photo.jpg" --text "What is in this picture?"
.venv/bin/qwen3vl-trt generate --model "$out/checkpoint" --build "$out/build" --image "$out/photo.jpg" --text "What is in this picture?" --max-new-tokens 24
