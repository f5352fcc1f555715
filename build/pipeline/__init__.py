"""`qwen3vl-trt build`, orchestrated: the stages run in order with one options type (`build`), the calibrated LLM
conversion (`calibration`); what it built is recorded in common.manifest. The stages themselves live in
`vision`, `llm` and `serving.repository`; the shared build cache in `build_cache`."""
