"""The CPU deployment the serving and gateway tests run: small limits keep the too-long-prompt cases
cheap; the serving settings are the defaults (requests arriving together still meet in one batch:
they queue while the model executes the first)."""

from __future__ import annotations

from pathlib import Path

from qwen3vl_trt.limits import EngineLimits
from qwen3vl_trt.pipeline import build
from qwen3vl_trt.serving.repository import RepositorySettings

LIMITS = EngineLimits(
    max_batch_size=8, max_input_len=1024, max_seq_len=2048, max_num_tokens=2048, max_visual_tokens=1024
)
SETTINGS = RepositorySettings()


def _quiet(*_args, **_kwargs) -> None:
    pass


def build_cpu_repository(model_dir: Path, root: Path) -> Path:
    """`qwen3vl-trt build --target cpu` of the checkpoint under root; the Triton model repository's path."""
    build(model_dir, root / "build", llm_dtype="fp32", limits=LIMITS, target="cpu", settings=SETTINGS, log=_quiet)
    return root / "build" / "triton_repo"
