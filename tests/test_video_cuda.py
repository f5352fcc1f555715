"""The GPU video path (NVDEC through PyNvVideoCodec into device memory), on hosts with CUDA and PyNvVideoCodec;
skipped elsewhere. scripts/gpu_checks.sh runs these.

NVDEC decodes the same YUV as FFmpeg (H.264 and VP9 decoding is bit-exact by their standards); its RGB conversion is
not swscale's (nvdec_decoder's docstring), so frames are compared with a tolerance, and each NVDEC frame must be
closer to FFmpeg's frame of the same number than to its neighbours (the frames are numbered alike)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from qwen3vl_trt.common.limits import RequestLimits
from qwen3vl_trt.errors import Qwen3VLTrtError
from qwen3vl_trt.preprocess import Preprocessor
from qwen3vl_trt.preprocess.videos import decode_frames, probe_video
from qwen3vl_trt.qa.tiny import synthetic_video


def _nvdec_missing() -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA device"
    from qwen3vl_trt.preprocess.nvdec_decoder import NvdecVideoDecoder

    try:
        NvdecVideoDecoder(torch.device("cuda"))
    except Qwen3VLTrtError as e:
        return str(e)
    return None


pytestmark = [pytest.mark.cuda, pytest.mark.skipif(_nvdec_missing() is not None, reason=str(_nvdec_missing()))]
MEAN_LEVELS = 3.0  # mean |difference| of RGB levels NVDEC's conversion may add on these SD clips (BT.601 on both)
# NVDEC's smallest VP9 frame is 128x128; an odd width checks that the even-rounded surface is cropped.
CLIPS = {
    "h264 B-frames, keyframe every 12": dict(frames=60, height=160, width=96, fps=30, options={"g": "12", "bf": "2"}),
    "h264 640x360 29.97 fps": dict(frames=40, height=360, width=640, fps=30000 / 1001, options={"g": "15"}),
    "vp9 webm odd width": dict(frames=30, height=144, width=201, fps=25, codec="libvpx-vp9", container="webm"),
}


def _nvdec():
    from qwen3vl_trt.preprocess.nvdec_decoder import NvdecVideoDecoder

    return NvdecVideoDecoder(torch.device("cuda"))


@pytest.mark.parametrize("name", list(CLIPS))
def test_nvdec_frames_match_ffmpeg_frames(name):
    data = synthetic_video(**CLIPS[name])
    header = probe_video(data, 0, RequestLimits())
    every = list(range(header.total_frames))
    ffmpeg = dict(decode_frames(data, header, every))
    chunks = list(_nvdec().decode(data, every))
    assert all(c.device.type == "cuda" and c.dtype == torch.uint8 for c in chunks) and len(chunks) > 1
    decoded = torch.cat(chunks)
    assert tuple(decoded.shape) == (header.total_frames, header.height, header.width, 3)
    frames = decoded.cpu().numpy().astype(np.int16)
    for n in every:
        here = np.abs(frames[n] - ffmpeg[n]).mean()
        assert here <= MEAN_LEVELS, f"frame {n}: mean |diff| {here:.2f} levels"
        for other in (n - 1, n + 1):
            if 0 <= other < header.total_frames:
                assert here < np.abs(frames[n] - ffmpeg[other]).mean(), f"frame {n} looks like frame {other}"


@pytest.mark.parametrize("name", ["h264 B-frames, keyframe every 12", "vp9 under NVDEC's smallest frame"])
def test_a_video_request_on_cuda_equals_the_host_path_within_tolerance(name, tiny_dense):
    data = synthetic_video(**CLIPS[name]) if name in CLIPS else synthetic_video(20, 96, 96, 10, "libvpx-vp9", "webm")
    messages = [{"role": "user", "content": [{"type": "video", "video": data}, {"type": "text", "text": "?"}]}]
    gpu = Preprocessor.from_pretrained(tiny_dense, device="cuda", video_decoder="nvdec")
    if name in CLIPS:
        request = gpu(messages)
    else:  # NVDEC refuses it; the host decodes it, the device resizes it
        with pytest.warns(UserWarning, match="decoded on the host"):
            request = gpu(messages)
    cpu = Preprocessor.from_pretrained(tiny_dense, device="cpu")(messages)
    assert request.pixel_values.device.type == "cuda"
    np.testing.assert_array_equal(request.input_ids, cpu.input_ids)
    np.testing.assert_array_equal(request.video_grid_thw, cpu.video_grid_thw)
    diff = (request.pixel_values.cpu() - cpu.pixel_values).abs()
    assert diff.mean().item() <= MEAN_LEVELS * 2 / 255, f"mean |diff| {diff.mean().item():.4f}"
