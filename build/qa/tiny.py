"""make-tiny: random-weight Qwen3-VL checkpoints in the released on-disk format.

Tests and demos need real-architecture checkpoints without downloading weights. The files match
what the released models ship: config.json in the 4.57 style (`rope_scaling` with
`mrope_section` and `mrope_interleaved`), bf16 safetensors shards with an index (MoE experts
fused as `[experts, hidden, 2 * moe_intermediate]`), processor configs with patch 16 and
mean = std = 0.5, Qwen's byte-level BPE tokenizer with its special tokens at their real ids, and the
released Instruct or Thinking chat template (qwen3vl_trt/data/chat_templates). Presets keep the real vision
tower shapes for benchmarks.
"""

from __future__ import annotations

import io
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from safetensors.torch import save_file
from tqdm import tqdm

from ..common.fsutil import atomic_output_dir
from ..hf.chat_templates import released_chat_template
from .tokenizer_files import SPECIAL_TOKENS, qwen_tokenizer_json

IMAGE_TOKEN_ID, VIDEO_TOKEN_ID, VISION_START_ID, VISION_END_ID = 151655, 151656, 151652, 151653
ENDOFTEXT_ID, IM_END_ID = 151643, 151645
VOCAB_SIZE = 151936


@dataclass(frozen=True)
class TinySpec:
    """Shapes of a generated checkpoint; vision fields mirror vision_config keys."""

    vision: dict = field(default_factory=dict)
    text: dict = field(default_factory=dict)
    tie_word_embeddings: bool = False


_TINY_VISION = dict(depth=4, hidden_size=128, num_heads=2, intermediate_size=256, deepstack_visual_indexes=[0, 1, 2])
# Five decoder layers: the three DeepStack features enter after layers 0-2, and layers 3-4 show that
# nothing is added past them (L >= K + 2).
_TINY_TEXT = dict(
    hidden_size=64,
    num_hidden_layers=5,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    intermediate_size=128,
    mrope_section=[8, 4, 4],
)
_BENCH_TEXT = dict(
    num_hidden_layers=3,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=256,
    mrope_section=[24, 20, 20],
)

PRESETS: dict[str, TinySpec] = {
    "tiny": TinySpec(_TINY_VISION, _TINY_TEXT),
    # Real vision towers of the released sizes, with a tiny language model behind them.
    "2b-vision": TinySpec(
        dict(depth=24, hidden_size=1024, num_heads=16, intermediate_size=4096, deepstack_visual_indexes=[5, 11, 17]),
        dict(_BENCH_TEXT, hidden_size=2048),
        tie_word_embeddings=True,
    ),
    "8b-vision": TinySpec(
        dict(depth=27, hidden_size=1152, num_heads=16, intermediate_size=4304, deepstack_visual_indexes=[8, 16, 24]),
        dict(_BENCH_TEXT, hidden_size=4096),
    ),
}
_TINY_MOE = dict(
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=48,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    norm_topk_prob=True,
)


def build_config(spec: TinySpec, moe: bool) -> dict:
    """config.json as the released Qwen3-VL models write it (transformers 4.57 style)."""
    text = dict(spec.text)
    mrope_section = text.pop("mrope_section")
    text_config = {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": ENDOFTEXT_ID,
        "eos_token_id": IM_END_ID,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "max_position_embeddings": 262144,
        "model_type": "qwen3_vl_moe_text" if moe else "qwen3_vl_text",
        "rms_norm_eps": 1e-6,
        "rope_scaling": {"mrope_interleaved": True, "mrope_section": mrope_section, "rope_type": "default"},
        "rope_theta": 5000000,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "use_cache": True,
        "vocab_size": VOCAB_SIZE,
        "dtype": "bfloat16",
        **(_TINY_MOE if moe else {}),
        **text,  # overrides win
    }
    vision_config = {
        "hidden_act": "gelu_pytorch_tanh",
        "in_channels": 3,
        "initializer_range": 0.02,
        "model_type": "qwen3_vl_moe" if moe else "qwen3_vl",
        "num_position_embeddings": 2304,
        "out_hidden_size": text_config["hidden_size"],
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        **spec.vision,
    }
    return {
        "architectures": ["Qwen3VLMoeForConditionalGeneration" if moe else "Qwen3VLForConditionalGeneration"],
        "image_token_id": IMAGE_TOKEN_ID,
        "model_type": "qwen3_vl_moe" if moe else "qwen3_vl",
        "text_config": text_config,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "video_token_id": VIDEO_TOKEN_ID,
        "vision_config": vision_config,
        "vision_end_token_id": VISION_END_ID,
        "vision_start_token_id": VISION_START_ID,
    }


_PROCESSOR_COMMON = {
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "processor_class": "Qwen3VLProcessor",
}
PREPROCESSOR_CONFIG = {
    **_PROCESSOR_COMMON,
    "size": {"longest_edge": 16777216, "shortest_edge": 65536},
    "image_processor_type": "Qwen2VLImageProcessorFast",
}
VIDEO_PREPROCESSOR_CONFIG = {
    **_PROCESSOR_COMMON,
    "size": {"longest_edge": 25165824, "shortest_edge": 4096},
    "fps": 2,
    "video_processor_type": "Qwen3VLVideoProcessor",
}
GENERATION_CONFIG = {
    "bos_token_id": ENDOFTEXT_ID,
    "pad_token_id": ENDOFTEXT_ID,
    "do_sample": True,
    "eos_token_id": [IM_END_ID, ENDOFTEXT_ID],
    "top_k": 20,
    "top_p": 0.8,
    "temperature": 0.7,
    "repetition_penalty": 1.0,
}


