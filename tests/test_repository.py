"""The Triton model repository writer: configs as ModelConfig messages for both targets, the
write-repo command, and the request-level pieces the models run (word lists, sampling rules)."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from qwen3vl_trt.cli import main
from qwen3vl_trt.common.contracts import BuildLayout
from qwen3vl_trt.common.limits import EngineLimits
from qwen3vl_trt.errors import CheckpointError, LimitsError
from qwen3vl_trt.llm.checkpoint_format import TOKENIZER_INFO_FILE, ParallelLayout, read_trtllm_config
from qwen3vl_trt.pipeline.build import build
from qwen3vl_trt.runtime.sampling import SamplingParams, TokenSampler
from qwen3vl_trt.serving import interface
from qwen3vl_trt.serving.parameters import PreprocessingParameters, VisionEncoderParameters
from qwen3vl_trt.serving.repository import gpu_memory
from qwen3vl_trt.serving.repository import model_config as cfg
from qwen3vl_trt.serving.repository.gpu_memory import GpuMemoryPlan
from qwen3vl_trt.serving.repository.settings import RepositorySettings
from qwen3vl_trt.serving.repository.writer import (
    REPOSITORY_FILE,
    gpu_memory_plan,
    model_configs,
    write_model_files,
    write_models,
)
from qwen3vl_trt.serving.request import BATCH_PRIORITY, PRIORITY_LEVELS
from qwen3vl_trt.serving.stages.preprocessing import split_word_list, word_list
from qwen3vl_trt.serving.stages.vision_batching import plan_runs
from qwen3vl_trt.serving.tensors import NUMPY_DTYPES
from qwen3vl_trt.vision.metadata import vision_metadata
from qwen3vl_trt.vision.sidecar import VisionEngineProfile, VisionEngineSidecar, VisionSidecar
from tritonclient.grpc import model_config_pb2 as mc

# Config generation runs again at the GPU image's tritonclient and protobuf (build/gpu_image.py).
pytestmark = pytest.mark.gpu_image


def _quiet(*_args, **_kwargs) -> None:
    pass


@pytest.fixture(scope="module")
def built(tiny_dense, tmp_path_factory):
    output = tmp_path_factory.mktemp("repo") / "build"
    build(tiny_dense, output, target="cpu", log=_quiet)
    return output


def _steps(config) -> dict[str, tuple[dict, dict]]:
    return {s.model_name: (dict(s.input_map), dict(s.output_map)) for s in config.ensemble_scheduling.step}


def test_gpu_and_cpu_targets_route_the_same_ensemble(built, tiny_dense):
    layout = BuildLayout(built)
    _, llm = read_trtllm_config(layout.llm_checkpoint)
    limits = EngineLimits()
    cpu = model_configs(layout, tiny_dense, "cpu", limits, llm)
    gpu = model_configs(layout, tiny_dense, "gpu", limits, llm, memory=MEMORY)
    assert _steps(cpu[interface.ENSEMBLE]) == _steps(gpu[interface.ENSEMBLE])
    assert gpu[interface.LLM].backend == "tensorrtllm" and cpu[interface.LLM].backend == "python"
    # Every tensor the ensemble hands the llm is declared by both llms, with the same type and shape.
    for tensor in interface.LLM_INPUTS:
        ours = {i.name: i for i in cpu[interface.LLM].input}[tensor.name]
        theirs = {i.name: i for i in gpu[interface.LLM].input}[tensor.name]
        assert (ours.data_type, list(ours.dims), list(ours.reshape.shape)) == (
            theirs.data_type,
            list(theirs.dims),
            list(theirs.reshape.shape),
        ), tensor.name
    # Guided decoding on the engine reads the tokenizer info convert-llm wrote beside the TensorRT-LLM checkpoint.
    params = {k: v.string_value for k, v in gpu[interface.LLM].parameters.items()}
    info = Path(params["xgrammar_tokenizer_info_path"])
    assert params["guided_decoding_backend"] == "xgrammar" and info == layout.llm_checkpoint / TOKENIZER_INFO_FILE
    assert set(json.loads(info.read_text())) == {"encoded_vocab", "tokenizer_str", "stop_token_ids"}
    engine_dir = {name: VisionEncoderParameters.from_model_config(c[interface.VISION_ENCODER]).vision_engine_dir
                  for name, c in (("cpu", cpu), ("gpu", gpu))}  # fmt: skip
    assert engine_dir == {"cpu": None, "gpu": layout.vision_engine}
    pre = gpu[interface.PREPROCESSING]
    assert pre.instance_group[0].kind == pre.instance_group[0].KIND_GPU
    assert pre.parameters["FORCE_CPU_ONLY_INPUT_TENSORS"].string_value == "no"
    assert PreprocessingParameters.from_model_config(pre).preprocess_device == "cuda"
    assert PreprocessingParameters.from_model_config(pre).mrope_positions == limits.max_seq_len
    assert PreprocessingParameters.from_model_config(cpu[interface.PREPROCESSING]).mrope_positions == 0
    for configs in (cpu, gpu):
        for config in configs.values():
            assert cfg.parse(cfg.to_text(config)) == config
            if config.name != interface.ENSEMBLE:
                assert config.max_batch_size == limits.max_batch_size


MEMORY = GpuMemoryPlan(
    gpu=0,
    llm_gpus=(0,),
    gpu_bytes=80 << 30,
    llm_engine_bytes=16 << 30,
    vision_engine_bytes=1 << 30,
    vision_activation_bytes=2 << 30,
    decode_bytes=3 << 30,
    transfer_pool_bytes=4 << 30,
    llm_activation_bytes=1 << 30,
    prompt_table_buffer_bytes=1 << 30,
    mrope_tables_bytes=1 << 28,
    llm_paged_context_fmha=True,
)


@pytest.mark.parametrize("gpu", [0, 1])
def test_gpu_python_models_sit_on_one_stated_gpu_beside_a_planned_kv_cache(built, tiny_dense, gpu):
    """Without `gpus`, a KIND_GPU group puts an instance on every visible GPU; the KV cache share leaves room for the
    python models (serving.repository.gpu_memory), and the CUDA memory pool size travels to `serve` in a parameter."""
    layout = BuildLayout(built)
    _, llm = read_trtllm_config(layout.llm_checkpoint)
    settings = RepositorySettings(python_models_gpu=gpu)
    memory = replace(MEMORY, gpu=gpu)
    configs = model_configs(layout, tiny_dense, "gpu", EngineLimits(), llm, settings, memory=memory)
    for name in (interface.PREPROCESSING, interface.VISION_ENCODER):
        (group,) = configs[name].instance_group
        assert group.kind == group.KIND_GPU and list(group.gpus) == [gpu] and group.count == 1
    assert configs[interface.POSTPROCESSING].instance_group[0].kind == mc.ModelInstanceGroup.KIND_CPU
    llm_params = configs[interface.LLM].parameters
    assert float(llm_params["kv_cache_free_gpu_mem_fraction"].string_value) == memory.kv_cache_fraction()
    assert MEMORY.kv_cache_fraction() < 0.9  # beside the python models
    pool = PreprocessingParameters.from_model_config(configs[interface.PREPROCESSING]).cuda_memory_pool_bytes
    assert pool == MEMORY.transfer_pool_bytes
    given = RepositorySettings(kv_cache_free_gpu_mem_fraction=0.5)
    configs = model_configs(layout, tiny_dense, "gpu", EngineLimits(), llm, given, memory=MEMORY)
    assert configs[interface.LLM].parameters["kv_cache_free_gpu_mem_fraction"].string_value == "0.5"
    with pytest.raises(ValueError, match="GPU memory plan"):
        model_configs(layout, tiny_dense, "gpu", EngineLimits(), llm)
    with pytest.raises(ValueError, match="GPU memory plan puts the python models on GPU 0"):
        model_configs(layout, tiny_dense, "gpu", EngineLimits(), llm, RepositorySettings(python_models_gpu=1), MEMORY)


def _preserves_response_order(config: mc.ModelConfig) -> bool:
    """Whether Triton core r26.04 delivers an ensemble step's responses in order: its response callbacks run on the
    thread that sends them when this holds of the step model's config, else on a shared thread pool that may deliver
    a stream's pieces out of order (triton-inference-server/core r26.04, ee0bc478,
    src/ensemble_scheduler/ensemble_scheduler.cc: preserve_responses_order, EnsembleContext::ResponseComplete)."""
    instances = sum(group.count for group in config.instance_group)
    return (
        config.HasField("sequence_batching")
        or (not config.HasField("dynamic_batching") and instances <= 1)
        or (config.HasField("dynamic_batching") and config.dynamic_batching.preserve_ordering)
        or config.model_transaction_policy.decoupled
    )


@pytest.mark.parametrize("dynamic_batching", [True, False])
def test_every_ensemble_step_delivers_its_responses_in_order(built, tiny_dense, dynamic_batching):
    """A streamed answer's pieces pass the ensemble one response each; on the GPU image's Triton a step that batches
    without preserve_ordering (and is not decoupled) hands them to a thread pool, which can reorder them. The CPU
    tritonserver (2.51, core r24.10) has no such pool, so the written configs are checked against r26.04's rule."""
    layout = BuildLayout(built)
    _, llm = read_trtllm_config(layout.llm_checkpoint)
    settings = RepositorySettings(dynamic_batching=dynamic_batching)
    for target, memory in (("cpu", None), ("gpu", MEMORY)):
        configs = model_configs(layout, tiny_dense, target, EngineLimits(), llm, settings, memory=memory)
        for ensemble in (interface.ENSEMBLE, interface.TOKENS_ENSEMBLE):
            for step in configs[ensemble].ensemble_scheduling.step:
                assert _preserves_response_order(configs[step.model_name]), (target, ensemble, step.model_name)


