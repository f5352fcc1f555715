"""Request preprocessing against transformers: ids, pixels, grids, 3-D positions, rotary tables."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch
import transformers
from images import exif_rotated_jpeg, jpeg, parity_images
from PIL import Image
from qwen3vl_trt.common.contracts import LLM_INPUTS
from qwen3vl_trt.hf.reference import (
    hf_rope_index,
    hf_text_rotary,
    load_hf_processor,
    load_hf_text_model,
)
from qwen3vl_trt.preprocess import Preprocessor
from transformers.image_utils import load_image

IMAGES = parity_images()
BACKENDS = ("torchvision", "pil")
OTHER = {"torchvision": "pil", "pil": "torchvision"}
PIXEL_TOLERANCE = 1e-6


@pytest.fixture(scope="module")
def image_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("images")
    paths = {}
    for i, (name, data) in enumerate(IMAGES.items()):
        paths[name] = root / f"{i}.img"
        paths[name].write_bytes(data)
    return paths


@pytest.fixture(scope="module")
def preprocessors(tiny_dense):
    return {backend: Preprocessor.from_pretrained(tiny_dense, resize_backend=backend) for backend in BACKENDS}


@pytest.fixture(scope="module")
def processors(tiny_dense):
    return {backend: load_hf_processor(tiny_dense, backend) for backend in BACKENDS}


@pytest.fixture(scope="module")
def hf_model(tiny_dense):
    return load_hf_text_model(tiny_dense)


def _user(*parts):
    return [{"role": "user", "content": list(parts)}]


def _client_image(path):
    """What transformers makes of an image file or URL: load_image (EXIF transpose, RGB)."""
    return load_image(str(path))


def _hf_image_outputs(processor, paths):
    # Passed explicitly: transformers 4.57's PIL processor replaces the configured size with Qwen2-VL's
    # class defaults in __init__ (its 5.x and torchvision processors keep it).
    size = {"shortest_edge": 65536, "longest_edge": 16777216}
    out = processor.image_processor(images=[_client_image(p) for p in paths], size=size, return_tensors="pt")
    return out["pixel_values"], out["image_grid_thw"].numpy()


# After load_image has converted a palette PNG with a transparent colour to RGB, transformers 5's
# processor still composites that colour onto white (its convert_to_rgb reads the leftover
# `transparency` key); load_image itself, 4.57 and this package keep the colour.
KEYED_TRANSPARENCY = pytest.mark.skipif(
    int(transformers.__version__.split(".")[0]) >= 5, reason="transformers 5 whitens the colour load_image kept"
)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=KEYED_TRANSPARENCY) if n == "palette png with transparency" else n for n in IMAGES]
)
def test_pixels_equal_processor_with_same_backend(name, backend, preprocessors, processors, image_files):
    request = preprocessors[backend](_user({"type": "image", "image": IMAGES[name]}, {"type": "text", "text": "?"}))
    pixel_values, grid = _hf_image_outputs(processors[backend], [image_files[name]])
    np.testing.assert_array_equal(request.image_grid_thw, grid)
    assert request.pixel_values.shape == pixel_values.shape
    assert (request.pixel_values - pixel_values).abs().max().item() <= PIXEL_TOLERANCE


@pytest.mark.parametrize("backend", BACKENDS)
def test_pixels_against_the_other_backend(backend, preprocessors, processors, image_files):
    """The two transformers backends resize with different bicubic kernels: a few uint8 levels apart at
    most, well under one on average (measured: 5 levels max, 0.26 mean on this noisy downscale)."""
    name = "jpeg 4:4:4 non-square 517x333"
    request = preprocessors[backend](_user({"type": "image", "image": IMAGES[name]}))
    pixel_values, _ = _hf_image_outputs(processors[OTHER[backend]], [image_files[name]])
    levels = (request.pixel_values - pixel_values).abs() * 127.5  # std 0.5: one uint8 level is 2/255
    assert 1 <= levels.max().item() <= 8
    assert levels.mean().item() <= 0.5


def test_batched_images_equal_processor(preprocessors, processors, image_files):
    names = ["jpeg 640x480", "tiny jpeg 32x32", "cmyk jpeg", "jpeg 4:4:4 non-square 517x333"]
    parts = [{"type": "image", "image": IMAGES[n]} for n in names]
    request = preprocessors["torchvision"](_user(*parts, {"type": "text", "text": "compare"}))
    pixel_values, grid = _hf_image_outputs(processors["torchvision"], [image_files[n] for n in names])
    np.testing.assert_array_equal(request.image_grid_thw, grid)
    assert (request.pixel_values - pixel_values).abs().max().item() <= PIXEL_TOLERANCE


def _three_image_chat(paths=None):
    def image(name):
        return {"type": "image", "path": str(paths[name])} if paths else {"type": "image", "image": IMAGES[name]}

    return [
        {"role": "system", "content": [{"type": "text", "text": "You are a careful assistant."}]},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "First "},
                image("jpeg 640x480"),
                {"type": "text", "text": " then "},
                image("exif-rotated jpeg (6)"),
                {"type": "text", "text": " and finally "},
                image("png 400x300"),
                {"type": "text", "text": ". What differs?"},
            ],
        },
    ]


CHATS = {
    "text only": lambda paths: _user({"type": "text", "text": "Hello there, how are you today?"}),
    "one image": lambda paths: _user(
        {"type": "image", **({"path": str(paths["jpeg 640x480"])} if paths else {"image": IMAGES["jpeg 640x480"]})},
        {"type": "text", "text": "Describe this."},
    ),
    "three images between text": _three_image_chat,
}


@pytest.mark.parametrize("chat", list(CHATS))
def test_ids_grids_and_positions_equal_transformers(chat, preprocessors, processors, hf_model, image_files):
    request = preprocessors["torchvision"](CHATS[chat](None))
    hf = processors["torchvision"].apply_chat_template(
        CHATS[chat](image_files), tokenize=True, add_generation_prompt=True, return_dict=True, return_tensors="pt"
    )
    hf = {k: v.numpy() for k, v in hf.items()}
    np.testing.assert_array_equal(request.input_ids, hf["input_ids"][0])
    np.testing.assert_array_equal(request.attention_mask, hf["attention_mask"][0])
    if "image_grid_thw" in hf:
        np.testing.assert_array_equal(request.image_grid_thw, hf["image_grid_thw"])
    else:
        assert request.image_grid_thw.shape == (0, 3) and request.pixel_values.shape[0] == 0
    positions, delta = hf_rope_index(hf_model, hf["input_ids"][0], hf.get("image_grid_thw"), 151655)
    np.testing.assert_array_equal(request.position_ids, positions)
    assert request.mrope_position_delta == delta
    if chat != "text only":
        assert delta < 0  # images take fewer positions than tokens


def test_plain_prompt_equals_processor(preprocessors, processors, image_files):
    prompt = "<|vision_start|><|image_pad|><|vision_end|>Compare with <|vision_start|><|image_pad|><|vision_end|>."
    names = ["grayscale jpeg", "exif-mirrored jpeg (2)"]
    request = preprocessors["pil"](prompt=prompt, images=[IMAGES[n] for n in names])
    hf = processors["torchvision"](
        text=[prompt], images=[_client_image(image_files[n]) for n in names], return_tensors="pt"
    )
    np.testing.assert_array_equal(request.input_ids, hf["input_ids"][0].numpy())
    pixel_values, _ = _hf_image_outputs(processors["pil"], [image_files[n] for n in names])
    assert (request.pixel_values - pixel_values).abs().max().item() <= PIXEL_TOLERANCE


@pytest.mark.parametrize("chat", list(CHATS))
def test_rotary_table_equals_transformers_text_model(chat, preprocessors, hf_model):
    request = preprocessors["torchvision"](CHATS[chat](None))
    cos, sin = hf_text_rotary(hf_model, request.position_ids)
    ours_cos = np.concatenate([request.rotary_cos_sin[..., 0]] * 2, axis=-1)  # HF duplicates the halves
    ours_sin = np.concatenate([request.rotary_cos_sin[..., 1]] * 2, axis=-1)
    assert np.abs(ours_cos - cos).max() <= 1e-6
    assert np.abs(ours_sin - sin).max() <= 1e-6


def test_engine_mrope_layout(preprocessors, hf_model):
    """TensorRT-LLM's layout: float32 [max_positions * rotary_dim], (cos, sin) pairs per (position, pair),
    the prompt first, then position 0 (cos 1, sin 0)."""
    request = preprocessors["torchvision"](CHATS["one image"](None))
    length, max_positions = request.num_tokens, request.num_tokens + 40
    table = request.mrope_rotary_cos_sin(max_positions)
    cos, sin = hf_text_rotary(hf_model, request.position_ids)
    half = cos.shape[1] // 2
    assert table.dtype == np.float32 and table.shape == (max_positions * 2 * half,)
    pairs = table.reshape(max_positions, half, 2)
    np.testing.assert_allclose(pairs[:length, :, 0], cos[:, :half], atol=1e-6, rtol=0)
    np.testing.assert_allclose(pairs[:length, :, 1], sin[:, :half], atol=1e-6, rtol=0)
    assert (pairs[length:, :, 0] == 1).all() and (pairs[length:, :, 1] == 0).all()
    inputs = request.engine_inputs(max_positions)
    assert set(inputs) == {spec.name for spec in LLM_INPUTS} - {"prompt_embedding_table"}
    np.testing.assert_array_equal(inputs["mrope_rotary_cos_sin"], table)
    assert inputs["mrope_position_deltas"].dtype == np.int32
    assert inputs["mrope_position_deltas"].tolist() == [request.mrope_position_delta]
    assert inputs["input_ids"] is request.engine_input_ids
    with pytest.raises(Exception, match="longer than the engine"):
        request.mrope_rotary_cos_sin(length - 1)


def test_interleaved_pair_axes_follow_the_design(tiny_dense):
    from qwen3vl_trt.llm.inputs import H_AXIS, T_AXIS, W_AXIS, rope_pair_axes

    axes = rope_pair_axes(128, (24, 20, 20))
    assert (axes == H_AXIS).sum() == 20 and (axes == W_AXIS).sum() == 20 and (axes == T_AXIS).sum() == 24
    for i, axis in enumerate(axes):
        assert axis == (H_AXIS if i % 3 == 1 and i < 60 else W_AXIS if i % 3 == 2 and i < 60 else T_AXIS)


def test_fake_ids(preprocessors, tiny_dense):
    request = preprocessors["torchvision"](_three_image_chat())
    vocab, k = 151936, 3
    visual = request.input_ids == 151655
    assert request.engine_input_ids.dtype == np.int32
    np.testing.assert_array_equal(request.engine_input_ids[~visual], request.input_ids[~visual])
    fake = request.engine_input_ids[visual]
    np.testing.assert_array_equal(fake, vocab + (k + 1) * np.arange(visual.sum()))
    assert request.num_visual_tokens == int(request.image_grid_thw.prod(axis=1).sum()) // 4


def test_prompt_table_rows_hold_main_and_deepstack_embeddings(preprocessors, vision_exports, parity):
    """With the exported encoder's outputs, the row of each fake id is the visual token's main embedding
    and the next K rows its DeepStack features, in the order transformers scatters them."""
    from qwen3vl_trt.hf.reference import run_hf_vision_tower
    from qwen3vl_trt.vision import OnnxVisionRunner

    request = preprocessors["torchvision"](_three_image_chat())
    encoder = OnnxVisionRunner(vision_exports["dense"])
    feeds = {"pixel_values": request.pixel_values.numpy(), **request.vision_inputs}
    image_embeds, deepstack = (torch.from_numpy(a) for a in encoder.run(feeds))
    table = request.prompt_embedding_table(image_embeds, deepstack)
    k = deepstack.shape[0]
    assert table.shape == ((k + 1) * image_embeds.shape[0], image_embeds.shape[1])
    hf_main, hf_deep = run_hf_vision_tower(parity("dense").reference, request.pixel_values, request.image_grid_thw)
    scale = float(np.abs(hf_main).max())
    rows = request.engine_input_ids[request.input_ids == 151655].astype(np.int64) - 151936
    for token, row in enumerate(rows):
        assert np.abs(table[row].numpy() - hf_main[token]).max() <= 1e-4 * scale
        for j in range(k):
            assert np.abs(table[row + 1 + j].numpy() - hf_deep[j, token]).max() <= 1e-4 * float(np.abs(hf_deep).max())
    with pytest.raises(Exception, match="visual tokens"):
        request.prompt_embedding_table(image_embeds[:-1], deepstack[:, :-1])


def test_batch_equals_single_requests(preprocessors):
    pre = preprocessors["torchvision"]
    requests = [
        {"messages": CHATS["one image"](None)},
        {"messages": CHATS["text only"](None)},
        {"prompt": "<|vision_start|><|image_pad|><|vision_end|>hi", "images": [IMAGES["rgba png"]]},
        {"messages": _three_image_chat()},
    ]
    batched = pre.batch(requests)
    for spec, got in zip(requests, batched, strict=True):
        single = pre(**spec)
        np.testing.assert_array_equal(got.input_ids, single.input_ids)
        np.testing.assert_array_equal(got.position_ids, single.position_ids)
        assert torch.equal(got.pixel_values, single.pixel_values)
        for name, value in single.vision_inputs.items():
            np.testing.assert_array_equal(got.vision_inputs[name], value)


def test_data_url_and_image_parts_are_the_same_image(preprocessors):
    data = IMAGES["jpeg 640x480"]
    url = "data:image/jpeg;base64," + base64.b64encode(data).decode()
    a = preprocessors["torchvision"](_user({"type": "image_url", "image_url": {"url": url}}))
    b = preprocessors["torchvision"](_user({"type": "image", "image": data}))
    assert torch.equal(a.pixel_values, b.pixel_values)
    np.testing.assert_array_equal(a.input_ids, b.input_ids)


@pytest.mark.parametrize("name", ["jpeg 640x480", "tiny jpeg 32x32"])
def test_serving_pixel_cap_equals_processor_with_those_bounds(name, tiny_dense, image_files):
    """The cap acts as the processor's longest_edge, and lowers shortest_edge to itself when the
    checkpoint's is larger (so small images are upscaled to the cap's neighbourhood, not past 256x256)."""
    from qwen3vl_trt.preprocess import RequestLimits

    cap = 128 * 128
    pre = Preprocessor.from_pretrained(tiny_dense, limits=RequestLimits(max_image_pixels=cap))
    request = pre(_user({"type": "image", "image": IMAGES[name]}))
    processor = load_hf_processor(tiny_dense, "torchvision").image_processor
    out = processor(
        images=[_client_image(image_files[name])],
        size={"shortest_edge": min(65536, cap), "longest_edge": cap},
        return_tensors="pt",
    )
    np.testing.assert_array_equal(request.image_grid_thw, out["image_grid_thw"].numpy())
    assert (request.pixel_values - out["pixel_values"]).abs().max().item() <= PIXEL_TOLERANCE


@pytest.mark.gpu_image
def test_nvimgcodec_cpu_decoder_equals_pillow(tiny_dense):
    """The GPU path's decoder code, run on nvImageCodec's CPU backend: same frames as Pillow."""
    pytest.importorskip("nvidia.nvimgcodec")
    nv = Preprocessor.from_pretrained(tiny_dense, decoder="nvimgcodec")
    pillow = Preprocessor.from_pretrained(tiny_dense, decoder="pillow")
    for name, data in IMAGES.items():
        chat = _user({"type": "image", "image": data})
        assert torch.equal(nv(chat).pixel_values, pillow(chat).pixel_values), name
    mixed = _user(*({"type": "image", "image": data} for data in IMAGES.values()))
    assert torch.equal(nv(mixed).pixel_values, pillow(mixed).pixel_values)
    for orientation in range(1, 9):
        chat = _user({"type": "image", "image": exif_rotated_jpeg(60, 100, orientation, seed=orientation)})
        assert torch.equal(nv(chat).pixel_values, pillow(chat).pixel_values), orientation


def test_orientations_turn_frames_like_pillow():
    """The device path turns frames with torch; all eight EXIF orientations equal PIL's transposes."""
    from qwen3vl_trt.preprocess.images import _PIL_TRANSPOSE, orient

    array = np.random.default_rng(0).integers(0, 256, (5, 7, 3), dtype=np.uint8)
    for orientation, transpose in _PIL_TRANSPOSE.items():
        expected = array if transpose is None else np.asarray(Image.fromarray(array).transpose(transpose))
        np.testing.assert_array_equal(orient(torch.from_numpy(array), orientation).numpy(), expected)


