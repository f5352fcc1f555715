"""`qwen3vl-trt build`: runs the stages this machine can run and records them in a manifest."""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..build_cache.digest import Remembered, checkpoint_digest, file_sha256
from ..build_cache.key import BuildKey, Platform
from ..build_cache.store import BuildCache, CacheSettings
from ..common.contracts import PLUGIN, BuildLayout
from ..common.fsutil import atomic_output_dir, check_no_overlap, check_output_dir
from ..common.limits import EngineLimits
from ..common.manifest import (
    LLM_CHECKPOINT_STAGE,
    LLM_ENGINE_STAGE,
    TRITON_REPO_STAGE,
    VISION_ENGINE_STAGE,
    VISION_STAGE,
    BuildManifest,
    StageRecord,
    Target,
)
from ..errors import BuildCacheError, GpuStackMissingError
from ..hf.checkpoint import Checkpoint
from ..llm.checkpoint_format import read_trtllm_config
from ..llm.convert import LLMOptions, check_llm_options
from ..llm.engine_build import build_llm_engine, gpu_stack_problem
from ..llm.precision import visible_gpu_arch
from ..serving.repository.settings import RepositorySettings
from ..serving.repository.writer import write_models
from ..vision.engine import build_vision_engine, tensorrt_problem
from ..vision.export import export_vision
from ..vision.sidecar import VisionEngineProfile
from .calibration import convert_calibrated


@dataclass(frozen=True)
class BuildOptions:
    """What a build makes its artifacts with, as `build` takes them on the command line: the vision ONNX's dtype
    (parity against transformers runs in fp32 only) and the vision engine's; the LLM's dtype and --llm-quant (None:
    chosen for the checkpoint, llm.convert.check_llm_options), its KV cache's dtype, the GPU arch its quantization
    is checked for (None: the visible GPU's), activation ranges' calibration data (None: built in), tensor and
    pipeline parallelism, and the engine limits. The build key (build_cache.key) is made of these, resolved."""

    dtype: str = "fp32"
    vision_engine_dtype: str = "bf16"
    llm_dtype: str | None = None
    llm_quant: str | None = None
    kv_cache_dtype: str = "auto"
    gpu_arch: int | None = None
    calibration_data: str | os.PathLike[str] | None = None
    tp: int = 1
    pp: int = 1
    limits: EngineLimits = field(default_factory=EngineLimits)

    def check(self, ckpt: Checkpoint) -> LLMOptions:
        """The LLM's options for this checkpoint, checked before any work (UnsupportedModelError)."""
        return check_llm_options(
            ckpt, self.llm_dtype, self.llm_quant, self.tp, self.pp, self.kv_cache_dtype, self.gpu_arch
        )

    def key_parts(self, llm: LLMOptions) -> dict[str, str]:
        """The options' part of the build key, resolved: the LLM's dtype and --llm-quant as chosen, the GPU arch
        they were checked for, the calibration file's sha256 (or "builtin")."""
        arch = self.gpu_arch if self.gpu_arch is not None else visible_gpu_arch()
        calibration = self.calibration_data
        parts = dict(
            vision_dtype=self.dtype,
            vision_engine_dtype=self.vision_engine_dtype,
            llm_dtype=llm.dtype,
            llm_quant=llm.quant,
            kv_cache_dtype=self.kv_cache_dtype,
            gpu_arch="none" if arch is None else f"sm{arch}",
            tp=str(self.tp),
            pp=str(self.pp),
            calibration="builtin" if calibration is None else f"sha256:{file_sha256(Path(calibration))}",
        )
        return {**parts, **{f"limits.{k}": str(v) for k, v in dataclasses.asdict(self.limits).items()}}


