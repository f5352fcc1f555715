"""The GPU acceptance's checks of a build and of the GPU it runs on (build/qa/acceptance.py), on this machine: what the
fp32 and chunked-context rows read of a GPU build (the LLM engine's config.json and the repository's `llm` config, as
the repository writer writes it), which server log lines count as tensors that missed the CUDA memory pool, and the
rows' needs of the visible GPUs; the int4-wo row's limit between int4 rounding and a wrong layout; and
scripts/device_check.sh's rows (their measurements run on the CPU, where the script itself exits 3)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from deployment import LIMITS
from qwen3vl_trt.common.contracts import BuildLayout
from qwen3vl_trt.common.limits import RequestLimits
from qwen3vl_trt.llm import precision
from qwen3vl_trt.llm.convert import convert_llm
from qwen3vl_trt.llm.weight_only import SCALE_NAME, WeightOnly
from qwen3vl_trt.preprocess import Preprocessor
from qwen3vl_trt.preprocess.videos import decode_frames, probe_video
from qwen3vl_trt.qa import acceptance
from qwen3vl_trt.qa.acceptance import CHUNK_TOKENS, LOGIT_GAP, QUANT_LOGIT_GAPS, Variant
from qwen3vl_trt.qa.tiny import synthetic_jpeg
from qwen3vl_trt.runtime import LLMRequest, ReferenceLLM, SamplingParams
from qwen3vl_trt.serving import interface
from qwen3vl_trt.serving.repository import model_config
from qwen3vl_trt.serving.repository.gpu_memory import ENGINE_CONFIG_FILE
from qwen3vl_trt.serving.repository.trtllm_config import tensorrt_llm_model_config
from safetensors.torch import load_file, save_file


def gpu_build(root: Path, paged_context_fmha: bool, max_num_tokens: int) -> Path:
    """A build directory's LLM engine config.json (trtllm-build's keys) and its repository's `llm` config as
    write-repo writes it for that engine."""
    layout = BuildLayout(root)
    layout.llm_engine.mkdir(parents=True)
    plugins = {"use_paged_context_fmha": paged_context_fmha}
    engine = {"build_config": {"max_num_tokens": max_num_tokens, "plugin_config": plugins}}
    (layout.llm_engine / ENGINE_CONFIG_FILE).write_text(json.dumps(engine))
    llm = tensorrt_llm_model_config(
        layout.llm_engine, LIMITS, "BF16", root, root / "tokenizer_info.json", 0, paged_context_fmha
    )
    (layout.triton_repo / interface.LLM).mkdir(parents=True)
    model_config.write(layout.triton_repo / interface.LLM, llm)
    return root


@pytest.fixture(scope="module")
def jpeg_variant(checkpoints):
    jpeg = ("Describe this picture.", [synthetic_jpeg(480, 640, seed=5)])
    dense = checkpoints["dense"]
    return Variant("dense", dense, dense, LOGIT_GAP, "served", (jpeg,))


def test_the_fp32_row_wants_paged_context_fmha_kv_cache_reuse_and_chunked_context_off(tmp_path, jpeg_variant):
    off = acceptance._no_reuse_no_chunks(gpu_build(tmp_path / "fp32", False, 1024), jpeg_variant)
    assert off == (True, "paged context FMHA off, KV-cache reuse off, chunked context off")
    on = acceptance._no_reuse_no_chunks(gpu_build(tmp_path / "bf16", True, 1024), jpeg_variant)
    assert on == (False, "paged context FMHA on, KV-cache reuse on, chunked context on")


def test_the_chunked_row_wants_prompts_longer_than_a_step_and_chunked_context_on(tmp_path, jpeg_variant):
    chunked, figure = acceptance._chunked_prompts(gpu_build(tmp_path / "on", True, CHUNK_TOKENS), jpeg_variant)
    (length,) = json.loads(figure.split("prompts of ")[1].split(" tokens")[0])
    assert chunked and length > 2 * CHUNK_TOKENS, figure  # the JPEG's prompt spans three chunks
    assert figure.endswith(f"max_num_tokens {CHUNK_TOKENS}, chunked context on")
    assert not acceptance._chunked_prompts(gpu_build(tmp_path / "off", False, CHUNK_TOKENS), jpeg_variant)[0]
    assert not acceptance._chunked_prompts(gpu_build(tmp_path / "long", True, length), jpeg_variant)[0]


# Log lines as r26.04 writes them (core src/memory.cc and src/pinned_memory_manager.cc, python_backend
# src/infer_response.cc and src/python_be.cc), and as tritonserver 2.51 writes them on every CPU machine.
MISSED_THE_POOL = [
    'W1206 memory.cc:211] "Failed to allocate memory: out of CUDA memory pool, falling back to pinned system memory"',
    "E1206 infer_response.cc:346] Failed to allocate memory from CUDA memory pool, will use CUDA IPC for GPU output "
    "transfer.",
    "E1206 python_be.cc:2015] Failed to get the CUDA memory pool. Will use CUDA IPC.",
]
NO_PINNED_POOL = [
    'W1206 pinned_memory_manager.cc:273] "Unable to allocate pinned system memory, pinned memory pool will not be '
    'available: CUDA driver version is insufficient for CUDA runtime version"',
    'W1206 pinned_memory_manager.cc:170] "failed to allocate pinned system memory: no pinned memory pool, falling '
    'back to non-pinned system memory"',
    "I1206 pinned_memory_manager.cc:199] pinned memory allocation: size 1024, addr 0x7f0000000000",
]


def test_only_tensors_that_missed_the_cuda_memory_pool_count_as_misses():
    assert all(acceptance._POOL_MISS.search(line) for line in MISSED_THE_POOL)
    assert not any(acceptance._POOL_MISS.search(line) for line in NO_PINNED_POOL)


@pytest.mark.parametrize(
    ("quant", "kv", "arch", "reason"),
    [
        ("fp8", "auto", None, "no CUDA device is visible"),
        ("fp8", "auto", 80, "needs a GPU of sm89 or newer"),
        ("fp8", "fp8", 90, None),
        ("none", "int8", 90, None),
        ("none", "int8", 100, "INT8 KV cache"),
        ("int4-wo", "auto", 80, None),
    ],
)
def test_a_quantized_row_needs_a_gpu_its_build_takes(monkeypatch, quant, kv, arch, reason):
    monkeypatch.setattr(precision, "visible_gpu_arch", lambda: arch)
    missing = acceptance._gpu_takes(quant, kv)()
    assert missing is None if reason is None else reason in missing, missing


@pytest.mark.parametrize(
    ("visible", "reason"), [(0, "no CUDA device is visible (it needs 2)"), (1, "it needs 2 GPUs, 1 visible"), (2, None)]
)
def test_the_tp_row_needs_two_gpus(monkeypatch, visible, reason):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    assert acceptance._gpus(2)() == reason


def _worst_gap(reference: ReferenceLLM, llm: ReferenceLLM, prompt_ids: np.ndarray) -> float:
    """The largest gap of `llm`'s greedy tokens after the prompt, scored teacher-forced by `reference` (text only:
    plain positions are the prompt's mrope positions)."""
    (result,) = llm.generate([LLMRequest(prompt_ids, sampling=SamplingParams(max_new_tokens=acceptance.NEW_TOKENS))])
    ids = np.concatenate([prompt_ids, np.asarray(result.output_ids, np.int32)])
    steps = reference.prompt_logits(LLMRequest(ids))[len(prompt_ids) - 1 : -1]
    return max(acceptance.logit_gaps(steps, result.output_ids))


