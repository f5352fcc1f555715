"""build-llm-engine: trtllm-build flags from the EngineLimits, the GPU-host command, the launcher over
the TensorRT-LLM 1.2.1 stand-in (tests/trtllm_standin: config loading through MODEL_MAP, pydantic
BuildConfig/PluginConfig, parallel_build's spawned workers, as upstream), and the DeepStack index
arithmetic shared by the engine model and the runtime."""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from qwen3vl_trt.cli import main as cli
from qwen3vl_trt.common.limits import EngineLimits
from qwen3vl_trt.errors import Qwen3VLTrtError, UnsupportedModelError
from qwen3vl_trt.llm import engine_build
from qwen3vl_trt.llm import engine_model as trtllm_model
from qwen3vl_trt.llm import inputs as llm_inputs
from qwen3vl_trt.llm.checkpoint_format import read_trtllm_config
from qwen3vl_trt.llm.convert import convert_llm
from qwen3vl_trt.llm.engine_build import launcher_command, trtllm_build_flags
from qwen3vl_trt.runtime import reference_llm

# trtllm-build's flags, the launcher and the stand-in's loading: nothing here reads transformers.
pytestmark = pytest.mark.once

LIMITS = EngineLimits(
    max_batch_size=4, max_input_len=2048, max_seq_len=4096, max_num_tokens=8192, max_visual_tokens=1024
)


@pytest.fixture(scope="module")
def bf16_checkpoints(checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("engine-ckpt")
    converted = {name: convert_llm(checkpoints[name], root / name, progress=False) for name in ("dense", "moe")}
    converted["dense-fp32-tp2"] = convert_llm(checkpoints["dense"], root / "fp32", dtype="fp32", tp=2, progress=False)
    return converted


def _flags(argv: list[str]) -> dict[str, str]:
    assert len(argv) % 2 == 0 and all(a.startswith("--") for a in argv[::2])
    return dict(zip(argv[::2], argv[1::2], strict=True))


@pytest.mark.parametrize("name", ["dense", "moe", "dense-fp32-tp2"])
def test_flags_derive_from_the_build_config(name, bf16_checkpoints):
    _, config = read_trtllm_config(bf16_checkpoints[name])
    flags = _flags(trtllm_build_flags("/ckpt", "/engine", config, LIMITS))
    dtype = "float32" if name == "dense-fp32-tp2" else "bfloat16"
    fused_context = "disable" if dtype == "float32" else "enable"  # no fp32 context FMHA kernels
    assert flags == {
        "--checkpoint_dir": "/ckpt",
        "--output_dir": "/engine",
        "--max_batch_size": "4",
        "--max_input_len": "2048",
        "--max_seq_len": "4096",
        "--max_num_tokens": "8192",
        "--max_beam_width": "1",
        # (K+1) rows per visual token, for every request of a full batch: 4 x 1024 x 4.
        "--max_prompt_embedding_table_size": "16384",
        "--kv_cache_type": "paged",
        "--tokens_per_block": "32",
        "--use_paged_context_fmha": fused_context,
        "--context_fmha": fused_context,
        "--remove_input_padding": "enable",
        "--output_timing_cache": "/engine/timing.cache",  # not trtllm-build's default, ./model.cache
        "--gpt_attention_plugin": dtype,
        "--gemm_plugin": dtype,
        "--workers": str(config.mapping.world_size),  # one build process per rank
        **({"--moe_plugin": "bfloat16"} if name == "moe" else {}),
    }


@pytest.mark.parametrize(
    "quant_algo, kv, paged",
    [(None, "INT8", False), (None, "FP8", False), ("W8A16", "FP8", False), ("FP8", "FP8", True), ("FP8", None, True)],
)
def test_quantized_kv_caches_without_paged_context_fmha_hold_whole_prompts(bf16_checkpoints, quant_algo, kv, paged):
    """The builder drops paged context FMHA for an INT8 cache and for an FP8 one beside non-FP8 weights (builder.py):
    the flags say so, and an engine without it (no chunked prefill) takes a whole prompt in one step."""
    _, config = read_trtllm_config(bf16_checkpoints["dense"])
    config = dataclasses.replace(config, quant_algo=quant_algo, kv_cache_quant_algo=kv)
    limits = dataclasses.replace(LIMITS, max_num_tokens=1024)  # below max_input_len 2048
    flags = _flags(trtllm_build_flags("/ckpt", "/engine", config, limits))
    assert flags["--use_paged_context_fmha"] == ("enable" if paged else "disable")
    assert flags["--max_num_tokens"] == ("1024" if paged else "2048")


def test_limits_are_checked(bf16_checkpoints):
    _, config = read_trtllm_config(bf16_checkpoints["dense"])
    with pytest.raises(Qwen3VLTrtError, match="exceeds the model's 262144 positions"):
        limits = EngineLimits(max_input_len=1000, max_seq_len=300000, max_visual_tokens=8)
        trtllm_build_flags("/c", "/e", config, limits)
    with pytest.raises(Qwen3VLTrtError, match="must exceed max_input_len"):
        EngineLimits(max_input_len=4096, max_seq_len=4096)
    with pytest.raises(Qwen3VLTrtError, match="max_visual_tokens"):
        EngineLimits(max_input_len=1024, max_visual_tokens=2048)
    with pytest.raises(Qwen3VLTrtError, match="max_batch_size must be a positive integer"):
        EngineLimits(max_batch_size=0)


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "qwen3vl_trt.cli", *args], capture_output=True, text=True)


