"""Image bytes -> normalized patches, equal to the transformers Qwen3-VL image processor.

Stages: read the header (size, EXIF orientation; no pixels), enforce limits, decode, resize to the
processor's smart_resize grid, normalize and patchify into one preallocated [N, patch_dim] buffer.
Decoding follows `transformers.image_utils.load_image` (EXIF transpose, RGB) and flattens
transparency onto white as transformers 5's convert_to_rgb does. Resizing follows the processor of
the chosen backend:

- "torchvision": transformers' default (torchvision) processor: bicubic with antialias on uint8
  CHW tensors. Runs on the tensors' device, so the GPU path resizes in device memory.
- "pil": the PIL-backend processor (and transformers 4.57's slow processor): PIL bicubic on uint8.

Normalization and patchify run in torch on the tensors' device with the same floating-point
operations, in the same order, as the matching processor, so the results are bit-identical.
"""

from __future__ import annotations

import io
import math
import os
import re
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

import numpy as np
import PIL.Image
import PIL.ImageOps
import torch

from ..common.fsutil import read_json
from ..common.limits import ImageLimits
from ..errors import (
    CheckpointError,
    ImageDecodeError,
    ImageShapeError,
    ImageTooLargeError,
    Qwen3VLTrtError,
    UnsupportedModelError,
)

ResizeBackend = Literal["torchvision", "pil"]
RESIZE_BACKENDS: tuple[str, ...] = ("torchvision", "pil")
PREPROCESSOR_CONFIG_FILE = "preprocessor_config.json"
_PIL_BICUBIC = 3
_EXIF_ORIENTATION_TAG = 0x0112
# EXIF orientation -> the transpose that makes the image upright (PIL.ImageOps.exif_transpose's table).
_PIL_TRANSPOSE = {
    1: None,
    2: PIL.Image.Transpose.FLIP_LEFT_RIGHT,
    3: PIL.Image.Transpose.ROTATE_180,
    4: PIL.Image.Transpose.FLIP_TOP_BOTTOM,
    5: PIL.Image.Transpose.TRANSPOSE,
    6: PIL.Image.Transpose.ROTATE_270,
    7: PIL.Image.Transpose.TRANSVERSE,
    8: PIL.Image.Transpose.ROTATE_90,
}
# Formats a client may send (JPEG includes MPO); Pillow opens many more (EPS would run Ghostscript).
ACCEPTED_FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP")
# Orientations 5-8 rotate by 90 degrees, so the upright image swaps width and height.
_TRANSPOSING_ORIENTATIONS = (5, 6, 7, 8)
# smart_resize's own bound in transformers.
MAX_ASPECT_RATIO = 200


