#!/usr/bin/env bash
# The test suite: lint, then pytest under transformers 5.x and again under 4.57.3 (the GPU image's pin).
# Extra arguments go to pytest, e.g. scripts/test.sh -k parity -x
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
.venv/bin/ruff check build plugins triton_models tests scripts
.venv/bin/mypy
echo "== tests with transformers 5.x"
.venv/bin/python -m pytest "$@"
# The deployment tests (marker server) run once, above: the served code does not use transformers, and
# this pass checks the same chain against 4.57.3's generate in test_reference_llm. Nor do the kernel's
# (marker once).
echo "== tests with transformers 4.57.3"
PYTHONPATH=.venv/overlay-tf457 .venv/bin/python -m pytest -m "not server and not once" "$@"
