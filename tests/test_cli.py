"""The command line: real subprocesses, exit codes and messages a user sees."""

from __future__ import annotations

import json
import subprocess
import sys

from qwen3vl_trt.qa.tiny import synthetic_jpeg, synthetic_video
from videos import audio_only


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "qwen3vl_trt.cli", *args], capture_output=True, text=True)


def test_make_tiny_inspect_export(tmp_path):
    model = tmp_path / "tiny-moe"
    made = run_cli("make-tiny", "--output", str(model), "--moe", "--seed", "3")
    assert made.returncode == 0, made.stderr
    inspected = run_cli("inspect", "--model", str(model))
    assert inspected.returncode == 0, inspected.stderr
    info = json.loads(inspected.stdout)
    assert info["model_type"] == "qwen3_vl_moe" and info["moe"] and info["vision"]["head_dim"] == 64
    exported = run_cli("export-vision", "--model", str(model), "--output", str(tmp_path / "v"), "--verify")
    assert exported.returncode == 0, exported.stderr
    assert "max abs" in exported.stdout and (tmp_path / "v" / "vision_config.json").is_file()
    again = run_cli("make-tiny", "--output", str(model))
    assert again.returncode == 2 and "already exists; pass --force" in again.stderr


def test_build_writes_manifest(tiny_dense, tmp_path):
    built = run_cli("build", "--model", str(tiny_dense), "--output", str(tmp_path / "b"))
    assert built.returncode == 0, built.stderr
    manifest = json.loads((tmp_path / "b" / "manifest.json").read_text())
    stages = ["vision-onnx", "llm-checkpoint", "llm-engine", "vision-engine", "triton-repo"]
    assert [s["stage"] for s in manifest["stages"]] == stages
    assert manifest["stages"][3]["status"] == "skipped" and "rerun_on_gpu_host" in manifest["stages"][3]
    assert manifest["target"] == "cpu" and manifest["stages"][4]["target"] == "cpu"
    assert (tmp_path / "b" / "triton_repo" / "qwen3vl" / "config.pbtxt").is_file()
    assert manifest["stages"][0]["verification"] <= 1e-4
    assert (tmp_path / "b" / "llm_checkpoint" / "rank0.safetensors").is_file()
    engine = manifest["stages"][2]
    assert engine["status"] == "skipped" and "tensorrt_llm is not importable" in engine["reason"]
    assert "SKIPPED" in built.stdout and "build-llm-engine --checkpoint" in built.stdout
    # The CPU chain answers from the build: preprocessing, ONNX Runtime encoder, reference LLM.
    photo = tmp_path / "photo.jpg"
    photo.write_bytes(synthetic_jpeg(120, 200))
    args = ["--model", str(tiny_dense), "--build", str(tmp_path / "b"), "--image", str(photo), "--max-new-tokens", "6"]
    answered = run_cli("generate", *args)
    assert answered.returncode == 0, answered.stderr
    assert answered.stdout.strip()
    missing = run_cli("generate", *args[:4], "--image", str(tmp_path / "nope.jpg"))
    assert missing.returncode == 2 and "cannot read image" in missing.stderr
    clip = tmp_path / "clip.mp4"
    clip.write_bytes(synthetic_video(20, 64, 96))
    with_video = run_cli("generate", *args, "--video", str(clip), "--json")
    assert with_video.returncode == 0, with_video.stderr
    assert len(json.loads(with_video.stdout)["token_ids"]) > 0
    song = tmp_path / "song.mp4"
    song.write_bytes(audio_only())
    refused = run_cli("generate", *args[:4], "--video", str(song))
    assert refused.returncode == 2 and "video 0: the file has no video stream (streams: audio)" in refused.stderr


def test_errors_are_one_line_without_traceback(tmp_path):
    result = run_cli("export-vision", "--model", str(tmp_path / "missing"), "--output", str(tmp_path / "out"))
    assert result.returncode == 2
    assert (
        result.stderr.strip()
        == f"qwen3vl-trt export-vision: error: checkpoint directory {tmp_path / 'missing'} does not exist"
    )
    assert not (tmp_path / "out").exists()


def test_preprocess_summarizes_a_request(tiny_dense, tmp_path):
    from images import jpeg

    image = tmp_path / "photo.jpg"
    image.write_bytes(jpeg(480, 640))
    result = run_cli("preprocess", "--model", str(tiny_dense), "--image", str(image), "--text", "What is it?", "--ids")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["images"][0]["grid_thw"] == [1, 30, 40] and summary["visual_tokens"] == 300
    assert summary["pixel_values"] == [1200, 1536] and summary["prompt_table_rows"] == 4 * 300
    assert summary["input_ids"].count(151655) == 300 and len(summary["input_ids"]) == summary["tokens"]
    bad = run_cli("preprocess", "--model", str(tiny_dense), "--image", str(tmp_path / "none.jpg"))
    assert bad.returncode == 2 and "cannot read image" in bad.stderr and "Traceback" not in bad.stderr


def test_output_equal_to_the_model_is_refused_even_with_force(tiny_dense, tmp_path):
    import shutil

    model = shutil.copytree(tiny_dense, tmp_path / "model")
    before = sorted(p.name for p in model.iterdir())
    result = run_cli("convert-llm", "--model", str(model), "--output", str(model), "--force")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip() == (
        f"qwen3vl-trt convert-llm: error: output {model} overlaps the input {model} (the same directory, inside it "
        "or around it); choose an --output outside the input"
    )
    assert sorted(p.name for p in model.iterdir()) == before


def test_preprocess_summarizes_a_video(tiny_dense, tmp_path):
    clip = tmp_path / "clip.webm"
    clip.write_bytes(synthetic_video(25, 96, 128, 10, "libvpx-vp9", "webm"))
    result = run_cli("preprocess", "--model", str(tiny_dense), "--video", str(clip), "--text", "What happens?")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    # 2.5 s at 10 fps sampled at 2 fps: 5 frames (0, 6, 12, 18, 24), 3 temporal patches at 0.3, 1.5 and 2.4 s.
    assert summary["videos"][0]["grid_thw"] == [3, 6, 8]
    assert [round(t, 1) for t in summary["videos"][0]["timestamps"]] == [0.3, 1.5, 2.4]
    assert summary["visual_tokens"] == 3 * 12
