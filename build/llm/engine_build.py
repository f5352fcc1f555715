"""build-llm-engine: the TensorRT-LLM engine of a converted checkpoint, built by trtllm-build.

trtllm-build finds a model class by the checkpoint's `architecture`; Qwen3VLForCausalLM is ours
(trtllm_model.py), so the build runs through this module's launcher, `python -m
qwen3vl_trt.llm.engine_build`, which registers the class in TensorRT-LLM's MODEL_MAP and then runs
trtllm-build's own main() in the same process with the flags derived here from the EngineLimits.
The launcher also:

- builds from a view of the checkpoint whose max_position_embeddings is max_seq_len: the engine's
  per-request mrope table is max_position_embeddings x rotary_dim float32 values (262144 x 128 on
  the released models would be 128 MiB per request), and the attention kernels need max_seq_len
  positions at most;
- records `use_mrope: true` in the engine's build_config (trtllm-build derives it from qwen_type
  qwen2_vl only), which tells the C++ runtime to feed the two mrope inputs the engine declares.

`--workers 1` keeps every rank's build in this process, where the class is registered.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from ..errors import GpuStackMissingError, Qwen3VLTrtError
from ..fsutil import atomic_output_dir
from ..limits import EngineLimits
from .checkpoint_format import ARCHITECTURE, CONFIG_FILE, LLMConfig, rank_file, read_trtllm_config

LAUNCHER = "qwen3vl_trt.llm.engine_build"


def trtllm_build_flags(checkpoint_dir: str, output_dir: str, config: LLMConfig, build: EngineLimits) -> list[str]:
    """trtllm-build's flags (TensorRT-LLM 1.2.1 names) for this checkpoint and these limits."""
    if build.max_seq_len > config.max_position_embeddings:
        raise Qwen3VLTrtError(
            f"max_seq_len {build.max_seq_len} exceeds the model's {config.max_position_embeddings} positions"
        )
    plugin_dtype = config.dtype  # the checkpoint's: bfloat16, float16 or float32
    flags = {
        "--checkpoint_dir": checkpoint_dir,
        "--output_dir": output_dir,
        "--max_batch_size": build.max_batch_size,
        "--max_input_len": build.max_input_len,
        "--max_seq_len": build.max_seq_len,
        "--max_num_tokens": build.max_num_tokens,
        "--max_beam_width": 1,
        "--max_prompt_embedding_table_size": build.prompt_table_rows(config.deepstack_count),
        "--kv_cache_type": "paged",
        "--tokens_per_block": build.tokens_per_block,
        "--use_paged_context_fmha": "enable",
        "--context_fmha": "enable",
        "--remove_input_padding": "enable",
        "--gpt_attention_plugin": plugin_dtype,
        "--gemm_plugin": plugin_dtype,
        "--workers": 1,
    }
    if config.moe is not None:
        flags["--moe_plugin"] = plugin_dtype
    return [str(item) for pair in flags.items() for item in pair]


def launcher_command(checkpoint_dir: str, output_dir: str, config: LLMConfig, build: EngineLimits) -> list[str]:
    """The whole command: this module's launcher, its own flag, then trtllm-build's."""
    return [
        sys.executable,
        "-m",
        LAUNCHER,
        "--max_position_embeddings",
        str(build.max_seq_len),
        *trtllm_build_flags(checkpoint_dir, output_dir, config, build),
    ]


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
    problem = gpu_stack_problem()
    if problem is not None:
        raise GpuStackMissingError(
            f"cannot build the LLM engine here: {problem}. Build on a GPU host with TensorRT-LLM 1.2.1 "
            "(pip install 'qwen3vl-trt[gpu]', or the NGC Triton TRT-LLM container); `qwen3vl-trt "
            "build-llm-engine ... --print-command` prints the exact command to run there"
        )
    with atomic_output_dir(output, force=force) as tmp:
        command = launcher_command(str(Path(checkpoint_dir).absolute()), str(tmp), config, build)
        print("+ " + shlex.join(command), flush=True)
        result = subprocess.run(command, check=False)
        if result.returncode != 0:
            raise Qwen3VLTrtError(f"trtllm-build failed with exit code {result.returncode}; its output is above")
    return Path(output)


# -- the launcher (runs on the GPU host, in the trtllm-build process) ----------------------------------------


def _checkpoint_view(checkpoint_dir: Path, view: Path, max_position_embeddings: int) -> None:
    """`view`: the checkpoint's rank files (linked) and its config with max_position_embeddings replaced."""
    cfg, config = read_trtllm_config(checkpoint_dir)
    cfg["max_position_embeddings"] = max_position_embeddings
    (view / CONFIG_FILE).write_text(json.dumps(cfg, indent=4) + "\n")
    for rank in range(config.mapping.world_size):
        (view / rank_file(rank)).symlink_to((checkpoint_dir / rank_file(rank)).absolute())


def _flag_value(argv: list[str], flag: str) -> str:
    if flag not in argv or argv.index(flag) + 1 >= len(argv):
        raise SystemExit(f"{LAUNCHER}: {flag} is required")
    return argv[argv.index(flag) + 1]


def _record_use_mrope(output_dir: Path) -> None:
    path = output_dir / CONFIG_FILE
    engine = json.loads(path.read_text())
    engine["build_config"]["use_mrope"] = True
    path.write_text(json.dumps(engine, indent=4) + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=f"python -m {LAUNCHER}",
        description="trtllm-build with Qwen3VLForCausalLM registered; other flags go to trtllm-build",
    )
    parser.add_argument("--max_position_embeddings", type=int, required=True)
    args, rest = parser.parse_known_args(argv)
    problem = gpu_stack_problem()
    if problem is not None:
        print(f"{LAUNCHER}: cannot build here: {problem}", file=sys.stderr)
        return GpuStackMissingError.exit_code

    from qwen3vl_trt.llm.engine_model import Qwen3VLForCausalLM
    from tensorrt_llm.commands import build as trtllm_build
    from tensorrt_llm.models import MODEL_MAP

    MODEL_MAP[ARCHITECTURE] = Qwen3VLForCausalLM
    checkpoint = Path(_flag_value(rest, "--checkpoint_dir"))
    output = Path(_flag_value(rest, "--output_dir"))
    with tempfile.TemporaryDirectory(prefix="qwen3vl-trt-ckpt-") as view:
        _checkpoint_view(checkpoint, Path(view), args.max_position_embeddings)
        rest[rest.index("--checkpoint_dir") + 1] = view
        sys.argv = ["trtllm-build", *rest]
        trtllm_build.main()
    _record_use_mrope(output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
