"""The Triton deployment, in rooms by the process each runs in (docs/architecture.md walks one request through them).

At this level, the contract every room shares: `interface` (the ensemble's tensors and model names),
`parameters` (each model's config.pbtxt parameters, written by the repository and read by its stage),
`ports` (where a deployment listens, the gateway's options) and `client` (the gRPC client).

- `repository/`: build time, in `qwen3vl-trt build` / `write-repo`: the model repository and its config.pbtxt files.
- `stages/`: inside Triton's python-backend stubs: each python model's logic and their adapters.
- `server/`: the `qwen3vl-trt serve` process: it launches, supervises and warms up tritonserver, and says when the
  replica is ready.
- `gateway/`: the OpenAI-compatible HTTP process (`qwen3vl-trt openai`, or inside `serve --openai-port`).
"""