@dataclass(frozen=True)
class ImageProcessingConfig:
    """The checkpoint's preprocessor_config.json, with the values Qwen3-VL relies on made explicit."""

    patch_size: int
    temporal_patch_size: int
    merge_size: int
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]
    rescale_factor: float
    do_rescale: bool
    do_normalize: bool
    min_pixels: int
    max_pixels: int

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    @property
    def patch_dim(self) -> int:
        return 3 * self.temporal_patch_size * self.patch_size * self.patch_size

    @classmethod
    def from_pretrained(cls, model_dir: str | os.PathLike[str]) -> ImageProcessingConfig:
        path = Path(model_dir) / PREPROCESSOR_CONFIG_FILE
        missing = f"{path} is missing; copy preprocessor_config.json from the released checkpoint"
        return cls.from_dict(read_json(path, missing), where=str(path))

    @classmethod
    def from_dict(cls, cfg: dict, where: str = PREPROCESSOR_CONFIG_FILE) -> ImageProcessingConfig:
        # Qwen2-VL's class defaults (patch 14, CLIP mean/std) differ from Qwen3-VL's released values,
        # so every value that shapes the output must be in the file.
        missing = [
            k for k in ("patch_size", "merge_size", "temporal_patch_size", "image_mean", "image_std") if k not in cfg
        ]
        if missing:
            raise CheckpointError(f"{where} has no {', '.join(missing)}; the processor's class defaults are Qwen2-VL's")
        size = dict(cfg.get("size") or {})
        min_pixels = cfg.get("min_pixels", size.get("shortest_edge"))
        max_pixels = cfg.get("max_pixels", size.get("longest_edge"))
        if min_pixels is None or max_pixels is None:
            raise CheckpointError(f"{where} needs size.shortest_edge and size.longest_edge (pixel bounds)")
        if not cfg.get("do_resize", True):
            raise UnsupportedModelError(f"{where} sets do_resize=false; Qwen3-VL needs resizing to the patch grid")
        if cfg.get("resample", _PIL_BICUBIC) != _PIL_BICUBIC:
            raise UnsupportedModelError(f"{where} asks for resample={cfg['resample']}; only bicubic (3) is supported")
        mean, std = tuple(float(v) for v in cfg["image_mean"]), tuple(float(v) for v in cfg["image_std"])
        if len(mean) != 3 or len(std) != 3:
            raise CheckpointError(f"{where}: image_mean and image_std need 3 values (RGB)")
        return cls(
            patch_size=int(cfg["patch_size"]),
            temporal_patch_size=int(cfg["temporal_patch_size"]),
            merge_size=int(cfg["merge_size"]),
            image_mean=mean,
            image_std=std,
            rescale_factor=float(cfg.get("rescale_factor", 1 / 255)),
            do_rescale=bool(cfg.get("do_rescale", True)),
            do_normalize=bool(cfg.get("do_normalize", True)),
            min_pixels=int(min_pixels),
            max_pixels=int(max_pixels),
        )


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """transformers' smart_resize (Python's round, so .5 goes to even), with a typed error."""
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ImageShapeError(
            f"aspect ratio {max(height, width) / min(height, width):.0f}:1 ({width}x{height}) is over "
            f"{MAX_ASPECT_RATIO}:1, the most the model's resizing accepts; crop the image"
        )
    return fit_pixel_bounds(height, width, factor, min_pixels, max_pixels)