@pytest.mark.parametrize("name", ["rgba png", "la png (gray + alpha)"])
def test_transparent_images_equal_the_chat_path(name, preprocessors, processors, image_files):
    """An image sent as a file goes through load_image in transformers, which drops the alpha channel."""
    chat = _user({"type": "image", "path": str(image_files[name])}, {"type": "text", "text": "?"})
    hf = processors["torchvision"].apply_chat_template(
        chat, tokenize=True, add_generation_prompt=True, return_dict=True, return_tensors="pt"
    )
    request = preprocessors["torchvision"](
        _user({"type": "image", "image": IMAGES[name]}, {"type": "text", "text": "?"})
    )
    np.testing.assert_array_equal(request.input_ids, hf["input_ids"][0].numpy())
    assert (request.pixel_values - hf["pixel_values"]).abs().max().item() <= PIXEL_TOLERANCE


def test_16_bit_grayscale_keeps_its_top_8_bits(preprocessors):
    """transformers' processors mis-scale 16-bit PNGs (PIL clips them to white, torchvision passes raw
    values); here they equal the same picture saved with 8 bits."""
    from images import gray16_png
    from qwen3vl_trt.qa.tiny import synthetic_photo

    eight_bit = io.BytesIO()
    Image.fromarray(synthetic_photo(100, 150, 12)[..., 0]).save(eight_bit, "PNG")
    a = preprocessors["torchvision"](_user({"type": "image", "image": gray16_png(100, 150, 12)}))
    b = preprocessors["torchvision"](_user({"type": "image", "image": eight_bit.getvalue()}))
    assert torch.equal(a.pixel_values, b.pixel_values)
    assert a.pixel_values.std().item() > 0.1  # a picture, not a flat frame