def test_the_python_steps_serve_batch_lines_after_interactive_requests(built, tiny_dense):
    """Every python model an ensemble runs but postprocessing queues at two priority levels, interactive (1, the
    default) before batch lines (BATCH_PRIORITY), with its queue bound on each (core r24.10 and r26.04
    src/scheduler_utils.cc: a level's own PolicyQueue). Postprocessing keeps its pieces' order, which Triton allows
    at one level only; the tensorrtllm model has none, so it takes any priority as its default."""
    layout = BuildLayout(built)
    _, llm = read_trtllm_config(layout.llm_checkpoint)
    for target, memory in (("cpu", None), ("gpu", MEMORY)):
        configs = model_configs(layout, tiny_dense, target, EngineLimits(), llm, memory=memory)
        steps = {step.model_name for step in configs[interface.ENSEMBLE].ensemble_scheduling.step}
        for name in steps:
            batching = configs[name].dynamic_batching
            if configs[name].backend == "python" and not batching.preserve_ordering:
                assert (batching.priority_levels, batching.default_priority_level) == (PRIORITY_LEVELS, 1), name
                assert BATCH_PRIORITY == PRIORITY_LEVELS
            else:
                assert batching.priority_levels == 0, (target, name)
        assert configs[interface.PREPROCESSING].dynamic_batching.priority_levels == PRIORITY_LEVELS
    settings = RepositorySettings(dynamic_batching=False)
    unbatched = model_configs(layout, tiny_dense, "cpu", EngineLimits(), llm, settings)
    assert not unbatched[interface.PREPROCESSING].HasField("dynamic_batching")


