"""Exported vision encoder (ONNX Runtime, fp32) against the transformers tower, on processor inputs."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import CHECKPOINTS, random_pixels
from PIL import Image
from qwen3vl_trt.vision.export import FP32_REL_TOLERANCE as PARITY_TOLERANCE
from transformers import AutoImageProcessor


def _image(h: int, w: int, seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def _process(model_dir, images, min_pixels=None):
    processor = AutoImageProcessor.from_pretrained(model_dir)
    kwargs = {}
    if min_pixels is not None:
        kwargs["size"] = {"shortest_edge": min_pixels, "longest_edge": 16777216}
    out = processor(images=images, return_tensors="pt", **kwargs)
    return out["pixel_values"], out["image_grid_thw"]


CASES = {
    "one image": lambda d: _process(d, [_image(64, 96, 0)]),
    "three images of different sizes": lambda d: _process(
        d, [_image(64, 64, 1), _image(96, 160, 2), _image(256, 128, 3)]
    ),
    "non-square grid": lambda d: _process(d, [_image(32, 320, 4)], min_pixels=1024),
    "smallest grid (2x2 patches)": lambda d: _process(d, [_image(32, 32, 5)], min_pixels=1024),
}


@pytest.mark.parametrize("tower", list(CHECKPOINTS))
@pytest.mark.parametrize("case", list(CASES))
def test_images_match_transformers(tower, case, checkpoints, parity):
    pixel_values, grid_thw = CASES[case](checkpoints[tower])
    if case == "smallest grid (2x2 patches)":
        assert grid_thw.tolist() == [[1, 2, 2]]
    if case == "non-square grid":
        assert grid_thw[0, 1] != grid_thw[0, 2]
    errors = parity(tower).errors(pixel_values, grid_thw)
    assert max(errors.values()) <= PARITY_TOLERANCE, errors


@pytest.mark.parametrize("tower", list(CHECKPOINTS))
def test_video_plus_image_matches_transformers(tower, parity):
    grid = np.array([[3, 4, 6], [1, 6, 4]])  # a 3-frame-pair video, then an image
    errors = parity(tower).errors(random_pixels(grid, seed=7), grid)
    assert max(errors.values()) <= PARITY_TOLERANCE, errors


def test_concatenated_requests_equal_separate_runs(parity):
    """The per-patch host inputs concatenate: one batched run equals one run per request."""
    encoder = parity("dense").encoder
    grids = [np.array([[1, 4, 6]]), np.array([[2, 2, 2], [1, 8, 4]])]
    pixels = [random_pixels(g, seed=i) for i, g in enumerate(grids)]
    separate = [encoder.encode(p, g) for p, g in zip(pixels, grids, strict=False)]
    feeds = [encoder.inputs_for(p, g) for p, g in zip(pixels, grids, strict=False)]
    batched = encoder.run({name: np.concatenate([f[name] for f in feeds]) for name in feeds[0]})
    np.testing.assert_allclose(batched[0], np.concatenate([s[0] for s in separate]), rtol=0, atol=1e-5)
    np.testing.assert_allclose(batched[1], np.concatenate([s[1] for s in separate], axis=1), rtol=0, atol=1e-5)
