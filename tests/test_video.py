"""Video preprocessing against transformers on real encoded clips: ids with timestamps, grids, 3-D positions and
pixels; the decoders' paths against each other; and every kind of bad video refused before decoding."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
import videos as clips
from images import jpeg
from PIL import Image
from qwen3vl_trt.common.limits import RequestLimits
from qwen3vl_trt.errors import (
    MessageError,
    PromptTooLongError,
    TooManyVideosError,
    VideoDecodeError,
    VideoTooLargeError,
)
from qwen3vl_trt.hf.reference import (
    hf_rope_index,
    hf_video_reference,
    load_hf_processor,
    load_hf_text_model,
)
from qwen3vl_trt.preprocess import Preprocessor
from qwen3vl_trt.preprocess import videos as video_module
from qwen3vl_trt.preprocess.videos import DecodedVideo, probe_video
from qwen3vl_trt.qa.tiny import IMAGE_TOKEN_ID, VIDEO_TOKEN_ID, synthetic_video

PIXEL_TOLERANCE = 1e-6
TF5 = int(transformers.__version__.split(".")[0]) >= 5


@pytest.fixture(scope="module")
def pre(tiny_dense):
    return Preprocessor.from_pretrained(tiny_dense)


@pytest.fixture(scope="module")
def processor(tiny_dense):
    return load_hf_processor(tiny_dense)


@pytest.fixture(scope="module")
def hf_model(tiny_dense):
    return load_hf_text_model(tiny_dense)


def _chat(video, *images, text="What happens in the video?"):
    parts = [{"type": "image", "image": image} for image in images]
    return [{"role": "user", "content": [*parts, {"type": "video", "video": video}, {"type": "text", "text": text}]}]


def _hf_text(processor, messages) -> str:
    template = [
        {**m, "content": [{"type": p["type"]} if p["type"] != "text" else p for p in m["content"]]} for m in messages
    ]
    return processor.apply_chat_template(template, tokenize=False, add_generation_prompt=True)


def _assert_equals_transformers(request, hf, hf_model):
    np.testing.assert_array_equal(request.input_ids, hf["input_ids"])
    np.testing.assert_array_equal(request.video_grid_thw, hf["video_grid_thw"])
    got = request.pixel_values_videos.numpy()
    assert got.shape == hf["pixel_values_videos"].shape
    assert np.abs(got - hf["pixel_values_videos"]).max() <= PIXEL_TOLERANCE
    positions, delta = hf_rope_index(
        hf_model, hf["input_ids"], hf.get("image_grid_thw"), IMAGE_TOKEN_ID, hf["video_grid_thw"], VIDEO_TOKEN_ID
    )
    np.testing.assert_array_equal(request.position_ids, positions)
    assert request.mrope_position_delta == delta


@pytest.mark.parametrize("name", list(clips.CLIPS))
def test_video_equals_transformers_processor(name, pre, processor, hf_model, tmp_path):
    data = clips.clip(name)
    path = tmp_path / "clip"
    path.write_bytes(data)
    request = pre(_chat(data))
    hf = hf_video_reference(processor, _hf_text(processor, _chat(data)), path)
    _assert_equals_transformers(request, hf, hf_model)
    # Every temporal patch is introduced by its time: "<t seconds>" once per patch.
    text = pre.prompts.tokenizer.decode(request.input_ids.tolist(), skip_special_tokens=False)
    assert text.count(" seconds>") == request.video_grid_thw[0, 0]


def test_image_and_video_together_equal_transformers(pre, processor, hf_model, tmp_path):
    data, photo = clips.clip("h264 3 s 10 fps"), jpeg(64, 96, seed=3)
    path = tmp_path / "clip.mp4"
    path.write_bytes(data)
    request = pre(_chat(data, photo))
    image = Image.open(__import__("io").BytesIO(photo)).convert("RGB")
    hf = hf_video_reference(processor, _hf_text(processor, _chat(data, photo)), path, images=[image])
    _assert_equals_transformers(request, hf, hf_model)
    np.testing.assert_array_equal(request.image_grid_thw, hf["image_grid_thw"])
    image_rows = int(hf["image_grid_thw"].prod())
    assert np.abs(request.pixel_values[:image_rows].numpy() - hf["pixel_values"]).max() <= PIXEL_TOLERANCE
    # The vision encoder's input is in prompt order: the image (first in the message), then the video.
    assert [v.kind for v in request.visual] == ["image", "video"]
    np.testing.assert_array_equal(request.vision_grid_thw, np.concatenate([hf["image_grid_thw"], hf["video_grid_thw"]]))


def test_video_before_image_keeps_prompt_order(pre):
    data, photo = clips.clip("h264 3 s 10 fps"), jpeg(64, 96, seed=3)
    content = [{"type": "video", "video": data}, {"type": "image", "image": photo}, {"type": "text", "text": "?"}]
    request = pre([{"role": "user", "content": content}])
    alone = pre(_chat(data))
    assert [v.kind for v in request.visual] == ["video", "image"]
    video_rows = int(request.video_grid_thw.prod())
    torch.testing.assert_close(request.pixel_values[:video_rows], alone.pixel_values_videos, rtol=0, atol=0)
    # Fake ids count visual tokens of both kinds in prompt order; extra ids name each input's content.
    visual = np.isin(request.input_ids, (IMAGE_TOKEN_ID, VIDEO_TOKEN_ID))
    assert (request.engine_input_ids[visual] >= pre.info.text.vocab_size).all()
    first_video_token = np.flatnonzero(request.input_ids == VIDEO_TOKEN_ID)[0]
    first_image_token = np.flatnonzero(request.input_ids == IMAGE_TOKEN_ID)[0]
    ids = request.prompt_table_extra_ids
    assert ids[first_video_token] != ids[first_image_token] and ids[~visual].max() == 0


def test_decoded_frames_with_timestamps_equal_transformers(pre, processor, hf_model):
    from transformers.video_utils import VideoMetadata

    frames = np.stack([np.asarray(Image.open(__import__("io").BytesIO(jpeg(60, 84, seed=s)))) for s in range(5)])
    fps, indices = 4.0, [0, 3, 5, 9, 12]
    request = pre(_chat(DecodedVideo(frames, tuple(i / fps for i in indices))))
    metadata = VideoMetadata(total_num_frames=13, fps=fps, frames_indices=indices)
    hf = processor(
        text=[_hf_text(processor, _chat(b""))],
        videos=[frames],
        video_metadata=[metadata],
        do_sample_frames=False,
        return_tensors="pt",
    )
    hf = {k: v.numpy() for k, v in hf.items()}
    from qwen3vl_trt.hf.reference import released_video_layout

    hf["input_ids"] = released_video_layout(hf["input_ids"][0], processor.tokenizer)
    _assert_equals_transformers(request, hf, hf_model)


RAW_PROMPTS = {
    "video first": "<|vision_start|><|video_pad|><|vision_end|>Say what moves.",
    "text before the video": "Watch <|vision_start|><|video_pad|><|vision_end|> and say what moves.",
}


@pytest.mark.parametrize("name", list(RAW_PROMPTS))
def test_raw_prompt_with_a_video(name, pre, processor, hf_model, tmp_path):
    if TF5 and name == "text before the video":
        pytest.skip("5.x keeps <|vision_start|> before the first timestamp, so the text before it tokenizes apart")
    data = clips.clip("vp9 webm 25 fps odd size")
    path = tmp_path / "clip.webm"
    path.write_bytes(data)
    prompt = RAW_PROMPTS[name]
    request = pre(prompt=prompt, videos=[data])
    _assert_equals_transformers(request, hf_video_reference(processor, prompt, path), hf_model)


def test_seeking_decode_equals_decoding_every_frame(pre):
    """Keyframe every 4 frames, B-frames: the seeking path skips GOPs and still yields the same frames."""
    data = synthetic_video(90, 64, 96, 30, options={"g": "4", "bf": "2"})
    header = probe_video(data, 0, RequestLimits())
    assert header.frame_pts is not None and sum(header.keyframes) > 10
    wanted = [0, 1, 9, 30, 31, 57, 88, 89]
    seeking = {p: f for p, f in video_module.decode_frames(data, header, wanted)}
    in_order = video_module.decode_frames(
        data, video_module.VideoHeader(**{**header.__dict__, "frame_pts": None}), wanted
    )
    for position, frame in in_order:
        np.testing.assert_array_equal(seeking[position], frame)
    assert len(seeking) == len(wanted)
    in_parallel = dict(video_module.decode_frames(data, header, wanted, workers=3))  # GOP runs, 3 decoders at once
    assert sorted(in_parallel) == list(range(len(wanted)))
    for position, frame in in_parallel.items():
        np.testing.assert_array_equal(seeking[position], frame)


def test_seeking_skips_frames_it_does_not_need(monkeypatch):
    data = synthetic_video(120, 48, 64, 30, options={"g": "10"})
    header = probe_video(data, 0, RequestLimits())
    decoded = []
    original = video_module._rgb

    def counting(frame):
        decoded.append(frame.pts)
        return original(frame)

    monkeypatch.setattr(video_module, "_rgb", counting)
    list(video_module.decode_frames(data, header, [5, 60, 115]))
    assert len(decoded) == 3  # only the sampled frames are converted; the demuxer seeks past the GOPs between


# -- bad videos: each refused with a clear error, before any frame is decoded --------------------------------


def _never_decode(monkeypatch):
    def refuse(*_args, **_kwargs):
        raise AssertionError("a frame was decoded for a video that should have been refused first")

    monkeypatch.setattr(video_module, "decode_frames", refuse)


BAD = {
    "empty": (lambda: b"", VideoDecodeError, "empty"),
    "garbage": (lambda: bytes(range(256)) * 8, VideoDecodeError, "not a readable video container"),
    "an image": (lambda: jpeg(32, 32), VideoDecodeError, "this is an image .*; send it as an image"),
    "truncated mp4": (lambda: clips.clip("h264 3 s 10 fps")[:5000], VideoDecodeError, "truncated"),
    "audio only": (clips.audio_only, VideoDecodeError, r"no video stream \(streams: audio\)"),
    "unsupported codec": (clips.ffv1_mkv, VideoDecodeError, "codec 'ffv1' is not supported"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_videos_are_refused_before_decoding(name, pre, monkeypatch):
    make, error, message = BAD[name]
    data = make()
    _never_decode(monkeypatch)
    with pytest.raises(error, match=message):
        pre(_chat(data))
    with pytest.raises(error, match=message):
        pre.prompt_ids(_chat(data))


LIMITED = {
    "bytes": (dict(max_video_bytes=1000), VideoTooLargeError, "max_video_bytes"),
    "duration": (dict(max_video_seconds=2), VideoTooLargeError, "lasts 3.0 s.*max_video_seconds"),
    "frames": (dict(max_video_frames=4), VideoTooLargeError, "6 frames sampled.*max_video_frames"),
    "frame size": (dict(max_video_frame_pixels=100 * 80), VideoTooLargeError, "130x90.*max_video_frame_pixels"),
    "visual tokens": (dict(max_visual_tokens=20), PromptTooLongError, "36 visual tokens"),
}


@pytest.mark.parametrize("name", list(LIMITED))
def test_videos_over_a_limit_are_refused_before_decoding(name, tiny_dense, monkeypatch):
    limits, error, message = LIMITED[name]
    pre = Preprocessor.from_pretrained(tiny_dense, limits=RequestLimits(**limits))
    _never_decode(monkeypatch)
    with pytest.raises(error, match=message):
        pre(_chat(clips.clip("h264 3 s 10 fps")))


def test_too_many_videos_and_placeholder_mismatches(tiny_dense, pre):
    data = clips.clip("h264 3 frames (under min_frames)")
    limited = Preprocessor.from_pretrained(tiny_dense, limits=RequestLimits(max_videos=1))
    with pytest.raises(TooManyVideosError, match="2 videos in one request; the limit is 1"):
        limited(prompt="<|vision_start|><|video_pad|><|vision_end|>" * 2, videos=[data, data])
    with pytest.raises(MessageError, match="1 <\\|video_pad\\|> placeholder\\(s\\) but 2 video"):
        pre(prompt="<|vision_start|><|video_pad|><|vision_end|>", videos=[data, data])
    with pytest.raises(MessageError, match="write each video placeholder"):
        pre(prompt="a bare <|video_pad|>", videos=[data])


def test_a_single_frame_and_a_video_with_a_decode_error(pre):
    one_frame = synthetic_video(1, 64, 64)
    with pytest.raises(VideoDecodeError, match="1 frame\\(s\\); the model needs at least 2"):
        pre(_chat(one_frame))
    with pytest.raises(VideoDecodeError, match="video 0"):
        pre(_chat(clips.corrupt_middle(clips.clip("h264 portrait 30 fps, keyframe every 12, B-frames"))))


def test_frames_too_small_for_a_merged_patch(pre, processor, hf_model, tmp_path):
    """transformers 5.x scales frames under 32 px up (as here); 4.57.3 refuses them."""
    data = synthetic_video(8, 16, 40, 4)
    request = pre(_chat(data))
    assert request.video_grid_thw.tolist() == [[2, 2, 4]]  # 16x40 scaled to 32x80, rounded to 32x64
    if TF5:
        path = tmp_path / "small.mp4"
        path.write_bytes(data)
        _assert_equals_transformers(
            request, hf_video_reference(processor, _hf_text(processor, _chat(data)), path), hf_model
        )


def test_aspect_ratio_over_200_is_refused(pre):
    with pytest.raises(VideoDecodeError, match="video 0: aspect ratio"):
        pre(_chat(synthetic_video(4, 2, 600)))


class _HostAsDevice:
    """A VideoFrameDecoder (the interface NVDEC implements on GPU hosts) made of FFmpeg's frames on the CPU, in
    chunks of 4, that gives up after `fail_after` chunks: what render_video does with a device decoder's chunks and
    with its refusal, checkable here."""

    device = torch.device("cpu")

    def __init__(self, fail_after: int | None = None):
        self.fail_after = fail_after

    def decode(self, data, indices):
        header = probe_video(data, 0, RequestLimits())
        frames = dict(video_module.decode_frames(data, header, indices))
        for k, first in enumerate(range(0, len(indices), 4)):
            if self.fail_after is not None and k == self.fail_after:
                raise VideoDecodeError("this decoder lacks the codec")
            yield torch.stack([torch.from_numpy(frames[p]) for p in range(first, min(first + 4, len(indices)))])


@pytest.mark.parametrize("fail_after", [None, 0, 1], ids=["decoded in chunks", "refused", "refused midway"])
def test_a_device_decoders_chunks_and_refusals_give_the_host_paths_pixels(fail_after, pre):
    from qwen3vl_trt.preprocess.videos import empty_rows, plan_video, render_video

    data = clips.clip("h264 portrait 30 fps, keyframe every 12, B-frames")
    plan = plan_video(data, 0, pre.video_config, RequestLimits())
    host = empty_rows([plan], pre.video_config.pixels.patch_dim, torch.device("cpu"))
    render_video(plan, pre.video_config, pre.video_normalize, host)
    device = torch.full_like(host, float("nan"))
    if fail_after is None:
        render_video(plan, pre.video_config, pre.video_normalize, device, _HostAsDevice())
    else:
        with pytest.warns(UserWarning, match="video 0: decoded on the host: this decoder lacks the codec"):
            render_video(plan, pre.video_config, pre.video_normalize, device, _HostAsDevice(fail_after))
    torch.testing.assert_close(device, host, rtol=0, atol=0)
