#!/usr/bin/env bash
# The vision plugin and engine checks, in one run on a GPU host (torch with CUDA; TensorRT 10.14 for the engine
# part; flash-attn compared where importable):
#   1. the varlen attention kernel against per-segment SDPA (and flash-attn's varlen kernel) at Qwen3-VL's sizes,
#      16 heads, head_dim 72, 4-16 images of 1024-4096 patches: errors and time ratios as a table;
#   2. where TensorRT is present: `build-vision-engine` from a tiny checkpoint's plugin export through the command
#      line, then engines of head_dim 64 and 72 towers against ONNX Runtime (scripts/vision_engine_check.py).
# Exits 3 at once without a CUDA device; non-zero when a check fails. Tables and JSON go to $OUT (default: a temp
# directory, printed at the end).
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
if ! "$python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "device_check: no CUDA device visible to torch ($python): run this on a GPU host" >&2
    exit 3
fi
out=${OUT:-$(mktemp -d)}
mkdir -p "$out"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cli=("$python" -m qwen3vl_trt.cli)

echo "== GPU"
"$python" -c "import torch; print(torch.cuda.get_device_name(), 'sm_%d%d' % torch.cuda.get_device_capability(), \
'torch', torch.__version__, 'CUDA', torch.version.cuda)"

echo "== varlen attention kernel vs per-segment SDPA (vs flash-attn varlen)"
"$python" scripts/bench_varlen_attention.py --json "$out/varlen_attention.json" | tee "$out/varlen_attention.txt"

if ! "$python" -c "import tensorrt" 2>/dev/null; then
    echo "== vision engine: skipped (tensorrt is not importable by $python)"
    echo "results in $out"
    exit 0
fi
echo "== build-vision-engine (command line), TensorRT $("$python" -c "import tensorrt; print(tensorrt.__version__)")"
"${cli[@]}" make-tiny --output "$work/tiny"
"${cli[@]}" export-vision --model "$work/tiny" --variant plugin --dtype bf16 --output "$work/plugin"
"${cli[@]}" build-vision-engine --onnx "$work/plugin" --output "$work/engine" --dtype bf16 \
    --opt-patches 1024 --max-patches 8192 --max-images 16 --timing-cache "$out/timing.cache"
cp "$work/engine/vision_engine.json" "$out/vision_engine.json"

echo "== vision engines vs ONNX Runtime"
"$python" scripts/vision_engine_check.py --json "$out/vision_engine_check.json" | tee "$out/vision_engine_check.txt"
echo "results in $out"