def build(
    model_dir: str | os.PathLike[str],
    output_dir: str | os.PathLike[str],
    options: BuildOptions = BuildOptions(),
    *,
    target: Target | None = None,
    settings: RepositorySettings | None = None,
    force: bool = False,
    cache: CacheSettings | None = None,
    log=print,
) -> BuildManifest:
    """Runs the stages with `options`; the Triton repository (last) is written for `target` (default: gpu where the
    GPU stack is present, else cpu) with `settings`. A gpu target needs the LLM engine, so it fails early elsewhere.
    The vision engine (TensorRT and a GPU) is built from a plugin-variant export. With `cache`, the artifacts come
    from the shared build cache (built and published there on a miss) and only the repository is written here."""
    problem = gpu_stack_problem()
    target = target or ("gpu" if problem is None else "cpu")
    if target == "gpu" and problem is not None:
        raise GpuStackMissingError(
            f"a gpu-target repository needs the LLM engine, which cannot be built here: {problem}"
        )
    ckpt = Checkpoint(model_dir)  # refuses a quantization it does not read, before any stage
    ckpt.verify_shards()
    llm_options = options.check(ckpt)
    log(f"language model engine: --llm-quant {llm_options.quant} ({llm_options.why})")
    key = store = None
    if cache is not None:
        # Refused before the cache is touched or the checkpoint hashed (minutes for the largest).
        check_no_overlap(Path(output_dir).absolute(), [ckpt.path, cache.root])
        check_output_dir(Path(output_dir).absolute(), force)
        root, model = cache.root.resolve(), ckpt.path.resolve()
        if root.is_relative_to(model) or model.is_relative_to(root):
            raise BuildCacheError(f"--cache {cache.root} and the checkpoint {ckpt.path} overlap; keep them apart")
        store = BuildCache(cache.root, cache.lease_s, cache.wait_s, log).open()
        key = build_key(ckpt, options, llm_options, cache.checkpoint_id, store.remembered, log)
        log(key.describe())
    out = BuildLayout(Path(output_dir))
    final = BuildLayout(out.root.absolute())  # what the repository and the stages' commands name

    def artifacts(root: Path) -> tuple[StageRecord, ...]:
        return _artifacts(ckpt, BuildLayout(root), final, options, llm_options.quant, problem, log)

    inputs = [ckpt.path] if cache is None else [ckpt.path, cache.root]
    with atomic_output_dir(output_dir, force=force, inputs=inputs) as tmp_root:
        tmp = BuildLayout(tmp_root)
        record = None
        if store is None or key is None:
            stages = list(artifacts(tmp_root))
        else:
            assert cache is not None
            pulled = store.obtain(key, artifacts, tmp_root, final.root, cache.mode, cache.verify)
            stages, record = list(pulled.stages), pulled.record
        start = time.perf_counter()
        _, llm = read_trtllm_config(tmp.llm_checkpoint)
        model = Path(model_dir).absolute()
        settings = settings or RepositorySettings()
        # The repository records the build's final paths, where its models will find the files.
        write_models(tmp.triton_repo, final, model, target, options.limits, llm, settings, files=tmp, log=log)
        stages.append(StageRecord.done(TRITON_REPO_STAGE, BuildLayout.TRITON_REPO, start, target=target))
        manifest = BuildManifest(
            model=model,
            limits=options.limits,
            stages=tuple(stages),
            target=target,
            model_type=ckpt.info.model_type,
            size=ckpt.info.size_name,
            cache=record,
        )
        manifest.write(tmp.root)
    for stage in stages:
        if stage.status == "skipped":
            log(f"stage {stage.stage}: SKIPPED: {stage.reason}; on a GPU host run: {stage.rerun_on_gpu_host}")
        else:
            log(f"stage {stage.stage}: {stage.status} ({stage.seconds}s) -> {out.root / str(stage.output)}")
    return manifest