def _gpu_build(built: Path, root: Path, rank_bytes: tuple[int, ...]) -> BuildLayout:
    """What a GPU memory plan reads of a build, engines standing in by their sizes: the vision export's sidecar, the
    vision engine's sidecar (3 GiB of activations) and plan, and the LLM engine's config.json and one file per rank."""
    layout = BuildLayout(root)
    shutil.copytree(BuildLayout(built).vision, layout.vision)
    layout.vision_engine.mkdir()
    profile = VisionEngineProfile()
    sidecar = VisionEngineSidecar.of_build(
        VisionSidecar.load(layout.vision), profile, "10.14.1.48", "NVIDIA H100 80GB HBM3", (9, 0), 90, 3, "", 3 << 30
    )
    sidecar.write(layout.vision_engine)
    (layout.vision_engine / sidecar.engine_file).write_bytes(b"\0" * 1000)
    layout.llm_engine.mkdir()
    build_config = {"max_num_tokens": 64, "plugin_config": {"use_paged_context_fmha": True}}
    (layout.llm_engine / gpu_memory.ENGINE_CONFIG_FILE).write_text(json.dumps({"build_config": build_config}))
    for rank, size in enumerate(rank_bytes):
        (layout.llm_engine / f"rank{rank}.engine").write_bytes(b"\0" * size)
    return layout