def _channels_swapped(checkpoint: Path, output: Path) -> Path:
    """The int4-wo checkpoint read in a wrong layout: every weight-only linear's adjacent output channels swapped (its
    low and high nibbles taken the other way round)."""
    shutil.copytree(checkpoint, output)
    scheme = WeightOnly(4)
    for shard in output.glob("rank*.safetensors"):
        state = load_file(str(shard))
        for name in [n for n in state if n.endswith(".weight") and n.replace("weight", SCALE_NAME) in state]:
            q = scheme.from_stored(state[name])
            state[name] = scheme.to_stored(q.view(-1, 2, q.shape[-1]).flip(1).reshape(q.shape))
        save_file(state, str(shard))
    return output


@pytest.mark.slow
@pytest.mark.once
def test_the_int4_limit_passes_int4_rounding_and_fails_a_wrong_layout(tmp_path):
    """The int4-wo row's limit against the gaps it must tell apart, on the row's own block-FP8 checkpoint (a text
    request): the reference runtime's tokens on its int4-wo conversion and on that conversion read in a wrong layout,
    each scored by the FP8 weights dequantized in fp32 (what transformers on the bf16 twin scores: the same here)."""
    fp8, _ = acceptance._block_fp8_checkpoint(tmp_path, moe=False)
    reference = ReferenceLLM.from_checkpoint(convert_llm(fp8, tmp_path / "fp32", dtype="fp32", progress=False))
    int4 = convert_llm(fp8, tmp_path / "int4", dtype="bf16", quant="int4-wo", progress=False)
    prompt = Preprocessor.from_pretrained(fp8)([acceptance._user_message("Describe a sunset in three words.", [])])
    gaps = {
        name: _worst_gap(reference, ReferenceLLM.from_checkpoint(path), prompt.engine_input_ids)
        for name, path in (("int4-wo", int4), ("wrong layout", _channels_swapped(int4, tmp_path / "swapped")))
    }
    assert 1.5 * gaps["int4-wo"] <= QUANT_LOGIT_GAPS["int4-wo"] <= 0.75 * gaps["wrong layout"], gaps


