"""The GPU target's memory plan (serving.repository.gpu_memory): the KV cache share that leaves room for the python
models on their GPU, the CUDA memory pool sized for the tensors between models, from a build's engines and limits."""

from __future__ import annotations

import pytest
from qwen3vl_trt.errors import LimitsError
from qwen3vl_trt.limits import EngineLimits, ImageLimits
from qwen3vl_trt.serving.repository import gpu_memory
from qwen3vl_trt.serving.repository.gpu_memory import GpuMemoryPlan

GIB = 1 << 30


def _plan(**changes) -> GpuMemoryPlan:
    values = dict(
        gpu=0,
        gpu_bytes=80 * GIB,
        llm_engine_bytes=16 * GIB,
        vision_engine_bytes=1 * GIB,
        vision_activation_bytes=2 * GIB,
        decode_bytes=3 * GIB,
        transfer_pool_bytes=4 * GIB,
    )
    return GpuMemoryPlan(**{**values, **changes})


def test_kv_cache_share_leaves_room_for_the_python_models():
    plan = _plan()
    contexts = gpu_memory.GPU_PROCESSES * gpu_memory.CUDA_CONTEXT_BYTES
    free = 80 * GIB - contexts - 16 * GIB
    room = free - 10 * GIB - int(0.05 * 80 * GIB)
    assert plan.free_at_llm_load == free and plan.python_models_bytes == 10 * GIB
    assert plan.kv_cache_fraction() == round(room / free, 3)
    # Loaded after the LLM, the python models still fit in what the KV cache leaves.
    assert (1 - plan.kv_cache_fraction()) * free >= plan.python_models_bytes
    # A large GPU is capped at the backend's default share.
    assert _plan(gpu_bytes=1000 * GIB).kv_cache_fraction() == 0.9
    text = plan.describe()
    assert "python models: 10.00 GiB" in text and f"kv_cache_free_gpu_mem_fraction = {plan.kv_cache_fraction()}" in text


def test_a_gpu_without_room_is_refused_with_the_arithmetic():
    plan = _plan(gpu_bytes=24 * GIB)
    with pytest.raises(LimitsError, match="no room for a KV cache") as error:
        plan.kv_cache_fraction()
    assert "LLM engine, rank 0: 16.00 GiB" in str(error.value) and "--max-batch-size" in str(error.value)


def test_transfer_pool_holds_two_full_batches_of_pixels_and_prompt_tables():
    limits = EngineLimits(max_batch_size=8, max_visual_tokens=8192)
    # Qwen3-VL-8B: hidden 4096, K = 3 DeepStack layers, bf16 prompt table; patch_dim 1536, 2 x 2 merge.
    row = 4 * 4096 * 2
    per_patch = 1536 * 4 + 4 * 4 + 4 * 4 + 2 * 4 + 4
    # In flight, and gathered by the next model's batcher; the table twice: vision_encoder's rows back to
    # preprocessing (BLS), the request's table on to the llm.
    expected = 2 * 8 * (8192 * 4 * per_patch + 2 * 8192 * row)
    assert gpu_memory.transfer_pool_bytes(limits, 1536, 4, row) == expected
    assert 11.0 * GIB < expected < 11.1 * GIB


def test_decode_memory_counts_the_largest_decoded_frame_and_the_resized_copies():
    limits = EngineLimits(max_batch_size=2, max_visual_tokens=1024)
    images = ImageLimits(max_decode_pixels=1_000_000)
    resized = 1024 * 4 * 256
    assert gpu_memory.decode_bytes(limits, images) == 2 * (1_000_000 * 3 + resized * 3 * 4 * 2)


def test_plan_reads_the_engine_sizes_of_a_build(tmp_path):
    (tmp_path / "llm").mkdir()
    (tmp_path / "llm" / "rank0.engine").write_bytes(b"\0" * 1000)
    (tmp_path / "llm" / "rank1.engine").write_bytes(b"\0" * 5000)  # another GPU's rank: not counted here
    (tmp_path / "vision.plan").write_bytes(b"\0" * 300)
    limits = EngineLimits(max_batch_size=1, max_input_len=64, max_seq_len=128, max_visual_tokens=16)
    vision = tmp_path / "vision.plan"
    plan = gpu_memory.plan(0, 80 * GIB, limits, tmp_path / "llm", vision, 77, 1536, 4, "bfloat16", 64, 3)
    assert (plan.llm_engine_bytes, plan.vision_engine_bytes, plan.vision_activation_bytes) == (1000, 300, 77)
    assert plan.transfer_pool_bytes == gpu_memory.transfer_pool_bytes(limits, 1536, 4, 4 * 64 * 2)
    with pytest.raises(LimitsError, match="build the LLM engine first"):
        gpu_memory.plan(0, GIB, limits, tmp_path, tmp_path / "vision.plan", 0, 1536, 4, "bfloat16", 64, 3)
