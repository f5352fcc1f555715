"""The GPU path (nvImageCodec decode into device memory, resize and patchify on the GPU), on hosts with
CUDA and nvImageCodec; skipped elsewhere. scripts/gpu_checks.sh runs these with the GPU benchmark."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from images import parity_images
from PIL import Image, ImageOps
from qwen3vl_trt.hf_reference import load_hf_processor
from qwen3vl_trt.preprocess import Preprocessor
from qwen3vl_trt.preprocess.images import ImageProcessingConfig, Normalizer, patchify_into, resize_torchvision

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
IMAGES = parity_images()
PNGS = [n for n in IMAGES if "png" in n]


@pytest.fixture(scope="module")
def gpu(tiny_dense):
    pytest.importorskip("nvidia.nvimgcodec")
    return Preprocessor.from_pretrained(tiny_dense, device="cuda")


@pytest.fixture(scope="module")
def cpu(tiny_dense):
    return Preprocessor.from_pretrained(tiny_dense, device="cpu")


def _chat(*names):
    return [
        {
            "role": "user",
            "content": [*({"type": "image", "image": IMAGES[n]} for n in names), {"type": "text", "text": "?"}],
        }
    ]


def _pillow_frame(data: bytes) -> torch.Tensor:
    return torch.from_numpy(np.asarray(ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB")).copy())


def test_pixels_stay_on_the_gpu(gpu):
    request = gpu(_chat("jpeg 640x480", "png 400x300"))
    assert request.pixel_values.device.type == "cuda"
    assert request.pixel_values.dtype == torch.float32


@pytest.mark.parametrize("name", list(IMAGES))
def test_resize_and_patchify_on_gpu_equal_the_processor_on_gpu(name, tiny_dense):
    """Given the same decoded frame, our GPU resize/normalize/patchify equals transformers' torchvision
    processor running on the GPU (bit for bit: same kernels, same operation order)."""
    config = ImageProcessingConfig.from_pretrained(tiny_dense)
    frame = _pillow_frame(IMAGES[name])
    processor = load_hf_processor(tiny_dense, "torchvision").image_processor
    reference = processor(images=[frame.permute(2, 0, 1)], device="cuda", return_tensors="pt")
    grid = reference["image_grid_thw"][0].tolist()
    height, width = grid[1] * config.patch_size, grid[2] * config.patch_size
    out = torch.empty_like(reference["pixel_values"], device="cuda")
    patchify_into(
        resize_torchvision(frame.cuda(), height, width),
        config,
        Normalizer(config, "torchvision", torch.device("cuda")),
        out,
    )
    assert (out - reference["pixel_values"].cuda()).abs().max().item() <= 1e-6


@pytest.mark.parametrize("name", PNGS)
def test_png_frames_equal_pillow(name, gpu, cpu):
    """PNG decoding is lossless: the GPU path's pixels equal the CPU path's."""
    assert (gpu(_chat(name)).pixel_values.cpu() - cpu(_chat(name)).pixel_values).abs().max().item() <= 1e-6


@pytest.mark.parametrize("name", [n for n in IMAGES if n not in PNGS])
def test_jpeg_decoding_on_gpu_is_close_to_libjpeg(name, gpu, cpu):
    """nvJPEG's IDCT and chroma upsampling may round differently from libjpeg-turbo: bounded, and small
    on average (the vision encoder's parity tolerance is far looser)."""
    a, b = gpu(_chat(name)), cpu(_chat(name))
    np.testing.assert_array_equal(a.image_grid_thw, b.image_grid_thw)
    diff = (a.pixel_values.cpu() - b.pixel_values).abs()
    print(f"{name}: max {diff.max().item():.4f} mean {diff.mean().item():.2e} (normalized units; 1 level = 0.0078)")
    assert diff.mean().item() <= 4 * 2 / 255
    assert diff.max().item() <= 40 * 2 / 255


def test_gpu_batch_equals_single_requests(gpu):
    requests = [{"messages": _chat("jpeg 640x480")}, {"messages": _chat("rgba png", "tiny jpeg 32x32")}]
    for spec, got in zip(requests, gpu.batch(requests), strict=True):
        assert torch.equal(got.pixel_values, gpu(**spec).pixel_values)


def test_gpu_errors_are_typed(gpu):
    from qwen3vl_trt.errors import ImageDecodeError

    data = IMAGES["jpeg 640x480"]
    with pytest.raises(ImageDecodeError, match="image 0"):
        gpu(_chat_bytes(data[: len(data) // 3]))


def _chat_bytes(data: bytes):
    return [{"role": "user", "content": [{"type": "image", "image": data}]}]
