"""The GPU path (nvImageCodec decode into device memory, resize and patchify on the GPU), on hosts with
CUDA and nvImageCodec; skipped elsewhere. scripts/gpu_checks.sh runs these with the GPU benchmark.

The reference is transformers' torchvision processor running on the same GPU: torchvision resizes
uint8 with a fixed-point kernel on the CPU and in float32 on CUDA, so GPU pixels equal transformers
on the GPU, not transformers on the CPU (up to a few levels apart at sharp edges)."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from images import encode, jpeg, parity_images
from PIL import Image
from qwen3vl_trt.common.limits import RequestLimits
from qwen3vl_trt.hf.reference import load_hf_processor
from qwen3vl_trt.preprocess import Preprocessor
from qwen3vl_trt.preprocess.images import decodes_on_device, open_image
from transformers.image_utils import load_image

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
LEVEL = 2 / 255  # one uint8 level in normalized units (std 0.5)


def _chroma_edges() -> bytes:
    """Saturated red/blue 8-pixel squares at 4:2:0: nearest-neighbour chroma upsampling (nvJPEG without
    fancy upsampling) is off by tens of levels on every edge."""
    tile = np.zeros((16, 16, 3), dtype=np.uint8)
    tile[:8, :8] = tile[8:, 8:] = (230, 20, 20)
    tile[:8, 8:] = tile[8:, :8] = (20, 20, 230)
    return encode(Image.fromarray(np.tile(tile, (24, 32, 1))), "JPEG", quality=95, subsampling=2)


IMAGES = {**parity_images(), "4:2:0 chroma edges": _chroma_edges()}
ON_DEVICE = [n for n, d in IMAGES.items() if decodes_on_device(open_image(d, 0, RequestLimits())[1])]
# Not the keyed-transparency palette PNG: transformers 5 whitens its transparent colour after load_image.
VIA_PILLOW = [n for n in IMAGES if n not in ON_DEVICE and n != "palette png with transparency"]


@pytest.fixture(scope="module")
def gpu(tiny_dense):
    pytest.importorskip("nvidia.nvimgcodec")
    return Preprocessor.from_pretrained(tiny_dense, device="cuda")


@pytest.fixture(scope="module")
def processor_on_gpu(tiny_dense):
    processor = load_hf_processor(tiny_dense, "torchvision").image_processor

    def run(data: bytes) -> torch.Tensor:
        image = load_image(Image.open(io.BytesIO(data)))
        return processor(images=[image], device="cuda", return_tensors="pt")["pixel_values"].cuda()

    return run


def _chat(*names):
    parts = [{"type": "image", "image": IMAGES[n]} for n in names]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": "?"}]}]


def test_pixels_stay_on_the_gpu(gpu):
    request = gpu(_chat("jpeg 640x480", "png 400x300"))
    assert request.pixel_values.device.type == "cuda" and request.pixel_values.dtype == torch.float32


@pytest.mark.parametrize("name", VIA_PILLOW)
def test_pillow_decoded_images_equal_the_processor_on_gpu(name, gpu, processor_on_gpu):
    """PNGs, CMYK JPEGs and the like are decoded by Pillow and uploaded: resize, normalize and patchify on
    the GPU then equal transformers on the GPU exactly."""
    assert (gpu(_chat(name)).pixel_values - processor_on_gpu(IMAGES[name])).abs().max().item() <= 1e-6


@pytest.mark.parametrize("name", ON_DEVICE)
def test_gpu_jpeg_decoding_is_close_to_libjpeg(name, gpu, processor_on_gpu):
    """nvJPEG (hardware or CUDA) may round its IDCT and chroma upsampling differently from libjpeg-turbo;
    the difference must stay a fraction of a level on average and far below nearest-neighbour chroma."""
    diff = (gpu(_chat(name)).pixel_values - processor_on_gpu(IMAGES[name])).abs()
    print(f"{name}: max {diff.max().item() / LEVEL:.1f} levels, mean {diff.mean().item() / LEVEL:.3f} levels")
    assert diff.mean().item() <= 1.0 * LEVEL
    assert diff.max().item() <= 24 * LEVEL


def test_gpu_batch_equals_single_requests(gpu):
    requests = [{"messages": _chat("jpeg 640x480")}, {"messages": _chat("rgba png", "tiny jpeg 32x32")}]
    for spec, got in zip(requests, gpu.batch(requests), strict=True):
        assert torch.equal(got.pixel_values, gpu(**spec).pixel_values)


def test_gpu_truncated_jpeg_is_a_typed_error(gpu):
    from qwen3vl_trt.errors import ImageDecodeError

    data = jpeg(256, 256, seed=3)
    with pytest.raises(ImageDecodeError, match="image 0"):
        gpu([{"role": "user", "content": [{"type": "image", "image": data[: len(data) // 3]}]}])
