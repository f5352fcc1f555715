#!/usr/bin/env bash
# Everything that needs a GPU, in one go, on a GPU host with CUDA, torch, nvImageCodec and PyNvVideoCodec
# (`pip install -e '.[dev]' 'nvidia-nvimgcodec-cu13[nvjpeg]>=0.9' PyNvVideoCodec==2.2.4`): the CUDA-only tests
# (nvImageCodec and NVDEC against the host decoders), then the GPU preprocessing benchmark. Prints every figure; exits non-zero if a test fails.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
"$python" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device visible to torch'; print(torch.cuda.get_device_name())"
"$python" -c "from nvidia import nvimgcodec; print('nvImageCodec', nvimgcodec.__version__)"
"$python" -c "import PyNvVideoCodec; print('PyNvVideoCodec', PyNvVideoCodec.__version__)"
"$python" -m pytest -m cuda -rA -s tests
"$python" scripts/bench_preprocess.py --device cuda --batch 8 --repeats 10
