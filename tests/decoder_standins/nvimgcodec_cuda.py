"""nvImageCodec's GPU decoding on a host without a GPU (tests only): `nvidia.nvimgcodec` as the 0.9.0.20 wheel defines
it, where a Decoder on a CUDA device decodes through the real wheel's CPU backend (libjpeg-turbo) and returns images
that hand their pixels to torch by DLPack as device images do. Everything but the Decoder is the real module.

What is modelled, and from where (NVIDIA/nvImageCodec at v0.8.0, commit 36b4ee8c; signatures from the 0.9.0.20 wheel):
- Decoder(device_id, max_num_cpu_threads, backends, options): a device that does not exist fails as the library's
  Exception(INTERNAL_ERROR) does, a RuntimeError "Internal error - Could not create decoder. Code: 8" (what the real
  wheel raises for a CUDA device it cannot use); device NVIMGCODEC_DEVICE_CPU_ONLY is the real decoder, untouched.
- Outputs land in device memory unless every backend asked for is CPU_ONLY (python/decoder.cpp, `is_cpu_only_`);
  then the real CPU decoder's host images come back, decoded with the caller's options.
- Chroma upsampling: nvJPEG interpolates only when `fancy_upsampling=1` is asked for, globally (`:`) or for
  `nvjpeg_cuda_decoder`, which the hardware decoder reads too (extensions/nvjpeg/nvjpeg_utils.cpp get_nvjpeg_flags,
  hw_decoder.cpp). Without it the stand-in decodes nearest-neighbour (libjpeg-turbo's `:fancy_upsampling=0`): the
  library's own Python default up to 0.8 (python/decoder.cpp) and nvJPEG's only mode before 12.1; 0.9 leaves it to
  the extensions' defaults, so a caller that wants libjpeg's pixels asks.
- decode(code_streams, *, params, cuda_stream): None where an image cannot be parsed or decoded (the real decoder's own
  result); each image keeps the decode stream (`image_info.cuda_stream`).
- Image.__dlpack__(stream): the consumer stream waits on the image's stream when they differ and the consumer is not
  -1 (python/dlpack_utils.cpp, DLPackTensor::getPyCapsule), noted as ("wait", consumer, producer) on the host CUDA
  timeline; __dlpack_device__ is (kDLCUDA, device_id) (python/image.cpp).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator, Sequence
from types import ModuleType
from typing import Any

import pytest
import torch

KDL_CUDA = 2  # dlpack.h DLDeviceType
_DO_NOT_SYNC = -1  # DLPackTensor::getPyCapsule's kDoNotSync
_COULD_NOT_CREATE = "Internal error - Could not create decoder. Code: 8"


def _fancy_upsampling(options: str) -> bool:
    """get_nvjpeg_flags' reading of the options, the last matching token winning; off unless asked (module doc)."""
    fancy = False
    for token in options.split(" "):
        colon, equal = token.find(":"), token.find("=")
        if colon < 0 or equal < 0 or colon > equal:
            continue
        module, option = token[:colon], token[colon + 1 : equal]
        if module in ("", "nvjpeg_cuda_decoder") and option == "fancy_upsampling":
            fancy = token[equal + 1 :] == "1"
    return fancy


def standin(real: ModuleType, note: Callable[..., None]) -> ModuleType:
    """The real nvidia.nvimgcodec with its Decoder replaced; `decoders` lists every Decoder made."""
    module = ModuleType(real.__name__, real.__doc__)
    module.__dict__.update({k: v for k, v in vars(real).items() if not k.startswith("__")})
    module.__version__ = real.__version__  # type: ignore[attr-defined]
    decoders: list[Decoder] = []
    module.decoders = decoders  # type: ignore[attr-defined]

    class DeviceImage:
        """An Image over a STRIDED_DEVICE buffer; its pixels are the host decoder's image."""

        buffer_kind = real.ImageBufferKind.STRIDED_DEVICE

        def __init__(self, host: Any, device_id: int, cuda_stream: int) -> None:
            self._host = host
            self.device_id, self.cuda_stream = device_id, cuda_stream
            self.shape, self.dtype = host.shape, host.dtype

        def __dlpack_device__(self) -> tuple[int, int]:
            return (KDL_CUDA, self.device_id)

        def __dlpack__(self, stream: int | None = None) -> Any:
            consumer = 0 if stream is None else int(stream)
            if consumer not in (_DO_NOT_SYNC, self.cuda_stream):
                note("wait", consumer, self.cuda_stream)
            return self._host.__dlpack__(stream=_DO_NOT_SYNC)  # host memory: no CUDA event to order it by

        def cpu(self) -> Any:
            return self._host

    class Decoder:
        def __init__(
            self,
            device_id: int = real.NVIMGCODEC_DEVICE_CURRENT,
            max_num_cpu_threads: int = 0,
            backends: Sequence[Any] | None = None,
            options: str = "",
        ) -> None:
            self.kinds = [b.backend_kind for b in backends or ()]
            self.options, self.max_num_cpu_threads = options, max_num_cpu_threads
            self.streams: list[int] = []  # the cuda_stream of every decode call
            cpu_only = bool(self.kinds) and all(k == real.BackendKind.CPU_ONLY for k in self.kinds)
            if device_id == real.NVIMGCODEC_DEVICE_CPU_ONLY:
                self.device_id = None
                self._real = real.Decoder(
                    device_id=device_id, max_num_cpu_threads=max_num_cpu_threads, backends=backends, options=options
                )
            else:
                self.device_id = (
                    torch.cuda.current_device() if device_id == real.NVIMGCODEC_DEVICE_CURRENT else device_id
                )
                if not 0 <= self.device_id < torch.cuda.device_count():
                    raise RuntimeError(_COULD_NOT_CREATE)
                self._real = real.Decoder(
                    device_id=real.NVIMGCODEC_DEVICE_CPU_ONLY,
                    max_num_cpu_threads=max_num_cpu_threads,
                    backends=[real.Backend(real.BackendKind.CPU_ONLY)],
                    # libjpeg-turbo as asked when it is the only backend; else in nvJPEG's place (module doc)
                    options=options if cpu_only else f":fancy_upsampling={int(_fancy_upsampling(options))}",
                )
            self._to_device = self.device_id is not None and not cpu_only
            decoders.append(self)

        def decode(self, code_streams: Sequence[Any], *, params: Any = None, cuda_stream: int = 0) -> list[Any]:
            self.streams.append(cuda_stream)
            images = self._real.decode(code_streams, params=params)
            if not self._to_device:
                return images
            device_id = self.device_id
            assert device_id is not None
            return [None if image is None else DeviceImage(image, device_id, cuda_stream) for image in images]

    module.Decoder = Decoder  # type: ignore[attr-defined]
    return module


@contextlib.contextmanager
def nvimgcodec_on_cuda(note: Callable[..., None]) -> Iterator[ModuleType]:
    """`from nvidia import nvimgcodec` gives the stand-in while active; note receives the stream waits."""
    import nvidia
    from nvidia import nvimgcodec as real

    module = standin(real, note)
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(sys.modules, "nvidia.nvimgcodec", module)
        patch.setattr(nvidia, "nvimgcodec", module)
        yield module
