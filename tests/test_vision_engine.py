"""build-vision-engine and the engine runner where TensorRT is absent: input checks first (exit 2), then a clear
GPU-stack message (exit 3); the profile's shapes; the sidecar checks the runner makes before loading an engine; and
`qwen3vl-trt build` recording the stage as skipped. The build and the runner themselves run through the TensorRT
stand-in in test_vision_trt_standin.py, and for real on GPU hosts (scripts/gpu_acceptance.sh)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import _quiet
from qwen3vl_trt.common.contracts import BuildLayout
from qwen3vl_trt.errors import CheckpointError, GpuStackMissingError, LimitsError, Qwen3VLTrtError
from qwen3vl_trt.vision.engine import build_vision_engine, tensorrt_problem
from qwen3vl_trt.vision.export import export_vision
from qwen3vl_trt.vision.sidecar import VisionEngineProfile, VisionEngineSidecar, VisionSidecar

# What a machine without TensorRT or a GPU shows; GPU hosts build for real (scripts/gpu_acceptance.sh).
without_gpu_stack = pytest.mark.skipif(tensorrt_problem() is None, reason="TensorRT and a GPU are here")


@pytest.fixture(scope="module")
def plugin_export(tiny_dense, tmp_path_factory):
    output = tmp_path_factory.mktemp("engine") / "plugin"
    return export_vision(tiny_dense, output, variant="plugin", log=_quiet).output_dir


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "qwen3vl_trt.cli", *args], capture_output=True, text=True)


@without_gpu_stack
def test_without_tensorrt_the_build_exits_3_and_says_where_to_run(plugin_export, tmp_path):
    result = run_cli("build-vision-engine", "--onnx", str(plugin_export), "--output", str(tmp_path / "engine"))
    assert result.returncode == 3, result.stderr
    assert result.stderr.startswith("qwen3vl-trt build-vision-engine: error: cannot build the vision engine here: ")
    assert "tensorrt is not importable" in result.stderr and "GPU host with TensorRT 10.14" in result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "engine").exists()


@pytest.mark.parametrize(
    "options, error, message",
    [
        ({"dtype": "bf16"}, Qwen3VLTrtError, "export-vision --variant plugin --dtype bf16"),
        ({"profile": VisionEngineProfile(min_patches=6, opt_patches=8, max_patches=64)}, LimitsError, "multiples of 4"),
        ({"arch": "hopper"}, Qwen3VLTrtError, "--arch: GPU architecture must look like sm_90"),
        ({"optimization_level": 6}, LimitsError, "0..5"),
    ],
)
def test_bad_options_are_refused_before_looking_for_the_gpu(plugin_export, tmp_path, options, error, message):
    with pytest.raises(error, match=message) as raised:
        build_vision_engine(plugin_export, tmp_path / "engine", log=_quiet, **options)
    assert raised.value.exit_code == 2
    assert not (tmp_path / "engine").exists()


def test_a_foreign_export_sidecar_is_refused(plugin_export, tmp_path):
    import shutil

    export = shutil.copytree(plugin_export, tmp_path / "export")
    sidecar = json.loads((export / "vision_config.json").read_text())
    sidecar["inputs"][4]["shape"] = ["N"]  # an older contract of cu_seqlens
    (export / "vision_config.json").write_text(json.dumps(sidecar))
    with pytest.raises(CheckpointError, match="export it again"):
        build_vision_engine(export, tmp_path / "engine", log=_quiet)


@pytest.mark.parametrize(
    "values, message",
    [
        ({"max_patches": 0}, "max-patches must be a positive integer"),
        ({"min_patches": 64, "opt_patches": 32}, "min <= opt <= max"),
        ({"max_images": True}, "max-images must be a positive integer"),
    ],
)
def test_profile_limits(values, message):
    with pytest.raises(LimitsError, match=message):
        VisionEngineProfile(**values)


def test_profile_shapes_cover_patches_segments_and_the_longest_segment(plugin_export):
    inputs = VisionSidecar.load(plugin_export).contract()["inputs"]
    shapes = VisionEngineProfile(min_patches=8, opt_patches=1024, max_patches=16384, max_images=16).input_shapes(inputs)
    assert list(shapes) == [
        "pixel_values",
        "pos_embed_idx",
        "pos_embed_w",
        "rotary_pos",
        "cu_seqlens",
        "max_seqlen_carrier",
    ]
    assert shapes["pixel_values"] == {"min": [8, 1536], "opt": [1024, 1536], "max": [16384, 1536]}
    assert shapes["pos_embed_idx"]["max"] == [16384, 4] and shapes["rotary_pos"]["min"] == [8, 2]
    assert shapes["cu_seqlens"] == {"min": [2], "opt": [2], "max": [17]}
    assert shapes["max_seqlen_carrier"] == {"min": [1], "opt": [1024], "max": [16384]}
    # `qwen3vl-trt build` sizes the engine for one request with the most visual tokens.
    limits = VisionEngineProfile.for_visual_tokens(8192, merge_unit=4)
    assert (limits.min_patches, limits.max_patches) == (4, 32768)
    assert VisionEngineProfile.for_visual_tokens(256, 4).opt_patches == 1024


def _engine_dir(plugin_export, tmp_path, **changes):
    """An engine directory as build-vision-engine writes it (without a plan: the checks come first)."""
    engine = tmp_path / "engine"
    engine.mkdir()
    export = VisionSidecar.load(plugin_export)
    export.write(engine)
    assert VisionSidecar.load(engine) == export
    sidecar = VisionEngineSidecar.of_build(
        export,
        VisionEngineProfile(),
        tensorrt_version="10.14.1.48",
        gpu_name="NVIDIA H100 80GB HBM3",
        compute_capability=(9, 0),
        plugin_capability=90,
        optimization_level=3,
        timing_cache="timing.cache",
        device_memory_bytes=3 << 30,
    )
    VisionEngineSidecar({**sidecar.raw, **changes}).write(engine)
    return engine


def test_runner_accepts_a_matching_engine_sidecar(plugin_export, tmp_path):
    engine = _engine_dir(plugin_export, tmp_path)
    sidecar = VisionEngineSidecar.load(engine)
    sidecar.check_runtime(VisionSidecar.load(engine), "10.14.1.48", (9, 0))
    assert (sidecar.max_patches, sidecar.max_images) == (32768, 64)
    assert sidecar.engine_file == "vision_encoder.plan" and sidecar.device_memory_bytes == 3 << 30
    assert sidecar.raw["plugin_arch"] == "sm_90" and sidecar.raw["strongly_typed"] is True
    assert sidecar.raw["profile"]["shapes"]["cu_seqlens"]["max"] == [65]


@pytest.mark.parametrize(
    "tensorrt_version, capability, message",
    [
        ("10.13.0.35", (9, 0), "built with TensorRT 10.14.1.48, this host has 10.13.0.35"),
        ("10.14.1.48", (8, 9), r"built for compute capability 9.0 \(NVIDIA H100 80GB HBM3\), this GPU is 8.9"),
    ],
)
def test_runner_refuses_an_engine_built_elsewhere(plugin_export, tmp_path, tensorrt_version, capability, message):
    engine = _engine_dir(plugin_export, tmp_path)
    with pytest.raises(CheckpointError, match=message) as raised:
        VisionEngineSidecar.load(engine).check_runtime(VisionSidecar.load(engine), tensorrt_version, capability)
    assert "build-vision-engine" in str(raised.value)


def test_runner_refuses_an_engine_of_another_contract(plugin_export, vision_exports, tmp_path):
    engine = _engine_dir(plugin_export, tmp_path)
    portable = VisionSidecar.load(vision_exports["dense"])  # the export beside it says portable
    with pytest.raises(CheckpointError, match="another input/output contract"):
        VisionEngineSidecar.load(engine).check_runtime(portable, "10.14.1.48", (9, 0))


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"format_version": 2}, "format_version 2, this version reads 1"),
        ({"tensorrt_version": 10}, "'tensorrt_version' must be a string"),
        ({"profile": {"max_images": 64}}, "lacks 'profile.max_patches'"),
    ],
)
def test_runner_refuses_a_malformed_engine_sidecar(plugin_export, tmp_path, changes, message):
    engine = _engine_dir(plugin_export, tmp_path, **changes)
    with pytest.raises(CheckpointError, match=message):
        VisionEngineSidecar.load(engine)


@without_gpu_stack
def test_the_runner_needs_the_gpu_stack(plugin_export, tmp_path):
    from qwen3vl_trt.vision.trt_runner import VisionEngine

    with pytest.raises(GpuStackMissingError, match="cannot run the vision engine here") as raised:
        VisionEngine(_engine_dir(plugin_export, tmp_path))
    assert raised.value.exit_code == 3


@pytest.mark.slow
@without_gpu_stack
def test_build_records_the_vision_engine_stage_as_skipped(tiny_dense, tmp_path):
    from qwen3vl_trt.common.manifest import VISION_ENGINE_STAGE, BuildManifest
    from qwen3vl_trt.pipeline.build import build

    lines: list[str] = []
    manifest = build(tiny_dense, tmp_path / "b", log=lines.append)
    stage = manifest.stage(VISION_ENGINE_STAGE)
    assert stage is not None
    assert stage.status == "skipped" and "tensorrt is not importable" in str(stage.reason)
    layout = BuildLayout(tmp_path / "b")
    assert f"--variant plugin --dtype bf16 --output {layout.vision_plugin}" in str(stage.rerun_on_gpu_host)
    assert f"build-vision-engine --onnx {layout.vision_plugin} --output {layout.vision_engine}" in str(
        stage.rerun_on_gpu_host
    )
    assert not layout.vision_plugin.exists() and not layout.vision_engine.exists()
    assert any(line.startswith(f"stage {VISION_ENGINE_STAGE}: SKIPPED") for line in lines)
    assert json.loads(layout.manifest.read_text())["stages"] == [s.as_json() for s in manifest.stages]
    assert BuildManifest.read(layout.root) == manifest
