"""The bf16 vision export against the transformers tower run in bf16, on the same inputs.

ONNX Runtime's CPU provider has no bf16 kernels (no bf16 Gemm; OnnxVisionRunner refuses the export),
so the graph runs on ONNX's own reference evaluator (`onnx.reference`), which executes each op with
the graph's declared dtypes.

Tolerance: max |ours - transformers bf16| / max |transformers bf16| <= 2e-2 for image and DeepStack
embeddings. Measured on the tiny towers (head_dim 64 and 72): at most 7.6e-3. For scale, transformers'
own bf16 tower differs from its fp32 tower by up to 9.5e-3 on the same inputs (bf16 keeps 8 bits of
mantissa: one rounding step is 3.9e-3 relative), and the export must not lose more against fp32
than twice what transformers' bf16 run loses (measured: 7.9e-3 vs 7.5e-3 at worst).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch
from conftest import random_pixels
from onnx.reference import ReferenceEvaluator
from qwen3vl_trt.common.contracts import DEEPSTACK_EMBEDS, IMAGE_EMBEDS, PIXEL_VALUES, VISION_ONNX_FILE
from qwen3vl_trt.hf.checkpoint import Checkpoint
from qwen3vl_trt.hf.reference import load_hf_vision_tower, run_hf_vision_tower
from qwen3vl_trt.vision.export import export_vision, parity_errors
from qwen3vl_trt.vision.metadata import vision_metadata
from qwen3vl_trt.vision.onnx_runner import VisionSidecar

BF16_TOLERANCE = 2e-2
LOSS_FACTOR = 2.0  # the export's error against fp32 may be at most this times transformers' own bf16 error
TOWERS = ("dense", "dense-hd72")
GRIDS = {
    "one image": np.array([[1, 4, 6]]),
    "large grid (rotary positions up to 23)": np.array([[1, 16, 24]]),
    "video and image": np.array([[2, 4, 4], [1, 8, 6]]),
}


def _quiet(*_args, **_kwargs) -> None:
    pass


class Bf16Parity:
    """The bf16 export (ONNX reference evaluator) and transformers' tower in bf16 and fp32."""

    def __init__(self, model_dir, onnx_dir):
        self.sidecar = VisionSidecar.load(onnx_dir)
        assert self.sidecar.dtype == "bf16"
        self.graph = ReferenceEvaluator(str(onnx_dir / VISION_ONNX_FILE))
        self.fp32 = load_hf_vision_tower(Checkpoint(model_dir))
        self.bf16 = load_hf_vision_tower(Checkpoint(model_dir)).to(torch.bfloat16)

    def run(self, pixel_values: np.ndarray, grid_thw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        feeds = {PIXEL_VALUES.name: pixel_values}
        feeds |= vision_metadata(grid_thw, self.sidecar.spatial_merge_size, self.sidecar.num_grid_per_side)
        outputs = self.graph.run([IMAGE_EMBEDS.name, DEEPSTACK_EMBEDS.name], feeds)
        assert all(o.dtype == ml_dtypes.bfloat16 for o in outputs)
        image_embeds, deepstack_embeds = (o.astype(np.float32) for o in outputs)
        return image_embeds, deepstack_embeds


@pytest.fixture(scope="module")
def bf16_parity(checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("vision-bf16")
    return {
        tower: Bf16Parity(
            checkpoints[tower], export_vision(checkpoints[tower], root / tower, dtype="bf16", log=_quiet).output_dir
        )
        for tower in TOWERS
    }


def _relative_errors(actual: tuple[np.ndarray, ...], expected: tuple[np.ndarray, ...]) -> list[float]:
    return [parity_errors(a, e)[1] for a, e in zip(actual, expected, strict=True)]


@pytest.mark.parametrize("grid", list(GRIDS))
@pytest.mark.parametrize("tower", TOWERS)
def test_bf16_export_matches_transformers_bf16(bf16_parity, tower, grid):
    parity = bf16_parity[tower]
    grid_thw = GRIDS[grid]
    pixels = random_pixels(grid_thw, seed=11)
    ours = parity.run(pixels, grid_thw)
    theirs_bf16 = run_hf_vision_tower(parity.bf16, pixels, grid_thw)
    theirs_fp32 = run_hf_vision_tower(parity.fp32, pixels, grid_thw)
    assert [o.shape for o in ours] == [t.shape for t in theirs_bf16]
    against_bf16 = _relative_errors(ours, theirs_bf16)
    assert max(against_bf16) <= BF16_TOLERANCE, against_bf16
    ours_loss, their_loss = _relative_errors(ours, theirs_fp32), _relative_errors(theirs_bf16, theirs_fp32)
    assert max(ours_loss) <= LOSS_FACTOR * max(their_loss), (ours_loss, their_loss)
