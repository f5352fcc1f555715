"""Real encoded test videos, made here with FFmpeg (PyAV): the codecs, containers, rates and shapes clients send,
and the broken files they send too."""

from __future__ import annotations

import io
from fractions import Fraction

import av
import numpy as np
from qwen3vl_trt.qa.tiny import synthetic_video

# name -> (frames, height, width, fps, codec, container, encoder options)
CLIPS = {
    "h264 3 s 10 fps": (30, 90, 130, 10, "libx264", "mp4", {}),
    "h264 portrait 30 fps, keyframe every 12, B-frames": (100, 160, 90, 30, "libx264", "mp4", {"g": "12", "bf": "2"}),
    "h264 29.97 fps 74x102": (41, 74, 102, 30000 / 1001, "libx264", "mp4", {"g": "10"}),
    "vp9 webm 25 fps odd size": (50, 67, 123, 25, "libvpx-vp9", "webm", {"g": "10"}),
    "vp9 webm 7.5 fps": (11, 96, 96, 7.5, "libvpx-vp9", "webm", {}),
    "h264 3 frames (under min_frames)": (3, 64, 80, 10, "libx264", "mp4", {}),
    "h264 mkv 12 fps": (40, 72, 128, 12, "libx264", "matroska", {"g": "6"}),
}


def clip(name: str, seed: int = 0) -> bytes:
    frames, height, width, fps, codec, container, options = CLIPS[name]
    return synthetic_video(frames, height, width, fps, codec, container, seed, options)


def audio_only() -> bytes:
    """An MP4 with one AAC track and no video."""
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        stream = out.add_stream("aac", rate=16000)
        for i in range(10):
            samples = np.zeros((1, 1024), dtype=np.float32)
            frame = av.AudioFrame.from_ndarray(samples, format="fltp", layout="mono")
            frame.sample_rate, frame.pts, frame.time_base = 16000, i * 1024, Fraction(1, 16000)
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()


def ffv1_mkv() -> bytes:
    """A lossless FFV1 clip in Matroska: FFmpeg decodes it, NVDEC does not, so the deployment refuses it."""
    return synthetic_video(6, 32, 32, 10, "ffv1", "matroska")


def corrupt_middle(data: bytes) -> bytes:
    """The same container with its coded frames overwritten past the first keyframe: headers and index intact."""
    damaged = bytearray(data)
    start = len(damaged) // 3
    damaged[start : start + len(damaged) // 3] = bytes(len(damaged) // 3)
    return bytes(damaged)
