"""The OpenAI-compatible HTTP process (`qwen3vl-trt openai`; inside `serve --openai-port`, the same code on a thread
of the serve process): its settings, admission and body limits, chat planning, the app and its lifecycle, the
typed protocol, metrics and the client of a fleet of Triton replicas. It talks to Triton over gRPC only
(`serving.client`) and never imports `stages`."""
