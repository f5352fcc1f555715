"""The GPU target's memory plan (serving.repository.gpu_memory): the KV cache share that leaves room for the python
models when they share its GPU, their own GPU's room when they do not, the CUDA memory pool sized for the tensors
between models, from a build's engines and limits."""

from __future__ import annotations

import json
import os
from dataclasses import replace

import pytest
from qwen3vl_trt.common.limits import EngineLimits, ImageLimits
from qwen3vl_trt.errors import CheckpointError, LimitsError
from qwen3vl_trt.llm.checkpoint_format import LLMConfig, MoeSettings, ParallelLayout
from qwen3vl_trt.serving.repository import gpu_memory
from qwen3vl_trt.serving.repository.gpu_memory import GpuMemoryPlan, LLMEngineBuild

GIB = 1 << 30
MIB = 1 << 20
# Qwen3-VL-8B's text model: hidden 4096, MLP 12288, head 128, K = 3 DeepStack layers, bf16.
LLM_8B = LLMConfig(
    dtype="bfloat16",
    vocab_size=151936,
    hidden_size=4096,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_size=128,
    intermediate_size=12288,
    norm_epsilon=1e-6,
    rotary_base=5e6,
    rotary_dim=128,
    max_position_embeddings=262144,
    deepstack_count=3,
    mapping=ParallelLayout(),
)


def _engine_dir(tmp_path, max_num_tokens=64, paged_context_fmha=True, rank0_bytes=1000):
    """An engine directory as trtllm-build writes it: config.json (build_config with its plugin_config) and ranks."""
    engine = tmp_path / "llm"
    engine.mkdir()
    build_config = {"max_num_tokens": max_num_tokens, "plugin_config": {"use_paged_context_fmha": paged_context_fmha}}
    (engine / "config.json").write_text(json.dumps({"version": "1.2.1", "build_config": build_config}))
    (engine / "rank0.engine").write_bytes(b"\0" * rank0_bytes)
    return engine


def _plan(**changes) -> GpuMemoryPlan:
    values = dict(
        gpu=0,
        llm_gpus=(0,),
        gpu_bytes=80 * GIB,
        llm_engine_bytes=16 * GIB,
        vision_engine_bytes=1 * GIB,
        vision_activation_bytes=2 * GIB,
        decode_bytes=3 * GIB,
        transfer_pool_bytes=4 * GIB,
        llm_activation_bytes=0,
        prompt_table_buffer_bytes=0,
        mrope_tables_bytes=0,
        llm_paged_context_fmha=True,
    )
    return GpuMemoryPlan(**{**values, **changes})


def test_kv_cache_share_leaves_room_for_the_python_models():
    plan = _plan()
    contexts = 3 * gpu_memory.CUDA_CONTEXT_BYTES  # tritonserver and the two python stubs
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
    engine = _engine_dir(tmp_path, max_num_tokens=64)
    (engine / "rank1.engine").write_bytes(b"\0" * 5000)  # another GPU's rank: not counted beside rank 0
    (tmp_path / "vision.plan").write_bytes(b"\0" * 300)
    limits = EngineLimits(max_batch_size=1, max_input_len=64, max_seq_len=128, max_visual_tokens=16)
    vision = tmp_path / "vision.plan"
    llm = replace(LLM_8B, hidden_size=64, intermediate_size=128, rotary_dim=16)
    plan = gpu_memory.plan(0, (0,), 80 * GIB, limits, engine, vision, 77, 1536, 4, llm)
    assert (plan.llm_engine_bytes, plan.vision_engine_bytes, plan.vision_activation_bytes) == (1000, 300, 77)
    assert plan.transfer_pool_bytes == gpu_memory.transfer_pool_bytes(limits, 1536, 4, 4 * 64 * 2)
    # The rank's own allocations, from the engine's max_num_tokens (its config.json) and the limits.
    assert plan.llm_activation_bytes == 64 * (3 * 64 + 3 * 128) * 2
    assert plan.prompt_table_buffer_bytes == limits.prompt_table_rows(3) * 64 * 2
    assert plan.mrope_tables_bytes == 1 * (128 * 16 * 4 + 4)
    assert plan.llm_paged_context_fmha and plan.as_record()["llm_paged_context_fmha"] is True
    # Beside rank 1 (GPU 1 of two), the plan counts that rank's weights.
    assert gpu_memory.plan(1, (0, 1), 80 * GIB, limits, engine, vision, 77, 1536, 4, llm).llm_engine_bytes == 5000
    with pytest.raises(LimitsError, match="build the LLM engine first"):
        gpu_memory.plan(0, (0,), GIB, limits, tmp_path, tmp_path / "vision.plan", 0, 1536, 4, llm)


