"""Sampled video frames decoded by NVDEC into device memory, through NVIDIA PyNvVideoCodec (`PyNvVideoCodec==2.2.4`).

PyNvVideoCodec's SimpleDecoder takes the video's bytes in memory (bytes input since 2.2, copied once into native
memory: no temp file), demuxes with its bundled FFmpeg, seeks to the keyframe at or before each wanted frame and decodes
from there on NVDEC, converts to interleaved RGB with a CUDA kernel, and hands frames to torch by DLPack: pixels never
reach host memory. Frames are numbered in presentation order from 0, as SimpleDecoder counts them.

Colour: NVDEC outputs NV12/P016 (4:2:0), NV16 or YUV444; Video Codec SDK's ColorSpace.cu (`Nv12ToColor24<RGB24>`)
turns it into RGB with the matrix named by the bitstream's VUI matrix_coefficients and its full-range flag (limited
range otherwise). The 2.2.4 binary's `SetMatYuv2Rgb(int, int, bool, int, int)` (disassembled) uses BT.601 for
matrices 5/6 and for unspecified (2) frames of at most 720x576, BT.709 for 1, for larger unspecified frames and for
unknown values, plus FCC, SMPTE 240M and BT.2020. In the public ColorSpace.cu each 2x2 luma block shares one chroma
sample (no interpolation) and float results are truncated. The CPU path (PyAV/swscale `to_ndarray(format="rgb24")`)
uses BT.601 limited range unless the stream says otherwise, with fixed-point arithmetic and its own chroma handling.
The two are NOT bit-identical (like nvJPEG and libjpeg for images): expect differences of a few levels everywhere, and
tens of levels in saturated colours on untagged streams above 720x576 (NVDEC picks BT.709 there, swscale BT.601).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from ..errors import Qwen3VLTrtError, VideoDecodeError

PYNVVIDEOCODEC_VERSION = "2.2.4"
CHUNK_FRAMES = 16  # frames decoded per call: their full-size buffers are what is resident at once
_INSTALL_HINT = f"install it with `pip install PyNvVideoCodec=={PYNVVIDEOCODEC_VERSION}`"


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def _import_pynvvideocodec() -> Any:
    try:
        import PyNvVideoCodec as nvc
    except ImportError as e:
        raise Qwen3VLTrtError(f"PyNvVideoCodec is not installed; {_INSTALL_HINT}") from e
    except Exception as e:  # its __init__ raises RuntimeError when the driver's libnvidia-encode/libnvcuvid are missing
        raise Qwen3VLTrtError(
            f"PyNvVideoCodec cannot load the NVIDIA driver's video libraries ({_first_line(e)}); check the driver "
            "with nvidia-smi, and in a container set NVIDIA_DRIVER_CAPABILITIES=compute,utility,video"
        ) from e
    version = tuple(int(part) for part in str(getattr(nvc, "__version__", "0.0")).split(".")[:2] if part.isdigit())
    if version < (2, 2):  # SimpleDecoder reads bytes in memory from 2.2 on
        raise Qwen3VLTrtError(f"PyNvVideoCodec {getattr(nvc, '__version__', '?')} is too old; {_INSTALL_HINT}")
    return nvc


class NvdecVideoDecoder:
    """Decodes sampled frames of one video into device memory (RGB uint8 [n, H, W, 3] torch tensor on cuda)."""

    device: torch.device

    def __init__(self, device: torch.device) -> None:
        device = torch.device(device)
        if device.type != "cuda":
            raise Qwen3VLTrtError(f"NVDEC decodes video into CUDA memory, not onto {device}")
        if not torch.cuda.is_available():
            raise Qwen3VLTrtError("NVDEC video decoding needs a CUDA device, and torch sees none")
        self._nvc = _import_pynvvideocodec()
        self.device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        # SimpleDecoder warns on every in-memory video over 8 MiB that it copies it (decoders/SimpleDecoder.py, 2.2.4).
        warnings.filterwarnings("ignore", message="SimpleDecoder: in-memory buffer", category=UserWarning)

    def decode(self, data: bytes, indices: Sequence[int]) -> Iterator[torch.Tensor]:
        """RGB uint8 [n, H, W, 3] on the device for the frames `indices` (presentation order, ascending), in order, a
        chunk of at most CHUNK_FRAMES at a time: each chunk's frames hold decoder buffers until the next call, so only
        one chunk is resident, copied out before the next is decoded. Raises VideoDecodeError for what NVDEC cannot
        decode (a codec, profile or size this GPU's NVDEC lacks, or corrupt data): the caller decodes on the host."""
        wanted = [int(i) for i in indices]
        if not data:
            raise VideoDecodeError("the video is empty")
        nvc = self._nvc
        with torch.cuda.device(self.device):
            try:
                # SimpleDecoder(enc_file_path, gpu_id, ..., use_device_memory, ..., need_scanned_stream_metadata, ...,
                # output_color_type) as decoders/SimpleDecoder.py in the 2.2.4 wheel defines it. bytes, not a BinaryIO
                # stream: only bytes allow the demux-only scan (a thread) that counts frames and finds keyframes where
                # the container header lacks them (WebM, MOV); it also raises on a stream with no frames.
                decoder = nvc.SimpleDecoder(
                    bytes(data),
                    gpu_id=self.device.index,
                    use_device_memory=True,
                    need_scanned_stream_metadata=True,
                    output_color_type=nvc.OutputColorType.RGB,
                )
                total = len(decoder)
                meta = decoder.get_stream_metadata()
            except Exception as e:  # PyNvVCException(Unsupported), RuntimeError, ValueError, Exception: all upstream
                raise VideoDecodeError(f"NVDEC cannot open the video: {_first_line(e)}") from e
            if wanted and (wanted[0] < 0 or wanted[-1] >= total):
                bad = wanted[0] if wanted[0] < 0 else wanted[-1]
                raise VideoDecodeError(f"frame {bad} was asked for, but the video has {total} frames")
            height, width = int(meta.height), int(meta.width)
            for first in range(0, len(wanted), CHUNK_FRAMES):
                chunk = wanted[first : first + CHUNK_FRAMES]
                unique = sorted(set(chunk))
                try:
                    # get_batch_frames_by_index(indices): seeks to the keyframe before a target only when it lies in
                    # another GOP, else decodes on (SeekUtils::GetFramesByIdxList); the codec's and size's support
                    # is checked as the sequence starts, so an unsupported stream fails here.
                    frames = decoder.get_batch_frames_by_index(unique)
                except IndexError as e:  # SimpleDecoder (2.2.4) maps the frames asked for onto those decoded: fewer
                    raise VideoDecodeError(
                        f"NVDEC decoded fewer frames than the container lists ({total}): the video is truncated"
                    ) from e
                except Exception as e:
                    raise VideoDecodeError(f"NVDEC failed decoding the video: {_first_line(e)}") from e
                # torch.from_dlpack passes torch's current stream to DecodedFrame.__dlpack__, which makes it wait on
                # the frame's decode event (ExternalBuffer::dlpack). The frames live in the decoder's buffers, reused
                # by its next call, so they are copied (stack) and the copy awaited before the next call.
                decoded = [torch.from_dlpack(frame) for frame in frames]
                # Every frame has the first sequence's size, which is the stream's (FFmpeg's stream info decodes it;
                # NvDecoder::ReconfigureDecoder scales later sequences to it), its width rounded up to even for NV12
                # (NvDecoder::GetWidth): crop.
                position = {index: k for k, index in enumerate(unique)}
                out = torch.stack([decoded[position[i]][:height, :width] for i in chunk])
                torch.cuda.current_stream(self.device).synchronize()
                del decoded, frames
                yield out
            del decoder