def _tokenizer_config() -> dict:
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(i): {
                "content": c,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": s,
            }
            for i, c, s in SPECIAL_TOKENS
        },
        "additional_special_tokens": [
            c for _, c, s in SPECIAL_TOKENS if s and c not in ("<|endoftext|>", "<|im_end|>")
        ],
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 262144,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def _released_layout(name: str, tensor: torch.Tensor, moe_intermediate: int | None) -> torch.Tensor:
    """transformers 5.x keeps fused experts transposed in memory; checkpoints store them as 4.57 does."""
    import transformers

    if moe_intermediate is None or ".mlp.experts." not in name or int(transformers.__version__.split(".")[0]) < 5:
        return tensor
    return tensor.transpose(1, 2).contiguous()


def _random_state_dict(model_dir: Path, config: dict, seed: int) -> dict[str, torch.Tensor]:
    from transformers import AutoConfig, AutoModelForImageTextToText

    hf_config = AutoConfig.from_pretrained(model_dir)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(hf_config)
    moe_intermediate = config["text_config"].get("moe_intermediate_size")
    state = {}
    for name, tensor in model.state_dict().items():
        if config["tie_word_embeddings"] and name == "lm_head.weight":
            continue  # tied checkpoints do not store the head
        state[name] = _released_layout(name, tensor, moe_intermediate).to(torch.bfloat16)
    return state


def _write_shards(state: dict[str, torch.Tensor], out: Path, shard_bytes: int) -> None:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(state):
        nbytes = state[name].numel() * state[name].element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = state[name]
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(tqdm(shards, desc="write shards", unit="shard", leave=False, disable=None), start=1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


def make_tiny_checkpoint(
    output: str | os.PathLike[str],
    moe: bool = False,
    seed: int = 0,
    preset: str = "tiny",
    vision_overrides: dict | None = None,
    text_overrides: dict | None = None,
    shard_mb: int = 20,
    force: bool = False,
    tie_word_embeddings: bool | None = None,
    template: str = "instruct",
) -> Path:
    """Writes a random-weight Qwen3-VL checkpoint and returns its directory; tie_word_embeddings
    overrides the preset's (tied checkpoints store no lm_head, as the released 2B and 4B). template: which
    released chat template it carries (RELEASED_TEMPLATES: the Instruct or the Thinking checkpoints')."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    spec = PRESETS[preset]
    chat_template = released_chat_template(template)  # an unknown name fails before anything is written
    if vision_overrides or text_overrides:
        spec = TinySpec(
            {**spec.vision, **(vision_overrides or {})},
            {**spec.text, **(text_overrides or {})},
            spec.tie_word_embeddings,
        )
    if tie_word_embeddings is not None:
        spec = TinySpec(spec.vision, spec.text, tie_word_embeddings)
    config = build_config(spec, moe)
    with atomic_output_dir(output, force=force) as tmp:
        _write_json(tmp / "config.json", config)
        _write_json(tmp / "generation_config.json", GENERATION_CONFIG)
        _write_json(tmp / "preprocessor_config.json", PREPROCESSOR_CONFIG)
        _write_json(tmp / "video_preprocessor_config.json", VIDEO_PREPROCESSOR_CONFIG)
        _write_json(tmp / "chat_template.json", {"chat_template": chat_template})
        _write_json(tmp / "tokenizer_config.json", _tokenizer_config())
        (tmp / "tokenizer.json").write_text(qwen_tokenizer_json())
        _write_shards(_random_state_dict(tmp, config, seed), tmp, shard_mb * 2**20)
    return Path(output)


def synthetic_photo(height: int, width: int, seed: int = 0) -> np.ndarray:
    """uint8 [H, W, 3]: smooth colour fields plus noise, which compresses like a photo (pure noise does not)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    fields = [128 + 100 * np.sin(x / (23 + 7 * c) + seed) * np.cos(y / (17 + 5 * c) - c) for c in range(3)]
    return np.clip(np.stack(fields, axis=-1) + rng.normal(0, 12, (height, width, 3)), 0, 255).astype(np.uint8)


def synthetic_jpeg(height: int, width: int, seed: int = 0, quality: int = 90, **save_options: object) -> bytes:
    """A photo-like JPEG for tests, demos and benchmarks."""
    buf = io.BytesIO()
    Image.fromarray(synthetic_photo(height, width, seed)).save(buf, "JPEG", quality=quality, **save_options)
    return buf.getvalue()


def synthetic_video(
    frames: int,
    height: int,
    width: int,
    fps: float = 10,
    codec: str = "libx264",
    container: str = "mp4",
    seed: int = 0,
    options: dict[str, str] | None = None,
) -> bytes:
    """A clip for tests, demos and benchmarks, encoded by FFmpeg (PyAV): a photo-like scene panning sideways with a
    square crossing it, so frames differ as in real footage. options go to the encoder (e.g. {"g": "8"}: a keyframe
    every 8 frames; {"bf": "2"}: B-frames)."""
    from fractions import Fraction

    import av

    scene = synthetic_photo(height, width + 2 * frames, seed)
    side = max(4, min(height, width) // 4)
    buf = io.BytesIO()
    with av.open(buf, "w", format=container) as out:
        stream = out.add_stream(codec, rate=Fraction(fps).limit_denominator(1001), options=options or {})
        assert isinstance(stream, av.VideoStream)
        stream.height, stream.width, stream.pix_fmt = height, width, "yuv420p"
        for i in range(frames):
            frame = np.ascontiguousarray(scene[:, 2 * i : 2 * i + width])
            top, left = (i * 3) % max(1, height - side), (i * 5) % max(1, width - side)
            frame[top : top + side, left : left + side] = (230, 40, 200)
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()