# -- scripts/device_check.sh's rows ------------------------------------------------------------------------------


class HostFrames:
    """A VideoFrameDecoder that decodes on this host (FFmpeg), in chunks as NVDEC hands them over."""

    device = torch.device("cpu")

    def decode(self, data: bytes, indices):
        header = probe_video(data, 0, RequestLimits())
        frames = [torch.from_numpy(frame) for _, frame in sorted(decode_frames(data, header, indices))]
        for first in range(0, len(frames), 16):
            yield torch.stack(frames[first : first + 16])


@pytest.mark.once
def test_the_device_checks_measure_on_any_device(checkpoints):
    """Each device row's measurement, run on the CPU: the same decoders and preprocessing there leave no difference."""
    dense = checkpoints["dense"]
    assert acceptance._nvimgcodec_against_pillow("cpu") == ("cpu", 0.0, 0.0)  # its CPU backend is libjpeg-turbo
    assert acceptance._pixels_against_pillow(dense, "cpu") == (0.0, 0.0)
    devices, frames, worst, aligned = acceptance._frames_against_ffmpeg(HostFrames())
    assert (devices, frames, worst, aligned) == (["cpu"], 40, 0.0, True)
    assert acceptance._video_pixels_against_host(dense, "cpu", "pyav") == (True, 0.0, False)


@pytest.mark.once
def test_on_a_cpu_machine_every_device_row_is_skipped_with_its_reason(tmp_path):
    report = acceptance.run_device_check(tmp_path, log=lambda _line: None)
    assert [row.status for row in report.rows] == [acceptance.SKIPPED] * len(report.rows) == [acceptance.SKIPPED] * 8
    assert all("no CUDA device is visible" in row.detail and row.limit for row in report.rows), report.rows
    assert report.exit_code == acceptance.EXIT_SKIPPED


@pytest.mark.once
def test_device_check_sh_exits_3_without_cuda(tmp_path):
    script = Path(__file__).resolve().parents[1] / "scripts" / "device_check.sh"
    result = subprocess.run(
        [str(script)], capture_output=True, text=True, timeout=120, env={**os.environ, "OUT": str(tmp_path)}
    )
    assert result.returncode == 3 and "no CUDA device visible to torch" in result.stderr, result
    assert not list(tmp_path.iterdir())  # nothing ran