def test_an_engine_for_top_logprobs_plans_its_logits_buffers_and_one_without_them_is_refused(tmp_path):
    """max_top_logprobs > 0: the runtime's generation-logits buffers (8 steps of a full batch, float32, the vocabulary
    padded to the world size) come off what the KV cache finds free; limits that ask for top_logprobs over an engine
    built without gathering its generation logits are refused with the flag to rebuild with."""
    engine = _engine_dir(tmp_path)
    (tmp_path / "vision.plan").write_bytes(b"\0" * 300)
    limits = EngineLimits(max_batch_size=4, max_input_len=64, max_seq_len=128, max_visual_tokens=16, max_top_logprobs=5)
    llm = replace(LLM_8B, hidden_size=64, intermediate_size=128, rotary_dim=16)
    args = (80 * GIB, limits, engine, tmp_path / "vision.plan", 77, 1536, 4, llm)
    with pytest.raises(LimitsError, match="built without --gather_generation_logits.*--max-top-logprobs 5"):
        gpu_memory.plan(0, (0,), *args)
    config = json.loads((engine / "config.json").read_text())
    config["build_config"]["gather_generation_logits"] = True
    (engine / "config.json").write_text(json.dumps(config))
    plan = gpu_memory.plan(0, (0,), *args)
    assert plan.generation_logits_bytes == (8 * 4 + 8) * llm.vocab_size * 4  # 151,936: a multiple of the world size
    without = gpu_memory.plan(0, (0,), 80 * GIB, replace(limits, max_top_logprobs=0), *args[2:])
    assert without.generation_logits_bytes == 0
    assert without.free_at_kv_cache - plan.free_at_kv_cache == plan.generation_logits_bytes
    assert "generation logits' buffers" in plan.describe() and "generation logits" not in without.describe()


def test_the_engine_config_says_whether_it_has_paged_context_fmha(tmp_path):
    """build_config.plugin_config.use_paged_context_fmha and build_config.max_num_tokens, where TensorRT-LLM's runtime
    reads them (gptJsonConfig.cpp); an fp32 engine is built without paged context FMHA (llm.engine_build)."""
    engine = _engine_dir(tmp_path, max_num_tokens=8192, paged_context_fmha=False)
    assert LLMEngineBuild.read(engine) == LLMEngineBuild(max_num_tokens=8192, paged_context_fmha=False)
    (engine / "config.json").write_text(json.dumps({"build_config": {"max_num_tokens": 8192, "plugin_config": {}}}))
    with pytest.raises(CheckpointError, match="use_paged_context_fmha"):
        LLMEngineBuild.read(engine)
    (engine / "config.json").unlink()
    with pytest.raises(CheckpointError, match="build the LLM engine first"):
        LLMEngineBuild.read(engine)


