"""The GPU decoders executed on a CPU machine: nvImageCodec on CUDA (`NvImageCodecDecoder`), NVDEC through
PyNvVideoCodec (`NvdecVideoDecoder`) and the Preprocessor's device path, through the stand-ins of
tests/decoder_standins (README there) with torch's CUDA device on the host (tests/tensorrt_standin/host_cuda.py).

The stand-ins decode with the host's own libraries (nvImageCodec's CPU backend, PyAV), so pixels are compared exactly
with the host path; what only a GPU shows (nvJPEG's and NVDEC's own rounding) is checked on a GPU host by
test_preprocess_cuda.py and test_video_cuda.py."""

from __future__ import annotations

import io
import sys
import types
from pathlib import Path

import av
import numpy as np
import pytest
import torch
from decoder_standins.nvimgcodec_cuda import nvimgcodec_on_cuda
from images import encode, exif_rotated_jpeg, gray_jpeg, jpeg, png
from PIL import Image
from qwen3vl_trt.common.limits import RequestLimits
from qwen3vl_trt.errors import ImageDecodeError, Qwen3VLTrtError, VideoDecodeError
from qwen3vl_trt.preprocess import Preprocessor
from qwen3vl_trt.preprocess.images import open_image
from qwen3vl_trt.preprocess.nvdec_decoder import CHUNK_FRAMES, NvdecVideoDecoder
from qwen3vl_trt.preprocess.nvimgcodec_decoder import NvImageCodecDecoder
from qwen3vl_trt.preprocess.videos import decode_frames, probe_video
from qwen3vl_trt.qa.tiny import synthetic_video
from tensorrt_standin.host_cuda import host_cuda
from videos import clip, corrupt_middle

pytestmark = pytest.mark.once  # decoders and our preprocessing against the host's: no transformers
pytest.importorskip("nvidia.nvimgcodec")
STANDINS = Path(__file__).parent / "decoder_standins"


@pytest.fixture
def cuda():
    with host_cuda() as device:
        yield device


@pytest.fixture
def nv(cuda):
    with nvimgcodec_on_cuda(cuda.note) as module:
        yield module


def _pynvvideocodec_modules() -> list[str]:
    return [name for name in sys.modules if name.split(".")[0] == "PyNvVideoCodec"]


@pytest.fixture
def standin_path():
    """The PyNvVideoCodec stand-in importable (not yet imported) for the test."""
    with pytest.MonkeyPatch.context() as patch:
        for name in _pynvvideocodec_modules():
            patch.delitem(sys.modules, name)
        patch.syspath_prepend(str(STANDINS))
        yield patch
        for name in _pynvvideocodec_modules():
            del sys.modules[name]


@pytest.fixture
def nvc(cuda, standin_path):
    import PyNvVideoCodec

    standin_path.setattr(PyNvVideoCodec._native, "note", cuda.note)
    return PyNvVideoCodec


def _chroma_edges() -> bytes:
    """Saturated 8-pixel squares at 4:2:0: nearest-neighbour chroma is tens of levels off libjpeg on every edge."""
    tile = np.zeros((16, 16, 3), dtype=np.uint8)
    tile[:8, :8] = tile[8:, 8:] = (230, 20, 20)
    tile[:8, 8:] = tile[8:, :8] = (20, 20, 230)
    return encode(Image.fromarray(np.tile(tile, (3, 4, 1))), "JPEG", quality=95, subsampling=2)


IMAGES = [_chroma_edges(), jpeg(40, 56, seed=1), gray_jpeg(24, 32), exif_rotated_jpeg(32, 48, orientation=6)]


def _headers(images):
    return [open_image(data, i, RequestLimits())[1] for i, data in enumerate(images)]


def _pillow(data: bytes) -> np.ndarray:
    """Pillow's pixels as stored (no EXIF transpose), RGB."""
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


# --- nvImageCodec ----------------------------------------------------------------------------------------------------


