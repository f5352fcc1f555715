"""build-llm-engine: the TensorRT-LLM engine of a converted checkpoint.

trtllm-build finds a model class by the checkpoint's `architecture`, and Qwen3VLForCausalLM is ours
(engine_model.py), so the build runs through this module's launcher, `python -m
qwen3vl_trt.llm.engine_build`, with trtllm-build's flag names for the limits and plugins derived
here from the EngineLimits. The launcher does what trtllm-build's main() does on the 1.2 line
(`tensorrt_llm/commands/build.py` after PR #8330: BuildConfig and PluginConfig are pydantic models,
built with keyword arguments) with these differences, all made before the build:

- the model config is Qwen3VLForCausalLM.config_class (QWenConfig) built from config.json directly.
  trtllm-build's `PretrainedConfig.from_json_file` -> `from_dict` looks `config["architecture"]` up
  in TensorRT-LLM's MODEL_MAP (`tensorrt_llm/models/modeling_utils.py`: `model_cls =
  MODEL_MAP[config['architecture']]; config_cls = getattr(model_cls, 'config_class', cls);
  return config_cls(**config)`), where our architecture is not (KeyError); this is that body
  without the lookup. MODEL_MAP stays as it is;
- it passes Qwen3VLForCausalLM to parallel_build as its model class, so `--workers N` builds the
  TP x PP ranks in N spawned processes, each of which unpickles the config object and imports the
  class from this package; build_model uses the class it is given (`model_cls or
  MODEL_MAP[architecture]`) and `from_checkpoint(ckpt_dir, config=rank_config)` does not read
  config.json again, so no worker looks our architecture up either;
- its BuildConfig has `use_mrope` on, as trtllm-build sets it for qwen_type qwen2_vl only: it tells
  the C++ runtime to feed the engine's two mrope inputs;
- the model config's max_position_embeddings is max_seq_len: the engine's per-request mrope table
  is max_position_embeddings x rotary_dim float32 values (262144 x 128 on the released models would
  be 128 MiB per request), and attention needs max_seq_len positions at most. The engine's
  config.json records the value for the host;
- its BuildConfig's output_timing_cache is `--output_timing_cache`, a file in the output directory: the default,
  "model.cache", is relative to the working directory, and build() writes it from rank 0 after TensorRT built the
  engine and before the engine is saved (`builder.py`, build), so a read-only working directory lost the engine.

The checkpoint's rotary scaling type is mrope already (checkpoint_format.trtllm_config), as
QWenConfig writes it for qwen2_vl. tests/trtllm_standin models each of these upstream behaviours.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from ..common.fsutil import atomic_output_dir
from ..common.limits import EngineLimits
from ..errors import GpuStackMissingError, Qwen3VLTrtError
from .checkpoint_format import LLMConfig, check_deepstack_stage, read_trtllm_config
from .precision import check_engine_arch, visible_gpu_arch

LAUNCHER = "qwen3vl_trt.llm.engine_build"
# BuildConfig fields that the launcher reads from the trtllm-build flags of the same names.
BUILD_LIMIT_FIELDS = (
    "max_batch_size",
    "max_input_len",
    "max_seq_len",
    "max_num_tokens",
    "max_beam_width",
    "max_prompt_embedding_table_size",
)
GATHER_GENERATION_LOGITS = "--gather_generation_logits"
TIMING_CACHE_FILE = "timing.cache"  # in the engine directory: TensorRT's timing cache of the build


def check_buildable(config: LLMConfig, build: EngineLimits) -> None:
    """Refuses limits the model cannot serve and pipeline splits the engine model cannot run."""
    if build.max_seq_len > config.max_position_embeddings:
        raise Qwen3VLTrtError(
            f"max_seq_len {build.max_seq_len} exceeds the model's {config.max_position_embeddings} positions"
        )
    check_deepstack_stage(config.num_hidden_layers, config.deepstack_count, config.mapping)


def trtllm_build_flags(checkpoint_dir: str, output_dir: str, config: LLMConfig, build: EngineLimits) -> list[str]:
    """The launcher's flags (trtllm-build's names, TensorRT-LLM 1.2.1) for this checkpoint and these limits."""
    check_buildable(config, build)
    plugin_dtype = config.dtype  # the checkpoint's: bfloat16, float16 or float32
    # TensorRT-LLM's fused context attention has fp16/bf16 kernels only; fp32 engines run the unfused
    # context path (and, without paged context FMHA, cannot reuse KV cache blocks).
    fused_context = "disable" if config.dtype == "float32" else "enable"
    # Quantized KV caches without paged context FMHA: the builder turns it off for an INT8 cache, and for an FP8 cache
    # unless the weights are FP8 too (builder.py, build); so do we, and the engine's config says what it has
    # (serving.repository.trtllm_config reads it). Without it a prompt is not chunked, so a step must hold a whole
    # prompt: max_num_tokens is raised to max_input_len (trtllm-build does so itself without context FMHA).
    kv = config.kv_cache_quant_algo
    no_paged = kv == "INT8" or (kv == "FP8" and config.quant_algo != "FP8")
    paged_context = "disable" if no_paged else fused_context
    max_num_tokens = (
        max(build.max_num_tokens, build.max_input_len) if paged_context == "disable" else build.max_num_tokens
    )
    flags = {
        "--checkpoint_dir": checkpoint_dir,
        "--output_dir": output_dir,
        "--max_batch_size": build.max_batch_size,
        "--max_input_len": build.max_input_len,
        "--max_seq_len": build.max_seq_len,
        "--max_num_tokens": max_num_tokens,
        "--max_beam_width": 1,
        "--max_prompt_embedding_table_size": build.prompt_table_rows(config.deepstack_count),
        "--kv_cache_type": "paged",
        "--tokens_per_block": build.tokens_per_block,
        "--use_paged_context_fmha": paged_context,
        "--context_fmha": fused_context,
        "--remove_input_padding": "enable",
        "--output_timing_cache": str(Path(output_dir) / TIMING_CACHE_FILE),
        "--gpt_attention_plugin": plugin_dtype,
        "--gemm_plugin": plugin_dtype,
        # One build process per rank; the launcher caps it at the GPUs it sees.
        "--workers": config.mapping.world_size,
    }
    if config.moe is not None:
        flags["--moe_plugin"] = plugin_dtype
    argv = [str(item) for pair in flags.items() for item in pair]
    # The tensorrtllm backend returns generation logits (top_logprobs) only from an engine built to gather them: its
    # executor config never sets gatherGenerationLogits, so the engine's build_config must.
    return [*argv, GATHER_GENERATION_LOGITS] if build.max_top_logprobs else argv


def launcher_command(checkpoint_dir: str, output_dir: str, config: LLMConfig, build: EngineLimits) -> list[str]:
    """The whole command: this module's launcher and its flags."""
    return [sys.executable, "-m", LAUNCHER, *trtllm_build_flags(checkpoint_dir, output_dir, config, build)]


