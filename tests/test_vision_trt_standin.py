"""The GPU target's vision path executed on a CPU machine: build-vision-engine (`build_vision_engine`), the engine
runner (`VisionEngine`) and the vision_encoder's engine runs (`VisionBatching(engine_dir=...)`, its warm-up at load
included), through the TensorRT 10.14 stand-in and CUDA on the host (tests/tensorrt_standin/README.md).

Only what needs CUDA or TensorRT's C++ is stood in: the engine runs the same ONNX in ONNX Runtime, reading its inputs
from and writing its outputs to the addresses the runner binds, and the varlen attention plugin is registered and
built through TensorRT's own `tensorrt.plugin` sources. Both graph variants; the plugin variant's kernel launches
are checked against the grid its kernel needs. GPU hosts run the real thing (scripts/vision_engine_check.py)."""

from __future__ import annotations

import importlib.util
import shutil
import sys
import types
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from conftest import _quiet, random_pixels
from qwen3vl_trt.common.contracts import (
    SEGMENT_START,
    VISION_ENGINE_FILE,
    VISION_ENGINE_SIDECAR_FILE,
    VISION_GRAPH_INPUTS,
    VISION_ONNX_FILE,
    VISION_SIDECAR_FILE,
    VISION_TIMING_CACHE_FILE,
)
from qwen3vl_trt.common.fsutil import OUTPUT_MARKER
from qwen3vl_trt.errors import CheckpointError, InputError, Qwen3VLTrtError
from qwen3vl_trt.plugins import registration
from qwen3vl_trt.plugins.varlen_kernel import launch_grid, shipped_config
from qwen3vl_trt.serving import interface
from qwen3vl_trt.serving.stages.vision_batching import ALONE, VisionBatching
from qwen3vl_trt.vision import OnnxVisionRunner
from qwen3vl_trt.vision.engine import _device_memory_bytes, build_vision_engine, tensorrt_problem
from qwen3vl_trt.vision.export import export_vision
from qwen3vl_trt.vision.metadata import attention_segments
from qwen3vl_trt.vision.sidecar import VisionEngineProfile, VisionEngineSidecar, VisionSidecar
from tensorrt_standin.activation import gpu_stack
from tensorrt_standin.host_cuda import DEVICE_NAME
from test_vision_batching import _request

# The engines run what the export wrote, whatever transformers made it (test_export_vision checks the export under
# both versions).
pytestmark = pytest.mark.once
VARIANTS = ("portable", "plugin")
PROFILE = VisionEngineProfile(min_patches=8, opt_patches=64, max_patches=256, max_images=8)
# One batch of requests: sizes, a non-square grid, the smallest grid and a video of two frame pairs (two segments).
REQUESTS = ([[1, 4, 6]], [[1, 2, 2], [1, 8, 4]], [[2, 4, 4]])


@pytest.fixture(scope="module")
def exports(tiny_dense, tmp_path_factory):
    root = tmp_path_factory.mktemp("exports")
    return {v: export_vision(tiny_dense, root / v, variant=v, log=_quiet).output_dir for v in VARIANTS}


@pytest.fixture(scope="module")
def gpu(exports):
    """TensorRT (the stand-in) and torch's CUDA device on the host for the module's tests (the exports come first);
    yields the host device (its stream timeline)."""
    with gpu_stack() as cuda:
        yield cuda


@pytest.fixture(scope="module")
def engines(gpu, exports, tmp_path_factory):
    """Each variant's engine directory, and the build's log lines."""
    if importlib.util.find_spec("tensorrt.plugin") is None:
        pytest.skip("no tensorrt.plugin sources: run scripts/tensorrt_stubs.sh (bootstrap does)")
    root = tmp_path_factory.mktemp("engines")
    logs: dict[str, list[str]] = {}
    for variant in VARIANTS:
        logs[variant] = []
        build_vision_engine(exports[variant], root / variant, PROFILE, log=logs[variant].append)
    return {v: root / v for v in VARIANTS}, logs


def _requests(encoder: OnnxVisionRunner) -> list[dict[str, np.ndarray]]:
    return [encoder.inputs_for(random_pixels(g, seed=i), np.array(g)) for i, g in enumerate(REQUESTS)]