def fit_pixel_bounds(
    height: int, width: int, factor: int, min_pixels: int, max_pixels: int, frames: int = 1, rounded_frames: int = 1
) -> tuple[int, int]:
    """smart_resize's core, shared by the image and the video processor: the size rounded to the factor, scaled
    down (up) to keep frames x height x width within max_pixels (min_pixels); the video processor bounds its
    frame count rounded to the temporal patch but scales by the frame count itself."""
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if rounded_frames * h_bar * w_bar > max_pixels:
        beta = math.sqrt((frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif rounded_frames * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@dataclass(frozen=True)
class ImageHeader:
    """What the header says, before any pixel is decoded. width/height are upright (EXIF applied)."""

    index: int
    format: str
    mode: str
    width: int
    height: int
    orientation: int


def _label(index: int) -> str:
    return f"image {index}"


def _orientation(image: PIL.Image.Image) -> int:
    """EXIF (or XMP) orientation from what the header parse found. The base class method is called on
    purpose: PngImageFile.getexif decodes the whole image to look for an eXIf chunk after the pixels."""
    try:
        value = int(PIL.Image.Image.getexif(image).get(_EXIF_ORIENTATION_TAG, 1))
    except Exception:  # a malformed EXIF block: exif_transpose ignores it too
        return 1
    return value if value in _PIL_TRANSPOSE else 1


def open_image(data: bytes, index: int, limits: ImageLimits) -> tuple[PIL.Image.Image, ImageHeader]:
    """Parses the header only (PIL opens lazily) and enforces the decode limit on its dimensions."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ImageDecodeError(f"{_label(index)}: expected encoded image bytes, got {type(data).__name__}")
    if len(data) == 0:
        raise ImageDecodeError(f"{_label(index)}: empty bytes")
    with warnings.catch_warnings():
        # Our own decode limit applies below; PIL's bomb warning would only be noise.
        warnings.simplefilter("ignore", PIL.Image.DecompressionBombWarning)
        try:
            image = PIL.Image.open(io.BytesIO(data), formats=ACCEPTED_FORMATS)
        except PIL.Image.DecompressionBombError as e:
            # Pillow refuses past twice its own limit while parsing the header.
            claimed = re.search(r"\((\d+) pixels\)", str(e))
            size = f"{int(claimed.group(1)) / 1e6:.1f} MP" if claimed else "an enormous size"
            limit = min(limits.max_decode_pixels, 2 * (PIL.Image.MAX_IMAGE_PIXELS or 0) or limits.max_decode_pixels)
            raise ImageTooLargeError(
                f"{_label(index)}: header says {size}, over the decode limit of {limit / 1e6:.1f} MP; "
                "downscale it before sending"
            ) from e
        except (PIL.UnidentifiedImageError, OSError, ValueError) as e:
            head = bytes(data[:8]).hex(" ")
            raise ImageDecodeError(
                f"{_label(index)}: not a recognized image ({len(data)} bytes starting {head}); "
                f"send {', '.join(ACCEPTED_FORMATS[:-1])} or {ACCEPTED_FORMATS[-1]}"
            ) from e
    width, height = image.size
    if width * height > limits.max_decode_pixels:
        raise ImageTooLargeError(
            f"{_label(index)}: header says {width}x{height} ({width * height / 1e6:.1f} MP), over the decode limit "
            f"of {limits.max_decode_pixels / 1e6:.1f} MP; downscale it before sending"
        )
    if width == 0 or height == 0:
        raise ImageDecodeError(f"{_label(index)}: header says {width}x{height}")
    if image.mode in ("I", "F"):
        raise ImageDecodeError(f"{_label(index)}: {image.mode}-mode (32-bit) images are not supported; send 8-bit")
    orientation = _orientation(image)
    if orientation in _TRANSPOSING_ORIENTATIONS:
        width, height = height, width
    return image, ImageHeader(index, image.format or "unknown", image.mode, width, height, orientation)


def decode_pil(image: PIL.Image.Image, header: ImageHeader) -> PIL.Image.Image:
    """Upright RGB pixels as transformers' load_image returns them: EXIF transpose (the header's
    orientation), then PIL's RGB conversion, which drops alpha. 16-bit grayscale keeps its top 8 bits
    (PIL's conversion would clip it to white)."""
    try:
        image.load()
        if image.mode.startswith("I;16"):
            image = PIL.Image.fromarray((np.asarray(image, dtype=np.uint16) >> 8).astype(np.uint8))
        transpose = _PIL_TRANSPOSE[header.orientation]
        if transpose is not None:
            image = image.transpose(transpose)
        if image.mode != "RGB":
            image = image.convert("RGB")
    except (OSError, ValueError, SyntaxError) as e:
        raise ImageDecodeError(f"{_label(header.index)}: truncated or corrupt {header.format} data ({e})") from e
    return image


def orient(frame_hwc: torch.Tensor, orientation: int) -> torch.Tensor:
    """The EXIF transpose of a stored-orientation [H, W, C] tensor, on its device; equals PIL's."""
    if orientation == 2:
        return frame_hwc.flip(1)
    if orientation == 3:
        return frame_hwc.flip(0, 1)
    if orientation == 4:
        return frame_hwc.flip(0)
    if orientation == 5:
        return frame_hwc.transpose(0, 1)
    if orientation == 6:
        return frame_hwc.transpose(0, 1).flip(1)
    if orientation == 7:
        return frame_hwc.transpose(0, 1).flip(0, 1)
    if orientation == 8:
        return frame_hwc.transpose(0, 1).flip(0)
    return frame_hwc


def _empty_float32(shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        # numpy asks the kernel for huge pages on large arrays; first-touch faults on torch's 4 KiB pages
        # cost more than the patchify itself.
        return torch.from_numpy(np.empty(shape, dtype=np.float32))
    return torch.empty(shape, dtype=torch.float32, device=device)


class Normalizer:
    """The processor's rescale + normalize as per-channel float ops in the processor's order, so the
    results are bit-identical.

    torchvision backend: one fused normalize, (x - mean/rescale) / (std/rescale) in float32.
    PIL backend: x * rescale in float64 then cast to float32, then (x - mean) / std in float32.
    """

    def __init__(self, config: ImageProcessingConfig, backend: ResizeBackend, device: torch.device):
        if backend not in RESIZE_BACKENDS:
            raise Qwen3VLTrtError(f"resize backend must be one of {', '.join(RESIZE_BACKENDS)}; got {backend!r}")
        self.backend = backend
        self.do_rescale, self.do_normalize = config.do_rescale, config.do_normalize
        self.rescale_factor = config.rescale_factor
        mean = torch.tensor(config.image_mean, dtype=torch.float32)
        std = torch.tensor(config.image_std, dtype=torch.float32)
        if backend == "torchvision" and self.do_rescale and self.do_normalize:
            # The same expression as TorchvisionBackend._fuse_mean_std_and_rescale_factor.
            mean, std = mean * (1.0 / self.rescale_factor), std * (1.0 / self.rescale_factor)
            self.do_rescale = False
        shape = (1, 3, 1)  # broadcasts over [patches, C, ph * pw]
        self.mean = mean.view(shape).to(device)
        self.std = std.view(shape).to(device)
        self._divisor = _exact_float32_divisor(self.rescale_factor) if backend == "pil" else None
        # PIL's rescale is float64; without an exact float32 divisor it has to stay float64.
        self._rescale_in_float64 = backend == "pil" and self.do_rescale and self._divisor is None

    def __call__(self, patches_u8: torch.Tensor, out: torch.Tensor) -> None:
        """patches_u8 [patches, 3, T, p * p] uint8 (the frame broadcast over T) -> out, float32, same shape.

        The conversion writes every temporal copy at once; the float ops then run over the contiguous
        output (per channel: [patches, 3, T * p * p]), where torch's kernels vectorize."""
        if self._rescale_in_float64:
            out.copy_(patches_u8.to(torch.float64).mul_(self.rescale_factor))
        else:
            out.copy_(patches_u8)
        flat = out.view(out.shape[0], 3, -1)
        if self.do_rescale and not self._rescale_in_float64:
            if self._divisor is not None:
                flat.div_(self._divisor)
            else:
                flat.mul_(self.rescale_factor)
        if self.do_normalize:
            flat.sub_(self.mean).div_(self.std)


def _exact_float32_divisor(rescale_factor: float) -> float | None:
    """A float32 divisor that reproduces float32(float64(v) * rescale_factor) for every uint8 v, if one
    exists (1/255: dividing by 255 does), so the PIL backend's float64 step needs no float64 pass."""
    divisor = round(1.0 / rescale_factor)
    values = torch.arange(256)
    exact = (values.to(torch.float64) * rescale_factor).to(torch.float32)
    return float(divisor) if torch.equal(values.to(torch.float32) / divisor, exact) else None


def _merge_block_order(image_hwc: torch.Tensor, bh: int, bw: int, m: int, p: int) -> torch.Tensor:
    """uint8 [H, W, 3] -> contiguous uint8 [bh, bw, mh, mw, C, ph, pw]. Reordering the uint8 pixels
    moves a quarter of the bytes that reordering float32 would; on the CPU numpy's strided copy is
    about twice as fast as torch's for this 7-D permutation."""
    order = (0, 3, 1, 4, 6, 2, 5)
    if image_hwc.device.type == "cpu":
        blocks = image_hwc.numpy().reshape(bh, m, p, bw, m, p, 3).transpose(order)
        return torch.from_numpy(np.ascontiguousarray(blocks))
    return image_hwc.reshape(bh, m, p, bw, m, p, 3).permute(order).contiguous()


def patchify_into(
    image_hwc: torch.Tensor, config: ImageProcessingConfig, normalize: Normalizer, out: torch.Tensor
) -> None:
    """Writes one resized uint8 [H, W, 3] image into out [n_patches, patch_dim] in the processor's order:
    merge blocks row-major, patches row-major inside a block, then (C, T, ph, pw) per patch, the
    frame repeated over the temporal patch."""
    p, m, t = config.patch_size, config.merge_size, config.temporal_patch_size
    h, w, _ = image_hwc.shape
    bh, bw = h // (p * m), w // (p * m)
    blocks = _merge_block_order(image_hwc, bh, bw, m, p).view(-1, 3, 1, p * p)
    dst = out.view(-1, 3, t, p * p)
    normalize(blocks.expand(-1, -1, t, -1), dst)


def resize_torchvision(image_hwc: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """transformers' TorchvisionBackend.resize (bicubic, antialias, uint8 in and out). The channels-last
    view takes torch's vectorized uint8 path; the result equals resizing a contiguous CHW tensor."""
    import torchvision.transforms.v2.functional as tvF

    chw = image_hwc.permute(2, 0, 1).unsqueeze(0)
    resized = tvF.resize(chw, [height, width], interpolation=tvF.InterpolationMode.BICUBIC, antialias=True)
    return resized[0].permute(1, 2, 0)


class FrameDecoder(Protocol):
    """Decodes a batch of images to RGB uint8 [H, W, 3] tensors on its device, as stored (EXIF
    orientation not applied)."""

    device: torch.device

    def decode(self, data: Sequence[bytes], headers: Sequence[ImageHeader]) -> list[torch.Tensor]: ...


@dataclass(frozen=True)
class ImagePlan:
    """A request's images after their headers were read and checked: what decoding will produce."""

    data: tuple[bytes, ...]
    opened: tuple[PIL.Image.Image, ...]
    headers: tuple[ImageHeader, ...]
    sizes: tuple[tuple[int, int], ...]  # resized (height, width)
    image_grid_thw: np.ndarray  # [num_images, 3] int64

    @property
    def num_patches(self) -> int:
        return int(self.image_grid_thw.prod(axis=1).sum())

    def only(self, keep: Sequence[bool]) -> ImagePlan:
        """The plan of the images whose `keep` is true, in order."""
        kept = [i for i, k in enumerate(keep) if k]
        return ImagePlan(
            tuple(self.data[i] for i in kept),
            tuple(self.opened[i] for i in kept),
            tuple(self.headers[i] for i in kept),
            tuple(self.sizes[i] for i in kept),
            self.image_grid_thw[kept].reshape(-1, 3),
        )


def plan_images(data: Sequence[bytes], config: ImageProcessingConfig, limits: ImageLimits) -> ImagePlan:
    """Reads every header and fixes each image's resized size and grid; no pixel is decoded."""
    opened = [open_image(d, i, limits) for i, d in enumerate(data)]
    headers = tuple(h for _, h in opened)
    max_pixels = min(config.max_pixels, limits.max_image_pixels)
    min_pixels = min(config.min_pixels, max_pixels)
    sizes = []
    for h in headers:
        try:
            sizes.append(smart_resize(h.height, h.width, config.factor, min_pixels, max_pixels))
        except ImageShapeError as e:
            raise ImageShapeError(f"{_label(h.index)}: {e}") from None
    p = config.patch_size
    grid = np.array([[1, rh // p, rw // p] for rh, rw in sizes], dtype=np.int64).reshape(-1, 3)
    return ImagePlan(tuple(bytes(d) for d in data), tuple(im for im, _ in opened), headers, tuple(sizes), grid)


def decodes_on_device(header: ImageHeader) -> bool:
    """Whether a FrameDecoder (nvImageCodec) decodes this image. JPEGs in YCbCr or grayscale (MPO is
    JPEG too) are where the hardware decoder helps and nvImageCodec matches libjpeg; other formats and
    CMYK JPEGs go through Pillow and are uploaded (nvImageCodec decodes PNGs on the CPU anyway, scales
    16-bit ones differently, and its CMYK conversion is not known to match Pillow's)."""
    return header.format in ("JPEG", "MPO") and header.mode in ("RGB", "L")


def render_pixels(
    plans: Sequence[ImagePlan],
    config: ImageProcessingConfig,
    normalize: Normalizer,
    decoder: FrameDecoder | None = None,
    max_decoded_pixels: int = ImageLimits.max_decode_pixels,
) -> list[torch.Tensor]:
    """Decodes the images of all plans into one [N, patch_dim] buffer and returns each plan's rows
    (views). decoder None decodes with Pillow on this host; otherwise JPEGs are decoded by the decoder
    (nvImageCodec, into device memory) in batches of at most max_decoded_pixels (or one image), and
    everything is resized and patchified on the decoder's device. Full-size frames are dropped as soon
    as their patches are written."""
    images = [
        (data, opened, header, size)
        for plan in plans
        for data, opened, header, size in zip(plan.data, plan.opened, plan.headers, plan.sizes, strict=True)
    ]
    counts = [int(np.prod(size)) // (config.patch_size**2) for _, _, _, size in images]
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    device = decoder.device if decoder is not None else torch.device("cpu")
    pixels = _empty_float32((int(offsets[-1]), config.patch_dim), device)

    def write(i: int, frame: torch.Tensor | PIL.Image.Image) -> None:
        height, width = images[i][3]
        patchify_into(
            _resize(frame, height, width, normalize.backend), config, normalize, pixels[offsets[i] : offsets[i + 1]]
        )

    on_device = [i for i, image in enumerate(images) if decoder is not None and decodes_on_device(image[2])]
    pillow_decoded = sorted(set(range(len(images))) - set(on_device))
    if decoder is not None:
        for chunk in _pixel_budget_chunks(on_device, [images[i][2] for i in on_device], max_decoded_pixels):
            frames = decoder.decode([images[i][0] for i in chunk], [images[i][2] for i in chunk])
            for i, frame in zip(chunk, frames, strict=True):
                write(i, _upright(frame.to(device), images[i][2]))
            del frames
    for i in pillow_decoded:
        _, opened, header, _ = images[i]
        upright = decode_pil(opened, header)
        write(i, upright if decoder is None else _as_tensor(np.asarray(upright)).to(device))
    bounds = np.cumsum([0] + [plan.num_patches for plan in plans])
    return [pixels[int(a) : int(b)] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def _pixel_budget_chunks(indexes: list[int], headers: list[ImageHeader], budget: int) -> list[list[int]]:
    chunks: list[list[int]] = []
    total = budget + 1
    for i, header in zip(indexes, headers, strict=True):
        pixels = header.width * header.height
        if total + pixels > budget:
            chunks.append([])
            total = 0
        chunks[-1].append(i)
        total += pixels
    return chunks


def _upright(frame: torch.Tensor, header: ImageHeader) -> torch.Tensor:
    """A decoder's stored-orientation frame, turned upright by the header's orientation (so Pillow's
    reading of EXIF and XMP decides, on every path) and checked against the header."""
    frame = orient(frame, header.orientation)
    if tuple(frame.shape) != (header.height, header.width, 3):
        raise ImageDecodeError(
            f"{_label(header.index)}: decoded to {tuple(frame.shape)}, but its header says "
            f"{header.width}x{header.height} (upright); the file is inconsistent"
        )
    return frame


def _as_tensor(array: np.ndarray) -> torch.Tensor:
    """A tensor over a read-only array (Pillow's pixels), which is only ever read."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(array)


def _resize(frame: torch.Tensor | PIL.Image.Image, height: int, width: int, backend: ResizeBackend) -> torch.Tensor:
    if backend == "pil":
        image = frame if isinstance(frame, PIL.Image.Image) else PIL.Image.fromarray(frame.cpu().numpy())
        resized = image.resize((width, height), resample=PIL.Image.Resampling.BICUBIC)
        return _as_tensor(np.asarray(resized))
    hwc = _as_tensor(np.asarray(frame)) if isinstance(frame, PIL.Image.Image) else frame
    return resize_torchvision(hwc, height, width)
