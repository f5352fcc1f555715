"""Bad requests get typed errors with messages that say what to change, before any costly work."""

from __future__ import annotations

import pytest
import torch
from images import jpeg, png, png_header_only
from qwen3vl_trt.common.limits import EngineLimits
from qwen3vl_trt.errors import (
    ImageDecodeError,
    ImageShapeError,
    ImageTooLargeError,
    MessageError,
    PromptTooLongError,
    TooManyImagesError,
)
from qwen3vl_trt.preprocess import Preprocessor, RequestLimits


@pytest.fixture(scope="module")
def pre(tiny_dense):
    return Preprocessor.from_pretrained(tiny_dense, limits=RequestLimits(max_images=3, max_prompt_tokens=600))


def _image_chat(data):
    return [{"role": "user", "content": [{"type": "image", "image": data}, {"type": "text", "text": "?"}]}]


def test_empty_bytes(pre):
    with pytest.raises(ImageDecodeError, match="image 0: empty bytes"):
        pre(_image_chat(b""))


def test_not_an_image(pre):
    with pytest.raises(ImageDecodeError, match="not a recognized image .*68 65 6c 6c 6f"):
        pre(_image_chat(b"hello, this is text"))


def test_truncated_jpeg(pre):
    data = jpeg(256, 256, seed=3)
    with pytest.raises(ImageDecodeError, match="image 0: truncated or corrupt JPEG"):
        pre(_image_chat(data[: len(data) // 2]))


def test_decompression_bomb_is_rejected_from_the_header(pre, monkeypatch):
    import qwen3vl_trt.preprocess.images as images

    monkeypatch.setattr(images, "decode_pil", lambda *a: pytest.fail("a bomb must not be decoded"))
    with pytest.raises(ImageTooLargeError, match=r"header says 10000\.0 MP, over the decode limit of 64\.0 MP"):
        pre(_image_chat(png_header_only(100_000, 100_000)))


def test_bomb_under_pils_own_threshold_is_rejected_by_ours(tiny_dense):
    pre = Preprocessor.from_pretrained(tiny_dense, limits=RequestLimits(max_decode_pixels=1_000_000))
    with pytest.raises(ImageTooLargeError, match="2000x2000"):
        pre(_image_chat(png_header_only(2000, 2000)))


def test_extreme_aspect_ratio(pre):
    with pytest.raises(ImageShapeError, match=r"image 0: aspect ratio 201:1 .* over 200:1"):
        pre(_image_chat(png(10, 2010)))


def test_too_many_images(pre):
    parts = [{"type": "image", "image": jpeg(32, 32, seed=i)} for i in range(4)]
    with pytest.raises(TooManyImagesError, match="4 images in one request; the limit is 3"):
        pre([{"role": "user", "content": parts}])


def test_prompt_too_long(pre):
    with pytest.raises(PromptTooLongError, match=r"the prompt is \d+ tokens .* the limit is 600"):
        pre([{"role": "user", "content": "word " * 700}])
    # Visual tokens count too: one 640x480 image is 300 tokens, two exceed 600 with the text.
    parts = [{"type": "image", "image": jpeg(480, 640, seed=i)} for i in range(2)]
    with pytest.raises(PromptTooLongError, match="600 of them for 2 image"):
        pre([{"role": "user", "content": [*parts, {"type": "text", "text": "compare"}]}])


def test_visual_tokens_stay_within_the_engine_share(tiny_dense):
    """EngineLimits's limits reach preprocessing: a request cannot carry more visual tokens than its
    share of the engine's prompt table, nor a longer prompt than max_input_len."""
    limits = EngineLimits(max_input_len=1000, max_seq_len=2000, max_visual_tokens=400).request_limits()
    assert (limits.max_prompt_tokens, limits.max_visual_tokens) == (1000, 400)
    pre = Preprocessor.from_pretrained(tiny_dense, limits=limits)
    one = [{"type": "image", "image": jpeg(480, 640)}, {"type": "text", "text": "?"}]
    assert pre([{"role": "user", "content": one}]).num_visual_tokens == 300
    two = [{"type": "image", "image": jpeg(480, 640, seed=i)} for i in range(2)]
    with pytest.raises(PromptTooLongError, match="600 visual tokens; the limit is 400"):
        pre([{"role": "user", "content": two}])


def test_image_part_without_image(pre):
    with pytest.raises(MessageError, match="message 0 part 0: image part without an image"):
        pre([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "?"}]}])


