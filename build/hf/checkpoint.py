"""Lazy reader for local Hugging Face Qwen3-VL checkpoints.

Parses config.json as transformers 4.57 and 5.x write it (`rope_scaling` and `rope_theta`, or
`rope_parameters`; each field under either name its attribute_map gives it), identifies dense vs
MoE and the released size, and loads only the tensors a stage asks for, shard by shard: the vision
export of a 235B-A22B checkpoint reads the tower's few hundred MB and never touches the language
model's shards.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..common.fsutil import read_json
from ..errors import CheckpointError, UnsupportedModelError
from .quantization import (
    FP8_TAG,
    SCALE_SUFFIX,
    BlockFP8,
    BlockFP8Location,
    check_scale_shape,
    read_quantization,
    scale_names,
)

# torch and safetensors load only when tensors are read: the command line's light paths import this module.
if TYPE_CHECKING:
    import torch

    from .safetensors_io import TensorLocation

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
SUPPORTED_MODEL_TYPES = ("qwen3_vl", "qwen3_vl_moe")
_PREDECESSORS = {
    "qwen2_vl": "Qwen2-VL",
    "qwen2_5_vl": "Qwen2.5-VL",
    "qwen2_5_omni": "Qwen2.5-Omni",
    "qwen3_omni_moe": "Qwen3-Omni",
}

# Config keys that transformers reads under a second name, per config.json object: its config classes'
# attribute_map (standard name -> the attribute stored, which save_pretrained writes). transformers 5.x
# declares these; 4.57 declares none and writes the standard names. tests/test_checkpoint.py keeps the
# table equal to the installed classes' maps.
CONFIG_ALIASES: dict[str, dict[str, str]] = {
    "vision_config": {"num_attention_heads": "num_heads", "num_hidden_layers": "depth"},
    "text_config": {"num_experts": "num_local_experts"},
}

# (moe, text hidden size, text layers) -> released name.
_RELEASED_SIZES = {
    (False, 2048, 28): "2B",
    (False, 2560, 36): "4B",
    (False, 4096, 36): "8B",
    (False, 5120, 64): "32B",
    (True, 2048, 48): "30B-A3B",
    (True, 4096, 94): "235B-A22B",
}


@dataclass(frozen=True)
class VisionConfig:
    depth: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    out_hidden_size: int
    hidden_act: str
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    num_position_embeddings: int
    deepstack_visual_indexes: tuple[int, ...]
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size * self.patch_size

    @property
    def num_grid_per_side(self) -> int:
        return int(round(self.num_position_embeddings**0.5))

    @property
    def merge_unit(self) -> int:
        return self.spatial_merge_size**2


@dataclass(frozen=True)
class ExpertConfig:
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    decoder_sparse_step: int
    mlp_only_layers: tuple[int, ...]
    norm_topk_prob: bool


@dataclass(frozen=True)
class TextConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    mrope_section: tuple[int, ...]
    mrope_interleaved: bool
    max_position_embeddings: int
    moe: ExpertConfig | None


@dataclass(frozen=True)
class ModelInfo:
    model_type: str
    vision: VisionConfig
    text: TextConfig
    tie_word_embeddings: bool
    saved_by_transformers_major: int | None  # config.json's transformers_version; None when not recorded
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    quantization: BlockFP8 | None = None  # the checkpoint's own (quantization_config), None for unquantized

    @property
    def is_moe(self) -> bool:
        return self.text.moe is not None

    @property
    def size_name(self) -> str:
        key = (self.is_moe, self.text.hidden_size, self.text.num_hidden_layers)
        return _RELEASED_SIZES.get(key, "custom")

    @property
    def deepstack_count(self) -> int:
        return len(self.vision.deepstack_visual_indexes)


_REQUIRED = object()


class _ConfigObject:
    """One object of config.json ("config" for the top level), read as transformers reads it: a key is
    also found under the name that CONFIG_ALIASES pairs it with."""

    def __init__(self, name: str, values: Any):
        if not isinstance(values, dict):
            raise CheckpointError(f"config.json: '{name}' must be an object")
        self.name, self.values = name, values
        self._aliases: dict[str, tuple[str, ...]] = {}
        for standard, stored in CONFIG_ALIASES.get(name, {}).items():
            self._aliases[standard] = self._aliases[stored] = (stored, standard)

    def get(self, key: str, default: Any = _REQUIRED) -> Any:
        names = self._aliases.get(key, (key,))
        for name in names:
            if name in self.values:
                return self.values[name]
        if default is _REQUIRED:
            raise CheckpointError(f"config.json: '{self.name}' has no {' or '.join(repr(n) for n in names)}")
        return default


def _rope_settings(text: _ConfigObject) -> tuple[float, tuple[int, ...]]:
    """(theta, mrope_section) from either config style: 4.57 writes `rope_scaling` and a top-level
    `rope_theta`, 5.x `rope_parameters` with the theta inside."""
    merged = {**(text.get("rope_scaling", None) or {}), **(text.get("rope_parameters", None) or {})}
    theta = merged.get("rope_theta", text.get("rope_theta", None))
    if theta is None:
        raise CheckpointError("config.json: text_config has no rope_theta (rope_parameters or rope_theta)")
    section = merged.get("mrope_section")
    if not section:
        raise CheckpointError("config.json: text_config has no mrope_section (rope_scaling or rope_parameters)")
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    if rope_type not in ("default", "mrope"):
        # Scaled variants (yarn, dynamic, ...) change the frequencies and scale cos/sin.
        raise UnsupportedModelError(
            f"config.json: rope_type {rope_type!r} is not supported yet; the rotary tables assume unscaled rope"
        )
    # transformers' Qwen3-VL never reads this flag: it always interleaves. False asks for Qwen2-VL's
    # chunked layout, which no Qwen3-VL implementation computes.
    if merged.get("mrope_interleaved", True) is not True:
        raise UnsupportedModelError(
            "config.json: mrope_interleaved is false, but Qwen3-VL always interleaves its MRoPE sections "
            "(as transformers computes it); set it to true, or remove it, if the model is a Qwen3-VL"
        )
    return float(theta), tuple(int(s) for s in section)


def _saved_by_major(top: _ConfigObject) -> int | None:
    """Major version of the transformers that wrote config.json (its transformers_version), if recorded."""
    major = str(top.get("transformers_version", "")).split(".")[0]
    return int(major) if major.isdigit() else None


def _tie_word_embeddings(top: _ConfigObject, text: _ConfigObject, saved_by: int | None) -> bool:
    """Whether the output head is the embedding, read where the saving transformers reads it: 5.x
    obeys the top-level flag, 4.x text_config's (get_text_config); both default to false."""
    top_level, text_level = bool(top.get("tie_word_embeddings", False)), bool(text.get("tie_word_embeddings", False))
    if saved_by is not None:
        return top_level if saved_by >= 5 else text_level
    if top_level != text_level:
        raise CheckpointError(
            f"config.json: tie_word_embeddings is {str(top_level).lower()} at the top level and "
            f"{str(text_level).lower()} in text_config, and no transformers_version says which applies "
            "(5.x reads the top level, 4.x text_config); make the two agree"
        )
    return top_level


