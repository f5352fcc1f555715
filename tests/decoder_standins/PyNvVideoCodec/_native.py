"""The native part of PyNvVideoCodec 2.2.4 that SimpleDecoder calls (`PyNvVideoCodec_130*.so`), with PyAV standing in
for its FFmpeg demuxer, NVDEC and the RGB conversion kernel. Names and fields are the extension's own (its pybind
strings): CreateSimpleDecoder, StreamMetadata (width, height, num_frames, average_fps, duration, bitrate, codec_name),
ScannedStreamMetadata (adds key_frame_indices, packet_size, pts, dts), DecodedFrame (__dlpack__, __dlpack_device__,
shape, strides, dtype), OutputColorType (NATIVE, RGB, RGBP), PyNvVCException and PyNvVCExceptionUnsupported.

Behaviour modelled, and from where:
- the container's frame count is what its header says (0 for WebM); the scan counts packets (need_scanned_stream_
  metadata, a demux-only pass);
- frames are numbered in presentation order; RGB is PyAV's (swscale's) rgb24, so the stand-in's pixels equal the host
  path's exactly (NVDEC's colour conversion is not swscale's: nvdec_decoder's docstring);
- codecs NVDEC decodes on the GPU host_cuda reports (an H100, Hopper: the Video Codec SDK 13.0 NVDEC application note,
  "NVDEC Hardware Capabilities": MPEG-1/2/4, VC-1, H.264, HEVC, VP8, VP9; not AV1, which needs GA10x or later); any
  other stream fails as its sequence starts, on the first decode call (NvDecoder::HandleVideoSequence, "Codec not
  supported on this GPU", PyNvVCExceptionUnsupported);
- a stream that ends before the frames asked for yields fewer frames; bitstream errors FFmpeg reports raise
  PyNvVCException (NVDEC often conceals them instead: the stand-in errs towards failing);
- a later sequence of another size: larger than the first is refused unless VP9, whose driver handles it; otherwise
  its frames come scaled to the first sequence's size, the display rectangle kept (NvDecoder::ReconfigureDecoder, max
  width and height 0 meaning the first sequence's; swscale scales here, NVDEC's own scaler differs);
- surfaces of NV12 output are an even number of pixels wide (NvDecoder::GetWidth), so RGB frames of odd-width streams
  carry one more column (zeros here);
- the frames of a call live in the decoder's frame buffers, which its next call overwrites (the reason the product
  copies each chunk before asking for the next);
- DecodedFrame.__dlpack__(stream) makes the consumer stream wait on the frame's decode stream when they differ and the
  consumer is not -1 (ExternalBuffer::dlpack), noted as ("wait", consumer, producer) on the host CUDA timeline
  (`note`, set by the test).
"""

from __future__ import annotations

import enum
import io
from dataclasses import dataclass, field
from typing import Any

import av
import numpy as np
import torch

KDL_CPU, KDL_CUDA = 1, 2  # dlpack.h DLDeviceType
_DO_NOT_SYNC = -1
NVDEC_CODECS = ("mpeg1video", "mpeg2video", "mpeg4", "vc1", "h264", "hevc", "vp8", "vp9")


def note(*event: Any) -> None:
    """The host CUDA timeline's note, which a test puts here."""


created: list[_SimpleDecoder] = []  # every decoder made, for tests to inspect


class PyNvVCException(Exception):
    pass


class PyNvVCExceptionUnsupported(PyNvVCException):
    pass


class OutputColorType(enum.Enum):
    NATIVE = 0
    RGB = 1
    RGBP = 2


@dataclass
class StreamMetadata:
    width: int
    height: int
    num_frames: int
    average_fps: float
    duration: float
    bitrate: int
    codec_name: str


@dataclass
class ScannedStreamMetadata(StreamMetadata):
    key_frame_indices: list[int] = field(default_factory=list)
    packet_size: list[int] = field(default_factory=list)
    pts: list[int] = field(default_factory=list)
    dts: list[int] = field(default_factory=list)


class DecodedFrame:
    def __init__(self, pixels: np.ndarray, gpu_id: int, on_device: bool, decode_stream: int) -> None:
        self._pixels = pixels
        self._device = (KDL_CUDA, gpu_id) if on_device else (KDL_CPU, 0)
        self._decode_stream = decode_stream
        self.shape, self.strides, self.dtype = pixels.shape, pixels.strides, pixels.dtype

    def __dlpack_device__(self) -> tuple[int, int]:
        return self._device

    def __dlpack__(self, stream: int | None = None) -> Any:
        consumer = 0 if stream is None else int(stream)
        if self._device[0] == KDL_CUDA and consumer not in (_DO_NOT_SYNC, self._decode_stream):
            note("wait", consumer, self._decode_stream)
        return self._pixels.__dlpack__()