def test_a_batch_decoded_on_cuda_equals_pillow_and_the_cpu_backend(cuda, nv):
    decoder = NvImageCodecDecoder("cuda")
    side = cuda.Stream(handle=7)  # not 1, which DLPack reserves for the legacy default stream
    with torch.cuda.stream(side):
        frames = decoder.decode(IMAGES, _headers(IMAGES))
    made = nv.decoders[-1]
    assert made.device_id == 0 and made.streams == [side.cuda_stream]  # decoded on torch's current stream
    kinds = nv.BackendKind
    assert made.kinds == [kinds.HW_GPU_ONLY, kinds.HYBRID_CPU_GPU, kinds.GPU_ONLY, kinds.CPU_ONLY]
    assert not [event for event in cuda.timeline if event[0] == "wait"]  # consumed on the stream it was decoded on
    on_cpu = NvImageCodecDecoder("cpu").decode(IMAGES, _headers(IMAGES))
    for data, frame, host in zip(IMAGES, frames, on_cpu, strict=True):
        assert frame.dtype == torch.uint8
        np.testing.assert_array_equal(frame.numpy(), _pillow(data))
        np.testing.assert_array_equal(host.numpy(), _pillow(data))


def test_chroma_upsampling_matches_libjpeg_only_because_the_decoder_asks(cuda, nv):
    data = IMAGES[0]
    frame = NvImageCodecDecoder("cuda").decode([data], _headers([data]))[0]
    assert ":fancy_upsampling=1" in nv.decoders[-1].options.split()
    np.testing.assert_array_equal(frame.numpy(), _pillow(data))
    unasked = nv.Decoder(device_id=0, backends=[nv.Backend(nv.BackendKind.HW_GPU_ONLY)])
    nearest = torch.from_dlpack(unasked.decode([nv.CodeStream(data)])[0]).numpy()
    assert np.abs(nearest.astype(int) - _pillow(data)).max() > 20


def test_images_are_consumed_after_their_decode_stream(cuda, nv):
    """On the default stream torch hands DLPack the legacy stream (1): the image's stream (0) is waited on."""
    NvImageCodecDecoder("cuda").decode(IMAGES[:2], _headers(IMAGES[:2]))
    assert [event for event in cuda.timeline if event[0] == "wait"] == [("wait", 1, 0)] * 2


