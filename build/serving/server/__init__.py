"""The `qwen3vl-trt serve` process: the tritonserver command (`launch`), its installation (`tritonserver_install`),
the process and its lifecycle (`serve`) and the supervisor that reloads a stage whose stub died. With
`--openai-port` the gateway (`serving.gateway`) runs in this process too, on a thread (`serve.serve`)."""