def _batch(requests: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    return {name: np.concatenate([r[name] for r in requests]) for name in requests[0]}


def _plan_header(engine_dir: Path) -> dict:
    from tensorrt._graph import read_plan

    read = read_plan((engine_dir / VISION_ENGINE_FILE).read_bytes())
    assert read is not None
    return read[0]


# --- the runner ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_engine_encodes_a_mixed_batch_as_onnx_runtime_does(gpu, exports, engines, variant, capsys):
    from qwen3vl_trt.vision.trt_runner import VisionEngine

    engine = VisionEngine(engines[0][variant])
    encoder = OnnxVisionRunner(exports[variant])
    requests = _requests(encoder)
    enqueue = engine.context.execute_async_v3
    engine.context.execute_async_v3 = lambda handle: gpu.note("enqueue", handle) or enqueue(handle)
    start = len(gpu.timeline)
    outputs = engine.encode_requests([{k: torch.from_numpy(v) for k, v in r.items()} for r in requests])
    for r, ((image, deepstack), request) in enumerate(zip(outputs, requests, strict=True)):
        want_image, want_deepstack = encoder.run(request)
        torch.testing.assert_close(image, torch.from_numpy(want_image), rtol=1e-5, atol=1e-6, msg=f"request {r}")
        torch.testing.assert_close(deepstack, torch.from_numpy(want_deepstack), rtol=1e-5, atol=1e-6)

    # The engine's stream waits for the caller's, reads the inputs recorded on it, and the caller waits for it.
    ours, caller = engine._stream.cuda_stream, 0
    events = gpu.timeline[start:]
    order = [e for e in events if e[0] != "record"]
    assert order == [("wait", ours, caller), ("enqueue", ours), ("wait", caller, ours)]
    enqueued = events.index(("enqueue", ours))
    inputs = len(VISION_GRAPH_INPUTS[engine.variant])
    assert [e[2] for e in events[:enqueued] if e[0] == "record"] == [ours] * inputs
    assert [e[2] for e in events[enqueued:] if e[0] == "record"] == [caller] * 2
    assert "default stream" not in capsys.readouterr().err

    # One run of the whole batch, host arrays in: the requests' outputs concatenated.
    image, deepstack = engine.run(_batch(requests))
    torch.testing.assert_close(image, torch.cat([o[0] for o in outputs]))
    torch.testing.assert_close(deepstack, torch.cat([o[1] for o in outputs], dim=1))
    export = VisionSidecar.load(exports[variant])
    if variant == "plugin":
        # Each attention node's kernel, launched on the grid the kernel needs for this batch's segments.
        segments = attention_segments(_batch(requests)[SEGMENT_START.name])
        config = shipped_config(export.raw["head_dim"], "fp32")
        grid = launch_grid(
            len(segments["max_seqlen_carrier"]), len(segments["cu_seqlens"]) - 1, export.num_heads, config
        )
        launches = engine.context.launches[-export.raw["depth"] :]
        assert {(lc["grid_x"], lc["grid_y"], lc["grid_z"]) for lc in launches} == {grid}
        assert {lc["block_x"] for lc in launches} == {config.num_warps * 32}
    else:
        assert engine.context.launches == []


def test_runs_outside_the_engine_profile_are_refused(gpu, exports, engines):
    from qwen3vl_trt.vision.trt_runner import VisionEngine

    engine = VisionEngine(engines[0]["plugin"])
    encoder = OnnxVisionRunner(exports["plugin"])

    def feeds(grids: list[list[int]]) -> dict[str, np.ndarray]:
        return encoder.inputs_for(random_pixels(grids), np.array(grids))

    with pytest.raises(InputError, match="at most 256 patches in 8 segments, got 320 in 1: split the batch"):
        engine.run(feeds([[1, 16, 20]]))
    with pytest.raises(InputError, match="at most 256 patches in 8 segments, got 36 in 9"):
        engine.run(feeds([[1, 2, 2]] * 9))
    # Fewer patches than the profile's minimum: TensorRT refuses the shape.
    with pytest.raises(InputError, match=r"the vision engine refuses pixel_values of shape \(4, 1536\)"):
        engine.run(feeds([[1, 2, 2]]))


def test_the_engine_reads_what_is_bound_in_the_engine_dtypes(gpu, exports, engines, monkeypatch):
    from qwen3vl_trt.vision.trt_runner import VisionEngine

    engine = VisionEngine(engines[0]["portable"])
    encoder = OnnxVisionRunner(exports["portable"])
    request = _requests(encoder)[0]
    want = torch.from_numpy(encoder.run(request)[0])
    # Inputs of other dtypes are cast to the engine's before they are bound.
    wide = {k: v.astype(np.float64 if v.dtype == np.float32 else np.int64) for k, v in request.items()}
    torch.testing.assert_close(engine.run(wide)[0], want, rtol=1e-5, atol=1e-6)
    # A wrong binding is wrong numbers, as on a GPU: the engine reads the address it is given.
    bind, zeros = engine._bind, []

    def misbind(name: str, tensor: torch.Tensor) -> None:
        if name == "pos_embed_w":
            zeros.append(torch.zeros_like(tensor))  # alive until the run is over, as device memory must be
            tensor = zeros[-1]
        bind(name, tensor)

    monkeypatch.setattr(engine, "_bind", misbind)
    assert not torch.allclose(engine.run(request)[0], want, rtol=1e-3, atol=1e-3)


def test_an_engine_of_other_inputs_or_a_damaged_plan_is_refused(gpu, engines, tmp_path):
    from qwen3vl_trt.vision.trt_runner import VisionEngine

    mixed = shutil.copytree(engines[0]["plugin"], tmp_path / "mixed")
    shutil.copy(engines[0]["portable"] / VISION_ENGINE_FILE, mixed / VISION_ENGINE_FILE)
    with pytest.raises(CheckpointError, match=r"the engine's inputs \[.*'segment_start'\] are not the contract's"):
        VisionEngine(mixed)
    (mixed / VISION_ENGINE_FILE).write_bytes(b"not a plan")
    with pytest.raises(CheckpointError, match=r"TensorRT cannot load .*vision_encoder.plan .*build-vision-engine"):
        VisionEngine(mixed)


def test_tensorrt_refusing_a_binding_or_the_enqueue_is_an_error(gpu, exports, engines, monkeypatch):
    from qwen3vl_trt.vision.trt_runner import VisionEngine

    engine = VisionEngine(engines[0]["portable"])
    request = _requests(OnnxVisionRunner(exports["portable"]))[0]
    monkeypatch.setattr(engine.context, "execute_async_v3", lambda stream: False)
    with pytest.raises(RuntimeError, match="TensorRT could not enqueue the vision engine"):
        engine.run(request)
    monkeypatch.setattr(engine.context, "set_tensor_address", lambda name, address: False)
    with pytest.raises(RuntimeError, match="refused the address of the vision engine's pixel_values"):
        engine.run(request)


def test_the_standin_refuses_what_tensorrt_refuses(gpu, engines, monkeypatch, capsys):
    import tensorrt as trt

    plan = (engines[0]["plugin"] / VISION_ENGINE_FILE).read_bytes()
    engine = trt.Runtime(trt.Logger()).deserialize_cuda_engine(plan)
    context = engine.create_execution_context()
    assert not context.set_input_shape("pixel_values", (16, 1537))  # a fixed dim
    assert not context.set_input_shape("pixel_values", (16,))
    assert not context.set_input_shape("cu_seqlens", (PROFILE.max_images + 2,))  # over the profile
    assert not context.execute_async_v3(1)  # nothing bound
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))
    assert trt.Runtime(trt.Logger()).deserialize_cuda_engine(plan) is None
    err = capsys.readouterr().err
    assert "Static dimension mismatch while setting input shape for pixel_values" in err
    assert "exceed min ~ max range at index 0, maximum dimension in profile is 9" in err
    assert "Neither address or allocator is set for pixel_values" in err
    assert "incompatible device, expecting compute 8.9 got compute 9.0, please rebuild" in err


