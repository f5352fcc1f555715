"""build-llm-engine: trtllm-build flags from the EngineLimits, the GPU-host command, the launcher's
checkpoint view, and the DeepStack index arithmetic shared by the engine model and the runtime."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys

import numpy as np
import pytest
import torch
from qwen3vl_trt.errors import Qwen3VLTrtError
from qwen3vl_trt.limits import EngineLimits
from qwen3vl_trt.llm import engine_model as trtllm_model
from qwen3vl_trt.llm import inputs as llm_inputs
from qwen3vl_trt.llm.checkpoint_format import read_trtllm_config
from qwen3vl_trt.llm.convert import convert_llm
from qwen3vl_trt.llm.engine_build import _checkpoint_view, _record_use_mrope, trtllm_build_flags
from qwen3vl_trt.runtime import reference_llm

LIMITS = EngineLimits(
    max_batch_size=4, max_input_len=2048, max_seq_len=4096, max_num_tokens=8192, max_visual_tokens=1024
)


@pytest.fixture(scope="module")
def bf16_checkpoints(checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("engine-ckpt")
    return {name: convert_llm(checkpoints[name], root / name, progress=False) for name in ("dense", "moe")}


def _flags(argv: list[str]) -> dict[str, str]:
    assert len(argv) % 2 == 0 and all(a.startswith("--") for a in argv[::2])
    return dict(zip(argv[::2], argv[1::2], strict=True))


@pytest.mark.parametrize("name", ["dense", "moe"])
def test_flags_derive_from_the_build_config(name, bf16_checkpoints):
    _, config = read_trtllm_config(bf16_checkpoints[name])
    flags = _flags(trtllm_build_flags("/ckpt", "/engine", config, LIMITS))
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
        "--use_paged_context_fmha": "enable",
        "--context_fmha": "enable",
        "--remove_input_padding": "enable",
        "--gpt_attention_plugin": "bfloat16",
        "--gemm_plugin": "bfloat16",
        "--workers": "1",
        **({"--moe_plugin": "bfloat16"} if name == "moe" else {}),
    }


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
    assert argv[3:5] == ["--max_position_embeddings", str(EngineLimits().max_seq_len)]
    flags = _flags(argv[5:])
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


def test_launcher_builds_from_a_view_with_engine_positions(bf16_checkpoints, tmp_path):
    ckpt = bf16_checkpoints["moe"]
    view = tmp_path / "view"
    view.mkdir()
    _checkpoint_view(ckpt, view, 4096)
    cfg, config = read_trtllm_config(view)
    original, _ = read_trtllm_config(ckpt)
    assert config.max_position_embeddings == 4096 and cfg == original | {"max_position_embeddings": 4096}
    assert (view / "rank0.safetensors").resolve() == (ckpt / "rank0.safetensors").resolve()
    engine = tmp_path / "engine"
    engine.mkdir()
    (engine / "config.json").write_text(json.dumps({"build_config": {"use_mrope": False}, "pretrained_config": {}}))
    _record_use_mrope(engine)
    assert json.loads((engine / "config.json").read_text())["build_config"]["use_mrope"] is True


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
