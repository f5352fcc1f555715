#!/usr/bin/env bash
# The one short run (a few minutes) of a GPU machine, with or without TensorRT: torch with CUDA and the Triton language
# are enough; nvImageCodec, PyNvVideoCodec, flash-attn and TensorRT are checked where present.
#   - the varlen attention kernel against per-segment SDPA (and flash-attn's varlen kernel) at Qwen3-VL's sizes;
#   - nvImageCodec and NVDEC (PyNvVideoCodec) decoding into device memory against Pillow and FFmpeg;
#   - the GPU preprocessing of a JPEG and of an H.264 request against the CPU's pixels;
#   - where TensorRT is: the plugin vision engine of a tiny checkpoint against the transformers tower.
# One table (check | status | figure | limit); device_check.json in $OUT (default: a temporary directory, printed).
# A row whose needs are missing is SKIPPED with the reason (build/qa/acceptance.py, run_device_check).
# Exit 0: every row passed; 1: a row failed; 3: some were skipped, or no CUDA device at all (then nothing runs).
# On a machine without a package index, WHEELS=DIR installs the decoders build/gpu_image.py pins from DIR first (and
# this package without its dependencies where it is not installed).
#   [OUT=DIR] [WHEELS=DIR] scripts/device_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && python=.venv/bin/python
if ! "$python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "device_check: no CUDA device visible to torch ($python): run this on a GPU host" >&2
    exit 3
fi
if [ -n "${WHEELS:-}" ]; then
    mapfile -t pins < <("$python" build/gpu_image.py requirements)
    "$python" -m pip install --quiet --no-index --find-links "$WHEELS" "${pins[@]}"
    if ! "$python" -c "import qwen3vl_trt" 2>/dev/null; then
        "$python" -m pip install --quiet --no-index --find-links "$WHEELS" --no-deps --no-build-isolation -e .
    fi
fi
out=${OUT:-$(mktemp -d)}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$python" -c "import torch; print(torch.cuda.get_device_name(), 'sm_%d%d' % torch.cuda.get_device_capability(), \
'torch', torch.__version__, 'CUDA', torch.version.cuda)"
status=0
"$python" - "$work" "$out" <<'EOF' || status=$?
import sys
from pathlib import Path

from qwen3vl_trt.qa.acceptance import DEVICE_CHECK_FILE, run_device_check, write_report

report = run_device_check(Path(sys.argv[1]))
print(report.table())
path = write_report(report, Path(sys.argv[2]), DEVICE_CHECK_FILE)
print(f"\n{path}: exit code {report.exit_code} (0 passed, 1 a row failed, 3 some rows skipped)")
sys.exit(report.exit_code)
EOF
echo "results in $out"
exit "$status"
