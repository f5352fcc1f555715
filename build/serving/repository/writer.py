"""`qwen3vl-trt write-repo`: a build directory -> a Triton model repository.

Models: `preprocessing`, `vision_encoder`, `llm`, `postprocessing` and the ensembles `qwen3vl` (text) and
`qwen3vl_tokens` (token ids, for clients that decode them) (serving.interface). Target `cpu` serves the ONNX vision
encoder with ONNX Runtime and the LLM checkpoint with the reference runtime (decoupled python models); target `gpu`
serves the TensorRT-LLM engine with the tensorrtllm backend and decodes images into device memory. Every
config.pbtxt is a ModelConfig message whose batching numbers come from the build's EngineLimits. The python models
find the build and the checkpoint's tokenizer/processor files by the absolute paths recorded in their parameters:
after moving either, write the repository again.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from importlib import resources
from pathlib import Path

import numpy as np
from tritonclient.grpc import model_config_pb2 as mc

from ... import __version__
from ...common.contracts import VISION_ENGINE_FILE, BuildLayout
from ...common.fsutil import atomic_output_dir
from ...common.limits import EngineLimits
from ...common.manifest import (
    LLM_CHECKPOINT_STAGE,
    LLM_ENGINE_STAGE,
    VISION_ENGINE_STAGE,
    VISION_STAGE,
    BuildManifest,
    Target,
)
from ...errors import CheckpointError, LimitsError
from ...hf.checkpoint import VisionConfig, parse_config, read_config
from ...llm.checkpoint_format import TOKENIZER_INFO_FILE, LLMConfig, read_trtllm_config
from ...vision.metadata import vision_metadata
from ...vision.sidecar import VisionEngineSidecar, VisionSidecar
from .. import interface
from ..backpressure import QUEUED_BATCHES, BackPressure
from ..parameters import (
    EnsembleParameters,
    LLMParameters,
    PostprocessingParameters,
    PreprocessingParameters,
    VisionEncoderParameters,
    VisionParameters,
)
from ..request import PRIORITY_LEVELS, REQUEST_INPUTS
from ..tensors import NUMPY_DTYPES, Tensor
from . import gpu_memory
from . import model_config as cfg
from .gpu_memory import GpuMemoryPlan
from .settings import DEFAULT_REPOSITORY_SETTINGS, VISUAL_CACHE_MAX_BYTES, VISUAL_CACHE_MIN_BYTES, RepositorySettings

REPOSITORY_FILE = "qwen3vl_repository.json"  # Triton ignores files at a repository's top
MODEL_FILE = "model.py"


@dataclass(frozen=True)
class RepositoryRecord:
    """What a `write-repo` output was written from (a build's own repository is recorded in its manifest)."""

    target: Target
    build_dir: Path
    model_dir: Path
    gpu_memory: dict[str, object] | None = None
    qwen3vl_trt: str = __version__

    def write(self, repo: Path) -> None:
        record = {k: str(v) if isinstance(v, Path) else v for k, v in asdict(self).items() if v is not None}
        (repo / REPOSITORY_FILE).write_text(json.dumps(record, indent=2) + "\n")


def visual_cache_bytes(limits: EngineLimits, llm: LLMConfig, settings: RepositorySettings) -> int:
    """The in-process visual cache's byte budget: the settings', or one sized from the build."""
    if settings.visual_cache_bytes is not None:
        return settings.visual_cache_bytes
    token_bytes = gpu_memory.prompt_table_token_bytes(llm.dtype, llm.hidden_size, llm.deepstack_count)
    full = QUEUED_BATCHES * limits.max_batch_size * limits.max_visual_tokens * token_bytes
    return min(max(full, VISUAL_CACHE_MIN_BYTES), VISUAL_CACHE_MAX_BYTES)


def _internal(producer: str, tensor: Tensor) -> str:
    """The ensemble's name for a tensor one step produces and later steps read."""
    return f"{producer}_{tensor.name}"


def _ragged(tensor: Tensor, model_data_type: str = "FP32", optional: bool | None = None) -> mc.ModelInput:
    return cfg.model_input(tensor, model_data_type, optional=optional, ragged=True)


def _llm_input(tensor: Tensor, model_data_type: str) -> mc.ModelInput:
    spec = _ragged(tensor, model_data_type)
    if tensor.scalar:
        spec.reshape.SetInParent()  # shape [], as the tensorrt_llm backend declares scalars
    return spec


@dataclass(frozen=True)
class _Models:
    """What every model's configuration is built from: the build at its final location (`build.root`), the
    checkpoint, the target, the limits, the LLM checkpoint's configuration and the settings; `memory`, the GPU
    memory plan, on the gpu target."""

    build: BuildLayout
    model_dir: Path
    target: Target
    limits: EngineLimits
    llm: LLMConfig
    settings: RepositorySettings
    memory: GpuMemoryPlan | None
    vision_digest: str  # the vision export's (VisionSidecar.features_digest)

    @property
    def gpu(self) -> bool:
        return self.target == "gpu"

    @property
    def kind(self) -> str:
        return "gpu" if self.gpu else "cpu"

    @property
    def model_type(self) -> str:
        return cfg.MODEL_DATA_TYPES[self.llm.dtype]

    @property
    def on_gpu(self) -> dict[str, str]:
        # python_backend's own key: pixels stay in device memory between models (r24.10 src/python_be.cc).
        return {"FORCE_CPU_ONLY_INPUT_TENSORS": "no"} if self.gpu else {}

    def vision(self) -> VisionParameters:
        return VisionParameters(
            model_dir=self.model_dir,
            limits=self.limits,
            vision_dir=self.build.vision,
            # The GPU target runs the TensorRT vision engine (varlen attention plugin); the CPU target the ONNX.
            vision_engine_dir=self.build.vision_engine if self.gpu else None,
            llm_dtype=self.llm.dtype,
            llm_hidden_size=self.llm.hidden_size,
            vision_digest=self.vision_digest,
        )


def _python_model(
    m: _Models,
    name: str,
    inputs: list[mc.ModelInput],
    outputs: list[mc.ModelOutput],
    kind: str,
    params: dict[str, str],
    decoupled: bool = False,
    bounded_queue: bool = True,
    priority_levels: bool = True,
) -> mc.ModelConfig:
    limits, settings = m.limits, m.settings
    config = mc.ModelConfig(name=name, backend="python", max_batch_size=limits.max_batch_size)
    config.input.extend(inputs)
    config.output.extend(outputs)
    # A KIND_GPU group without gpus puts an instance on every visible GPU: the python models stay on one.
    config.instance_group.append(cfg.instance_group(kind, gpus=[settings.python_models_gpu] if kind == "gpu" else []))
    if settings.dynamic_batching:
        config.dynamic_batching.max_queue_delay_microseconds = settings.max_queue_delay_us
        if priority_levels:
            # Batch lines (BATCH_PRIORITY) wait here while interactive requests do; each level has its own queue bound.
            config.dynamic_batching.priority_levels = PRIORITY_LEVELS
            config.dynamic_batching.default_priority_level = 1
        if bounded_queue:
            queue = BackPressure.plan(limits, settings.max_queue_size).triton_queue
            cfg.queue_policy(config, queue, settings.queue_timeout_us)
    if decoupled:
        config.model_transaction_policy.decoupled = True
    cfg.parameters(config, params)
    return config


def _preprocessing(m: _Models) -> mc.ModelConfig:
    params = PreprocessingParameters(
        **vars(m.vision()),
        preprocess_device="cuda" if m.gpu else "cpu",
        mrope_positions=m.limits.max_seq_len if m.gpu else 0,
        visual_cache=m.settings.visual_cache,
        visual_cache_bytes=visual_cache_bytes(m.limits, m.llm, m.settings),
        visual_cache_ttl_s=m.settings.visual_cache_ttl_s,
        # `serve` sizes Triton's CUDA memory pool of the python models' GPU from this (launch.cuda_pool_flags).
        cuda_memory_pool_bytes=m.memory.transfer_pool_bytes if m.memory is not None and m.gpu else None,
    )
    return _python_model(
        m,
        interface.PREPROCESSING,
        [_ragged(t, optional=True) for t in REQUEST_INPUTS],
        [cfg.model_output(t, m.model_type) for t in interface.PREPROCESSING_OUTPUTS],
        m.kind,
        {**m.on_gpu, **params.as_strings()},
        decoupled=True,  # its async execute answers hits while a batch waits for the vision encoder
    )


def _vision_encoder(m: _Models) -> mc.ModelConfig:
    params = VisionEncoderParameters(**vars(m.vision()), attention_budget_bytes=m.settings.attention_budget_bytes)
    config = _python_model(
        m,
        interface.VISION_ENCODER,
        [_ragged(t, optional=False) for t in interface.VISION_REQUEST],
        [cfg.model_output(interface.PROMPT_TABLE, m.model_type)],
        m.kind,
        {**m.on_gpu, **params.as_strings()},
        # Its one client is preprocessing (a request per batch), which bounds the requests it has in flight.
        bounded_queue=False,
    )
    if m.gpu:  # the CPU target's ONNX Runtime runs its own calibration sizes at load (vision_batching.warm_up)
        vision_warmup(config, m.limits, parse_config(read_config(m.model_dir)[1]).vision)
    return config


# Where Triton reads a model_warmup sample's input_data_file: the model directory's warmup/ (core r24.10
# src/constants.h kWarmupDataFolder).
WARMUP_DIR = "warmup"


def _warmup_metadata(rows: int, vision: VisionConfig) -> dict[str, np.ndarray]:
    """The vision encoder's inputs but its pixels for one square image of rows x rows patches, as preprocessing
    computes them (vision.metadata)."""
    merge = vision.spatial_merge_size
    grid = np.array([[1, rows, rows]], np.int64)
    values = {
        **vision_metadata(grid, merge, vision.num_grid_per_side),
        interface.IMAGE_GRID_THW.name: grid,
        interface.VISUAL_TOKEN_COUNT.name: np.array([rows * rows // merge**2], np.int32),
    }
    return {
        t.name: np.asarray(values[t.name], NUMPY_DTYPES[t.data_type])
        for t in interface.VISION_REQUEST
        if t is not interface.VISION_PIXELS
    }


def vision_warmup(config: mc.ModelConfig, limits: EngineLimits, vision: VisionConfig) -> None:
    """Adds model_warmup samples to the vision encoder's config: one square image each, of the most visual tokens a
    request may bring (at most interface.MAX_WARMUP_TOKENS), a quarter and a sixteenth of it (the TensorRT engine's
    first runs). Triton
    runs them on every instance at load, before the model is ready (core r24.10 src/backend_model_instance.cc
    WarmUp; a python model takes them as requests, server qa/L0_warmup), so a stage the supervisor reloads is warm
    too; its adapter keeps them out of the stage's metrics (stages.triton_adapters: an instance's first requests).
    Pixels are zeros; the rest is read from files (warmup_files), named by input and patch rows."""
    side = math.isqrt(min(limits.max_visual_tokens, interface.MAX_WARMUP_TOKENS))
    for tokens_side in sorted({max(1, side // 4), max(1, side // 2), side}):
        rows = tokens_side * vision.spatial_merge_size
        sample = config.model_warmup.add(name=f"{tokens_side * tokens_side} visual tokens", batch_size=1)
        pixels = sample.inputs[interface.VISION_PIXELS.name]
        pixels.data_type = cfg.data_type(interface.VISION_PIXELS)
        pixels.dims.extend([rows * rows, vision.patch_dim])
        pixels.zero_data = True
        metadata = _warmup_metadata(rows, vision)
        for tensor in interface.VISION_REQUEST:
            if tensor.name in metadata:
                given = sample.inputs[tensor.name]
                given.data_type = cfg.data_type(tensor)
                given.dims.extend(metadata[tensor.name].shape)
                given.input_data_file = f"{tensor.name}_{rows}"


def warmup_files(config: mc.ModelConfig) -> dict[str, bytes]:
    """The files the vision encoder's model_warmup samples read (vision_warmup), by name: each sample's inputs, from
    its square image's patch rows (its pixels' first dim is rows x rows) and the checkpoint's vision config, as raw
    bytes (the tensor's, as Triton reads them: core GenerateWarmupData)."""
    model_dir = VisionEncoderParameters.from_model_config(config).model_dir
    vision = parse_config(read_config(model_dir)[1]).vision
    files = {}
    for sample in config.model_warmup:
        rows = math.isqrt(sample.inputs[interface.VISION_PIXELS.name].dims[0])
        for name, array in _warmup_metadata(rows, vision).items():
            files[sample.inputs[name].input_data_file] = array.tobytes()
    return files


def _llm(m: _Models) -> mc.ModelConfig:
    """The tensorrtllm backend over the engine on the gpu target; the reference runtime's python model on cpu."""
    if m.memory is not None and m.gpu:
        from .trtllm_config import tensorrt_llm_model_config

        fraction = m.settings.kv_cache_free_gpu_mem_fraction
        return tensorrt_llm_model_config(
            engine_dir=m.build.llm_engine,
            limits=m.limits,
            model_data_type=m.model_type,
            tokenizer_dir=m.model_dir,
            tokenizer_info=m.build.llm_checkpoint / TOKENIZER_INFO_FILE,
            max_queue_delay_us=m.settings.max_queue_delay_us,
            kv_cache_free_gpu_mem_fraction=m.memory.kv_cache_fraction() if fraction is None else fraction,
            paged_context_fmha=m.memory.llm_paged_context_fmha,
            # Written out, the backend's own default: the plan sized the KV cache for these GPUs.
            rank_gpus=m.memory.llm_gpus,
        )
    return _python_model(
        m,
        interface.LLM,
        [_llm_input(t, m.model_type) for t in interface.LLM_INPUTS],
        [cfg.model_output(t) for t in interface.LLM_OUTPUTS],
        m.kind,
        {**m.on_gpu, **LLMParameters(m.model_dir, m.limits, m.build.llm_checkpoint).as_strings()},
        decoupled=True,
    )


def _postprocessing(m: _Models) -> mc.ModelConfig:
    config = _python_model(
        m,
        interface.POSTPROCESSING,
        [_ragged(t) for t in interface.LLM_OUTPUTS],
        [cfg.model_output(t) for t in interface.REQUEST_OUTPUTS],
        "cpu",  # tokenizers run on the host
        {**m.on_gpu, **PostprocessingParameters(m.model_dir, m.limits).as_strings()},
        # Its requests are the llm's responses, a burst per streamed request already admitted: refusing one
        # would drop a piece of an answer, and tritonserver 2.51 then leaves the ensemble's stream open.
        bounded_queue=False,
        # preserve_ordering (below) takes one priority level only (core model_config_utils.cc refuses more).
        priority_levels=False,
    )
    if m.settings.dynamic_batching:
        # Each streamed piece of an answer is a request of its own. Triton core r26.04 hands the responses of an
        # ensemble step that batches, is not decoupled and does not preserve ordering to a shared thread pool, which
        # can deliver a stream's pieces out of order (src/ensemble_scheduler/ensemble_scheduler.cc
        # preserve_responses_order); the other steps are decoupled.
        config.dynamic_batching.preserve_ordering = True
    return config


def model_configs(
    build: BuildLayout,
    model_dir: Path,
    target: Target,
    limits: EngineLimits,
    llm: LLMConfig,
    settings: RepositorySettings = DEFAULT_REPOSITORY_SETTINGS,
    memory: GpuMemoryPlan | None = None,
    files: BuildLayout | None = None,
) -> dict[str, mc.ModelConfig]:
    """The configuration of every model, for a build whose final location is `build.root` and whose
    LLM checkpoint has the configuration `llm`; the gpu target needs the GPU memory plan. files: where the build's
    files are now, if not at build.root yet (a build writing its temporary directory)."""
    if llm.dtype not in cfg.MODEL_DATA_TYPES:
        raise CheckpointError(f"{build.llm_checkpoint}: dtype {llm.dtype!r} cannot be served")
    if target == "gpu" and memory is None:
        raise ValueError("a gpu-target repository needs the GPU memory plan")
    if target == "gpu" and memory is not None and memory.gpu != settings.python_models_gpu:
        planned, placed = memory.gpu, settings.python_models_gpu
        raise ValueError(f"the GPU memory plan puts the python models on GPU {planned}, the settings on GPU {placed}")
    vision_digest = VisionSidecar.load((files or build).vision).features_digest()
    models = _Models(build, model_dir, target, limits, llm, settings, memory, vision_digest)
    configs = {
        interface.PREPROCESSING: _preprocessing(models),
        interface.VISION_ENCODER: _vision_encoder(models),
        interface.LLM: _llm(models),
        interface.POSTPROCESSING: _postprocessing(models),
        interface.ENSEMBLE: _ensemble(limits, interface.ENSEMBLE),
        interface.TOKENS_ENSEMBLE: _ensemble(limits, interface.TOKENS_ENSEMBLE),
    }
    for config in configs.values():
        cfg.parse(cfg.to_text(config))
    return configs


def _ensemble(limits: EngineLimits, name: str) -> mc.ModelConfig:
    """The ensemble that answers text (interface.ENSEMBLE: preprocessing -> llm -> postprocessing), or the one that
    answers the llm's token ids (interface.TOKENS_ENSEMBLE: preprocessing -> llm)."""
    config = mc.ModelConfig(name=name, platform="ensemble", max_batch_size=limits.max_batch_size)
    EnsembleParameters().apply(config)
    # All optional here: an ensemble whose request lacks a required input never runs its first step and
    # answers with nothing, so preprocessing checks the required ones and says what is missing.
    config.input.extend(cfg.model_input(t, optional=True) for t in REQUEST_INPUTS)
    pre = {t.name: _internal(interface.PREPROCESSING, t) for t in interface.PREPROCESSING_OUTPUTS}
    steps = [(interface.PREPROCESSING, {t.name: t.name for t in REQUEST_INPUTS}, pre)]
    if name == interface.TOKENS_ENSEMBLE:
        config.output.extend(cfg.model_output(t) for t in interface.LLM_OUTPUTS)
        steps.append((interface.LLM, pre, {t.name: t.name for t in interface.LLM_OUTPUTS}))
    else:
        config.output.extend(cfg.model_output(t) for t in interface.REQUEST_OUTPUTS)
        generated = {t.name: _internal(interface.LLM, t) for t in interface.LLM_OUTPUTS}
        steps.append((interface.LLM, pre, generated))
        steps.append((interface.POSTPROCESSING, generated, {t.name: t.name for t in interface.REQUEST_OUTPUTS}))
    for model, inputs, outputs in steps:
        step = config.ensemble_scheduling.step.add(model_name=model, model_version=-1)
        step.input_map.update(inputs)
        step.output_map.update(outputs)
    return config


def write_warmup_files(model: Path, config: mc.ModelConfig) -> None:
    """The files of a model's model_warmup samples, in its directory `model`."""
    (model / WARMUP_DIR).mkdir(exist_ok=True)
    for file, data in warmup_files(config).items():
        (model / WARMUP_DIR / file).write_bytes(data)


def language_configs(
    configs: dict[str, mc.ModelConfig], settings: RepositorySettings, memory: GpuMemoryPlan | None
) -> dict[str, mc.ModelConfig]:
    """The configs a replica that leaves its images and videos to a vision pool loads instead (serve --role language;
    cfg.LANGUAGE_CONFIG): preprocessing's with no local encoder to fall back to and no CUDA memory pool of its own
    (its plan, `memory`, plan(encodes=False), needs none: Triton's default); the tensorrtllm llm's with that plan's KV
    cache fraction (unless the settings fix one)."""
    preprocessing = mc.ModelConfig()
    preprocessing.CopyFrom(configs[interface.PREPROCESSING])
    params = PreprocessingParameters.from_model_config(preprocessing)
    pool = memory.transfer_pool_bytes if memory is not None else 0
    replace(params, vision_fallback="fail", cuda_memory_pool_bytes=pool or None).apply(preprocessing)
    language = {interface.PREPROCESSING: preprocessing}
    if memory is not None and configs[interface.LLM].backend == "tensorrtllm":
        llm = mc.ModelConfig()
        llm.CopyFrom(configs[interface.LLM])
        fraction = settings.kv_cache_free_gpu_mem_fraction
        llm.parameters["kv_cache_free_gpu_mem_fraction"].string_value = str(
            memory.kv_cache_fraction() if fraction is None else fraction
        )
        language[interface.LLM] = llm
    for config in language.values():
        cfg.parse(cfg.to_text(config))
    return language


def write_models(
    repo: Path,
    build: BuildLayout,
    model_dir: Path,
    target: Target,
    limits: EngineLimits,
    llm: LLMConfig,
    settings: RepositorySettings,
    files: BuildLayout | None = None,
    log: Callable[[str], None] = print,
) -> GpuMemoryPlan | None:
    """Writes every model of the repository `repo` for a build whose final location is `build.root` (files: where its
    files are now, if elsewhere), the language role's configs beside them (language_configs); the gpu target's
    memory plans (the colocated one, returned, and the language role's) are planned first and logged."""
    memory = language = None
    if target == "gpu":
        memory = gpu_memory_plan(files or build, limits, llm, settings)
        language = gpu_memory_plan(files or build, limits, llm, settings, encodes=False)
        log(memory.describe())
        log(language.describe())
    configs = model_configs(build, model_dir, target, limits, llm, settings, memory, files=files)
    write_model_files(repo, configs, language_configs(configs, settings, language))
    return memory


def write_model_files(
    repo: Path, configs: dict[str, mc.ModelConfig], language: dict[str, mc.ModelConfig] | None = None
) -> None:
    """config.pbtxt for every model (and the `language` role's configs/language.pbtxt of those it changes), its
    model.py adapter for python models, version directory 1, and the files its model_warmup samples read."""
    sources = resources.files("qwen3vl_trt.triton_models")
    for name, config in configs.items():
        version = repo / name / "1"
        version.mkdir(parents=True)
        cfg.write(repo / name, config)
        if language and name in language:
            cfg.write(repo / name, language[name], cfg.LANGUAGE_CONFIG)
        if config.backend == "python":
            (version / MODEL_FILE).write_text(sources.joinpath(name, MODEL_FILE).read_text())
        if config.model_warmup:
            write_warmup_files(repo / name, config)


def gpu_memory_plan(
    files: BuildLayout, limits: EngineLimits, llm: LLMConfig, settings: RepositorySettings, encodes: bool = True
) -> GpuMemoryPlan:
    """The GPU memory plan of a build's engines (read from `files`, the build as it is on disk now): the python models
    on settings.python_models_gpu, the LLM's rank r on GPU r (encodes False: a replica that leaves its images to a
    vision pool). Refuses python models that do not fit on a GPU of their own."""
    gpu = settings.python_models_gpu
    llm_gpus = tuple(range(llm.mapping.world_size))
    total = settings.gpu_memory_bytes
    if total is None:
        sizes = {g: gpu_memory.device_memory_bytes(g) for g in sorted({gpu, *llm_gpus})}
        missing = [g for g, size in sizes.items() if size is None]
        if missing:
            raise LimitsError(
                f"no GPU {missing[0]} is visible here to plan its memory (the KV cache, the python models, the CUDA "
                "memory pool): give the GPU's memory with --gpu-memory-gib"
            )
        total = min(size for size in sizes.values() if size is not None)
    vision = VisionSidecar.load(files.vision)
    engine = VisionEngineSidecar.load(files.vision_engine)
    memory = gpu_memory.plan(
        gpu=gpu,
        llm_gpus=llm_gpus,
        gpu_bytes=total,
        limits=limits,
        llm_engine_dir=files.llm_engine,
        vision_engine_file=files.vision_engine / VISION_ENGINE_FILE,
        vision_activation_bytes=engine.device_memory_bytes,
        patch_dim=vision.patch_dim,
        merge_unit=vision.spatial_merge_size**2,
        llm=llm,
        encodes=encodes,
    )
    memory.check_python_models_gpu()
    return memory


def default_target() -> Target:
    from ...llm.engine_build import gpu_stack_problem

    return "gpu" if gpu_stack_problem() is None else "cpu"


def write_repository(
    build_dir: str | os.PathLike[str],
    output: str | os.PathLike[str],
    target: Target | None = None,
    model_dir: str | os.PathLike[str] | None = None,
    settings: RepositorySettings = DEFAULT_REPOSITORY_SETTINGS,
    force: bool = False,
    log: Callable[[str], None] = print,
) -> Path:
    """Writes the repository for a `qwen3vl-trt build` directory (the checkpoint is the one the build
    was made from unless model_dir says otherwise)."""
    build = BuildLayout(Path(build_dir).absolute())
    target = target or default_target()
    engines = (LLM_ENGINE_STAGE, VISION_ENGINE_STAGE) if target == "gpu" else ()
    required = (VISION_STAGE, LLM_CHECKPOINT_STAGE, *engines)
    manifest = BuildManifest.read(build.root, required_stages=required)
    model = Path(model_dir or manifest.model).absolute()
    read_config(model)  # the tokenizer and processor files must be there at serving time
    _, llm = read_trtllm_config(build.llm_checkpoint)
    if not (build.llm_checkpoint / TOKENIZER_INFO_FILE).is_file():  # both llms read it for guided decoding
        raise CheckpointError(
            f"{build.llm_checkpoint} has no {TOKENIZER_INFO_FILE}, which guided decoding reads: convert the LLM again "
            "(`qwen3vl-trt convert-llm`, or build) from a checkpoint with its tokenizer.json and generation_config.json"
        )
    with atomic_output_dir(output, force=force, inputs=[build.root, model]) as tmp:
        memory = write_models(tmp, build, model, target, manifest.limits, llm, settings, log=log)
        RepositoryRecord(target, build.root, model, memory.as_record() if memory is not None else None).write(tmp)
    return Path(output)
