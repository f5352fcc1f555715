"""`qwen3vl-trt build`: runs the stages this machine can run and records them in a manifest."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from . import __version__
from .checkpoint import Checkpoint
from .export_vision import export_vision
from .fsutil import atomic_output_dir

MANIFEST_FILE = "manifest.json"


def build(
    model_dir: str | os.PathLike[str],
    output_dir: str | os.PathLike[str],
    dtype: str = "fp32",
    force: bool = False,
    log=print,
) -> dict:
    ckpt = Checkpoint(model_dir)
    ckpt.verify_shards()
    stages = []
    with atomic_output_dir(output_dir, force=force) as tmp:
        start = time.perf_counter()
        # Parity against transformers runs in fp32 only; other dtypes are checked structurally.
        result = export_vision(ckpt, tmp / "vision", dtype=dtype, verify=dtype == "fp32", log=log)
        stages.append(
            {
                "stage": "vision-onnx",
                "status": "done",
                "output": "vision",
                "seconds": round(time.perf_counter() - start, 1),
                "verification": result.sidecar.get("verification", {}).get("max_rel_error"),
            }
        )
        manifest = {
            "qwen3vl_trt": __version__,
            "model": str(Path(model_dir).absolute()),
            "model_type": ckpt.info.model_type,
            "size": ckpt.info.size_name,
            "stages": stages,
        }
        (tmp / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n")
    for stage in stages:
        log(f"stage {stage['stage']}: {stage['status']} ({stage['seconds']}s) -> {Path(output_dir) / stage['output']}")
    return manifest
