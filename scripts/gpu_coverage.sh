#!/usr/bin/env bash
# The GPU side's line coverage by the CPU tests, per module, with the reason for every line left (scripts/gpu_coverage.py).
# Extra arguments: --json FILE, --keep DIR, or the pytest arguments to run instead of its list of tests.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
exec .venv/bin/python scripts/gpu_coverage.py "$@"