def test_a_corrupt_image_in_a_batch_is_an_error_naming_it(cuda, nv):
    good, bad = jpeg(64, 64, seed=2), jpeg(256, 256, seed=3)
    images = [good, bad[: len(bad) // 3]]
    with pytest.raises(ImageDecodeError, match=r"^image 1: truncated or corrupt JPEG data \(nvImageCodec\)$"):
        NvImageCodecDecoder("cuda").decode(images, _headers(images))


def test_only_cuda_backends_decode_into_device_memory(cuda, nv):
    """A CPU_ONLY decoder on a CUDA device returns host images (python/decoder.cpp): what the stand-in models."""
    decoder = nv.Decoder(device_id=0, backends=[nv.Backend(nv.BackendKind.CPU_ONLY)])
    image = decoder.decode([nv.CodeStream(IMAGES[1])])[0]
    assert image.buffer_kind == nv.ImageBufferKind.STRIDED_HOST


@pytest.mark.parametrize(
    "problem, message",
    [
        ("missing", r"^nvImageCodec is not installed; install it with `pip install 'nvidia-nvimgcodec-cu13\[nvjpeg\]"),
        ("0.8", r"^nvImageCodec 0\.8\.0 is too old; install it with"),
    ],
)
def test_a_missing_or_old_nvimgcodec_is_named(problem, message, nv, monkeypatch):
    import nvidia

    if problem == "missing":
        monkeypatch.setitem(sys.modules, "nvidia.nvimgcodec", None)
        monkeypatch.delattr(nvidia, "nvimgcodec")
    else:  # 0.9 is the first to export NVIMGCODEC_DEVICE_CPU_ONLY to Python
        monkeypatch.delattr(nv, "NVIMGCODEC_DEVICE_CPU_ONLY")
        monkeypatch.setattr(nv, "__version__", "0.8.0")
    with pytest.raises(Qwen3VLTrtError, match=message):
        NvImageCodecDecoder("cuda")


def test_decoder_creation_failures_are_named(cuda, nv):
    created = (
        r"^nvImageCodec could not create a decoder on cuda:1: Internal error - Could not create decoder\. Code: 8$"
    )
    with pytest.raises(Qwen3VLTrtError, match=created):
        NvImageCodecDecoder("cuda:1")
    with pytest.raises(Qwen3VLTrtError, match=r"^nvImageCodec decodes to 'cuda' or 'cpu', not meta$"):
        NvImageCodecDecoder("meta")


def test_cuda_without_a_device_is_refused():
    with pytest.raises(Qwen3VLTrtError, match=r"^device 'cuda' was asked for but torch sees no CUDA device$"):
        NvImageCodecDecoder("cuda")


# --- NVDEC -----------------------------------------------------------------------------------------------------------

VIDEOS = {
    "h264 B-frames": "h264 portrait 30 fps, keyframe every 12, B-frames",  # 100 frames 160x90
    "vp9 webm, odd width, no frame count": "vp9 webm 25 fps odd size",  # 50 frames 67x123
}


@pytest.mark.parametrize("name", list(VIDEOS))
def test_nvdec_frames_equal_pyav_frames(name, cuda, nvc):
    data = clip(VIDEOS[name])
    header = probe_video(data, 0, RequestLimits())
    # Over two chunks, with duplicates (a short video sampled to min_frames repeats frames).
    wanted = sorted([0, 0, 3, 3, 7, header.total_frames - 1] + list(range(10, 10 + 2 * CHUNK_FRAMES)))
    chunks = list(NvdecVideoDecoder(torch.device("cuda")).decode(data, wanted))
    made = nvc._native.created[-1]
    assert (made.gpu_id, made.use_device_memory, made.scan) == (0, True, True)
    assert made.output_color_type == nvc.OutputColorType.RGB
    assert [len(c) for c in chunks] == [CHUNK_FRAMES, CHUNK_FRAMES, len(wanted) - 2 * CHUNK_FRAMES]
    # Each frame is read on torch's stream (the legacy default, 1) after its decode stream (0).
    frames = sum(len(set(wanted[i : i + CHUNK_FRAMES])) for i in range(0, len(wanted), CHUNK_FRAMES))
    assert [event for event in cuda.timeline if event[0] == "wait"] == [("wait", 1, 0)] * frames
    # Chunks were copied out of the decoder's buffers: the later calls did not overwrite the earlier chunks.
    decoded = torch.cat(chunks)
    assert decoded.dtype == torch.uint8 and tuple(decoded.shape) == (len(wanted), header.height, header.width, 3)
    host = dict(decode_frames(data, header, wanted))
    for position in range(len(wanted)):
        np.testing.assert_array_equal(decoded[position].numpy(), host[position], err_msg=f"frame {wanted[position]}")


def test_frames_out_of_range_are_refused_before_decoding(nvc):
    data = clip("h264 3 s 10 fps")
    decoder = NvdecVideoDecoder(torch.device("cuda"))
    with pytest.raises(VideoDecodeError, match=r"^frame 30 was asked for, but the video has 30 frames$"):
        next(decoder.decode(data, [0, 30]))
    with pytest.raises(VideoDecodeError, match=r"^frame -1 was asked for, but the video has 30 frames$"):
        next(decoder.decode(data, [-1, 2]))
    assert not nvc._native.created[-1]._buffers  # nothing was decoded


def _ts_with_a_resolution_change(first: tuple[int, int], then: tuple[int, int]) -> bytes:
    """Two H.264 clips in MPEG-TS, one after the other (TS concatenates): the stream's size changes mid-video."""
    return synthetic_video(6, *first, 10, "libx264", "mpegts") + synthetic_video(6, *then, 10, "libx264", "mpegts", 1)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: b"", r"^the video is empty$"),
        (lambda: b"\x00\x01 not a container" * 8, r"^NVDEC cannot open the video: FFmpegDemuxer: "),
        (
            lambda: corrupt_middle(clip("h264 3 s 10 fps")),
            r"^NVDEC failed decoding the video: NvDecoder: .*Invalid data",
        ),
        (
            lambda: synthetic_video(8, 64, 64, 10, "libsvtav1", "mp4"),
            r"^NVDEC failed decoding the video: Codec not supported on this GPU$",
        ),
        (
            lambda: _ts_with_a_resolution_change((48, 64), (64, 96)),
            r"^NVDEC failed decoding the video: Reconfigure Not supported when width/height > maxwidth/maxheight$",
        ),
    ],
    ids=["empty", "not a container", "corrupt frames", "av1 (no NVDEC AV1 on Hopper)", "larger sequence later"],
)
def test_videos_nvdec_cannot_decode_are_a_video_decode_error(make, message, nvc):
    with pytest.raises(VideoDecodeError, match=message):
        list(NvdecVideoDecoder(torch.device("cuda")).decode(make(), [0, 7]))