# --- the vision_encoder model on the engine ------------------------------------------------------------------------


def test_vision_batching_warms_up_and_serves_on_the_engine(gpu, exports, engines):
    """The GPU target's vision_encoder: warm-up at load, then a batch cut to the engine's profile, on the device."""
    runs: list[tuple[int, int, float | None]] = []
    ours = VisionBatching(
        exports["plugin"], torch.float32, 64, 1 << 30, engine_dir=engines[0]["plugin"], on_run=lambda *r: runs.append(r)
    )
    ours.warm_up()
    assert ours.run_cost is None  # the engine's runs are cut by its profile, not by a measured cost
    onnx_runtime = VisionBatching(exports["plugin"], torch.float32, 64, 1 << 30, run_cost=ALONE)
    merge, side = ours.merge, ours.num_grid_per_side
    requests = [
        _request([[1, 8, 8]], merge, side, seed=0),
        _request([[1, 4, 4], [1, 8, 12]], merge, side, seed=1),
        _request([], merge, side, seed=2),
        _request([[2, 6, 4], [1, 8, 8]], merge, side, seed=3),  # a video: two attention segments
        _request([[1, 2, 4]] * 8, merge, side, seed=4),
    ]
    runs.clear()
    got = [out[interface.PROMPT_TABLE.name] for out in ours.execute(requests)]
    want = [out[interface.PROMPT_TABLE.name] for out in onnx_runtime.execute(requests)]
    for r, (table, reference) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(table, reference, rtol=1e-5, atol=1e-6, msg=f"request {r}")
    # Images of 64, 16, 96, 48 (2 segments), 64 and 8 x 8 patches, in order: a run is cut before it would pass 256
    # patches (the second 64), then before it would pass 8 segments (the last 8).
    assert [(images, patches) for images, patches, _ in runs] == [(4, 224), (8, 120), (1, 8)]
    assert {seconds for *_, seconds in runs} == {None}  # enqueued on a stream: the host does not see it end


