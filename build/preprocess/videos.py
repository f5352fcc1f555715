"""Videos -> sampled, timestamped, normalized patches, equal to transformers' Qwen3-VL video processor and processor.

What transformers does (`video_processing_qwen3_vl.py`, `processing_qwen3_vl.py`, `video_utils.read_video_pyav`),
and so what this module does:

- Sampling: `fps` frames per second of the container's frame count (`stream.frames`) at its average rate, clamped
  to [min_frames, max_frames] and to the frame count; indices `linspace(0, total - 1, n).round()`. Frames are
  numbered in presentation order, as PyAV's decoder outputs them.
- Resizing: one size per video from the video `smart_resize` (the whole video's pixels within `size`, frames too
  small for a merged patch scaled up first as 5.x does; 4.57.3 refuses them), bicubic with antialias on uint8
  (torchvision), then the fused rescale-normalize and the patchify of images, two frames per temporal patch (the
  last frame repeated when the count is odd).
- Timestamps: each temporal patch is introduced in the prompt by `<{t:.1f} seconds>`, t the mean time of its two
  frames (index / fps).
- `cap_pixels_per_frame` (5.x only: qwen-vl-utils' per-frame cap) applies when the checkpoint's
  video_preprocessor_config.json sets it; transformers 5.x's default (unset) leaves it off, as 4.57.3 does.

Decoding is faster than transformers' without changing a pixel: only the packet index is read up front (frame count,
keyframes, limits, all checked before anything is decoded), the decoder runs its own threads, each sampled frame is
reached by seeking to the keyframe before it when that skips frames, only sampled frames are converted to RGB
(swscale's rgb24, as `to_ndarray` in transformers), and each is resized and patchified as soon as it is decoded.
"""

from __future__ import annotations

import contextlib
import io
import os
import queue
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

import numpy as np
import torch

from ..common.fsutil import read_json
from ..common.limits import VideoLimits
from ..errors import ImageShapeError, VideoDecodeError, VideoTooLargeError
from .images import (
    MAX_ASPECT_RATIO,
    ImageProcessingConfig,
    Normalizer,
    _empty_float32,
    fit_pixel_bounds,
    resize_torchvision,
)

VIDEO_PREPROCESSOR_CONFIG_FILE = "video_preprocessor_config.json"
# Codecs accepted: what FFmpeg decodes here and NVDEC decodes on some GPU (what a GPU's NVDEC lacks, the host decodes).
ACCEPTED_CODECS = ("h264", "hevc", "vp8", "vp9", "av1", "mpeg4", "mpeg2video", "mpeg1video", "mjpeg")
# The processor's class defaults (Qwen3VLVideoProcessor, both 4.57.3 and 5.x) where the checkpoint's file is silent.
_DEFAULT_FPS, _DEFAULT_MIN_FRAMES, _DEFAULT_MAX_FRAMES, _DEFAULT_MAX_VIDEO_TOKENS = 2.0, 4, 768, 768


@dataclass(frozen=True)
class VideoProcessingConfig:
    """The checkpoint's video_preprocessor_config.json. `pixels` holds patching, normalization and the whole
    video's pixel bounds (size.shortest_edge / longest_edge, over all sampled frames)."""

    pixels: ImageProcessingConfig
    fps: float
    min_frames: int
    max_frames: int
    cap_pixels_per_frame: bool
    max_video_tokens: int

    @classmethod
    def from_pretrained(cls, model_dir: str | os.PathLike[str]) -> VideoProcessingConfig:
        path = Path(model_dir) / VIDEO_PREPROCESSOR_CONFIG_FILE
        cfg = read_json(path, f"{path} is missing; copy video_preprocessor_config.json from the released checkpoint")
        return cls(
            pixels=ImageProcessingConfig.from_dict(cfg, where=str(path)),
            fps=float(cfg.get("fps", _DEFAULT_FPS)),
            min_frames=int(cfg.get("min_frames", _DEFAULT_MIN_FRAMES)),
            max_frames=int(cfg.get("max_frames", _DEFAULT_MAX_FRAMES)),
            cap_pixels_per_frame=bool(cfg.get("cap_pixels_per_frame") or False),
            max_video_tokens=int(cfg.get("max_video_tokens", _DEFAULT_MAX_VIDEO_TOKENS)),
        )