def test_the_llm_rank_allocations_before_its_kv_cache_shrink_what_it_finds_free():
    """Activations and the prompt-table buffer are allocated before the rank reads its free memory (the fraction
    applies to what is left); the mrope tables after, beside the python models."""
    base = _plan()
    plan = _plan(llm_activation_bytes=2 * GIB, prompt_table_buffer_bytes=2 * GIB, mrope_tables_bytes=1 * GIB)
    free = base.free_at_llm_load - 4 * GIB
    assert plan.free_at_llm_load == base.free_at_llm_load and plan.free_at_kv_cache == free
    room = free - 10 * GIB - 1 * GIB - int(0.05 * 80 * GIB)
    assert plan.kv_cache_fraction() == round(room / free, 3)
    # The KV cache gets less than without them, and everything else still fits beside it.
    assert plan.kv_cache_fraction() * free < base.kv_cache_fraction() * base.free_at_llm_load
    assert (1 - plan.kv_cache_fraction()) * free >= plan.python_models_bytes + plan.mrope_tables_bytes
    text = plan.describe()
    assert "its prompt-table buffer: 2.00 GiB" in text and "LLM mrope tables of a full batch: 1.00 GiB" in text
    assert f"free when it sizes its KV cache: {free / GIB:.2f} GiB" in text


def test_the_llm_rank_allocations_of_an_8b_build():
    """The default limits (8 requests of 8192 visual tokens, max_seq_len and max_num_tokens 16384) on Qwen3-VL-8B."""
    limits = EngineLimits()
    # PromptTuningBuffers: max_prompt_embedding_table_size (4 x 8192 x 8 rows) x hidden 4096, bf16.
    assert gpu_memory.prompt_table_buffer_bytes(limits, LLM_8B) == 4 * 8192 * 8 * 4096 * 2 == 2 * GIB
    # Per request max_position_embeddings (16384) x rotary_dim (128) float32, and an int32 delta.
    assert gpu_memory.mrope_tables_bytes(limits, LLM_8B) == 8 * (16384 * 128 * 4 + 4)
    assert gpu_memory.llm_activation_bytes(16384, LLM_8B) == 16384 * (3 * 4096 + 3 * 12288) * 2 == 1536 * MIB
    # Tensor parallelism splits the MLP, pipeline stages keep a buffer set each; an MoE token runs top_k experts.
    two_way = replace(LLM_8B, mapping=ParallelLayout(tp_size=2, pp_size=2))
    assert gpu_memory.llm_activation_bytes(16384, two_way) == 16384 * (3 * 4096 + 3 * 6144) * 2
    assert gpu_memory.prompt_table_buffer_bytes(limits, two_way) == 2 * 2 * GIB
    moe = replace(LLM_8B, moe=MoeSettings(num_experts=128, top_k=8, intermediate_size=768, renormalize=True))
    assert gpu_memory.llm_activation_bytes(16384, moe) == 16384 * (3 * 4096 + 3 * 8 * 768) * 2


def test_python_models_on_a_gpu_of_their_own_leave_the_llm_gpu_to_the_kv_cache():
    """With the python models on GPU 1 and the LLM's rank 0 on GPU 0, the KV cache's GPU holds no python models (and
    no python stubs' contexts), and the python models' GPU gets a check of its own."""
    plan = _plan(gpu=1, mrope_tables_bytes=1 * GIB)
    assert not plan.shares_llm_gpu and (plan.llm_rank, plan.llm_gpu) == (0, 0)
    free = 80 * GIB - gpu_memory.CUDA_CONTEXT_BYTES - 16 * GIB  # tritonserver's context only
    assert plan.free_at_llm_load == free and plan.kv_cache_fraction() == 0.9
    small = _plan(gpu=1, gpu_bytes=20 * GIB, mrope_tables_bytes=1 * GIB)
    free = 20 * GIB - gpu_memory.CUDA_CONTEXT_BYTES - 16 * GIB
    assert small.kv_cache_fraction() == round((free - 1 * GIB - int(0.05 * 20 * GIB)) / free, 3)
    # GPU 1: tritonserver's context and the stubs', the python models (10 GiB) and the margin.
    assert plan.python_gpu_left_bytes == 80 * GIB - 3 * gpu_memory.CUDA_CONTEXT_BYTES - 10 * GIB - 4 * GIB
    plan.check_python_models_gpu()
    text = plan.describe()
    assert text.startswith("GPU 0 (LLM rank 0): 80.00 GiB") and "\nGPU 1 (python models): 80.00 GiB" in text
    assert "CUDA contexts (1 processes)" in text and "CUDA contexts (3 processes)" in text
    cramped = _plan(gpu=1, gpu_bytes=12 * GIB, llm_engine_bytes=1 * GIB)
    assert cramped.kv_cache_fraction() > 0.05
    with pytest.raises(LimitsError, match="GPU 1 .* has no room for the python models") as error:
        cramped.check_python_models_gpu()
    assert "no room for the python models" in str(error.value).splitlines()[-2]
    _plan(gpu_bytes=12 * GIB, llm_engine_bytes=1 * GIB).check_python_models_gpu()  # beside a rank: the fraction's