def _device_ids(configs) -> str:
    return configs[interface.LLM].parameters["gpu_device_ids"].string_value


def test_the_kv_cache_is_planned_on_the_llm_gpu_and_the_python_models_on_theirs(built, tiny_dense, tmp_path):
    """The LLM's rank r runs on GPU r (gpu_device_ids, written out), its KV cache sized on rank 0's GPU; python models
    on another GPU leave that one whole to the LLM and are checked to fit on their own."""
    layout = _gpu_build(built, tmp_path / "build", (2000,))
    _, llm = read_trtllm_config(BuildLayout(built).llm_checkpoint)
    limits = EngineLimits(max_batch_size=2, max_visual_tokens=1024)
    settings = {gpu: RepositorySettings(python_models_gpu=gpu, gpu_memory_bytes=24 << 30) for gpu in (0, 1)}
    beside, apart = (gpu_memory_plan(layout, limits, llm, settings[gpu]) for gpu in (0, 1))
    configs = {gpu: model_configs(layout, tiny_dense, "gpu", limits, llm, settings[gpu], plan)
               for gpu, plan in ((0, beside), (1, apart))}  # fmt: skip
    assert _device_ids(configs[0]) == _device_ids(configs[1]) == "0"
    fraction = {gpu: float(c[interface.LLM].parameters["kv_cache_free_gpu_mem_fraction"].string_value)
                for gpu, c in configs.items()}  # fmt: skip
    # Alone on GPU 0 the rank keeps the backend's default share; beside the python models it leaves them room.
    assert fraction[1] == 0.9 and fraction[0] < 0.9
    assert (1 - fraction[0]) * beside.free_at_kv_cache >= beside.python_models_bytes
    # Only the tritonserver process holds a CUDA context on the LLM's own GPU; the python models' stubs hold theirs.
    assert apart.free_at_llm_load == (24 << 30) - gpu_memory.CUDA_CONTEXT_BYTES - 2000
    assert beside.free_at_llm_load == apart.free_at_llm_load - 2 * gpu_memory.CUDA_CONTEXT_BYTES
    assert "GPU 1 (python models)" in apart.describe() and "GPU 0 (python models" not in apart.describe()
    # Their own GPU must hold them: the vision engine, its activations, decoding and the CUDA memory pool.
    small = RepositorySettings(python_models_gpu=1, gpu_memory_bytes=apart.python_models_bytes)
    with pytest.raises(LimitsError, match="GPU 1 .* has no room for the python models"):
        gpu_memory_plan(layout, limits, llm, small)


def test_with_tensor_parallelism_the_python_models_plan_beside_the_rank_on_their_gpu(built, tiny_dense, tmp_path):
    layout = _gpu_build(built, tmp_path / "build", (2000, 3000))
    _, llm = read_trtllm_config(BuildLayout(built).llm_checkpoint)
    llm = replace(llm, mapping=ParallelLayout(tp_size=2))
    limits = EngineLimits(max_batch_size=2, max_visual_tokens=1024)
    settings = RepositorySettings(python_models_gpu=1, gpu_memory_bytes=24 << 30)
    plan = gpu_memory_plan(layout, limits, llm, settings)
    assert plan.llm_gpus == (0, 1) and plan.llm_rank == 1 and plan.llm_engine_bytes == 3000
    # Both ranks' tritonserver processes hold a context on every GPU (Triton's default CUDA memory pool), and the
    # python stubs theirs.
    assert plan.free_at_llm_load == (24 << 30) - 4 * gpu_memory.CUDA_CONTEXT_BYTES - 3000
    configs = model_configs(layout, tiny_dense, "gpu", limits, llm, settings, plan)
    assert _device_ids(configs) == "0,1"
    assert float(configs[interface.LLM].parameters["kv_cache_free_gpu_mem_fraction"].string_value) < 0.9


