"""build-vision-engine: a TensorRT engine of a vision export (GPU host), with a sidecar its runner checks.

The network is strongly typed (what TensorRT 11 requires): the ONNX carries every precision, fp32
islands included, so there are no precision flags. One optimization profile covers batches of
min..max patches and up to max_images attention segments; the plugin variant's attention nodes
resolve to the varlen attention plugin, registered (for the build GPU, or --arch) before parsing,
whose ahead-of-time kernel the engine embeds. Tactic timings are kept in a timing cache, reused by the
next build (a given file, or the one in the output being replaced). The output directory holds the
plan, the export's vision_config.json, vision_engine.json (TensorRT version, GPU, profile, contract
hash) and the timing cache, written atomically like every stage's output.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from ..common.contracts import PLUGIN, VISION_ENGINE_FILE, VISION_SIDECAR_FILE, VISION_TIMING_CACHE_FILE
from ..common.fsutil import atomic_output_dir
from ..errors import CheckpointError, GpuStackMissingError, LimitsError, Qwen3VLTrtError
from .sidecar import VisionEngineProfile, VisionEngineSidecar, VisionSidecar

if TYPE_CHECKING:
    import tensorrt as trt

DEFAULT_OPTIMIZATION_LEVEL = 3  # TensorRT's default; 0..5


def tensorrt_problem() -> str | None:
    """Why a vision engine cannot be built or run here, or None."""
    try:
        import tensorrt as trt
    except (ImportError, OSError) as e:  # OSError: bindings present, libnvinfer missing
        return f"tensorrt is not importable ({e})"
    if not hasattr(trt, "Builder"):  # a tensorrt directory without the bindings (stubs only)
        return "the tensorrt package found has no TensorRT bindings"
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device is visible (TensorRT builds and runs engines on a GPU)"
    return None


def require_gpu_stack(what: str) -> None:
    problem = tensorrt_problem()
    if problem is not None:
        raise GpuStackMissingError(
            f"cannot {what} here: {problem}. Run it on a GPU host with TensorRT 10.14 (pip install 'qwen3vl-trt[gpu]', "
            "or the NGC Triton TRT-LLM container)"
        )


def build_vision_engine(
    onnx_dir: str | os.PathLike[str],
    output_dir: str | os.PathLike[str],
    profile: VisionEngineProfile | None = None,
    dtype: str | None = None,
    arch: str | None = None,
    timing_cache: str | os.PathLike[str] | None = None,
    optimization_level: int = DEFAULT_OPTIMIZATION_LEVEL,
    force: bool = False,
    log: Callable[[str], None] = print,
) -> Path:
    """Builds the engine of an export-vision directory into `output_dir` (see module doc) and returns it.

    dtype: the compute dtype the export must have (the network is strongly typed: the export decides);
    arch: the GPU target of the plugin kernel (sm_XX, default the build GPU's)."""
    profile = profile or VisionEngineProfile()
    onnx_dir, output = Path(onnx_dir), Path(output_dir)
    export = VisionSidecar.load(onnx_dir)
    if not export.records_this_contract():
        raise CheckpointError(
            f"{onnx_dir / VISION_SIDECAR_FILE} records inputs/outputs other than this version's {export.graph_variant} "
            "graph contract: export it again with `qwen3vl-trt export-vision`"
        )
    if dtype is not None and dtype != export.dtype:
        raise Qwen3VLTrtError(
            f"{onnx_dir} is a {export.dtype} export and the engine's network takes its precision from the ONNX: "
            f"export with `qwen3vl-trt export-vision --variant {export.graph_variant} --dtype {dtype}` "
            f"for a {dtype} engine"
        )
    profile.check_merge_unit(export.spatial_merge_size**2)
    if not 0 <= optimization_level <= 5:
        raise LimitsError(f"builder optimization level must be 0..5, got {optimization_level}")
    capability = _plugin_capability(arch) if export.graph_variant == PLUGIN else None
    require_gpu_stack("build the vision engine")

    import tensorrt as trt
    import torch

    device_capability = torch.cuda.get_device_capability()
    device_sm = device_capability[0] * 10 + device_capability[1]
    if capability is not None and capability > device_sm:
        raise Qwen3VLTrtError(
            f"--arch sm_{capability} is newer than this GPU (sm_{device_sm}), which could not run the kernel "
            f"TensorRT times while it builds: build on an sm_{capability} host"
        )
    plugin_sm = device_sm if capability is None else capability
    shapes = profile.input_shapes(export.contract()["inputs"])
    given_cache = Path(timing_cache).absolute() if timing_cache is not None else None
    previous_cache = given_cache or output.absolute() / VISION_TIMING_CACHE_FILE
    cache_bytes = previous_cache.read_bytes() if previous_cache.is_file() else b""
    with atomic_output_dir(output, force=force, inputs=[onnx_dir]) as tmp:
        start = time.perf_counter()
        log(
            f"building the {export.graph_variant} {export.dtype} vision engine on {torch.cuda.get_device_name()} "
            f"(TensorRT {trt.__version__}, optimization level {optimization_level}, "
            f"{'reusing' if cache_bytes else 'new'} timing cache {previous_cache})"
        )
        if export.graph_variant == PLUGIN:
            from ..plugins.registration import register_plugins

            register_plugins(plugin_sm)
        onnx_file = onnx_dir / export.onnx_file
        # A cache of an earlier output may come from another TensorRT or GPU (the rebuild check_runtime asks for):
        # then the build starts a new one; a cache the user named must be usable.
        plan, cache = _build_plan(
            onnx_file, export, shapes, optimization_level, cache_bytes, may_restart_cache=given_cache is None, log=log
        )
        (tmp / VISION_ENGINE_FILE).write_bytes(plan)
        device_memory = _device_memory_bytes(plan)
        if given_cache is None:
            (tmp / VISION_TIMING_CACHE_FILE).write_bytes(cache)
        else:
            _replace_file(given_cache, cache)
        export.write(tmp)  # the runner checks the engine against the export it was built from
        VisionEngineSidecar.of_build(
            export,
            profile,
            tensorrt_version=trt.__version__,
            gpu_name=torch.cuda.get_device_name(),
            compute_capability=device_capability,
            plugin_capability=plugin_sm,
            optimization_level=optimization_level,
            timing_cache=str(given_cache) if given_cache else VISION_TIMING_CACHE_FILE,
            device_memory_bytes=device_memory,
        ).write(tmp)
        log(f"built {len(plan) / 2**20:.1f} MiB engine in {time.perf_counter() - start:.1f}s")
    return output


def _plugin_capability(arch: str | None) -> int | None:
    """The compute capability of --arch (sm_XX), None for the build GPU's."""
    if arch is None:
        return None
    from ..plugins.aot import parse_arch

    try:
        return int(parse_arch(arch))
    except ValueError as e:
        raise Qwen3VLTrtError(f"--arch: {e}") from None


def _build_plan(
    onnx_file: Path,
    export: VisionSidecar,
    shapes: Mapping[str, Mapping[str, list[int]]],
    optimization_level: int,
    cache_bytes: bytes,
    may_restart_cache: bool,
    log: Callable[[str], None],
) -> tuple[bytes, bytes]:
    """(serialized engine, serialized timing cache) of a strongly typed network parsed from onnx_file.

    TensorRT 10.14 refuses a timing cache of another device environment (IBuilderConfig.set_timing_cache returns
    False); with may_restart_cache the build then starts from an empty cache instead of failing."""
    import tensorrt as trt

    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_file)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise Qwen3VLTrtError(f"TensorRT cannot parse {onnx_file}: {errors}")
    _check_network_inputs(network, shapes)
    config = builder.create_builder_config()
    config.builder_optimization_level = optimization_level
    if not _use_timing_cache(config, cache_bytes):
        if not (may_restart_cache and cache_bytes and _use_timing_cache(config, b"")):
            raise Qwen3VLTrtError("TensorRT refused the timing cache; delete it or pass another --timing-cache")
        log("the previous output's timing cache is of another TensorRT or GPU: starting a new one")
    profile = builder.create_optimization_profile()
    for name, points in shapes.items():
        profile.set_shape(name, trt.Dims(points["min"]), trt.Dims(points["opt"]), trt.Dims(points["max"]))
    config.add_optimization_profile(profile)
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise Qwen3VLTrtError(f"TensorRT could not build the {export.graph_variant} vision engine; its log is above")
    return bytes(plan), bytes(config.get_timing_cache().serialize())


def _device_memory_bytes(plan: bytes) -> int:
    """ICudaEngine.device_memory_size_v2 of a serialized engine: the activation memory an execution context takes
    (TensorRT 10.14; without weight streaming, the largest over the profile's shapes)."""
    import tensorrt as trt

    engine = trt.Runtime(trt.Logger(trt.Logger.WARNING)).deserialize_cuda_engine(plan)
    if engine is None:
        raise Qwen3VLTrtError("TensorRT cannot load the vision engine it has just built (its log is above)")
    return int(engine.device_memory_size_v2)


def _use_timing_cache(config: trt.IBuilderConfig, cache_bytes: bytes) -> bool:
    cache = config.create_timing_cache(cache_bytes)
    return cache is not None and bool(config.set_timing_cache(cache, False))


def _check_network_inputs(network: trt.INetworkDefinition, shapes: Mapping[str, object]) -> None:
    names = [network.get_input(i).name for i in range(network.num_inputs)]
    if names != list(shapes):
        raise Qwen3VLTrtError(f"the parsed network's inputs {names} are not the contract's {list(shapes)}")


def _replace_file(path: Path, content: bytes) -> None:
    """Writes `content` to path through a temp file and a rename (readers never see half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(content)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