@dataclass(frozen=True)
class DecodedVideo:
    """A video the caller decoded and sampled: RGB uint8 frames [T, H, W, 3] and each frame's time in seconds.
    Used as given (no sampling), as transformers' processor with do_sample_frames=False."""

    frames: np.ndarray
    timestamps: tuple[float, ...]


VideoSource = bytes | DecodedVideo


def _label(index: int) -> str:
    return f"video {index}"


@dataclass(frozen=True)
class VideoHeader:
    """What the container says before any frame is decoded. frame_pts/keyframes (per frame, presentation order)
    are None when the packet index cannot be trusted to name frames; then frames are found by decoding in order."""

    index: int
    codec: str
    width: int
    height: int
    fps: float
    total_frames: int
    frame_pts: tuple[int, ...] | None
    keyframes: tuple[bool, ...] | None

    def keyframe_before(self) -> np.ndarray:
        """Per frame, the last keyframe at or before it (-1 before the first); needs frame_pts and keyframes."""
        assert self.keyframes is not None
        return np.maximum.accumulate(np.where(self.keyframes, np.arange(self.total_frames), -1))


def check_video_bytes(size: int, max_video_bytes: int, where: str) -> None:
    if size > max_video_bytes:
        raise VideoTooLargeError(
            f"{where}: the video is {size:,} bytes, over the limit of {max_video_bytes:,} bytes per video "
            "(max_video_bytes); send a shorter or more compressed clip"
        )


def probe_video(data: bytes, index: int, limits: VideoLimits) -> VideoHeader:
    """Opens the container and reads its packet index (no frame is decoded); checks codec and limits."""
    import av

    where = _label(index)
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise VideoDecodeError(f"{where}: expected encoded video bytes, got {type(data).__name__}")
    if len(data) == 0:
        raise VideoDecodeError(f"{where}: empty bytes")
    check_video_bytes(len(data), limits.max_video_bytes, where)
    try:
        container = av.open(io.BytesIO(data), mode="r")
    except (av.FFmpegError, ValueError, OSError) as e:
        head = bytes(data[:8]).hex(" ")
        raise VideoDecodeError(
            f"{where}: not a readable video container ({len(data)} bytes starting {head}: {e}); it may be truncated. "
            "Send MP4, WebM, MKV or MOV"
        ) from e
    with container:
        if container.format.name.endswith("_pipe") or container.format.name == "image2":
            raise VideoDecodeError(f"{where}: this is an image ({container.format.long_name}); send it as an image")
        if not container.streams.video:
            kinds = sorted({s.type for s in container.streams})
            raise VideoDecodeError(f"{where}: the file has no video stream (streams: {', '.join(kinds) or 'none'})")
        stream = container.streams.video[0]
        # The codec's own name: the decoder's can differ (PyAV's wheels decode AV1 with libdav1d).
        codec = stream.codec_context.codec.canonical_name if stream.codec_context is not None else "unknown"
        if codec not in ACCEPTED_CODECS:
            raise VideoDecodeError(f"{where}: codec {codec!r} is not supported; send {', '.join(ACCEPTED_CODECS)}")
        width, height = int(stream.codec_context.width), int(stream.codec_context.height)
        if width <= 0 or height <= 0:
            raise VideoDecodeError(f"{where}: the stream declares no frame size")
        if width * height > limits.max_video_frame_pixels:
            raise VideoTooLargeError(
                f"{where}: frames are {width}x{height}, over the limit of {limits.max_video_frame_pixels:,} pixels "
                "per frame (max_video_frame_pixels); downscale the video"
            )
        rate = stream.average_rate
        if not rate or float(rate) <= 0:
            raise VideoDecodeError(f"{where}: the stream declares no frame rate, so frames cannot be timed")
        fps = float(rate)
        pts, keys = [], []
        try:
            for packet in container.demux(stream):
                if packet.size == 0 or packet.is_discard:
                    continue
                pts.append(packet.pts)
                keys.append(bool(packet.is_keyframe))
                if len(pts) > limits.max_video_seconds * fps:  # bounds the index read on endless streams
                    break
        except av.FFmpegError as e:
            raise VideoDecodeError(f"{where}: the container is corrupt ({e})") from e
        # transformers counts stream.frames (0 where the muxer records none, as WebM; there it fails, here the
        # packet index counts them).
        total = int(stream.frames) or len(pts)
    if total == 0:
        raise VideoDecodeError(f"{where}: the video stream has no frames")
    if total / fps > limits.max_video_seconds:
        raise VideoTooLargeError(
            f"{where}: the video lasts {total / fps:.1f} s, over the limit of {limits.max_video_seconds} s "
            "(max_video_seconds); send a shorter clip"
        )
    trusted = len(pts) == total and None not in pts and len(set(pts)) == total
    order = np.argsort(np.asarray(pts, dtype=np.int64)) if trusted else None
    return VideoHeader(
        index=index,
        codec=codec,
        width=width,
        height=height,
        fps=fps,
        total_frames=total,
        frame_pts=tuple(int(pts[i]) for i in order) if order is not None else None,
        keyframes=tuple(keys[i] for i in order) if order is not None else None,
    )