def gpu_stack_problem() -> str | None:
    """Why an engine cannot be built here, or None."""
    from .engine_model import TRTLLM_IMPORT_ERROR

    if TRTLLM_IMPORT_ERROR is not None:
        return f"tensorrt_llm is not importable ({TRTLLM_IMPORT_ERROR})"
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device is visible (trtllm-build needs a GPU)"
    return None


def build_llm_engine(
    checkpoint_dir: str | os.PathLike[str],
    output: str | os.PathLike[str],
    build: EngineLimits | None = None,
    force: bool = False,
) -> Path:
    """Builds the engine into `output` (atomically) and returns it."""
    build = build or EngineLimits()
    _, config = read_trtllm_config(checkpoint_dir)
    check_buildable(config, build)
    problem = gpu_stack_problem()
    if problem is not None:
        raise GpuStackMissingError(
            f"cannot build the LLM engine here: {problem}. Build on a GPU host with TensorRT-LLM 1.2.1 "
            "(pip install 'qwen3vl-trt[gpu]', or the NGC Triton TRT-LLM container); `qwen3vl-trt "
            "build-llm-engine ... --print-command` prints the exact command to run there"
        )
    arch = visible_gpu_arch()
    assert arch is not None  # gpu_stack_problem found a CUDA device
    check_engine_arch(config.quant_algo, config.kv_cache_quant_algo, arch)
    with atomic_output_dir(output, force=force, inputs=[checkpoint_dir]) as tmp:
        command = launcher_command(str(Path(checkpoint_dir).absolute()), str(tmp), config, build)
        print("+ " + shlex.join(command), flush=True)
        result = subprocess.run(command, check=False)
        if result.returncode != 0:
            raise Qwen3VLTrtError(f"trtllm-build failed with exit code {result.returncode}; its output is above")
    return Path(output)


