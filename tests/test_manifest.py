"""The build manifest: what `qwen3vl-trt build` writes is what its readers get back, a manifest of another schema
or a damaged one is refused with a message that says how to fix it."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from qwen3vl_trt.common.contracts import BuildLayout
from qwen3vl_trt.common.limits import EngineLimits
from qwen3vl_trt.common.manifest import (
    LLM_CHECKPOINT_STAGE,
    LLM_ENGINE_STAGE,
    MANIFEST_SCHEMA,
    STAGES,
    TRITON_REPO_STAGE,
    VISION_ENGINE_STAGE,
    VISION_STAGE,
    BuildManifest,
    StageRecord,
)
from qwen3vl_trt.errors import CheckpointError

# A manifest as this version writes it.
WRITTEN = {
    "schema": MANIFEST_SCHEMA,
    "qwen3vl_trt": "0.1.0",
    "model": "/models/Qwen3-VL-2B-Instruct",
    "model_type": "qwen3_vl",
    "size": "2B",
    "limits": {
        "max_batch_size": 4,
        "max_input_len": 2048,
        "max_seq_len": 4096,
        "max_num_tokens": 4096,
        "max_visual_tokens": 1024,
        "tokens_per_block": 32,
        "max_top_logprobs": 0,
    },
    "target": "cpu",
    "stages": [
        {"stage": "vision-onnx", "status": "done", "output": "vision", "seconds": 12.5, "verification": 3.1e-06},
        {"stage": "llm-checkpoint", "status": "done", "output": "llm_checkpoint", "seconds": 4.0},
        {
            "stage": "llm-engine",
            "status": "skipped",
            "reason": "tensorrt_llm is not importable (No module named 'tensorrt_llm')",
            "rerun_on_gpu_host": "qwen3vl-trt build-llm-engine --checkpoint b/llm_checkpoint --output b/llm_engine",
        },
        {
            "stage": "vision-engine",
            "status": "skipped",
            "reason": "tensorrt is not importable (No module named 'tensorrt')",
            "rerun_on_gpu_host": "qwen3vl-trt export-vision ... && qwen3vl-trt build-vision-engine ...",
        },
        {"stage": "triton-repo", "status": "done", "output": "triton_repo", "seconds": 0.1, "target": "cpu"},
    ],
    # Pulled from the build cache (build --cache) after waiting for the replica that built it.
    "cache": {
        "key": "c7aa68d4248192f8af11bfe0719ab56b",
        "parts": {"checkpoint": "id:rev1", "gpu": "none", "tp": "1"},
        "source": "pulled",
        "entry": "/cache/entries/c7aa68d4248192f8af11bfe0719ab56b",
        "mode": "link",
        "wait_s": 41.0,
        "pull_s": 0.21,
        "pull_bytes": 62914560,
        "build_s": None,
        "refused": None,
    },
}


def _write(build: Path, content: object) -> Path:
    build.mkdir(exist_ok=True)
    BuildLayout(build).manifest.write_text(json.dumps(content))
    return build


def test_reads_a_manifest_as_written(tmp_path):
    build = _write(tmp_path / "b", WRITTEN)
    manifest = BuildManifest.read(build, required_stages=(VISION_STAGE, LLM_CHECKPOINT_STAGE))
    assert manifest.model == Path("/models/Qwen3-VL-2B-Instruct") and manifest.target == "cpu"
    assert manifest.limits == EngineLimits(4, 2048, 4096, 4096, 1024, 32, max_top_logprobs=0)
    assert [s.stage for s in manifest.stages] == list(STAGES)
    assert manifest.done_stages() == (VISION_STAGE, LLM_CHECKPOINT_STAGE, TRITON_REPO_STAGE)
    vision = manifest.stage(VISION_STAGE)
    assert vision is not None and vision.verification == 3.1e-06 and vision.output == BuildLayout.VISION
    engine = manifest.stage(LLM_ENGINE_STAGE)
    assert engine is not None and engine.status == "skipped" and "build-llm-engine" in str(engine.rerun_on_gpu_host)
    assert manifest.source == "pulled" and manifest.cache is not None and manifest.cache.wait_s == 41.0
    # Written again, it is the same file.
    assert manifest.as_json() == WRITTEN
    # One written before max_top_logprobs existed serves none.
    older = {**WRITTEN, "limits": {k: v for k, v in WRITTEN["limits"].items() if k != "max_top_logprobs"}}
    assert BuildManifest.read(_write(tmp_path / "older", older)).limits.max_top_logprobs == 0


@pytest.mark.parametrize("cache", [{"key": "k"}, {**WRITTEN["cache"], "source": "borrowed"}, "pulled"])  # type: ignore[dict-item]
def test_refuses_a_cache_record_it_cannot_read(tmp_path, cache):
    build = _write(tmp_path / "b", {**WRITTEN, "cache": cache})
    with pytest.raises(CheckpointError, match="'cache' is not a build-cache record"):
        BuildManifest.read(build)


@pytest.mark.parametrize("schema", [None, 1, MANIFEST_SCHEMA + 1])
def test_refuses_a_manifest_of_another_schema(tmp_path, schema):
    """Manifests written before the schema (0.1.0 wrote none) or by a later version: rebuilt, never guessed at."""
    other = {k: v for k, v in WRITTEN.items() if k != "schema"} | ({} if schema is None else {"schema": schema})
    with pytest.raises(CheckpointError, match=f"manifest schema {schema}.*rebuild it with `qwen3vl-trt build --force`"):
        BuildManifest.read(_write(tmp_path / "b", other))


def test_round_trips_what_it_writes(tmp_path):
    started = time.perf_counter()
    manifest = BuildManifest(
        model=Path("/models/m"),
        limits=EngineLimits(max_batch_size=2),
        stages=(
            StageRecord.done(VISION_STAGE, BuildLayout.VISION, started, verification=None),
            StageRecord.done(LLM_CHECKPOINT_STAGE, BuildLayout.LLM_CHECKPOINT, started),
            StageRecord.skipped(LLM_ENGINE_STAGE, "no GPU", "qwen3vl-trt build-llm-engine ..."),
            StageRecord.done(VISION_ENGINE_STAGE, BuildLayout.VISION_ENGINE, started, onnx=BuildLayout.VISION_PLUGIN),
            StageRecord.done(TRITON_REPO_STAGE, BuildLayout.TRITON_REPO, started, target="gpu"),
        ),
        target="gpu",
        model_type="qwen3_vl_moe",
        size="30B-A3B",
    )
    (tmp_path / "b").mkdir()
    path = manifest.write(tmp_path / "b")
    assert path == BuildLayout(tmp_path / "b").manifest
    assert BuildManifest.read(tmp_path / "b") == manifest
    # An unverified export says so (null), as every manifest so far has.
    assert json.loads(path.read_text())["stages"][0]["verification"] is None


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"stages": [{"status": "done"}]}, "'stage' is None"),
        ({"stages": [{"stage": "vision-onnx", "status": "finished"}]}, "'status' is 'finished'"),
        ({"stages": [{"stage": "vision-onnx", "status": "done", "seconds": "5"}]}, "'seconds' is '5'"),
        ({"model": None}, "'model' must be the checkpoint's path"),
        ({"target": "tpu"}, "'target' must be one of gpu, cpu"),
        ({"limits": {"max_batch_size": 0}}, "EngineLimits.max_batch_size must be a positive integer"),
        ({"limits": {"max_beams": 2}}, "'limits' is not a set of engine limits"),
        ({"limits": None}, "'limits' is not a set of engine limits"),
    ],
)
def test_refuses_a_damaged_manifest(tmp_path, change, message):
    build = _write(tmp_path / "b", {**WRITTEN, **change})
    with pytest.raises(CheckpointError, match="rebuild it with `qwen3vl-trt build --force`") as raised:
        BuildManifest.read(build)
    assert message in str(raised.value)


def test_later_versions_entries_are_ignored(tmp_path):
    later = {**WRITTEN, "stages": [{**WRITTEN["stages"][0], "gpu": "H200"}]}
    (stage,) = BuildManifest.read(_write(tmp_path / "b", later)).stages
    assert stage == StageRecord("vision-onnx", "done", output="vision", seconds=12.5, verification=3.1e-06)
