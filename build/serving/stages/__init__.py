"""Inside Triton's python-backend stubs: one module per python model's logic (preprocessing and its scheduler, the
visual-feature cache, vision-encoder batching, the CPU target's llm, postprocessing) and stage metrics, all
importable and testable without a server. `triton_adapters` alone imports `triton_python_backend_utils`: it turns
Triton's tensors and responses into those components' calls. Never imports `server` or `gateway`."""
