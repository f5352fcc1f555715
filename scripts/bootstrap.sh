#!/usr/bin/env bash
# Creates (or refreshes) .venv with qwen3vl-trt, its dev tools, and two overlays of the GPU image's versions:
# transformers 4.57.3 (the tests run against both 4.57 and 5.x), and the GPU-side packages whose wheels install on a
# CPU machine (the Triton language, tritonclient/protobuf, nvImageCodec: build/gpu_image.py says which and why);
# checkov, which checks the Kubernetes manifests, in an environment of its own inside it ($venv/checkov).
# Idempotent: does nothing when pyproject.toml and this script are unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
venv=${QWEN3VL_VENV:-.venv}
# torchvision is needed by transformers' Qwen3-VL processor (the tests' reference); its wheels must match torch
# exactly. TORCH_SPEC overrides what is installed (pip arguments: another platform's pins, an index).
torch_pins="torch==2.14.1 torchvision==0.29.1"
# PyPI's Linux x86_64 torch is the CUDA build: 3.2 GB of CUDA libraries that a host without an NVIDIA GPU never
# loads. There PyTorch's CPU-only wheels of the same versions come from its own index, when that index answers.
cpu_index=${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}

torch_spec() {
    if [ -n "${TORCH_SPEC:-}" ]; then
        echo "$TORCH_SPEC"
    elif [ "$(uname -m)" = x86_64 ] && ! command -v nvidia-smi > /dev/null &&
        "$python" -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=10)" "$cpu_index/torch/" \
            > /dev/null 2>&1; then
        echo "$torch_pins --index-url $cpu_index"
    else
        echo "$torch_pins"
    fi
}
if [ "${1:-}" = --torch-spec ]; then  # what a new .venv would install
    torch_spec
    exit 0
fi

# The tests start a real redis-server (the visual cache) and a real dnsmasq (a DNS name for two replicas: the
# gateway's fleet test), from Debian's packages; CI runs as root on a fresh machine.
missing=()
command -v redis-server > /dev/null || missing+=(redis-server)
command -v dnsmasq > /dev/null || [ -x /usr/sbin/dnsmasq ] || missing+=(dnsmasq-base)
if [ ${#missing[@]} -gt 0 ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get > /dev/null; then
        echo "bootstrap: installing ${missing[*]} (apt-get)" >&2
        { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"; } > /dev/null
    else
        echo "bootstrap: ${missing[*]} missing; install (Debian/Ubuntu): apt-get install ${missing[*]}" >&2
        exit 1
    fi
fi

stamp="$venv/.bootstrap-stamp"
want="$(cat pyproject.toml scripts/bootstrap.sh build/gpu_image.py | sha256sum | cut -d' ' -f1) ${TORCH_SPEC:-}"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    exit 0
fi
torch_spec=$(torch_spec)
echo "bootstrap: preparing $venv (torch: $torch_spec); log in $venv.log" >&2
log="$PWD/$venv.log"
: > "$log"
trap 'echo "bootstrap failed; last lines of $log:" >&2; tail -n 30 "$log" >&2' ERR
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv" >> "$log" 2>&1
pip=("$venv/bin/python" -m pip --disable-pip-version-check)
"${pip[@]}" install --upgrade pip >> "$log" 2>&1
# shellcheck disable=SC2086
"${pip[@]}" install $torch_spec >> "$log" 2>&1
"${pip[@]}" install -e ".[dev]" >> "$log" 2>&1
PYTHON="$venv/bin/python" scripts/tensorrt_stubs.sh "$venv/typing-tensorrt" >> "$log" 2>&1
rm -rf "$venv/overlay-tf457"
"${pip[@]}" install --no-deps --target "$venv/overlay-tf457" \
    "transformers==4.57.3" "huggingface-hub>=0.34,<1.0" "tokenizers>=0.22,<=0.23.0" >> "$log" 2>&1
rm -rf "$venv/overlay-gpu-image"
# shellcheck disable=SC2046
"${pip[@]}" install --no-deps --target "$venv/overlay-gpu-image" \
    $("$venv/bin/python" build/gpu_image.py overlay) >> "$log" 2>&1
# checkov (tests/test_kubernetes.py) gets an environment of its own: its pins would downgrade packages of $venv
# (packaging, networkx, importlib-metadata). The tests run $venv/checkov/bin/checkov.
[ -x "$venv/checkov/bin/python" ] || "$python" -m venv "$venv/checkov" >> "$log" 2>&1
"$venv/checkov/bin/python" -m pip --disable-pip-version-check install "checkov==3.3.30" >> "$log" 2>&1
echo "$want" > "$stamp"
echo "bootstrap: $venv ready" >&2