def _artifacts(
    ckpt: Checkpoint,
    tmp: BuildLayout,
    out: BuildLayout,
    options: BuildOptions,
    llm_quant: str,
    problem: str | None,
    log,
) -> tuple[StageRecord, ...]:
    """Every stage but the repository, into `tmp` (the build's temporary directory or a cache entry being built);
    skipped stages' commands name the build's output `out`."""
    stages: list[StageRecord] = []
    start = time.perf_counter()
    # Parity against transformers runs in fp32 only; other dtypes are checked structurally.
    dtype = options.dtype
    result = export_vision(ckpt, tmp.vision, dtype=dtype, verify=dtype == "fp32", log=log)
    stages.append(StageRecord.done(VISION_STAGE, BuildLayout.VISION, start, verification=result.sidecar.max_rel_error))
    start = time.perf_counter()
    convert_calibrated(
        ckpt,
        tmp.llm_checkpoint,
        dtype=options.llm_dtype,
        tp=options.tp,
        pp=options.pp,
        quant=llm_quant,
        kv_cache_dtype=options.kv_cache_dtype,
        gpu_arch=options.gpu_arch,
        calibration_data=options.calibration_data,
        log=log,
    )
    stages.append(StageRecord.done(LLM_CHECKPOINT_STAGE, BuildLayout.LLM_CHECKPOINT, start))
    if problem is None:
        start = time.perf_counter()
        build_llm_engine(tmp.llm_checkpoint, tmp.llm_engine, options.limits)
        stages.append(StageRecord.done(LLM_ENGINE_STAGE, BuildLayout.LLM_ENGINE, start))
    else:
        rerun = f"qwen3vl-trt build-llm-engine --checkpoint {out.llm_checkpoint} --output {out.llm_engine}"
        stages.append(StageRecord.skipped(LLM_ENGINE_STAGE, problem, rerun))
    stages.append(_vision_engine_stage(ckpt, tmp, out, options.limits, options.vision_engine_dtype, log))
    return tuple(stages)


def build_key(
    ckpt: Checkpoint,
    options: BuildOptions,
    llm: LLMOptions,
    checkpoint_id: str | None = None,
    remembered: Remembered | None = None,
    log=print,
) -> BuildKey:
    """The build key of these options (`llm`: as checked for the checkpoint) on this machine (build_cache.key):
    checkpoint_id (a revision the user vouches for) stands in for the checkpoint's digest, which is otherwise
    computed (file hashes looked up in and added to `remembered`)."""
    if checkpoint_id is not None:
        checkpoint = f"id:{checkpoint_id}"
    else:
        digest = checkpoint_digest(ckpt.path, remembered, log)
        log(digest.describe())
        checkpoint = digest.value
    return BuildKey.of(checkpoint, Platform.detect(options.tp * options.pp), options.key_parts(llm))


def _vision_engine_stage(
    ckpt: Checkpoint, tmp: BuildLayout, out: BuildLayout, limits: EngineLimits, dtype: str, log
) -> StageRecord:
    """The plugin-variant export and its TensorRT engine where TensorRT and a GPU are; else a skip record."""
    problem = tensorrt_problem()
    if problem is not None:
        rerun = (
            f"qwen3vl-trt export-vision --model {ckpt.path.absolute()} --variant {PLUGIN} --dtype {dtype} "
            f"--output {out.vision_plugin} && qwen3vl-trt build-vision-engine --onnx {out.vision_plugin} "
            f"--output {out.vision_engine}"
        )
        return StageRecord.skipped(VISION_ENGINE_STAGE, problem, rerun)
    start = time.perf_counter()
    export_vision(ckpt, tmp.vision_plugin, dtype=dtype, variant=PLUGIN, log=log)
    profile = VisionEngineProfile.for_visual_tokens(limits.max_visual_tokens, ckpt.info.vision.merge_unit)
    build_vision_engine(tmp.vision_plugin, tmp.vision_engine, profile, log=log)
    return StageRecord.done(VISION_ENGINE_STAGE, BuildLayout.VISION_ENGINE, start, onnx=BuildLayout.VISION_PLUGIN)