@pytest.mark.parametrize("target", ["gpu", "cpu"])
def test_the_language_role_reads_configs_of_its_own_beside_every_model(built, tiny_dense, tmp_path, target):
    """serve --role language has tritonserver read configs/language.pbtxt (--model-config-name): preprocessing's
    has no local encoder to fall back to and, on the gpu target, the CUDA memory pool of the plan without the vision
    side (prompt tables only), the llm's that plan's larger KV cache share; every other model reads config.pbtxt."""
    layout = _gpu_build(built, tmp_path / "build", (2000,)) if target == "gpu" else BuildLayout(built)
    _, llm = read_trtllm_config(BuildLayout(built).llm_checkpoint)
    limits = EngineLimits(max_batch_size=2, max_visual_tokens=1024)
    settings = RepositorySettings(gpu_memory_bytes=24 << 30)
    logged: list[str] = []
    repo = tmp_path / "repo"
    memory = write_models(repo, layout, tiny_dense, target, limits, llm, settings, log=logged.append)
    language = {m: cfg.read(repo / m, cfg.LANGUAGE_CONFIG) for m in interface.MODELS}
    colocated = {m: cfg.read(repo / m) for m in interface.MODELS}
    changed = {m for m in interface.MODELS if language[m] != colocated[m]}
    assert changed == ({interface.PREPROCESSING, interface.LLM} if target == "gpu" else {interface.PREPROCESSING})
    assert sorted(p.parent.parent.name for p in repo.glob(f"*/{cfg.CONFIGS_DIR}/*.pbtxt")) == sorted(changed)
    mine, theirs = (PreprocessingParameters.from_model_config(c[m]) for c, m in
                    ((language, interface.PREPROCESSING), (colocated, interface.PREPROCESSING)))  # fmt: skip
    assert (mine.vision_fallback, theirs.vision_fallback) == ("fail", "local")
    if target == "cpu":
        assert memory is None and mine.cuda_memory_pool_bytes is None and not logged
        return
    assert memory is not None and memory.encodes
    plan = gpu_memory_plan(layout, limits, llm, settings, encodes=False)
    # Nothing it passes between models is in device memory: Triton's default pool, no flag (launch.cuda_pool_flags).
    assert mine.cuda_memory_pool_bytes is None and plan.transfer_pool_bytes == 0 < theirs.cuda_memory_pool_bytes
    fraction = {name: float(c[interface.LLM].parameters["kv_cache_free_gpu_mem_fraction"].string_value)
                for name, c in (("language", language), ("colocated", colocated))}  # fmt: skip
    assert fraction == {"language": plan.kv_cache_fraction(), "colocated": memory.kv_cache_fraction()}
    assert fraction["language"] > fraction["colocated"]
    assert logged == [memory.describe(), plan.describe()]


def test_the_gpu_vision_encoder_warms_up_at_three_sizes_on_what_preprocessing_sends(built, tiny_dense, tmp_path):
    """Triton runs a model's model_warmup samples at load, before it is ready (docs/serving.md, "Warm-up and
    readiness"): the GPU target's vision encoder gets one square image of the request's most visual tokens (at most
    256), a quarter and a sixteenth of it, zero pixels and the metadata preprocessing computes, read from the model's
    warmup/ files."""
    layout = BuildLayout(built)
    _, llm = read_trtllm_config(layout.llm_checkpoint)
    limits = EngineLimits(max_visual_tokens=8192)
    gpu = model_configs(layout, tiny_dense, "gpu", limits, llm, memory=MEMORY)
    cpu = model_configs(layout, tiny_dense, "cpu", limits, llm)
    assert not cpu[interface.VISION_ENCODER].model_warmup  # ONNX Runtime calibrates its own sizes at load
    config = gpu[interface.VISION_ENCODER]
    assert [s.name for s in config.model_warmup] == ["16 visual tokens", "64 visual tokens", "256 visual tokens"]
    write_model_files(tmp_path, gpu)
    vision = VisionSidecar.load(layout.vision)
    merge = vision.spatial_merge_size
    for sample, side in zip(config.model_warmup, (4, 8, 16), strict=True):
        rows = side * merge
        assert sample.batch_size == 1
        pixels = sample.inputs[interface.VISION_PIXELS.name]
        assert pixels.zero_data and list(pixels.dims) == [rows * rows, vision.patch_dim]
        grid = np.array([[1, rows, rows]])
        expected = {
            **vision_metadata(grid, merge, vision.num_grid_per_side),
            interface.IMAGE_GRID_THW.name: grid,
            interface.VISUAL_TOKEN_COUNT.name: np.array([side * side]),
        }
        for tensor in interface.VISION_REQUEST[1:]:
            given = sample.inputs[tensor.name]
            data = (tmp_path / interface.VISION_ENCODER / "warmup" / given.input_data_file).read_bytes()
            dtype = NUMPY_DTYPES[tensor.data_type]
            assert given.data_type == cfg.data_type(tensor) and data == expected[tensor.name].astype(dtype).tobytes()
            assert list(given.dims) == list(expected[tensor.name].shape)
    assert cfg.read(tmp_path / interface.VISION_ENCODER) == config


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(python_models_gpu=-1), "GPU index"),
        (dict(gpu_memory_bytes=0), "must be positive"),
        (dict(kv_cache_free_gpu_mem_fraction=1.5), r"in \(0, 1\]"),
    ],
)
def test_bad_repository_settings_are_refused(settings, message):
    with pytest.raises(LimitsError, match=message):
        RepositorySettings(**settings)


