#!/usr/bin/env bash
# The test suite: lint, then pytest under transformers 5.x, again under 4.57.3 (the GPU image's pin), and the
# GPU-side checks once more at the GPU image's versions (build/gpu_image.py): the Triton language 3.5.1 (kernel in
# the interpreter, AOT compile and ptxas report), tritonclient/protobuf (config generation; the OpenAI gateway's
# asyncio client against a real server), nvImageCodec.
# Extra arguments go to pytest, e.g. scripts/test.sh -k parity -x
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
# Two workers: a serial pass keeps about one of two cores busy (much of it waits on tritonserver start-ups and
# subprocesses). A test file stays on one worker, so a module's server is started once. QWEN3VL_TEST_WORKERS=0 runs
# serially; extra arguments may name another -n.
workers=(-n "${QWEN3VL_TEST_WORKERS:-2}" --dist loadfile)
.venv/bin/ruff check build plugins triton_models tests scripts
.venv/bin/mypy
# A pass that selects none of the tests the arguments name (pytest's exit status 5: a file of server tests has none in
# the second pass) is no failure, unless no pass selects any; without arguments every pass selects some.
selected=0
run_pass() {
    local status=0
    "$@" || status=$?
    if [ "$status" -eq 5 ] && [ "$narrowed" -eq 1 ]; then
        echo "(no test of this selection runs in this pass)"
        return 0
    fi
    [ "$status" -ne 0 ] || selected=1
    return "$status"
}
narrowed=$(($# > 0))
echo "== tests with transformers 5.x"
run_pass .venv/bin/python -m pytest "${workers[@]}" "$@"
# The deployment tests (marker server) run once, above: the served code does not use transformers, and
# this pass checks the same chain against 4.57.3's generate in test_reference_llm. Nor do the kernel's
# (marker once).
echo "== tests with transformers 4.57.3"
run_pass env PYTHONPATH=.venv/overlay-tf457 .venv/bin/python -m pytest "${workers[@]}" -m "not server and not once" "$@"
echo "== GPU-side checks at the GPU image's versions (build/gpu_image.py)"
image=(env PYTHONPATH=.venv/overlay-gpu-image QWEN3VL_GPU_IMAGE_PASS=1)
# Among them tests/test_plugin_aot.py runs scripts/aot_report.py: zero spills for every shipped configuration, here
# under Triton 3.5.1 as in the first pass under the development version.
run_pass "${image[@]}" .venv/bin/python -m pytest "${workers[@]}" -m gpu_image "$@"
if [ "$selected" -eq 0 ]; then
    echo "no pass selected a test of: $*" >&2
    exit 5
fi
