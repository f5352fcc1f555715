#!/usr/bin/env bash
# The main job on the embedded default: a tiny random-weight Qwen3-VL checkpoint, then
# `qwen3vl-trt build` on it for the CPU target (vision encoder ONNX verified against transformers,
# the LLM as a TensorRT-LLM checkpoint, the Triton model repository; the engine stage says it is
# skipped without a GPU), then `qwen3vl-trt serve --openai-port` on that repository (a real
# tritonserver and the OpenAI-compatible gateway), one gRPC request with a 1280x720 JPEG through
# `qwen3vl-trt infer`, the same request through the official `openai` client, and the server
# stopped. Random weights, so the words are noise, but every stage runs.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
out=${1:-runs/demo}
port=${QWEN3VL_DEMO_GRPC_PORT:-18001}
openai_port=${QWEN3VL_DEMO_OPENAI_PORT:-19000}
cli=.venv/bin/qwen3vl-trt
$cli make-tiny --output "$out/checkpoint" --force
$cli build --model "$out/checkpoint" --output "$out/build" --target cpu --force
.venv/bin/python -c "from qwen3vl_trt.qa.tiny import synthetic_jpeg; import sys; open(sys.argv[1], 'wb').write(synthetic_jpeg(720, 1280))" "$out/photo.jpg"

$cli serve --repo "$out/build/triton_repo" --grpc-port "$port" --http-port $((port + 1)) --metrics-port $((port + 2)) \
    --ready-port $((port + 3)) \
    --openai-port "$openai_port" > "$out/server.log" 2>&1 &
server=$!
trap 'kill -TERM $server 2>/dev/null; wait $server 2>/dev/null || true' EXIT
for _ in $(seq 300); do
    grep -q '^ready:' "$out/server.log" && break
    kill -0 $server 2>/dev/null || { echo "the server exited; its log:" >&2; tail -n 30 "$out/server.log" >&2; exit 1; }
    sleep 1
done
grep '^ready:' "$out/server.log"
answer=$($cli infer --url "127.0.0.1:$port" --image "$out/photo.jpg" --prompt "What is in this picture?" --max-tokens 24)
echo "gRPC client (qwen3vl-trt infer): $answer"
.venv/bin/python - "$out/photo.jpg" "$openai_port" <<'EOF'
import base64
import sys

from openai import OpenAI

image = "data:image/jpeg;base64," + base64.b64encode(open(sys.argv[1], "rb").read()).decode()
client = OpenAI(base_url=f"http://127.0.0.1:{sys.argv[2]}/v1", api_key="unused")
parts = [{"type": "image_url", "image_url": {"url": image}}, {"type": "text", "text": "What is in this picture?"}]
reply = client.chat.completions.create(model="checkpoint", messages=[{"role": "user", "content": parts}], max_tokens=24)
print(f"openai client: {reply.choices[0].message.content!r} ({reply.usage.prompt_tokens} prompt tokens)")
EOF
