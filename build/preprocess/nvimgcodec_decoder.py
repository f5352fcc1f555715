"""Batched image decoding with NVIDIA nvImageCodec (`nvidia-nvimgcodec-cu13>=0.9`).

On a GPU the frames land in device memory (hardware JPEG decoder first, then nvJPEG's CUDA
decoder, then the CPU codecs with an upload) and reach torch through DLPack: pixels never come back
to the host. With device "cpu" the same code drives nvImageCodec's CPU backend (libjpeg-turbo,
bit-identical to Pillow), which is how CPU-only hosts exercise it.

Fancy chroma upsampling is requested explicitly: 0.6-0.8 defaulted to nearest-neighbour chroma,
which differs from libjpeg/Pillow (what transformers decodes with) by up to 48 levels on 4:2:0.
Frames come back as stored: the caller applies the header's orientation, which Pillow read from
EXIF or XMP (nvImageCodec reads EXIF only), so every path turns images the same way.

Calls as nvImageCodec 0.9.0.20 (the version build/gpu_image.py pins) defines them, read from the wheel's own
signatures: Decoder(device_id, max_num_cpu_threads, backends, options), Backend(BackendKind), DecodeParams(
apply_exif_orientation, color_spec, allow_any_depth), decode(code_streams, *, params, cuda_stream) returning None
in place of an image it could not decode.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ..errors import ImageDecodeError, Qwen3VLTrtError
from .images import ImageHeader

_INSTALL_HINT = "install it with `pip install 'nvidia-nvimgcodec-cu13[nvjpeg]>=0.9'` (CUDA 13) or the -cu12 package"


def _import_nvimgcodec() -> Any:
    try:
        from nvidia import nvimgcodec
    except ImportError as e:
        raise Qwen3VLTrtError(f"nvImageCodec is not installed; {_INSTALL_HINT}") from e
    if not hasattr(nvimgcodec, "NVIMGCODEC_DEVICE_CPU_ONLY"):
        raise Qwen3VLTrtError(f"nvImageCodec {getattr(nvimgcodec, '__version__', '?')} is too old; {_INSTALL_HINT}")
    return nvimgcodec


class NvImageCodecDecoder:
    """FrameDecoder over nvImageCodec: RGB uint8 [H, W, 3] tensors on `device`, in stored orientation."""

    def __init__(self, device: str | torch.device = "cuda", max_cpu_threads: int = 1):
        nv = _import_nvimgcodec()
        self.device = torch.device(device)
        backend = nv.Backend
        kinds = nv.BackendKind
        if self.device.type == "cuda":
            if not torch.cuda.is_available():
                raise Qwen3VLTrtError("device 'cuda' was asked for but torch sees no CUDA device")
            device_id = self.device.index if self.device.index is not None else torch.cuda.current_device()
            self.device = torch.device("cuda", device_id)
            # The hardware decoder registers with the highest priority; HYBRID is nvJPEG's CUDA decoder.
            backends = [
                backend(kinds.HW_GPU_ONLY),
                backend(kinds.HYBRID_CPU_GPU),
                backend(kinds.GPU_ONLY),
                backend(kinds.CPU_ONLY),
            ]
        elif self.device.type == "cpu":
            device_id = nv.NVIMGCODEC_DEVICE_CPU_ONLY
            backends = [backend(kinds.CPU_ONLY)]
        else:
            raise Qwen3VLTrtError(f"nvImageCodec decodes to 'cuda' or 'cpu', not {self.device}")
        try:
            self._decoder = nv.Decoder(
                device_id=device_id,
                max_num_cpu_threads=max_cpu_threads,
                backends=backends,
                options=":fancy_upsampling=1",
            )
        except RuntimeError as e:
            raise Qwen3VLTrtError(f"nvImageCodec could not create a decoder on {self.device}: {e}") from e
        self._params = nv.DecodeParams(
            apply_exif_orientation=False, color_spec=nv.ColorSpec.SRGB, allow_any_depth=False
        )
        self._nv = nv

    def decode(self, data: Sequence[bytes], headers: Sequence[ImageHeader]) -> list[torch.Tensor]:
        # A CodeStream over bytes only wraps them; parsing waits for decode, which returns None for what it cannot
        # parse or decode (python/code_stream.cpp and decoder.cpp, NVIDIA/nvImageCodec v0.8.0; so does 0.9.0.20).
        streams = [self._nv.CodeStream(bytes(blob)) for blob in data]
        stream = torch.cuda.current_stream(self.device).cuda_stream if self.device.type == "cuda" else 0
        decoded = self._decoder.decode(streams, params=self._params, cuda_stream=stream)
        frames = []
        for image, header in zip(decoded, headers, strict=True):
            if image is None:
                raise ImageDecodeError(
                    f"image {header.index}: truncated or corrupt {header.format} data (nvImageCodec)"
                )
            frames.append(
                torch.from_dlpack(image) if self.device.type == "cuda" else torch.from_numpy(np.asarray(image))
            )
        return frames