def test_print_command_is_the_gpu_host_command(bf16_checkpoints, tmp_path):
    ckpt = bf16_checkpoints["moe"]
    result = _cli(
        "build-llm-engine", "--checkpoint", str(ckpt), "--output", "engine", "--max-batch-size", "2", "--print-command"
    )
    assert result.returncode == 0, result.stderr
    argv = shlex.split(result.stdout)
    assert argv[:3] == ["python", "-m", "qwen3vl_trt.llm.engine_build"]
    flags = _flags(argv[3:])
    assert flags["--checkpoint_dir"] == str(ckpt.absolute()) and flags["--output_dir"] == str(tmp_path.cwd() / "engine")
    assert flags["--max_batch_size"] == "2" and flags["--moe_plugin"] == "bfloat16"
    # The printed launcher itself refuses clearly on a machine without TensorRT-LLM.
    launched = subprocess.run([sys.executable, *argv[1:]], capture_output=True, text=True)
    assert launched.returncode == 3 and "tensorrt_llm is not importable" in launched.stderr


@pytest.mark.skipif(trtllm_model.TRTLLM_IMPORT_ERROR is None, reason="TensorRT-LLM is installed here")
def test_build_without_tensorrt_llm_stops_clearly(bf16_checkpoints, tmp_path):
    result = _cli("build-llm-engine", "--checkpoint", str(bf16_checkpoints["dense"]), "--output", str(tmp_path / "e"))
    assert result.returncode == 3
    assert "tensorrt_llm is not importable" in result.stderr and "--print-command" in result.stderr
    assert not (tmp_path / "e").exists()
    assert not hasattr(trtllm_model, "Qwen3VLForCausalLM")  # importable module, class absent