# --- the build ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_build_writes_the_engine_directory(gpu, exports, engines, variant):
    import tensorrt as trt

    engine_dir = engines[0][variant]
    assert sorted(p.name for p in engine_dir.iterdir()) == sorted(
        [VISION_ENGINE_FILE, VISION_SIDECAR_FILE, VISION_ENGINE_SIDECAR_FILE, VISION_TIMING_CACHE_FILE, OUTPUT_MARKER]
    )
    assert VisionSidecar.load(engine_dir) == VisionSidecar.load(exports[variant])
    sidecar = VisionEngineSidecar.load(engine_dir).raw
    assert sidecar["tensorrt_version"] == trt.__version__ == "10.14.1.48.post1"
    assert sidecar["gpu"] == {"name": DEVICE_NAME, "compute_capability": "9.0"}
    assert sidecar["plugin_arch"] == ("sm_90" if variant == "plugin" else None)
    assert (sidecar["timing_cache"], sidecar["builder_optimization_level"]) == (VISION_TIMING_CACHE_FILE, 3)
    header = _plan_header(engine_dir)
    assert header["strongly_typed"] and header["builder_optimization_level"] == 3
    assert header["profile"] == {n: [s["min"], s["opt"], s["max"]] for n, s in sidecar["profile"]["shapes"].items()}
    plan = (engine_dir / VISION_ENGINE_FILE).read_bytes()
    assert sidecar["device_memory_bytes"] == _device_memory_bytes(plan) == header["device_memory_size"] > 0
    assert header["timing_cache"]["hits"] == 0
    plugins = header["plugins"]
    if variant == "plugin":
        # The kernel of each attention node, compiled for sm_90, is in the engine; the runner needs no registration.
        depth = VisionSidecar.load(exports[variant]).raw["depth"]
        assert len(plugins) == depth and {p["plugin"] for p in plugins} == {registration.PLUGIN_ID}
        assert all(".target sm_90" in p["ptx"] and f".visible .entry {p['kernel']}(" in p["ptx"] for p in plugins)
    else:
        assert plugins == []
    log = engines[1][variant]
    assert log[0].startswith(f"building the {variant} fp32 vision engine on {DEVICE_NAME} (TensorRT 10.14.1.48.post1, ")
    assert log[0].endswith(f"optimization level 3, new timing cache {engine_dir / VISION_TIMING_CACHE_FILE})")
    assert log[-1].startswith("built ") and " MiB engine in " in log[-1]


def _other_gpus_cache(cache: Path) -> bytes:
    """The timing cache at `cache` as a build on another GPU would have written it."""
    import tensorrt as trt
    from tensorrt._builder import read_timing_cache

    record = read_timing_cache(cache.read_bytes())
    assert record is not None
    return bytes(trt.ITimingCache({"name": "NVIDIA L40S", "compute_capability": [8, 9]}, record["entries"]).serialize())