def test_urls_and_paths_are_not_fetched(pre):
    with pytest.raises(MessageError, match="only data: URLs are accepted"):
        pre([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://example.com/a.jpg"}}]}])
    with pytest.raises(MessageError, match="paths are not fetched"):
        pre([{"role": "user", "content": [{"type": "image", "path": "/etc/passwd"}]}])
    with pytest.raises(MessageError, match="not valid base64"):
        pre([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,@@"}}]}])


def test_unknown_role(pre):
    with pytest.raises(MessageError, match="message 1 has role 'robot'; use one of system, user, assistant, tool"):
        pre([{"role": "user", "content": "hi"}, {"role": "robot", "content": "beep"}])


def test_malformed_messages(pre):
    with pytest.raises(MessageError, match="non-empty list"):
        pre([])
    with pytest.raises(MessageError, match="message 0 part 0 has type 'audio'"):
        pre([{"role": "user", "content": [{"type": "audio", "audio": b"x"}]}])
    with pytest.raises(MessageError, match="video parts must carry encoded bytes under 'video'"):
        pre([{"role": "user", "content": [{"type": "video", "video": "clip.mp4"}]}])


def test_prompt_placeholders_must_match_images(pre):
    with pytest.raises(MessageError, match=r"the prompt has 1 <\|image_pad\|> placeholder\(s\) but 2 image\(s\)"):
        pre(prompt="<|vision_start|><|image_pad|><|vision_end|>hi", images=[jpeg(32, 32), jpeg(32, 32)])


def test_batch_names_the_bad_request_and_decodes_nothing(pre, monkeypatch):
    import qwen3vl_trt.preprocess.images as images

    calls = []
    monkeypatch.setattr(images, "decode_pil", lambda *a: calls.append(a))
    good = {"messages": _image_chat(jpeg(64, 64))}
    also_good = {"messages": _image_chat(png(300, 400))}  # PNG headers must not be decoded either
    with pytest.raises(ImageDecodeError, match="request 2: image 0: empty bytes"):
        pre.batch([good, also_good, {"messages": _image_chat(b"")}])
    assert calls == []


def test_errors_leave_the_preprocessor_usable(pre):
    with pytest.raises(ImageDecodeError):
        pre(_image_chat(b"\xff\xd8\xff"))
    assert isinstance(pre(_image_chat(jpeg(64, 64))).pixel_values, torch.Tensor)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on hosts without CUDA")
def test_cuda_without_a_gpu_says_so(tiny_dense):
    from qwen3vl_trt.errors import Qwen3VLTrtError

    with pytest.raises(Qwen3VLTrtError, match="torch sees no CUDA device"):
        Preprocessor.from_pretrained(tiny_dense, device="cuda")


def test_bad_options_are_named(tiny_dense):
    from qwen3vl_trt.errors import Qwen3VLTrtError

    with pytest.raises(Qwen3VLTrtError, match="decoder must be"):
        Preprocessor.from_pretrained(tiny_dense, decoder="libjpeg")
    with pytest.raises(Qwen3VLTrtError, match="resize backend must be one of torchvision, pil"):
        Preprocessor.from_pretrained(tiny_dense, resize_backend="lanczos")
    with pytest.raises(Qwen3VLTrtError, match="either chat messages or prompt="):
        Preprocessor.from_pretrained(tiny_dense)()


def test_template_errors_are_message_errors(tiny_dense, tmp_path):
    from test_preprocess import _config_only_copy

    model = _config_only_copy(tiny_dense, tmp_path / "strict", "{{ 'say: ' + messages[0].content }}")
    pre = Preprocessor.from_pretrained(model)
    with pytest.raises(MessageError, match="the chat template rejected the messages"):
        pre([{"role": "user", "content": [{"type": "text", "text": "a list, not a string"}]}])
    with pytest.raises(MessageError, match="continue_final_message is not supported"):
        pre([{"role": "user", "content": "hi"}], continue_final_message=True)


def test_broken_template_is_a_checkpoint_error(tiny_dense, tmp_path):
    from qwen3vl_trt.errors import CheckpointError
    from test_preprocess import _config_only_copy

    model = _config_only_copy(tiny_dense, tmp_path / "broken", "{% for m in messages %}{{ m.role }")
    with pytest.raises(CheckpointError, match="chat template does not compile"):
        Preprocessor.from_pretrained(model)


def test_prompt_images_must_be_wrapped(pre):
    with pytest.raises(MessageError, match=r"image placeholder 0 is not written as <\|vision_start\|>"):
        pre(prompt="<|image_pad|> what is this?", images=[jpeg(32, 32)])
    with pytest.raises(MessageError, match="has 1 <\\|video_pad\\|> placeholder\\(s\\) but 0 video"):
        pre(prompt="<|vision_start|><|video_pad|><|vision_end|>", images=[])
    with pytest.raises(MessageError, match="the prompt is empty"):
        pre(prompt="")


def test_line_wrapped_base64_is_accepted(pre):
    import base64

    data = jpeg(64, 64)
    url = "data:image/jpeg;base64," + base64.encodebytes(data).decode()  # MIME: a newline every 76 chars
    wrapped = pre([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}])
    assert torch.equal(wrapped.pixel_values, pre(_image_chat(data)).pixel_values)


def test_formats_outside_the_allowlist_are_refused(pre):
    eps = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\nshowpage\n"
    with pytest.raises(ImageDecodeError, match="not a recognized image .* send JPEG, PNG, WEBP, GIF or BMP"):
        pre(_image_chat(eps))