def test_pipeline_splits_without_the_deepstack_layers_first_are_refused_at_build_time(
    bf16_checkpoints, tmp_path, capsys
):
    """A checkpoint converted elsewhere (or edited) with pp=3: the first of 3 stages holds layers 0-1 only."""
    ckpt = tmp_path / "pp3"
    shutil.copytree(bf16_checkpoints["dense"], ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["mapping"] |= {"pp_size": 3, "world_size": 3}
    (ckpt / "config.json").write_text(json.dumps(cfg))
    _, config = read_trtllm_config(ckpt)
    with pytest.raises(UnsupportedModelError, match=r"pp=3 puts DeepStack layer\(s\) \[2\] .*use pp <= 2"):
        trtllm_build_flags(str(ckpt), "/engine", config, LIMITS)
    for extra in (["--print-command"], []):  # refused before looking for the GPU stack
        assert cli(["build-llm-engine", "--checkpoint", str(ckpt), "--output", str(tmp_path / "e"), *extra]) == 2
        out = capsys.readouterr()
        assert "use pp <= 2" in out.err and not out.out
    assert not (tmp_path / "e").exists()


# The launcher as the GPU host runs it, in a process of its own over the stand-in; afterwards it says whether anything
# registered our architecture in TensorRT-LLM's MODEL_MAP.
_LAUNCH = """
import sys, torch
torch.cuda.device_count = lambda: int(sys.argv[1])  # CUDA: what the stand-in cannot provide
from qwen3vl_trt.llm.engine_build import launch
code = launch(sys.argv[2:])
from tensorrt_llm.models import MODEL_MAP
assert "Qwen3VLForCausalLM" not in MODEL_MAP, "registered"
sys.exit(code)
"""


def _launch(argv: list[str], standin: Path, gpus: int = 1, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    path = os.pathsep.join([str(standin), *filter(None, [os.environ.get("PYTHONPATH")])])
    return subprocess.run(
        [sys.executable, "-c", _LAUNCH, str(gpus), *argv],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": path},
        cwd=cwd,
    )


def _engine(output: Path) -> tuple[dict, dict[int, dict]]:
    """The stand-in engine directory: config.json, and each rank's record of the model it was built from."""
    config = json.loads((output / "config.json").read_text())
    ranks = {int(p.stem[4:]): json.loads(p.read_text()) for p in output.glob("rank*.engine")}
    return config, ranks


def test_tensorrt_llm_cannot_load_our_architecture_by_name(bf16_checkpoints, trtllm_standin):
    """What trtllm-build's main() does (PretrainedConfig.from_json_file -> from_dict -> MODEL_MAP) fails for our
    checkpoints: the launcher must not go through it, in any process."""
    from tensorrt_llm.models import MODEL_MAP, PretrainedConfig

    with pytest.raises(KeyError, match=trtllm_model.ARCHITECTURE):
        PretrainedConfig.from_json_file(str(bf16_checkpoints["dense"] / "config.json"))
    assert trtllm_model.ARCHITECTURE not in MODEL_MAP


def test_launcher_sets_mrope_and_engine_positions_before_the_build(bf16_checkpoints, trtllm_standin, tmp_path):
    """One worker: upstream's parallel_build builds every rank in the launcher's process."""
    ckpt = bf16_checkpoints["moe"]
    _, config = read_trtllm_config(ckpt)
    command = launcher_command(str(ckpt), str(tmp_path / "engine"), config, LIMITS)
    assert command[1:3] == ["-m", engine_build.LAUNCHER]
    result = _launch(command[3:], trtllm_standin)
    assert result.returncode == 0, result.stderr[-3000:]  # and MODEL_MAP untouched: passed, never registered
    engine, ranks = _engine(tmp_path / "engine")
    assert list(ranks) == [0] and ranks[0]["model_class"].endswith("engine_model.Qwen3VLForCausalLM")
    build = engine["build_config"]
    assert build["use_mrope"] is True  # trtllm-build sets it for qwen2_vl only
    assert (build["max_batch_size"], build["max_input_len"], build["max_seq_len"], build["max_num_tokens"]) == (
        4,
        2048,
        4096,
        8192,
    )
    assert build["max_prompt_embedding_table_size"] == LIMITS.prompt_table_rows(config.deepstack_count)
    assert build["kv_cache_type"] == "paged" and build["max_beam_width"] == 1
    plugins = build["plugin_config"]
    assert (plugins["gpt_attention_plugin"], plugins["moe_plugin"], plugins["context_fmha"]) == (
        "bfloat16",
        "bfloat16",
        True,
    )
    model = engine["pretrained_config"]
    assert model["max_position_embeddings"] == LIMITS.max_seq_len  # the engine's mrope table length
    # As QWenConfig.from_hugging_face writes it for qwen2_vl: the attention layers take the MRoPE path.
    assert model["position_embedding_type"] == "mrope" and model["rotary_scaling"] == {"type": "mrope"}
    # The engine declares the prompt table and the mrope table of max_seq_len positions.
    inputs = ranks[0]["inputs"]
    assert inputs["prompt_embedding_table"] == "prompt_embedding_table"
    assert inputs["mrope_rotary_cos_sin_size"] == LIMITS.max_seq_len * model["rotary_embedding_dim"]


def test_an_engine_for_top_logprobs_gathers_its_generation_logits(bf16_checkpoints, trtllm_standin, tmp_path):
    """max_top_logprobs > 0: trtllm-build's --gather_generation_logits, which the tensorrtllm backend needs (its
    executor config never sets gatherGenerationLogits), lands in the engine's build_config, where the runtime
    (gptJsonConfig.cpp) and serving's memory plan read it; without it the engine has none."""
    from qwen3vl_trt.serving.repository.gpu_memory import LLMEngineBuild

    ckpt = bf16_checkpoints["dense"]
    _, config = read_trtllm_config(ckpt)
    for top, gathered in ((0, False), (5, True)):
        limits = dataclasses.replace(LIMITS, max_top_logprobs=top)
        argv = launcher_command(str(ckpt), str(tmp_path / f"engine-{top}"), config, limits)[3:]
        assert (engine_build.GATHER_GENERATION_LOGITS in argv) == gathered
        result = _launch(argv, trtllm_standin)
        assert result.returncode == 0, result.stderr[-3000:]
        engine, _ = _engine(tmp_path / f"engine-{top}")
        assert engine["build_config"]["gather_generation_logits"] is gathered
        assert LLMEngineBuild.read(tmp_path / f"engine-{top}").gather_generation_logits is gathered


def test_parallel_build_workers_build_each_rank_from_our_class(bf16_checkpoints, trtllm_standin, tmp_path):
    """--workers 2 over a tp=2 checkpoint: upstream's spawn pool, whose fresh processes import TensorRT-LLM (MODEL_MAP
    without our architecture), unpickle the config and import the model class; each builds its rank."""
    ckpt = bf16_checkpoints["dense-fp32-tp2"]
    _, config = read_trtllm_config(ckpt)
    argv = launcher_command(str(ckpt), str(tmp_path / "engine"), config, LIMITS)[3:]
    assert argv[argv.index("--workers") + 1] == "2"
    result = _launch(argv, trtllm_standin, gpus=2)
    assert result.returncode == 0, result.stderr[-3000:]
    engine, ranks = _engine(tmp_path / "engine")
    assert sorted(ranks) == [0, 1] and {r["gpu_id"] for r in ranks.values()} == {0, 1}
    assert all(r["model_class"].endswith("engine_model.Qwen3VLForCausalLM") for r in ranks.values())
    assert engine["pretrained_config"]["mapping"]["world_size"] == 2
    assert engine["pretrained_config"]["architecture"] == trtllm_model.ARCHITECTURE


def test_timing_cache_is_written_into_the_engine_directory(bf16_checkpoints, trtllm_standin, tmp_path):
    """trtllm-build's build() saves TensorRT's timing cache from rank 0 to BuildConfig.output_timing_cache, by default
    "model.cache" in the working directory, after TensorRT built and before the engine is saved (builder.py): a
    read-only working directory lost the engine. The launcher passes a path in the output directory; the working
    directory stays untouched."""
    ckpt = bf16_checkpoints["dense"]
    _, config = read_trtllm_config(ckpt)
    engine_dir, cwd = tmp_path / "engine", tmp_path / "cwd"
    cwd.mkdir()
    argv = launcher_command(str(ckpt), str(engine_dir), config, LIMITS)[3:]
    result = _launch(argv, trtllm_standin, cwd=cwd)
    assert result.returncode == 0, result.stderr[-3000:]
    assert list(cwd.iterdir()) == []
    assert (engine_dir / engine_build.TIMING_CACHE_FILE).is_file()
    engine, _ = _engine(engine_dir)
    assert engine["build_config"]["output_timing_cache"] == str(engine_dir / engine_build.TIMING_CACHE_FILE)


def _converted_as(checkpoint: Path, out: Path, quant_algo: str | None, kv_cache_quant_algo: str | None) -> Path:
    """A copy of a converted checkpoint whose config.json declares other quantization (what the build checks
    before reading any weights)."""
    shutil.copytree(checkpoint, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization"] |= {"quant_algo": quant_algo, "kv_cache_quant_algo": kv_cache_quant_algo}
    (out / "config.json").write_text(json.dumps(cfg))
    return out


@pytest.mark.parametrize(
    "quant_algo, kv, refused",
    [("W8A16", None, "weight-only"), ("W4A16", None, "weight-only"), (None, "INT8", "INT8 KV cache")],
)
def test_build_refuses_int8_int4_for_sm100_to_sm119_before_trtllm_build(
    bf16_checkpoints, tmp_path, monkeypatch, quant_algo, kv, refused
):
    """A checkpoint converted for another GPU (or with no --gpu-arch): on a GPU host of sm100-sm119 build-llm-engine
    refuses what TensorRT-LLM's builder refuses there only after loading the weights (builder.py, build), before
    launching it; on sm90 and sm120 it launches."""
    ckpt = _converted_as(bf16_checkpoints["dense"], tmp_path / "ckpt", quant_algo, kv)
    launched: list[list[str]] = []

    def run(command, check):
        launched.append(command)
        return subprocess.CompletedProcess(command, 0)

    monkeypatch.setattr(engine_build, "gpu_stack_problem", lambda: None)
    monkeypatch.setattr(engine_build.subprocess, "run", run)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the GPU host's device, as CUDA reports it
    for arch in (100, 103):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, arch=arch: divmod(arch, 10))
        with pytest.raises(UnsupportedModelError, match=f"builds no INT8/INT4 {refused}|builds no {refused}") as e:
            engine_build.build_llm_engine(ckpt, tmp_path / "engine", LIMITS)
        assert f"sm{arch}" in str(e.value) and "convert it again with --" in str(e.value)
    assert launched == [] and not (tmp_path / "engine").exists()
    for arch in (90, 120):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, arch=arch: divmod(arch, 10))
        engine_build.build_llm_engine(ckpt, tmp_path / f"engine{arch}", LIMITS)
    assert len(launched) == 2


def test_launcher_refuses_flags_it_does_not_apply(bf16_checkpoints, trtllm_standin, tmp_path):
    _, config = read_trtllm_config(bf16_checkpoints["dense"])
    argv = launcher_command(str(bf16_checkpoints["dense"]), str(tmp_path / "engine"), config, LIMITS)[3:]
    result = _launch([*argv, "--gather_context_logits"], trtllm_standin)
    assert result.returncode == 2 and "unrecognized arguments: --gather_context_logits" in result.stderr
    assert not (tmp_path / "engine").exists()


def test_deepstack_index_is_one_function():
    """The engine model and the reference runtime use the same row arithmetic, and it addresses
    the table preprocessing builds: main embedding, then the K DeepStack features per token."""
    assert trtllm_model.prompt_table_row is llm_inputs.prompt_table_row
    assert reference_llm.prompt_table_row is llm_inputs.prompt_table_row
    vocab, k, m, d = 1000, 3, 5, 8
    ids = np.array([1, 2, 151655, 151655, 7, 151655, 151655, 151655, 9])
    fake = torch.from_numpy(llm_inputs.fake_prompt_ids(ids, 151655, vocab, k).astype(np.int64))
    image = torch.randn(m, d)
    deepstack = torch.randn(k, m, d)
    table = llm_inputs.interleave_prompt_table(image, deepstack)
    visual = fake[fake >= vocab]
    assert torch.equal(table[llm_inputs.prompt_table_row(visual, vocab)], image)
    for layer in range(k):
        assert torch.equal(table[llm_inputs.prompt_table_row(visual, vocab, layer)], deepstack[layer])