# -- the launcher (runs on the GPU host) ---------------------------------------------------------------------


def launcher_arguments(
    argv: Sequence[str] | None, add_plugin_argument: Callable[[argparse._ArgumentGroup], object]
) -> argparse.Namespace:
    """The launcher's flags: the trtllm-build flags that trtllm_build_flags writes, and TensorRT-LLM's
    own plugin flags (`add_plugin_argument`); any other flag is refused."""
    parser = argparse.ArgumentParser(
        prog=f"python -m {LAUNCHER}", description="trtllm-build for checkpoints written by qwen3vl-trt convert-llm"
    )
    parser.add_argument("--checkpoint_dir", required=True)
    parser.add_argument("--output_dir", required=True)
    for name in BUILD_LIMIT_FIELDS:
        parser.add_argument(f"--{name}", type=int, required=True)
    parser.add_argument("--kv_cache_type", choices=["paged"], required=True)
    parser.add_argument("--output_timing_cache", required=True)
    parser.add_argument(GATHER_GENERATION_LOGITS, action="store_true")
    parser.add_argument("--workers", type=int, default=1, help="build processes (capped at the visible GPUs)")
    add_plugin_argument(parser.add_argument_group("plugin config arguments"))
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    problem = gpu_stack_problem()
    if problem is not None:
        print(f"{LAUNCHER}: cannot build here: {problem}", file=sys.stderr)
        return GpuStackMissingError.exit_code
    return launch(argv)


def launch(argv: Sequence[str] | None) -> int:
    """Builds every rank's engine with TensorRT-LLM (imported here: the GPU host has it)."""
    import torch
    from tensorrt_llm.builder import BuildConfig
    from tensorrt_llm.commands.build import parallel_build
    from tensorrt_llm.llmapi.kv_cache_type import KVCacheType
    from tensorrt_llm.plugin import PluginConfig, add_plugin_argument

    from .engine_model import Qwen3VLForCausalLM

    args = launcher_arguments(argv, add_plugin_argument)
    # As trtllm-build's main() does first: the build writes the timing cache into it before any engine is saved.
    Path(args.output_dir).mkdir(parents=True, exist_ok=True)
    # from_json_file's one step besides from_dict reads quant_cfg.json for MIXED_PRECISION checkpoints; convert-llm
    # writes none (its quant_algo is null, W8A16, W4A16 or FP8), so there is nothing to read.
    checkpoint_config, _ = read_trtllm_config(args.checkpoint_dir)
    model_config = Qwen3VLForCausalLM.config_class(**checkpoint_config)
    model_config.max_position_embeddings = args.max_seq_len
    plugin_config = PluginConfig.from_arguments(args)
    plugin_config.validate()
    build_config = BuildConfig(
        **{name: getattr(args, name) for name in BUILD_LIMIT_FIELDS},
        kv_cache_type=KVCacheType(args.kv_cache_type),
        output_timing_cache=args.output_timing_cache,
        gather_generation_logits=args.gather_generation_logits,
        use_mrope=True,
        plugin_config=plugin_config,
    )
    parallel_build(
        model_config,
        args.checkpoint_dir,
        build_config,
        args.output_dir,
        workers=min(args.workers, torch.cuda.device_count()),
        model_cls=Qwen3VLForCausalLM,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