def sample_indices(total_frames: int, video_fps: float, config: VideoProcessingConfig) -> np.ndarray:
    """Qwen3VLVideoProcessor.sample_frames at the config's fps."""
    count = int(total_frames / video_fps * config.fps)
    count = min(max(count, config.min_frames), config.max_frames, total_frames)
    return np.linspace(0, total_frames - 1, count).round().astype(int)


def patch_timestamps(frame_seconds: Sequence[float], temporal_patch_size: int) -> list[float]:
    """Qwen3VLProcessor._calculate_timestamps: each temporal patch's mean time (the last frame repeated to fill)."""
    seconds = list(frame_seconds)
    if len(seconds) % temporal_patch_size:
        seconds.extend([seconds[-1]] * (temporal_patch_size - len(seconds) % temporal_patch_size))
    return [
        (seconds[i] + seconds[i + temporal_patch_size - 1]) / 2 for i in range(0, len(seconds), temporal_patch_size)
    ]


def video_smart_resize(
    num_frames: int, height: int, width: int, config: VideoProcessingConfig, max_video_pixels: int
) -> tuple[int, int]:
    """The video processor's resize size (5.x: frames smaller than a merged patch are scaled up first), with the
    whole-video budget lowered to max_video_pixels and the per-frame cap when the config asks for it."""
    pixels = config.pixels
    factor, temporal = pixels.factor, pixels.temporal_patch_size
    max_pixels = min(pixels.max_pixels, max_video_pixels)
    min_pixels = pixels.min_pixels
    if config.cap_pixels_per_frame:
        frame_cap = config.max_video_tokens * factor * factor
        max_pixels = max(min(frame_cap, max_pixels // num_frames), int(min_pixels * 1.05)) * num_frames
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ImageShapeError(
            f"aspect ratio {max(height, width) / min(height, width):.0f}:1 ({width}x{height}) is over "
            f"{MAX_ASPECT_RATIO}:1, the most the model's resizing accepts; crop the video"
        )
    t_bar = round(num_frames / temporal) * temporal
    return fit_pixel_bounds(height, width, factor, min_pixels, max_pixels, num_frames, t_bar)


@dataclass(frozen=True)
class VideoPlan:
    """One video after its container index was read and checked: which frames decoding will produce and how."""

    source: VideoSource
    header: VideoHeader | None  # None for a DecodedVideo
    indices: np.ndarray  # sampled frames (presentation order); all frames of a DecodedVideo
    timestamps: tuple[float, ...]  # per temporal patch, as the prompt shows them
    size: tuple[int, int]  # resized (height, width)
    grid_thw: tuple[int, int, int]

    @property
    def num_patches(self) -> int:
        t, h, w = self.grid_thw
        return t * h * w


def plan_video(source: VideoSource, index: int, config: VideoProcessingConfig, limits: VideoLimits) -> VideoPlan:
    """Reads the container's index (or checks decoded frames), samples and sizes the video; no frame is decoded."""
    where = _label(index)
    if isinstance(source, DecodedVideo):
        frames = source.frames
        if not isinstance(frames, np.ndarray) or frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[3] != 3:
            raise VideoDecodeError(f"{where}: decoded frames must be RGB uint8 [frames, height, width, 3]")
        if len(source.timestamps) != len(frames) or not len(frames):
            raise VideoDecodeError(f"{where}: {len(frames)} decoded frames need as many timestamps")
        header, indices, seconds = None, np.arange(len(frames)), [float(t) for t in source.timestamps]
        height, width = int(frames.shape[1]), int(frames.shape[2])
    else:
        header = probe_video(source, index, limits)
        indices = sample_indices(header.total_frames, header.fps, config)
        seconds = [int(i) / header.fps for i in indices]
        height, width = header.height, header.width
    temporal = config.pixels.temporal_patch_size
    if len(indices) < temporal:
        raise VideoDecodeError(f"{where}: {len(indices)} frame(s); the model needs at least {temporal}")
    if len(indices) > limits.max_video_frames:
        raise VideoTooLargeError(
            f"{where}: {len(indices)} frames sampled, over the limit of {limits.max_video_frames} "
            "(max_video_frames); send a shorter clip"
        )
    try:
        size = video_smart_resize(len(indices), height, width, config, limits.max_video_pixels)
    except ImageShapeError as e:  # the model's resizing bound; for a video, an invalid video
        raise VideoDecodeError(f"{where}: {e}") from None
    p = config.pixels.patch_size
    grid = (-(-len(indices) // temporal), size[0] // p, size[1] // p)
    return VideoPlan(source, header, indices, tuple(patch_timestamps(seconds, temporal)), size, grid)


class VideoFrameDecoder(Protocol):
    """Decodes the sampled frames of one video (ascending) to RGB uint8 [n, H, W, 3] chunks on its device, in order
    (a GPU decoder); VideoDecodeError for a video it cannot decode."""

    device: torch.device

    def decode(self, data: bytes, indices: Sequence[int]) -> Iterator[torch.Tensor]: ...


def decode_frames(
    data: bytes,
    header: VideoHeader,
    indices: Sequence[int],
    workers: int = 1,
    transform: Callable[[np.ndarray], Any] | None = None,
) -> Iterator[tuple[int, Any]]:
    """(position in indices, RGB uint8 [H, W, 3]) for each sampled frame, decoded by FFmpeg (PyAV) on this host, in
    no particular order. With a trustworthy packet index each frame is reached from the keyframe before it (seeking
    past every frame not needed), and with several workers the video's GOPs are cut into that many runs decoded at
    once, each by a decoder of its own (a GOP decodes alike from its keyframe, whoever decodes it); otherwise frames are
    decoded in order from the start, as transformers does. transform, if given, is applied to each frame on the
    thread that decoded it."""
    wanted = [int(i) for i in indices]
    if header.frame_pts is None or header.keyframes is None:
        yield from _decode_part(data, header, wanted, 0, transform)
        return
    gops = np.flatnonzero(np.diff(header.keyframe_before()[wanted], prepend=-2)) if wanted else np.array([], int)
    if workers <= 1 or len(gops) <= 1:
        yield from _decode_part(data, header, wanted, 0, transform)
        return
    # Contiguous runs of GOPs, as even in sampled frames as GOP bounds allow; a decoder each.
    cuts = gops[np.linspace(0, len(gops), min(workers, len(gops)) + 1).astype(int)[1:-1]].tolist()
    bounds = [0, *cuts, len(wanted)]
    parts = [
        _decode_part(data, header, wanted[a:b], a, transform) for a, b in zip(bounds[:-1], bounds[1:], strict=True)
    ]
    yield from merged(parts, depth=4)


def _decode_part(
    data: bytes,
    header: VideoHeader,
    wanted: list[int],
    offset: int,
    transform: Callable[[np.ndarray], Any] | None,
) -> Iterator[tuple[int, Any]]:
    """Frames `wanted` (ascending) by one decoder, with their positions offset."""
    import av

    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            stream = container.streams.video[0]
            # Slice threads (FFmpeg's default kind): with a decoder per GOP run they still measured faster than
            # single-threaded decoders (frame threads, slower than both) on 2 cores.
            stream.thread_type = "SLICE"
            if header.frame_pts is None or header.keyframes is None:
                frames = _decode_in_order(container, stream, wanted, header)
            else:
                frames = _decode_seeking(container, stream, header, wanted)
            for position, frame in frames:
                yield offset + position, frame if transform is None else transform(frame)
    except av.FFmpegError as e:
        raise VideoDecodeError(f"{_label(header.index)}: corrupt video data ({e})") from e


def _rgb(frame) -> np.ndarray:  # type: ignore[no-untyped-def]
    return frame.to_ndarray(format="rgb24")


def _decode_in_order(container, stream, wanted: list[int], header: VideoHeader) -> Iterator[tuple[int, np.ndarray]]:  # type: ignore[no-untyped-def]
    position, number = 0, -1
    for number, frame in enumerate(container.decode(stream)):
        if number < wanted[position]:
            continue
        rgb = _rgb(frame)
        while position < len(wanted) and wanted[position] == number:
            yield position, rgb
            position += 1
        if position == len(wanted):
            return
    raise VideoDecodeError(
        f"{_label(header.index)}: the video ended after {number + 1} frames, before frame {wanted[position]}: "
        "it is truncated"
    )


def _decode_seeking(container, stream, header: VideoHeader, wanted: list[int]) -> Iterator[tuple[int, np.ndarray]]:  # type: ignore[no-untyped-def]
    assert header.frame_pts is not None and header.keyframes is not None
    number_of = {pts: n for n, pts in enumerate(header.frame_pts)}
    wanted_pts = {header.frame_pts[n] for n in wanted}
    keyframe_before = header.keyframe_before()
    position, next_out = 0, None  # next_out: the frame the running decoder gives next (None: not started)
    while position < len(wanted):
        target = wanted[position]
        key = int(keyframe_before[target])
        if next_out is None or key > next_out or target < next_out:
            # A seek lands on the keyframe at or before the timestamp; the decoder restarts clean there.
            container.seek(header.frame_pts[max(key, 0)], stream=stream, backward=True, any_frame=False)
            frames = _decode_skipping(container, stream, wanted_pts)
        found = False
        for frame in frames:
            number = number_of.get(frame.pts) if frame.pts is not None else None
            if number is None:
                raise VideoDecodeError(f"{_label(header.index)}: decoded a frame the index does not list")
            next_out = number + 1
            if number < target:
                continue
            if number > target:
                break
            rgb = _rgb(frame)
            while position < len(wanted) and wanted[position] == number:
                yield position, rgb
                position += 1
            found = True
            break
        if not found:
            raise VideoDecodeError(
                f"{_label(header.index)}: frame {target} of {header.total_frames} could not be decoded; "
                "the video is truncated or corrupt"
            )


def _decode_skipping(container, stream, wanted_pts: set[int]) -> Iterator:  # type: ignore[no-untyped-def]
    """Frames from the demuxer's position on, where a frame that is not wanted and that no other frame references
    (H.264/HEVC non-reference pictures, often half the frames of a clip with B-frames) is not decoded at all: the
    decoder discards it (skip_frame NONREF, set per packet before it is sent), which changes no other frame."""
    context = stream.codec_context
    try:
        for packet in container.demux(stream):
            context.skip_frame = "DEFAULT" if packet.pts is None or packet.pts in wanted_pts else "NONREF"
            yield from context.decode(packet)
    finally:
        context.skip_frame = "DEFAULT"


_T = TypeVar("_T")


def merged(producers: Sequence[Iterator[_T]], depth: int) -> Iterator[_T]:
    """The items of every producer, each run on a thread of its own (FFmpeg releases the GIL while it decodes), in
    the order they are made, at most `depth` waiting; a producer's error is raised here, and the producers stop
    when the consumer does."""
    made: queue.Queue[tuple[bool, object]] = queue.Queue(depth)
    stop = threading.Event()

    def put(item: tuple[bool, object]) -> bool:
        while not stop.is_set():
            try:
                made.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce(items: Iterator[_T]) -> None:
        try:
            for item in items:
                if not put((True, item)):
                    return
            put((False, None))
        except BaseException as e:  # handed to the consumer
            put((False, e))

    workers = [threading.Thread(target=produce, args=(p,), name="video-decode", daemon=True) for p in producers]
    for worker in workers:
        worker.start()
    try:
        running = len(workers)
        while running:
            more, item = made.get()
            if more:
                yield item  # type: ignore[misc]
            elif isinstance(item, BaseException):
                raise item
            else:
                running -= 1
    finally:
        stop.set()
        for worker in workers:
            worker.join()


@contextlib.contextmanager
def _torch_threads(count: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def render_video(
    plan: VideoPlan,
    config: VideoProcessingConfig,
    normalize: Normalizer,
    out: torch.Tensor,
    decoder: VideoFrameDecoder | None = None,
) -> None:
    """Decodes the plan's frames and writes their patches into out [num_patches, patch_dim] in the processor's
    order: each frame resized as soon as it is decoded, each temporal patch written as soon as its frames are in."""
    pixels = config.pixels
    height, width = plan.size
    temporal, p, m = pixels.temporal_patch_size, pixels.patch_size, pixels.merge_size
    t = plan.grid_thw[0]
    device = out.device
    resized = torch.empty((t * temporal, height, width, 3), dtype=torch.uint8, device=device)
    count = len(plan.indices)
    # Frames each temporal patch still waits for (the last patch repeats the last frame to fill up).
    frames_per_patch = [temporal] * (t - 1) + [count - (t - 1) * temporal]
    missing = list(frames_per_patch)
    bh, bw = height // (p * m), width // (p * m)
    rows_per_patch = bh * bw * m * m

    def keep(position: int, frame: torch.Tensor) -> None:
        resized[position] = frame
        g = position // temporal
        missing[g] -= 1
        if missing[g] == 0:
            if g == t - 1:
                resized[count:] = resized[count - 1]
            blocks = _pair_block_order(resized[g * temporal : (g + 1) * temporal], bh, bw, m, p)
            normalize(blocks, out[g * rows_per_patch : (g + 1) * rows_per_patch].view(-1, 3, temporal, p * p))

    def resize(frame: torch.Tensor) -> torch.Tensor:
        return resize_torchvision(frame, height, width)

    if isinstance(plan.source, DecodedVideo):
        for position, frame_np in enumerate(plan.source.frames):
            keep(position, resize(torch.from_numpy(np.ascontiguousarray(frame_np)).to(device)))
        return
    if decoder is not None:
        if _decoded_on_device(plan, decoder, keep, resize):
            return
        missing[:] = frames_per_patch  # the host decodes it all again
    if device.type == "cpu":
        assert plan.header is not None
        workers = torch.get_num_threads()  # this process's share of the cores
        # Each decoder thread resizes its own frames and this one patchifies, torch single-threaded meanwhile: its
        # own threads would wait on the decoders' at every op.
        with _torch_threads(1 if workers > 1 else workers):
            frames = decode_frames(
                plan.source,
                plan.header,
                plan.indices.tolist(),
                workers,
                lambda frame_np: resize(torch.from_numpy(frame_np)).contiguous(),
            )
            for position, small in frames:
                keep(position, small)
    else:  # decoded on the host, resized and patchified on the device
        assert plan.header is not None
        for position, frame_np in decode_frames(plan.source, plan.header, plan.indices.tolist()):
            keep(position, resize(torch.from_numpy(frame_np).to(device)))


def _decoded_on_device(
    plan: VideoPlan,
    decoder: VideoFrameDecoder,
    keep: Callable[[int, torch.Tensor], None],
    resize: Callable[[torch.Tensor], torch.Tensor],
) -> bool:
    """Whether the device decoder decoded the whole video (into keep); False where it cannot (NVDEC lacks some
    codecs, profiles and sizes per GPU: AV1 before Ampere, VP9 under 128 px...), so that the host decodes it."""
    assert not isinstance(plan.source, DecodedVideo) and plan.header is not None
    position = 0
    try:
        for chunk in decoder.decode(plan.source, plan.indices.tolist()):
            for frame in chunk:
                keep(position, resize(frame))
                position += 1
    except VideoDecodeError as e:
        warnings.warn(f"{_label(plan.header.index)}: decoded on the host: {e}", stacklevel=2)
        return False
    return True


def _pair_block_order(frames_thwc: torch.Tensor, bh: int, bw: int, m: int, p: int) -> torch.Tensor:
    """uint8 [T, H, W, 3] (one temporal patch) -> [bh*bw*m*m, 3, T, p*p]: merge blocks row-major, patches
    row-major inside a block, then (C, T, ph, pw), as the processor's patchify."""
    t = frames_thwc.shape[0]
    order = (1, 4, 2, 5, 7, 0, 3, 6)  # (bh, bw, mh, mw, C, T, ph, pw)
    if frames_thwc.device.type == "cpu":
        blocks = frames_thwc.numpy().reshape(t, bh, m, p, bw, m, p, 3).transpose(order)
        return torch.from_numpy(np.ascontiguousarray(blocks)).view(-1, 3, t, p * p)
    return frames_thwc.reshape(t, bh, m, p, bw, m, p, 3).permute(order).contiguous().view(-1, 3, t, p * p)


def empty_rows(plans: Sequence[VideoPlan], patch_dim: int, device: torch.device) -> torch.Tensor:
    return _empty_float32((sum(plan.num_patches for plan in plans), patch_dim), device)