def test_exif_orientation_is_applied(preprocessors):
    upright = Image.open(io.BytesIO(IMAGES["exif-rotated jpeg (6)"]))
    assert upright.size == (200, 120)  # stored landscape; orientation 6 makes it portrait
    request = preprocessors["torchvision"](_user({"type": "image", "image": IMAGES["exif-rotated jpeg (6)"]}))
    t, h, w = request.image_grid_thw[0]
    assert h > w


def test_tiny_image_is_upscaled_to_min_pixels(preprocessors):
    request = preprocessors["torchvision"](_user({"type": "image", "image": jpeg(32, 32)}))
    assert request.image_grid_thw.tolist() == [[1, 16, 16]]  # shortest_edge 65536 = 256 x 256


def _config_only_copy(model_dir, target, template=None):
    """The checkpoint's small files (no weights), optionally with another chat template."""
    import shutil

    target.mkdir()
    for path in model_dir.iterdir():
        if path.suffix == ".json" and path.name != "model.safetensors.index.json":
            shutil.copy(path, target / path.name)
    if template is not None:
        (target / "chat_template.json").unlink()
        (target / "chat_template.jinja").write_text(template)
    return target


# Exercises what released templates use: special-token variables, {% generation %}, system handling.
CUSTOM_TEMPLATE = (
    "{%- for m in messages -%}<|im_start|>{{ m.role }}\n"
    "{%- if m.content is string %}{{ m.content }}{% elif m.content is defined %}"
    "{%- for p in m.content %}{% if p.type == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif p.type == 'text' %}{{ p.text }}{% endif %}{% endfor %}{% endif %}"
    "{%- if m.role == 'assistant' %}{% generation %}{{ m.reasoning_content | default('') }}{% endgeneration %}"
    "{%- endif %}{{ eos_token }}\n{% endfor -%}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_template_features_equal_transformers(tiny_dense, tmp_path, image_files):
    model = _config_only_copy(tiny_dense, tmp_path / "custom", CUSTOM_TEMPLATE)
    ours = Preprocessor.from_pretrained(model)
    theirs = load_hf_processor(model, "torchvision")
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
        {"role": "assistant", "content": "Hello", "reasoning_content": "greet back"},
        {"role": "user", "content": [{"type": "image", "image": IMAGES["png 400x300"]}, {"type": "text", "text": "?"}]},
    ]
    hf_chat = [dict(m) for m in chat]
    hf_chat[0] = {"role": "system", "content": [{"type": "text", "text": "Be brief."}]}  # 4.57 needs parts
    hf_chat[2] = {**chat[2], "content": [{"type": "text", "text": "Hello"}]}
    hf_chat[3] = _user({"type": "image", "path": str(image_files["png 400x300"])}, {"type": "text", "text": "?"})[0]
    request = ours(chat)
    hf = theirs.apply_chat_template(hf_chat, tokenize=True, add_generation_prompt=True, return_dict=True)
    np.testing.assert_array_equal(request.input_ids, np.asarray(hf["input_ids"]).reshape(-1))


@pytest.mark.skipif(int(transformers.__version__.split(".")[0]) < 5, reason="4.57 rejects content=None")
def test_tool_call_turns_without_content_equal_transformers(preprocessors, processors):
    chat = [
        {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"type": "function", "function": {"name": "w", "arguments": {}}}],
        },
        {"role": "tool", "content": [{"type": "text", "text": "sunny"}]},
    ]
    request = preprocessors["torchvision"](chat)
    hf = processors["torchvision"].apply_chat_template(
        chat, tokenize=True, add_generation_prompt=True, return_dict=True
    )
    np.testing.assert_array_equal(request.input_ids, np.asarray(hf["input_ids"]).reshape(-1))
