"""The `qwen3vl-trt serve` process: the tritonserver command (`launch`), its installation (`tritonserver_install`), the
process (`serve`), the tritonserver it runs under its guard and its lifecycle (`tritonserver`), the supervisor that
reloads a stage whose stub died, the warm-up requests sent before ready (`warmup`) and serve's own readiness
endpoint and metrics (`readiness`, on a thread). With `--openai-port` the gateway (`serving.gateway`) runs in this
process too, on a thread (`serve.serve`)."""