def test_every_rank_server_holds_a_context_on_the_gpus():
    """Under MPI each rank's tritonserver creates Triton's default CUDA memory pool on every GPU; beside rank 1 of
    two the plan counts both servers' contexts and the stubs'."""
    plan = _plan(gpu=1, llm_gpus=(0, 1))
    assert plan.shares_llm_gpu and (plan.llm_rank, plan.llm_gpu) == (1, 1)
    assert plan.free_at_llm_load == 80 * GIB - 4 * gpu_memory.CUDA_CONTEXT_BYTES - 16 * GIB
    assert plan.describe().startswith("GPU 1 (LLM rank 1, python models): 80.00 GiB")


def test_a_replica_that_leaves_its_images_to_a_vision_pool_gives_the_vision_share_to_its_kv_cache(tmp_path):
    """serve --role language's plan (encodes=False) beside the colocated one, the docs' 8B example on one H200 (the
    default limits): one python stub, no vision engine, no decoding, no CUDA memory pool (its tables leave
    preprocessing in host memory); the KV cache takes the rest."""
    limits = EngineLimits()
    engine = _engine_dir(tmp_path, max_num_tokens=limits.max_num_tokens, rank0_bytes=0)
    os.truncate(engine / "rank0.engine", 16 * GIB)
    vision = tmp_path / "vision.engine"
    vision.write_bytes(b"")
    os.truncate(vision, GIB)  # sparse: the size the docs' example plans
    common = dict(
        gpu=0, llm_gpus=(0,), gpu_bytes=141 * GIB, limits=limits, llm_engine_dir=engine, vision_engine_file=vision,
        vision_activation_bytes=2 * GIB, patch_dim=1536, merge_unit=4, llm=LLM_8B,
    )  # fmt: skip
    colocated = gpu_memory.plan(**common)
    language = gpu_memory.plan(**common, encodes=False)
    assert language.python_models_bytes == 0 and gpu_memory.transfer_pool_bytes(limits, 1536, 4, 1, False) == 0
    assert language.python_stubs == 1 and colocated.python_stubs == 2
    # What the split frees on the replica's GPU: the vision side, the CUDA memory pool, one stub's context.
    freed = colocated.python_models_bytes + gpu_memory.CUDA_CONTEXT_BYTES
    assert 17.5 * GIB < freed < 17.6 * GIB
    gained = language.kv_cache_fraction() * language.free_at_kv_cache - colocated.kv_cache_fraction() * (
        colocated.free_at_kv_cache
    )
    # All of it but what the backend's ceiling (0.9 of what is free) keeps back: 95.7 -> 108.3 GiB of KV cache.
    assert language.kv_cache_fraction() == gpu_memory.KV_CACHE_FRACTION_CEILING
    assert 12.5 * GIB < gained <= freed
    text = language.describe()
    assert "--role language" in text and "vision engine 0" not in text and "(2 processes)" in text
    assert "no CUDA memory pool" in text
