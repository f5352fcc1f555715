"""The GPU video path (NVDEC through PyNvVideoCodec into device memory), on hosts with CUDA and PyNvVideoCodec;
skipped elsewhere. scripts/gpu_checks.sh runs these.

NVDEC decodes the same YUV as FFmpeg (H.264 and VP9 decoding is bit-exact by their standards); its RGB conversion is
not swscale's (nvdec_decoder's docstring), so frames are compared with a tolerance, and each NVDEC frame must be
closer to FFmpeg's frame of the same number than to its neighbours (the frames are numbered alike)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import videos as clips
from qwen3vl_trt.limits import RequestLimits
from qwen3vl_trt.preprocess import Preprocessor
from qwen3vl_trt.preprocess.videos import decode_frames, probe_video

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
MEAN_LEVELS = 3.0  # mean |difference| of RGB levels NVDEC's conversion may add on these SD clips (BT.601 on both)


def _nvdec():
    from qwen3vl_trt.preprocess.nvdec_decoder import NvdecVideoDecoder

    return NvdecVideoDecoder(torch.device("cuda"))


@pytest.mark.parametrize("name", [n for n in clips.CLIPS if "3 frames" not in n])
def test_nvdec_frames_match_ffmpeg_frames(name):
    data = clips.clip(name)
    header = probe_video(data, 0, RequestLimits())
    every = list(range(header.total_frames))
    ffmpeg = dict(decode_frames(data, header, every))
    decoded = _nvdec().decode(data, every)
    assert decoded.device.type == "cuda" and decoded.dtype == torch.uint8
    assert tuple(decoded.shape) == (header.total_frames, header.height, header.width, 3)
    frames = decoded.cpu().numpy().astype(np.int16)
    for n in every:
        here = np.abs(frames[n] - ffmpeg[n]).mean()
        assert here <= MEAN_LEVELS, f"frame {n}: mean |diff| {here:.2f} levels"
        for other in (n - 1, n + 1):
            if 0 <= other < header.total_frames:
                assert here < np.abs(frames[n] - ffmpeg[other]).mean(), f"frame {n} looks like frame {other}"


def test_a_video_request_on_cuda_equals_the_host_path_within_tolerance(tiny_dense):
    data = clips.clip("h264 portrait 30 fps, keyframe every 12, B-frames")
    messages = [{"role": "user", "content": [{"type": "video", "video": data}, {"type": "text", "text": "?"}]}]
    gpu = Preprocessor.from_pretrained(tiny_dense, device="cuda", video_decoder="nvdec")(messages)
    cpu = Preprocessor.from_pretrained(tiny_dense, device="cpu")(messages)
    assert gpu.pixel_values.device.type == "cuda"
    np.testing.assert_array_equal(gpu.input_ids, cpu.input_ids)
    np.testing.assert_array_equal(gpu.video_grid_thw, cpu.video_grid_thw)
    diff = (gpu.pixel_values.cpu() - cpu.pixel_values).abs()
    assert diff.mean().item() <= MEAN_LEVELS * 2 / 255, f"mean |diff| {diff.mean().item():.4f}"