def test_a_smaller_sequence_later_comes_scaled_to_the_first_size(nvc):
    data = _ts_with_a_resolution_change((64, 96), (48, 64))
    (chunk,) = NvdecVideoDecoder(torch.device("cuda")).decode(data, [0, 7])
    assert tuple(chunk.shape) == (2, 64, 96, 3)


def _cut_after_packets(data: bytes, keep: int, tmp_path: Path) -> bytes:
    """The clip remuxed with its index up front (faststart) and cut after its first `keep` packets: the container
    still lists every frame, as an upload cut short does."""
    path = tmp_path / "faststart.mp4"
    with av.open(io.BytesIO(data)) as source, av.open(str(path), "w", options={"movflags": "faststart"}) as out:
        stream = out.add_stream_from_template(source.streams.video[0])
        for packet in source.demux(source.streams.video[0]):
            if packet.dts is not None:
                packet.stream = stream
                out.mux(packet)
    whole = path.read_bytes()
    with av.open(io.BytesIO(whole)) as container:
        packets = [p for p in container.demux(container.streams.video[0]) if p.size]
    return whole[: packets[keep - 1].pos + packets[keep - 1].size]


def test_a_video_cut_short_is_named_truncated(nvc, tmp_path):
    data = _cut_after_packets(clip("h264 3 s 10 fps"), 12, tmp_path)
    with pytest.raises(VideoDecodeError, match=r"^NVDEC decoded fewer frames than the container lists \(30\): the vid"):
        list(NvdecVideoDecoder(torch.device("cuda")).decode(data, [0, 29]))


def _driver_missing() -> types.ModuleType:
    check = types.ModuleType("PyNvVideoCodec.VersionCheck")

    class DriverWrapper:
        def GetDriverVersion(self) -> int:
            raise OSError("libnvidia-encode.so.1: cannot open shared object file: No such file or directory")

    check.DriverWrapper = DriverWrapper  # type: ignore[attr-defined]
    return check


def _driver_too_old() -> types.ModuleType:
    check = types.ModuleType("PyNvVideoCodec.VersionCheck")
    check.DriverWrapper = type("DriverWrapper", (), {"GetDriverVersion": lambda self: 12 * 16})  # type: ignore[attr-defined]
    return check


