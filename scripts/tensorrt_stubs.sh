#!/usr/bin/env bash
# Type information for mypy on the TensorRT-facing modules of a machine without TensorRT: tensorrt-stubs
# (the bindings, 10.13) and the real tensorrt-cu12-bindings 10.14 wheel (its tensorrt.plugin sources; its
# libraries wheel is a download stub), installed into a directory that only mypy reads (pyproject.toml:
# mypy_path). Python never imports it, so `import tensorrt` keeps failing where TensorRT is absent.
# Usage: scripts/tensorrt_stubs.sh [DIR]  (default .venv/typing-tensorrt)
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-.venv/typing-tensorrt}
python=${PYTHON:-.venv/bin/python}
rm -rf "$dir"
"$python" -m pip --disable-pip-version-check install --quiet --no-deps --target "$dir" \
    "tensorrt-stubs==10.13.0.35.1" "tensorrt-cu12-bindings==10.14.1.48.post1"
stubs="$dir/tensorrt_bindings/tensorrt.pyi"
# tensorrt-stubs 10.13.0.35.1 has five signatures Python cannot parse (which stops mypy): parameters
# named `in`, and a parameter without a default after defaulted ones.
sed -i -E 's/\((self(: [A-Za-z0-9_]+)?), in: /(\1, in_: /' "$stubs"
sed -i 's/power: Weights = None, channel_axis: int)/power: Weights = None, channel_axis: int = ...)/' "$stubs"
"$python" -c "import ast, sys; ast.parse(open(sys.argv[1]).read())" "$stubs"
# TensorRT's `tensorrt.plugin` is the bindings' plugin package.
cp -r "$dir/tensorrt_bindings/plugin" "$dir/tensorrt/plugin"
echo "tensorrt type stubs in $dir"