def test_the_timing_cache_is_reused_restarted_or_refused(gpu, exports, engines, tmp_path, monkeypatch):
    from tensorrt._builder import read_timing_cache

    source, output = exports["portable"], tmp_path / "engine"
    nodes = len(onnx.load(source / VISION_ONNX_FILE, load_external_data=False).graph.node)

    def build(*args, **options) -> tuple[dict, list[str]]:
        lines: list[str] = []
        built = build_vision_engine(*args, PROFILE, log=lines.append, **options)
        return _plan_header(built), lines

    assert build(source, output)[0]["timing_cache"] == {"hits": 0, "misses": nodes}
    header, lines = build(source, output, force=True)  # the output's cache, replaced with the output
    assert header["timing_cache"] == {"hits": nodes, "misses": 0}
    assert f"reusing timing cache {output / VISION_TIMING_CACHE_FILE}" in lines[0]

    (output / VISION_TIMING_CACHE_FILE).write_bytes(_other_gpus_cache(output / VISION_TIMING_CACHE_FILE))
    header, lines = build(source, output, force=True)
    assert "timing cache is of another TensorRT or GPU: starting a new one" in lines[1]
    assert header["timing_cache"]["hits"] == 0
    record = read_timing_cache((output / VISION_TIMING_CACHE_FILE).read_bytes())
    assert record is not None and record["device"] == {"name": DEVICE_NAME, "compute_capability": [9, 0]}

    named = tmp_path / "caches" / "vision.cache"  # --timing-cache: kept where it is, shared by builds
    build(source, tmp_path / "first", timing_cache=named)
    assert named.is_file() and not (tmp_path / "first" / VISION_TIMING_CACHE_FILE).exists()
    assert VisionEngineSidecar.load(tmp_path / "first").raw["timing_cache"] == str(named)
    assert build(source, tmp_path / "second", timing_cache=named)[0]["timing_cache"]["hits"] == nodes
    for refused in (_other_gpus_cache(named), b"not a timing cache"):
        named.write_bytes(refused)
        with pytest.raises(Qwen3VLTrtError, match="TensorRT refused the timing cache; delete it or pass another"):
            build(source, tmp_path / "third", timing_cache=named)
        assert not (tmp_path / "third").exists()

    # The named cache is replaced whole or not at all.
    named.unlink()

    def no_rename(source: str, destination: Path) -> None:
        raise OSError("disk full")

    monkeypatch.setattr("qwen3vl_trt.vision.engine.os.replace", no_rename)
    with pytest.raises(OSError, match="disk full"):
        build(source, tmp_path / "third", timing_cache=named)
    assert list(named.parent.iterdir()) == [] and not (tmp_path / "third").exists()


def test_build_failures_on_the_gpu_host(gpu, exports, engines, tmp_path, monkeypatch):
    import tensorrt as trt

    with pytest.raises(Qwen3VLTrtError, match=r"--arch sm_100 is newer than this GPU \(sm_90\)"):
        build_vision_engine(exports["plugin"], tmp_path / "e", PROFILE, arch="sm_100", log=_quiet)

    broken = shutil.copytree(exports["portable"], tmp_path / "broken")
    (broken / VISION_ONNX_FILE).write_bytes(b"not a model")
    with pytest.raises(Qwen3VLTrtError, match="TensorRT cannot parse .*vision_encoder.onnx: Failed to parse ONNX"):
        build_vision_engine(broken, tmp_path / "e", PROFILE, log=_quiet)

    reordered = shutil.copytree(exports["portable"], tmp_path / "reordered")
    model = onnx.load(reordered / VISION_ONNX_FILE, load_external_data=False)
    first, second = (onnx.ValueInfoProto.FromString(v.SerializeToString()) for v in model.graph.input[:2])
    model.graph.input[0].CopyFrom(second)
    model.graph.input[1].CopyFrom(first)
    onnx.save(model, reordered / VISION_ONNX_FILE)
    with pytest.raises(Qwen3VLTrtError, match=r"the parsed network's inputs \['pos_embed_idx', 'pixel_values', "):
        build_vision_engine(reordered, tmp_path / "e", PROFILE, log=_quiet)

    # What the stand-in cannot do by itself: TensorRT failing the build (no tactic fits, out of memory).
    monkeypatch.setattr(trt.Builder, "build_serialized_network", lambda self, network, config: None)
    with pytest.raises(Qwen3VLTrtError, match="TensorRT could not build the portable vision engine; its log is above"):
        build_vision_engine(exports["portable"], tmp_path / "e", PROFILE, log=_quiet)
    assert not (tmp_path / "e").exists()
    with pytest.raises(Qwen3VLTrtError, match="TensorRT cannot load the vision engine it has just built"):
        _device_memory_bytes(b"not a plan")


def test_what_keeps_the_gpu_stack_from_working(gpu, monkeypatch):
    assert tensorrt_problem() is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert tensorrt_problem() == "no CUDA device is visible (TensorRT builds and runs engines on a GPU)"
    monkeypatch.setitem(sys.modules, "tensorrt", types.ModuleType("tensorrt"))  # a directory without the bindings
    assert tensorrt_problem() == "the tensorrt package found has no TensorRT bindings"