@pytest.mark.parametrize(
    "problem, message",
    [
        ("not installed", r"^PyNvVideoCodec is not installed; install it with `pip install PyNvVideoCodec==2\.2\.4`$"),
        (
            "driver libraries missing",
            r"^PyNvVideoCodec cannot load the NVIDIA driver's video libraries \(libnvidia-encode\.so\.1: cannot open "
            r"shared object file: No such file or directory\); check the driver with nvidia-smi, and in a container "
            r"set NVIDIA_DRIVER_CAPABILITIES=compute,utility,video$",
        ),
        (
            "driver too old",
            r"^PyNvVideoCodec cannot load the NVIDIA driver's video libraries \(Driver version is too old\)",
        ),
        ("2.1", r"^PyNvVideoCodec 2\.1\.0 is too old; install it with `pip install PyNvVideoCodec==2\.2\.4`$"),
    ],
)
def test_pynvvideocodec_import_problems_are_named(problem, message, cuda, standin_path):
    if problem == "not installed":
        standin_path.setitem(sys.modules, "PyNvVideoCodec", None)
    elif problem == "driver libraries missing":
        standin_path.setitem(sys.modules, "PyNvVideoCodec.VersionCheck", _driver_missing())
    elif problem == "driver too old":
        standin_path.setitem(sys.modules, "PyNvVideoCodec.VersionCheck", _driver_too_old())
    else:
        import PyNvVideoCodec

        standin_path.setattr(PyNvVideoCodec, "__version__", "2.1.0")
    with pytest.raises(Qwen3VLTrtError, match=message):
        NvdecVideoDecoder(torch.device("cuda"))


def test_without_nvdec_the_preprocessor_on_cuda_decodes_videos_on_the_host(tiny_dense, nv, standin_path):
    standin_path.setitem(sys.modules, "PyNvVideoCodec", None)
    with pytest.warns(
        UserWarning, match=r"^videos are decoded on the host \(FFmpeg\), not by NVDEC: PyNvVideoCodec is n"
    ):
        assert Preprocessor.from_pretrained(tiny_dense, device="cuda").video_decoder is None
    with pytest.raises(Qwen3VLTrtError, match=r"^PyNvVideoCodec is not installed"):
        Preprocessor.from_pretrained(tiny_dense, device="cuda", video_decoder="nvdec")


def test_nvdec_needs_a_cuda_device(standin_path):
    with pytest.raises(Qwen3VLTrtError, match=r"^NVDEC decodes video into CUDA memory, not onto cpu$"):
        NvdecVideoDecoder(torch.device("cpu"))
    with pytest.raises(Qwen3VLTrtError, match=r"^NVDEC video decoding needs a CUDA device, and torch sees none$"):
        NvdecVideoDecoder(torch.device("cuda"))


# --- the Preprocessor's device path ----------------------------------------------------------------------------------


def _chat(part: dict) -> list[dict]:
    return [{"role": "user", "content": [part, {"type": "text", "text": "?"}]}]


def test_the_preprocessor_on_cuda_equals_the_cpu_preprocessor(tiny_dense, nv, nvc):
    """One request of images (a JPEG nvImageCodec decodes, a PNG Pillow decodes and uploads) and one of a video that
    NVDEC decodes, one NVDEC cannot (AV1 on an H100: the host decodes it, the device resizes): pixels, tokens and
    grids equal the CPU preprocessor's."""
    gpu = Preprocessor.from_pretrained(tiny_dense, device="cuda")
    cpu = Preprocessor.from_pretrained(tiny_dense, device="cpu")
    assert isinstance(gpu.decoder, NvImageCodecDecoder) and isinstance(gpu.video_decoder, NvdecVideoDecoder)
    images = {"messages": [{"role": "user", "content": [
        {"type": "image", "image": IMAGES[3]}, {"type": "image", "image": png(48, 40)}, {"type": "text", "text": "?"},
    ]}]}  # fmt: skip
    videos = [clip("h264 mkv 12 fps"), synthetic_video(8, 64, 64, 10, "libsvtav1", "mp4")]
    requests = [images] + [{"messages": _chat({"type": "video", "video": video})} for video in videos]
    with pytest.warns(UserWarning, match="video 0: decoded on the host: NVDEC failed decoding the video: Codec not"):
        on_gpu = gpu.batch(requests)
    assert len(nv.decoders[-1].streams) == 1 and len(nvc._native.created) == 2
    for got, want in zip(on_gpu, cpu.batch(requests), strict=True):
        np.testing.assert_array_equal(got.input_ids, want.input_ids)
        np.testing.assert_array_equal(got.vision_grid_thw, want.vision_grid_thw)
        assert torch.equal(got.pixel_values, want.pixel_values)