def parse_config(cfg: dict) -> ModelInfo:
    model_type = cfg.get("model_type")
    if model_type in _PREDECESSORS:
        raise UnsupportedModelError(
            f"this is a {_PREDECESSORS[model_type]} checkpoint (model_type '{model_type}'); qwen3vl-trt compiles "
            f"Qwen3-VL only (model_type {' or '.join(SUPPORTED_MODEL_TYPES)})"
        )
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"unsupported model_type {model_type!r}: qwen3vl-trt compiles Qwen3-VL checkpoints "
            f"(model_type {' or '.join(SUPPORTED_MODEL_TYPES)})"
        )
    top = _ConfigObject("config", cfg)
    v = _ConfigObject("vision_config", top.get("vision_config"))
    t = _ConfigObject("text_config", top.get("text_config"))

    vision = VisionConfig(
        depth=int(v.get("depth")),
        hidden_size=int(v.get("hidden_size")),
        num_heads=int(v.get("num_heads")),
        intermediate_size=int(v.get("intermediate_size")),
        out_hidden_size=int(v.get("out_hidden_size")),
        hidden_act=str(v.get("hidden_act", "gelu_pytorch_tanh")),
        in_channels=int(v.get("in_channels", 3)),
        patch_size=int(v.get("patch_size")),
        temporal_patch_size=int(v.get("temporal_patch_size", 2)),
        spatial_merge_size=int(v.get("spatial_merge_size", 2)),
        num_position_embeddings=int(v.get("num_position_embeddings")),
        deepstack_visual_indexes=tuple(int(i) for i in v.get("deepstack_visual_indexes")),
        # transformers 5.x writes the vision rotary base under rope_parameters; 4.57 fixes it at 1e4.
        rope_theta=float((v.get("rope_parameters", None) or {}).get("rope_theta", 10000.0)),
    )
    if vision.hidden_size % vision.num_heads or vision.num_grid_per_side**2 != vision.num_position_embeddings:
        raise CheckpointError(
            "config.json: vision_config has inconsistent hidden_size/num_heads/num_position_embeddings"
        )
    if not vision.deepstack_visual_indexes or any(not 0 <= i < vision.depth for i in vision.deepstack_visual_indexes):
        raise CheckpointError(
            "config.json: vision_config.deepstack_visual_indexes must name layers of the vision tower "
            f"(got {list(vision.deepstack_visual_indexes)} for depth {vision.depth})"
        )

    moe = None
    if model_type == "qwen3_vl_moe":
        moe = ExpertConfig(
            num_experts=int(t.get("num_experts")),
            num_experts_per_tok=int(t.get("num_experts_per_tok")),
            moe_intermediate_size=int(t.get("moe_intermediate_size")),
            decoder_sparse_step=int(t.get("decoder_sparse_step", 1)),
            mlp_only_layers=tuple(int(i) for i in t.get("mlp_only_layers", None) or ()),
            norm_topk_prob=bool(t.get("norm_topk_prob", True)),
        )
    theta, section = _rope_settings(t)
    heads = int(t.get("num_attention_heads"))
    hidden = int(t.get("hidden_size"))
    text = TextConfig(
        vocab_size=int(t.get("vocab_size")),
        hidden_size=hidden,
        num_hidden_layers=int(t.get("num_hidden_layers")),
        num_attention_heads=heads,
        num_key_value_heads=int(t.get("num_key_value_heads", None) or heads),
        head_dim=int(t.get("head_dim", None) or hidden // heads),
        intermediate_size=int(t.get("intermediate_size")),
        rms_norm_eps=float(t.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        mrope_section=section,
        mrope_interleaved=True,  # _rope_settings refuses anything else
        max_position_embeddings=int(t.get("max_position_embeddings", 262144)),
        moe=moe,
    )
    half = text.head_dim // 2  # Qwen3-VL rotates every dim of a head: rotary_dim is head_dim
    if len(section) != 3 or sum(section) != half:
        # transformers' apply_interleaved_mrope takes the t, h and w sections of the head's rotary pairs.
        raise CheckpointError(
            f"config.json: text_config mrope_section {list(section)} must be 3 sections (t, h, w) that sum to "
            f"head_dim/2 = {half}"
        )
    if vision.out_hidden_size != text.hidden_size:
        raise CheckpointError(
            f"config.json: vision out_hidden_size {vision.out_hidden_size} != text hidden_size {text.hidden_size}"
        )
    saved_by = _saved_by_major(top)
    return ModelInfo(
        model_type=model_type,
        vision=vision,
        text=text,
        tie_word_embeddings=_tie_word_embeddings(top, t, saved_by),
        saved_by_transformers_major=saved_by,
        image_token_id=int(top.get("image_token_id", 151655)),
        video_token_id=int(top.get("video_token_id", 151656)),
        vision_start_token_id=int(top.get("vision_start_token_id", 151652)),
        vision_end_token_id=int(top.get("vision_end_token_id", 151653)),
        quantization=read_quantization(cfg),
    )


@dataclass(frozen=True)
class _ShardHeader:
    tensors: dict[str, dict]  # name -> {"dtype", "shape", "data_offsets"}
    data_start: int  # file offset of the first data byte


def read_shard_header(path: Path) -> _ShardHeader:
    """Reads a safetensors header and checks the file holds every byte the header promises."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            raw_len = f.read(8)
            if len(raw_len) < 8:
                raise CheckpointError(f"shard {path.name} is truncated or empty ({size} bytes)")
            (header_len,) = struct.unpack("<Q", raw_len)
            if header_len > size - 8:
                raise CheckpointError(f"shard {path.name} is truncated: its header runs past the end of the file")
            header = json.loads(f.read(header_len))
    except FileNotFoundError:
        raise CheckpointError(f"shard {path.name} is missing from {path.parent}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"shard {path.name} is not a safetensors file (bad header: {e})") from None
    header.pop("__metadata__", None)
    end = max((int(meta["data_offsets"][1]) for meta in header.values()), default=0)
    expected = 8 + header_len + end
    if size < expected:
        raise CheckpointError(
            f"shard {path.name} is truncated: {size} bytes on disk, its header describes {expected}; "
            "re-download or re-copy this file"
        )
    return _ShardHeader(tensors=header, data_start=8 + header_len)


def read_config(model_dir: Path) -> tuple[bytes, dict]:
    """config.json's bytes and parsed content."""
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{model_dir} has no config.json: is this a Hugging Face model directory?")
    raw = config_path.read_bytes()
    try:
        return raw, json.loads(raw)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{config_path} is not valid JSON: {e}") from None


class Checkpoint:
    """A local Hugging Face Qwen3-VL checkpoint, opened without reading any weights."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        if not self.path.exists():
            raise CheckpointError(f"checkpoint directory {self.path} does not exist")
        if not self.path.is_dir():
            raise CheckpointError(f"{self.path} is not a directory: pass the checkpoint directory, not a file")
        self.config_bytes, self.config = read_config(self.path)
        self.info = parse_config(self.config)
        self._weight_map = self._read_weight_map()
        self._headers: dict[str, _ShardHeader] = {}
        # Block scales belong to their weights, which read dequantized: they are not tensors of the model.
        self._scales = scale_names(self._weight_map) if self.info.quantization else set()

    def _read_weight_map(self) -> dict[str, str]:
        index = self.path / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"{index} is not a valid safetensors index ({e})") from None
            return {str(k): str(v) for k, v in weight_map.items()}
        single = self.path / SINGLE_FILE
        if single.is_file():
            return dict.fromkeys(read_shard_header(single).tensors, SINGLE_FILE)
        if any(self.path.glob("*.bin")):
            raise CheckpointError(
                f"{self.path} holds PyTorch .bin weights; qwen3vl-trt reads safetensors checkpoints only "
                "(save the model with safe_serialization=True)"
            )
        raise CheckpointError(f"{self.path} has no weights: expected {INDEX_FILE} or {SINGLE_FILE}")

    @property
    def shard_files(self) -> list[str]:
        return sorted(set(self._weight_map.values()))

    def tensor_names(self, prefix: str = "") -> list[str]:
        """The model's tensors (block scales excluded: their weights read dequantized)."""
        return sorted(name for name in self._weight_map if name.startswith(prefix) and name not in self._scales)

    def stored_bytes(self) -> dict[str, int]:
        """Bytes on disk per stored dtype (safetensors tag), over every tensor the index lists."""
        totals: dict[str, int] = defaultdict(int)
        for name in self._weight_map:
            meta = self._tensor_meta(name)
            begin, end = meta["data_offsets"]
            totals[meta["dtype"]] += int(end) - int(begin)
        return dict(sorted(totals.items()))

    def quantized_tensor_names(self, prefix: str = "") -> list[str]:
        """The model's tensors stored quantized (block FP8), which every reader sees dequantized."""
        return [n for n in self.tensor_names(prefix) if self._tensor_meta(n)["dtype"] == FP8_TAG]

    def _header(self, shard: str) -> _ShardHeader:
        if shard not in self._headers:
            self._headers[shard] = read_shard_header(self.path / shard)
        return self._headers[shard]

    def verify_shards(self) -> None:
        """Checks every shard exists, is whole and holds the tensors the index assigns to it."""
        by_shard: dict[str, list[str]] = defaultdict(list)
        for name, shard in self._weight_map.items():
            by_shard[shard].append(name)
        for shard, names in sorted(by_shard.items()):
            tensors = self._header(shard).tensors
            missing = [n for n in names if n not in tensors]
            if missing:
                raise CheckpointError(
                    f"shard {shard} lacks {len(missing)} tensor(s) the index assigns to it, e.g. {missing[0]}"
                )

    def _tensor_meta(self, name: str) -> dict:
        shard = self._shard_of(name)
        meta = self._header(shard).tensors.get(name)
        if meta is None:
            raise CheckpointError(f"shard {shard} lacks tensor '{name}' that the index assigns to it")
        return meta

    def tensor_bytes(self, names: Iterable[str]) -> int:
        total = 0
        for name in names:
            begin, end = self._tensor_meta(name)["data_offsets"]
            total += int(end) - int(begin)
        return total

    def _shard_of(self, name: str) -> str:
        try:
            return self._weight_map[name]
        except KeyError:
            listing = INDEX_FILE if (self.path / INDEX_FILE).is_file() else SINGLE_FILE
            raise CheckpointError(f"checkpoint has no tensor '{name}' (not listed in its {listing})") from None

    def iter_tensors(self, names: Iterable[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """Yields (name, tensor) for the requested names, opening each needed shard once."""
        from safetensors import safe_open

        by_shard: dict[str, list[str]] = defaultdict(list)
        for name in names:
            self._tensor_meta(name)  # every name checked before any shard is read
            by_shard[self._shard_of(name)].append(name)
        for shard in sorted(by_shard):
            with safe_open(str(self.path / shard), framework="pt") as f:
                for name in by_shard[shard]:
                    if self._tensor_meta(name)["dtype"] == FP8_TAG:
                        location = self.locate(name)
                        yield name, location.read_rows(0, location.shape[0])
                    else:
                        yield name, f.get_tensor(name)

    def locate(self, name: str) -> TensorLocation | BlockFP8Location:
        """Where tensor `name` lies on disk, for reading it in row ranges without loading its shard; a
        block-FP8 weight reads dequantized (float32) with its scales."""
        meta = self._tensor_meta(name)
        if meta["dtype"] != FP8_TAG:
            return self._stored(name)
        q = self.info.quantization
        if q is None:
            raise CheckpointError(
                f"tensor '{name}' is stored as {FP8_TAG}, but config.json declares no quantization_config: "
                "restore the release's config.json"
            )
        if name + SCALE_SUFFIX not in self._weight_map:
            raise CheckpointError(f"the {FP8_TAG} tensor '{name}' has no '{name}{SCALE_SUFFIX}' (its block scales)")
        weight, scale = self._stored(name), self._stored(name + SCALE_SUFFIX)
        check_scale_shape(name, weight.shape, scale.shape, q)
        return BlockFP8Location(weight, scale, q.block)

    def _stored(self, name: str) -> TensorLocation:
        from ..common.torch_dtypes import SAFETENSORS_DTYPES
        from .safetensors_io import TensorLocation

        meta = self._tensor_meta(name)
        shard = self._shard_of(name)
        dtype = SAFETENSORS_DTYPES.get(meta["dtype"])
        if dtype is None:
            raise CheckpointError(f"tensor '{name}' in {shard} has unsupported dtype {meta['dtype']}")
        begin, end = (int(v) for v in meta["data_offsets"])
        location = TensorLocation(
            self.path / shard, self._header(shard).data_start + begin, dtype, tuple(meta["shape"])
        )
        if location.nbytes != end - begin:
            raise CheckpointError(f"tensor '{name}' in {shard}: shape {meta['shape']} does not match its byte range")
        return location

    def load_tensors(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        return dict(self.iter_tensors(names))

    def config_sha256(self) -> str:
        return hashlib.sha256(self.config_bytes).hexdigest()


def tensors_sha256(tensors: dict[str, torch.Tensor]) -> str:
    """Content hash of named tensors (name, dtype, shape and raw bytes), independent of sharding."""
    import torch

    digest = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().data)  # a view: no copy
    return digest.hexdigest()


def generation_end_ids(model_dir: Path) -> tuple[int, ...]:
    """The eos ids of generation_config.json (none if the file is absent)."""
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return ()
    eos = read_json(path, "").get("eos_token_id", [])
    ids = eos if isinstance(eos, list) else [eos]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise CheckpointError(f"{path}: eos_token_id must be a token id or a list of them, got {eos!r}")
    return tuple(ids)