def test_write_repo_writes_every_model_and_refuses_a_gpu_target_without_engine(built, tmp_path, capsys):
    repo = tmp_path / "repo"
    assert main(["write-repo", "--build-dir", str(built), "--output", str(repo), "--target", "cpu"]) == 0
    for name in interface.MODELS:
        config = cfg.read(repo / name)
        assert config.name == name and (repo / name / "1").is_dir()
        assert (repo / name / "1" / "model.py").is_file() == (config.backend == "python")
    record = json.loads((repo / REPOSITORY_FILE).read_text())
    assert record["target"] == "cpu" and record["build_dir"] == str(built.absolute())
    assert main(["write-repo", "--build-dir", str(built), "--output", str(tmp_path / "gpu"), "--target", "gpu"]) == 2
    assert "llm-engine" in capsys.readouterr().err
    assert main(["write-repo", "--build-dir", str(built), "--output", str(built / "inside")]) == 2


def test_a_build_without_manifest_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match="manifest.json"):
        from qwen3vl_trt.serving.repository.writer import write_repository

        write_repository(tmp_path, tmp_path / "repo", target="cpu")


def test_word_lists_round_trip_in_tensorrt_llm_layout():
    table = word_list([[5, 6], [7], []])
    assert table.tolist() == [[5, 6, 7], [2, 3, -1]]
    assert split_word_list(table) == ((5, 6), (7,))
    assert word_list([]).tolist() == [[0], [-1]] and split_word_list(word_list([])) == ()


def _picks(params: SamplingParams, rows: list[list[float]]) -> list[int]:
    sampler = TokenSampler(params, torch.device("cpu"))
    return [sampler.next_token(torch.tensor(row)) for row in rows if not sampler.finished]


def test_stop_sequences_bad_sequences_and_min_tokens():
    # Logits favour token 2 then 0; token 0 is the end id.
    rows = [[1.0, 0.0, 3.0, 2.0]] * 3 + [[5.0, 0.0, 1.0, 0.0]] * 2
    assert _picks(SamplingParams(5, end_ids=[0]), rows) == [2, 2, 2, 0]
    assert _picks(SamplingParams(5, end_ids=[0], stop_sequences=[[2, 2]]), rows) == [2, 2]
    assert _picks(SamplingParams(5, end_ids=[0], bad_sequences=[[2]]), rows) == [3, 3, 3, 0]
    assert _picks(SamplingParams(5, end_ids=[0], bad_sequences=[[2, 2]]), rows)[:2] == [2, 3]
    assert _picks(SamplingParams(5, end_ids=[0], min_new_tokens=5), rows) == [2, 2, 2, 2, 2]


def test_vision_runs_are_cut_at_image_boundaries_to_what_fits():
    def within(patches, images):
        return patches <= 25 and images <= 2

    assert plan_runs([10, 10, 30, 5, 5, 5], within) == [[0, 1], [2], [3, 4], [5]]
    assert plan_runs([], within) == []
    assert plan_runs([10, 10], within, segments_per_image=[2, 1]) == [[0], [1]]  # a video's frame pairs count each