class _SimpleDecoder:
    def __init__(
        self,
        source: bytes,
        gpu_id: int,
        cuda_stream: int,
        use_device_memory: bool,
        scan: bool,
        output_color_type: OutputColorType,
    ) -> None:
        if output_color_type != OutputColorType.RGB:
            raise NotImplementedError("the stand-in decodes to interleaved RGB only")
        if not 0 <= gpu_id < torch.cuda.device_count():
            raise PyNvVCException("CUDA driver API error CUDA_ERROR_INVALID_DEVICE")
        self.gpu_id, self.cuda_stream, self.use_device_memory = gpu_id, cuda_stream, use_device_memory
        self.scan, self.output_color_type = scan, output_color_type
        self._source = source
        self._buffers: list[np.ndarray] = []  # the decoder's frame buffers, reused call after call
        try:
            with av.open(io.BytesIO(source), mode="r") as container:
                stream = container.streams.video[0]
                rate = float(stream.average_rate or 0)
                self._meta = StreamMetadata(
                    width=stream.codec_context.width,
                    height=stream.codec_context.height,
                    num_frames=int(stream.frames),
                    average_fps=rate,
                    duration=float(stream.duration * stream.time_base) if stream.duration and stream.time_base else 0.0,
                    bitrate=int(stream.bit_rate or 0),
                    codec_name=stream.codec_context.codec.canonical_name,
                )
                self._scanned = self._scan(container, stream) if scan else None
        except (av.FFmpegError, IndexError) as e:
            raise PyNvVCException(f"FFmpegDemuxer: {e}") from e
        created.append(self)

    def _scan(self, container: Any, stream: Any) -> ScannedStreamMetadata:
        packets = [p for p in container.demux(stream) if p.size]
        meta = ScannedStreamMetadata(**vars(self._meta))
        meta.num_frames = len(packets)
        meta.key_frame_indices = [i for i, p in enumerate(packets) if p.is_keyframe]
        meta.packet_size = [p.size for p in packets]
        meta.pts, meta.dts = [p.pts for p in packets], [p.dts for p in packets]
        return meta

    def get_stream_metadata(self) -> StreamMetadata:
        return self._meta

    def get_scanned_stream_metadata(self) -> ScannedStreamMetadata:
        assert self._scanned is not None
        return self._scanned

    def get_batch_frames_by_index(self, indices: list[int]) -> list[DecodedFrame]:
        wanted = set(indices)
        pictures: list[np.ndarray] = []
        try:
            with av.open(io.BytesIO(self._source), mode="r") as container:
                stream = container.streams.video[0]
                if stream.codec_context.codec.canonical_name not in NVDEC_CODECS:
                    raise PyNvVCExceptionUnsupported("Codec not supported on this GPU")
                width, height = stream.codec_context.width, stream.codec_context.height
                for number, frame in enumerate(container.decode(stream)):
                    larger = frame.width > width or frame.height > height
                    if larger and stream.codec_context.codec.canonical_name != "vp9":
                        raise PyNvVCException("Reconfigure Not supported when width/height > maxwidth/maxheight")
                    if number in wanted:
                        pictures.append(frame.reformat(width, height).to_ndarray(format="rgb24"))
                    if len(pictures) == len(wanted):
                        break
        except av.FFmpegError as e:
            raise PyNvVCException(f"NvDecoder: {e}") from e
        return [self._frame(k, rgb) for k, rgb in enumerate(pictures)]

    def _frame(self, slot: int, rgb: np.ndarray) -> DecodedFrame:
        height, width, _ = rgb.shape
        shape = (height, width + width % 2, 3)
        if slot == len(self._buffers):
            self._buffers.append(np.zeros(shape, np.uint8))
        elif self._buffers[slot].shape != shape:
            self._buffers[slot] = np.zeros(shape, np.uint8)
        self._buffers[slot][:, :width] = rgb
        return DecodedFrame(self._buffers[slot], self.gpu_id, self.use_device_memory, self.cuda_stream)


def CreateSimpleDecoder(  # upstream's names
    source: bytes,
    gpu_id: int,
    cuda_context: int,
    cuda_stream: int,
    use_device_memory: bool,
    max_width: int,
    max_height: int,
    need_scanned_stream_metadata: bool,
    decoder_cache_size: int,
    output_color_type: OutputColorType,
    wait_for_session_warm_up: bool,
    enable_decode_stats: bool,
) -> _SimpleDecoder:
    return _SimpleDecoder(
        source, gpu_id, cuda_stream, use_device_memory, bool(need_scanned_stream_metadata), output_color_type
    )
