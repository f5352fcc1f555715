"""The TensorRT-LLM 1.2.1 checkpoint of the Qwen3-VL language model: config, names and sharding.

Declared once here and used by the converter (which writes it), the reference runtime (which reads
it back, reassembling any split) and the engine build. The format follows TensorRT-LLM's own Qwen
converter (`tensorrt_llm/models/qwen/convert.py`, `model_weights_loader.py`, `mapping.py`):

- `config.json` (PretrainedConfig + QWenConfig fields) and `rank{r}.safetensors`, r = pp_rank * tp + tp_rank;
- pipeline stage p holds the layers `tensor_split(range(L), pp)[p]` under local indices 0..n-1, the
  embedding on the first stage, ln_f and lm_head on the last (lm_head written even when tied);
- attention `qkv` per rank is [q_r; k_r; v_r] (k/v heads repeated when tp > kv heads), or, where a rank
  holds as many query heads as key/value heads, head by head [q_0; k_0; v_0; q_1; ...]: the layout
  TensorRT-LLM's Attention reads then (`layers/attention.py`, the qk_layernorm block); `dense` split
  on its input dim; dense MLP `fc` = gate_proj (activated), `gate` = up_proj, `proj` = down_proj;
  MoE `router` in float32, unsplit, `fc` [E, 2 * I/tp, H] = [up_r; gate_r], `proj` [E, H, I/tp];
  lm_head rows padded with zeros to a multiple of tp, then split.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..common.dtypes import DTYPE_CHOICES, DTYPE_NAMES
from ..common.fsutil import json_entry, read_json
from ..errors import CheckpointError, UnsupportedModelError
from ..hf.checkpoint import ModelInfo
from .fp8 import ACTIVATION_SCALE, FP8_ALGO, WEIGHT_SCALE, FP8PerTensor, FP8Weight
from .kv_cache import KV_CACHE_ALGOS, KV_SCALE, KVCacheQuant
from .weight_only import QUANT_ALGO_SCHEMES, SCALE_NAME, WeightOnly

Scheme = WeightOnly | FP8PerTensor
# quantization.quant_algo values convert-llm writes, and how their weights are stored.
SCHEMES: dict[str, Scheme] = {**QUANT_ALGO_SCHEMES, FP8_ALGO: FP8PerTensor()}

# torch and safetensors load only when weights are read: the repository writer, which the command line's light
# paths import, reads only the config.
if TYPE_CHECKING:
    import torch

ARCHITECTURE = "Qwen3VLForCausalLM"
CONFIG_FILE = "config.json"
# The checkpoint tokenizer's xgrammar tokenizer info (guided_decoding.write_tokenizer_info), which the tensorrtllm
# backend's xgrammar_tokenizer_info_path and the reference runtime read for guided decoding.
TOKENIZER_INFO_FILE = "xgrammar_tokenizer_info.json"
# ExpertScaleNormalizationMode.RENORMALIZE (tensorrt_llm/layers/moe.py): softmax over the top-k
# logits, which equals transformers' Qwen3-VL-MoE routing (softmax, top-k, divide by their sum).
MOE_RENORMALIZE = 1


def rank_file(rank: int) -> str:
    return f"rank{rank}.safetensors"


@dataclass(frozen=True)
class ParallelLayout:
    """Tensor x pipeline parallel layout (TensorRT-LLM's Mapping, without context parallelism)."""

    tp_size: int = 1
    pp_size: int = 1

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    def rank(self, tp_rank: int, pp_rank: int) -> int:
        return pp_rank * self.tp_size + tp_rank

    def pp_layers(self, num_layers: int, pp_rank: int) -> list[int]:
        """Global layer indices of a pipeline stage; the first num_layers % pp stages get one more."""
        return [int(i) for i in np.array_split(np.arange(num_layers), self.pp_size)[pp_rank]]


@dataclass(frozen=True)
class LLMConfig:
    """What the runtimes need from a checkpoint's config.json."""

    dtype: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_size: int
    intermediate_size: int
    norm_epsilon: float
    rotary_base: float
    rotary_dim: int
    max_position_embeddings: int
    deepstack_count: int
    mapping: ParallelLayout
    moe: MoeSettings | None = None
    quant_algo: str | None = None  # quantization.quant_algo: None, or one of SCHEMES
    kv_cache_quant_algo: str | None = None  # None, or one of kv_cache.KV_CACHE_ALGOS

    @property
    def scheme(self) -> Scheme | None:
        return SCHEMES[self.quant_algo] if self.quant_algo else None

    @property
    def kv_cache(self) -> KVCacheQuant | None:
        return KV_CACHE_ALGOS[self.kv_cache_quant_algo] if self.kv_cache_quant_algo else None

    @property
    def vocab_size_padded(self) -> int:
        tp = self.mapping.tp_size
        return -(-self.vocab_size // tp) * tp


@dataclass(frozen=True)
class MoeSettings:
    num_experts: int
    top_k: int
    intermediate_size: int
    renormalize: bool


# quantize_layers' default exclusions (tensorrt_llm/quantization/quantize.py, 1.2 line), written out because a
# checkpoint's exclude_modules replaces them: the output head, the MoE router and the embedding stay in the dtype.
EXCLUDED_MODULES = ["*lm_head", "*router", "*vocab_embedding", "*position_embedding", "*block_embedding"]


def quantization_config(quant_algo: str | None, kv_cache_quant_algo: str | None = None) -> dict:
    """config.json's `quantization` (QuantConfig's fields, models/modeling_utils.py; group_size is read by
    group-wise algorithms only)."""
    out: dict[str, Any] = {"quant_algo": quant_algo, "kv_cache_quant_algo": kv_cache_quant_algo}
    if quant_algo is not None:
        out["exclude_modules"] = EXCLUDED_MODULES
    return out


def trtllm_config(
    info: ModelInfo,
    dtype: str,
    mapping: ParallelLayout,
    quant_algo: str | None = None,
    kv_cache_quant_algo: str | None = None,
) -> dict:
    """config.json for the TensorRT-LLM checkpoint: the fields PretrainedConfig and QWenConfig read
    (tensorrt_llm/models/modeling_utils.py, models/qwen/config.py), qwen_type qwen3 / qwen3_moe for
    the q/k RMSNorm and MoE layers, position_embedding_type mrope with rotary scaling type mrope (what
    QWenConfig.from_hugging_face writes for qwen2_vl, so the attention layers take the MRoPE path), and
    the Qwen3-VL settings the engine model and host need (DeepStack count, MRoPE sections, image token id)."""
    text, moe = info.text, info.text.moe
    if moe is not None and (moe.mlp_only_layers or moe.decoder_sparse_step != 1):
        raise UnsupportedModelError(
            "MoE checkpoints with dense layers (mlp_only_layers / decoder_sparse_step) are not supported: "
            "TensorRT-LLM's Qwen MoE model makes every layer sparse"
        )
    _check_divisible(info, mapping)
    check_deepstack_stage(text.num_hidden_layers, info.deepstack_count, mapping)
    return {
        "architecture": ARCHITECTURE,
        "dtype": DTYPE_NAMES[dtype],
        "logits_dtype": "float32",
        "vocab_size": text.vocab_size,
        "hidden_size": text.hidden_size,
        "num_hidden_layers": text.num_hidden_layers,
        "num_attention_heads": text.num_attention_heads,
        "num_key_value_heads": text.num_key_value_heads,
        "head_size": text.head_dim,
        "hidden_act": "swiglu" if moe else "silu",
        "intermediate_size": text.intermediate_size,
        "norm_epsilon": text.rms_norm_eps,
        "position_embedding_type": "mrope",
        "max_position_embeddings": text.max_position_embeddings,
        "rotary_embedding_dim": text.head_dim,
        "rotary_base": text.rope_theta,
        "rotary_scaling": {"type": "mrope"},
        "mapping": {
            "world_size": mapping.world_size,
            "tp_size": mapping.tp_size,
            "pp_size": mapping.pp_size,
            "cp_size": 1,
            "moe_tp_size": mapping.tp_size,
            "moe_ep_size": 1,
        },
        "quantization": quantization_config(quant_algo, kv_cache_quant_algo),
        "use_parallel_embedding": False,
        "embedding_sharding_dim": 0,
        "qwen_type": "qwen3_moe" if moe else "qwen3",
        "mlp_bias": False,
        "attn_bias": False,
        "use_logn_attn": False,
        "disable_weight_only_quant_plugin": False,
        "tie_word_embeddings": info.tie_word_embeddings,
        "seq_length": text.max_position_embeddings,
        "moe": {
            "num_experts": moe.num_experts if moe else 0,
            "top_k": moe.num_experts_per_tok if moe else 0,
            "normalization_mode": MOE_RENORMALIZE if moe else 0,
            "shared_expert_intermediate_size": 0,
        },
        "moe_intermediate_size": moe.moe_intermediate_size if moe else 0,
        "moe_shared_expert_intermediate_size": 0,
        "qwen3_vl": {
            "deepstack_count": info.deepstack_count,
            "mrope_section": list(text.mrope_section),
            "mrope_interleaved": text.mrope_interleaved,
            "image_token_id": info.image_token_id,
        },
    }


def _check_divisible(info: ModelInfo, mapping: ParallelLayout) -> None:
    text, tp = info.text, mapping.tp_size
    if mapping.tp_size < 1 or mapping.pp_size < 1:
        raise UnsupportedModelError(f"tp and pp must be >= 1, got tp={mapping.tp_size} pp={mapping.pp_size}")
    checks = [("attention heads", text.num_attention_heads), ("intermediate size", text.intermediate_size)]
    if text.moe is not None:
        checks.append(("MoE intermediate size", text.moe.moe_intermediate_size))
    for what, n in checks:
        if n % tp:
            raise UnsupportedModelError(f"tp={tp} does not divide the {what} ({n})")
    kv = text.num_key_value_heads
    if kv % tp and tp % kv:
        raise UnsupportedModelError(f"tp={tp} must divide, or be a multiple of, the {kv} key/value heads")
    if mapping.pp_size > text.num_hidden_layers:
        raise UnsupportedModelError(f"pp={mapping.pp_size} is more than the {text.num_hidden_layers} layers")


def check_deepstack_stage(num_layers: int, deepstack_count: int, mapping: ParallelLayout) -> None:
    """Refuses a pipeline split whose first stage lacks a DeepStack layer. Only the first stage has
    `input_ids`, which locate the visual tokens; TensorRT-LLM gives later stages `hidden_states_input`
    instead (models/generation_mixin.py, prepare_basic_inputs)."""
    needed = min(deepstack_count, num_layers)  # transformers adds no feature past the last layer
    first = mapping.pp_layers(num_layers, 0)
    if needed <= len(first):
        return
    first_stage_size = {pp: len(ParallelLayout(pp_size=pp).pp_layers(num_layers, 0)) for pp in range(1, num_layers + 1)}
    works = max(pp for pp, size in first_stage_size.items() if size >= needed)
    raise UnsupportedModelError(
        f"pp={mapping.pp_size} puts DeepStack layer(s) {list(range(len(first), needed))} past the first pipeline "
        f"stage (layers 0-{first[-1]}), but only the first stage sees the token ids that mark visual tokens; "
        f"use pp <= {works} (add GPUs with tp instead)"
    )


# LLMConfig fields that config.json holds under the same name, and their JSON types.
_SAME_NAMED_FIELDS: dict[str, type] = {
    "dtype": str,
    "vocab_size": int,
    "hidden_size": int,
    "num_hidden_layers": int,
    "num_attention_heads": int,
    "num_key_value_heads": int,
    "head_size": int,
    "intermediate_size": int,
    "norm_epsilon": float,
    "rotary_base": float,
    "max_position_embeddings": int,
}


def parse_trtllm_config(cfg: dict, where: str = f"TensorRT-LLM checkpoint {CONFIG_FILE}") -> LLMConfig:
    """The runtimes' view of a checkpoint config; CheckpointError naming `where` if it is foreign or malformed."""
    fix = "convert the checkpoint again with `qwen3vl-trt convert-llm`"
    if cfg.get("architecture") != ARCHITECTURE:
        raise CheckpointError(f"{where}: architecture is {cfg.get('architecture')!r}, expected {ARCHITECTURE!r}; {fix}")

    def entry(key: str, kind: type) -> Any:
        return json_entry(cfg, key, kind, where, fix)

    moe = None
    if entry("moe", dict).get("num_experts") != 0:  # 0 experts: a dense model
        moe = MoeSettings(
            num_experts=entry("moe.num_experts", int),
            top_k=entry("moe.top_k", int),
            intermediate_size=entry("moe_intermediate_size", int),
            renormalize=cfg["moe"].get("normalization_mode") == MOE_RENORMALIZE,
        )
    same_named = {name: entry(name, kind) for name, kind in _SAME_NAMED_FIELDS.items()}
    quantization = entry("quantization", dict)
    quant_algo, kv_cache_quant_algo = quantization.get("quant_algo"), quantization.get("kv_cache_quant_algo")
    for key, value, known in (
        ("quant_algo", quant_algo, SCHEMES),
        ("kv_cache_quant_algo", kv_cache_quant_algo, KV_CACHE_ALGOS),
    ):
        if value is not None and value not in known:
            raise CheckpointError(
                f"{where}: quantization.{key} {value!r} is not one convert-llm writes "
                f"({', '.join(known)} or null); {fix}"
            )
    if same_named["dtype"] not in DTYPE_NAMES.values():
        names = ", ".join(DTYPE_NAMES.values())
        raise CheckpointError(f"{where}: dtype {same_named['dtype']!r} is not one of {names}; {fix}")
    return LLMConfig(
        **same_named,
        rotary_dim=entry("rotary_embedding_dim", int),
        deepstack_count=entry("qwen3_vl.deepstack_count", int),
        mapping=ParallelLayout(entry("mapping.tp_size", int), entry("mapping.pp_size", int)),
        moe=moe,
        quant_algo=quant_algo,
        kv_cache_quant_algo=kv_cache_quant_algo,
    )


def read_trtllm_config(checkpoint_dir: str | os.PathLike[str]) -> tuple[dict, LLMConfig]:
    missing = f"{checkpoint_dir} has no {CONFIG_FILE}: is it a converted TensorRT-LLM checkpoint?"
    path = Path(checkpoint_dir) / CONFIG_FILE
    cfg = read_json(path, missing)
    return cfg, parse_trtllm_config(cfg, str(path))


# -- names and splits ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Split:
    """How a parameter is cut across tensor-parallel ranks: along `dim`, into consecutive groups
    (q, k, v of qkv; up, gate of MoE fc) of `unit`-sized blocks (heads), each group split evenly,
    or repeated when it has fewer blocks than ranks (key/value heads). dim None: every rank has it all.
    `interleaved`: each rank orders its part block by block across the groups (q_0, k_0, v_0, q_1, ...), which
    needs every group to give the rank as many blocks."""

    dim: int | None = None
    groups: tuple[int, ...] = ()
    unit: int = 1
    interleaved: bool = False

    def ranges(self, tp_rank: int, tp_size: int) -> list[tuple[int, int]]:
        """[start, stop) along `dim` of the whole tensor that rank tp_rank holds, in its order."""
        out, offset = [], 0
        for size in self.groups:
            blocks = size // self.unit
            if blocks >= tp_size:
                per = size // tp_size
                out.append((offset + tp_rank * per, offset + (tp_rank + 1) * per))
            else:
                block = tp_rank // (tp_size // blocks)
                out.append((offset + block * self.unit, offset + (block + 1) * self.unit))
            offset += size
        if not self.interleaved:
            return out
        per_group = [[(a, a + self.unit) for a in range(start, stop, self.unit)] for start, stop in out]
        return [block for blocks in zip(*per_group, strict=True) for block in blocks]


REPLICATED = Split()


@dataclass(frozen=True)
class StoredTensor:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Param:
    """One parameter of a rank file: its name there, its whole (unsplit) shape and its split."""

    name: str
    shape: tuple[int, ...]
    split: Split = REPLICATED
    float32: bool = False  # kept in float32 whatever the checkpoint dtype (the MoE router)
    quantizable: bool = False  # a linear weight that weight-only engines store quantized

    def stored(self, tp_rank: int, tp_size: int, dtype: torch.dtype, scheme: Scheme | None) -> list[StoredTensor]:
        """The tensors of this parameter in a rank file: itself in `dtype`; weight-only, its int8 `weight` in the
        stored layout and its `per_channel_scale` (llm/weight_only.py); FP8, its e4m3 `weight` and its weight and
        activation scales (llm/fp8.py)."""
        import torch

        shape = self.rank_shape(tp_rank, tp_size)
        if scheme is None or not self.quantizable:
            return [StoredTensor(self.name, torch.float32 if self.float32 else dtype, shape)]
        if isinstance(scheme, WeightOnly):
            return [
                StoredTensor(self.name, torch.int8, scheme.stored_shape(shape)),
                StoredTensor(self.scale_name, dtype, shape[:-1]),
            ]
        prefix = self.name.removesuffix("weight")
        return [
            StoredTensor(self.name, torch.float8_e4m3fn, shape),
            StoredTensor(prefix + WEIGHT_SCALE, torch.float32, (shape[0], 1) if len(shape) == 3 else (1,)),
            StoredTensor(prefix + ACTIVATION_SCALE, torch.float32, (1,)),
        ]

    @property
    def scale_name(self) -> str:
        return self.name.removesuffix("weight") + SCALE_NAME

    def rank_shape(self, tp_rank: int, tp_size: int) -> tuple[int, ...]:
        if self.split.dim is None:
            return self.shape
        shape = list(self.shape)
        shape[self.split.dim] = sum(b - a for a, b in self.split.ranges(tp_rank, tp_size))
        return tuple(shape)


def layer_params(config: LLMConfig, local: int) -> dict[str, Param]:
    """The parameters of one decoder layer, keyed by role, named with the stage-local index."""
    c = config
    p = f"transformer.layers.{local}."
    hd, d = c.head_size, c.hidden_size
    q, kv = c.num_attention_heads * hd, c.num_key_value_heads * hd
    # Attention.forward (tensorrt_llm/layers/attention.py, `if self.qk_layernorm:`) splits a rank's fused qkv as
    # [Q; K; V] when its query and key/value head counts differ, and views it as [heads, 3, head_size] when they
    # are equal (with one head each, the two layouts coincide).
    tp = c.mapping.tp_size
    per_head = c.num_attention_heads // tp == max(c.num_key_value_heads // tp, 1)
    params = {
        "input_layernorm": Param(p + "input_layernorm.weight", (d,)),
        "qkv": Param(
            p + "attention.qkv.weight", (q + 2 * kv, d), Split(0, (q, kv, kv), hd, per_head), quantizable=True
        ),
        "q_norm": Param(p + "attention.q_layernorm.weight", (hd,)),
        "k_norm": Param(p + "attention.k_layernorm.weight", (hd,)),
        "dense": Param(p + "attention.dense.weight", (d, q), Split(1, (q,)), quantizable=True),
        "post_layernorm": Param(p + "post_layernorm.weight", (d,)),
    }
    if c.kv_cache is not None:
        params["kv_scale"] = Param(p + "attention." + KV_SCALE, (1,), float32=True)
    if c.moe is None:
        i = c.intermediate_size
        params |= {
            "mlp_gate": Param(p + "mlp.fc.weight", (i, d), Split(0, (i,)), quantizable=True),
            "mlp_up": Param(p + "mlp.gate.weight", (i, d), Split(0, (i,)), quantizable=True),
            "mlp_down": Param(p + "mlp.proj.weight", (d, i), Split(1, (i,)), quantizable=True),
        }
    else:
        e, i = c.moe.num_experts, c.moe.intermediate_size
        params |= {
            "router": Param(p + "mlp.router.weight", (e, d), float32=True),
            "experts_up_gate": Param(p + "mlp.fc.weight", (e, 2 * i, d), Split(1, (i, i)), quantizable=True),
            "experts_down": Param(p + "mlp.proj.weight", (e, d, i), Split(2, (i,)), quantizable=True),
        }
    return params


def stage_params(config: LLMConfig, pp_rank: int) -> dict[str, Param]:
    """Every parameter of a pipeline stage, keyed by role ("layers.{global}.{role}" for layers)."""
    c, mapping = config, config.mapping
    params: dict[str, Param] = {}
    if pp_rank == 0:
        params["vocab_embedding"] = Param("transformer.vocab_embedding.weight", (c.vocab_size, c.hidden_size))
    for local, layer in enumerate(mapping.pp_layers(c.num_hidden_layers, pp_rank)):
        for role, param in layer_params(c, local).items():
            params[f"layers.{layer}.{role}"] = param
    if pp_rank == mapping.pp_size - 1:
        params["ln_f"] = Param("transformer.ln_f.weight", (c.hidden_size,))
        v = c.vocab_size_padded
        params["lm_head"] = Param("lm_head.weight", (v, c.hidden_size), Split(0, (v,)))
    return params


# -- reading a checkpoint back ---------------------------------------------------------------------------


@dataclass
class DenseMLPWeights:
    gate: torch.Tensor | FP8Weight  # [I, H], activated
    up: torch.Tensor | FP8Weight  # [I, H]
    down: torch.Tensor | FP8Weight  # [H, I]


@dataclass
class MoEWeights:
    router: torch.Tensor  # [E, H] float32
    up: torch.Tensor | FP8Weight  # [E, I, H]
    gate: torch.Tensor | FP8Weight  # [E, I, H], activated
    down: torch.Tensor | FP8Weight  # [E, H, I]


@dataclass
class LayerWeights:
    input_layernorm: torch.Tensor
    qkv: torch.Tensor | FP8Weight  # [(H + 2 KV) * head_size, hidden]: q, k, v heads (merge undoes any rank order)
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    dense: torch.Tensor | FP8Weight
    post_layernorm: torch.Tensor
    mlp: DenseMLPWeights | MoEWeights
    kv_scale: torch.Tensor | None = None  # (1,) float32 with a quantized KV cache


def layer_weights(roles: dict[str, Any], config: LLMConfig) -> LayerWeights:
    """A decoder layer from its parameters by role (layer_params' keys)."""
    w = dict(roles)
    mlp: DenseMLPWeights | MoEWeights
    if config.moe is None:
        mlp = DenseMLPWeights(w.pop("mlp_gate"), w.pop("mlp_up"), w.pop("mlp_down"))
    else:
        fc = w.pop("experts_up_gate")
        up, gate = fc.split([config.moe.intermediate_size] * 2, 1)
        mlp = MoEWeights(w.pop("router"), up, gate, w.pop("experts_down"))
    return LayerWeights(**w, mlp=mlp)


@dataclass
class LLMWeights:
    """The whole model, reassembled from any tensor/pipeline split."""

    config: LLMConfig
    vocab_embedding: torch.Tensor
    layers: list[LayerWeights]
    ln_f: torch.Tensor
    lm_head: torch.Tensor  # [vocab_size, hidden] (padding dropped)

    def to(self, device: str | torch.device) -> LLMWeights:
        import torch

        def move(obj: Any) -> Any:
            if isinstance(obj, (torch.Tensor, FP8Weight)):
                return obj.to(device)
            if isinstance(obj, list):
                return [move(o) for o in obj]
            if isinstance(obj, (LayerWeights, DenseMLPWeights, MoEWeights)):
                return replace(obj, **{f.name: move(getattr(obj, f.name)) for f in fields(obj)})
            return obj

        return replace(self, **{f.name: move(getattr(self, f.name)) for f in fields(self)})


def merge(param: Param, parts: list[torch.Tensor], tp_size: int) -> torch.Tensor:
    """The whole parameter from the tensor-parallel ranks' parts (inverse of Split.ranges)."""
    if param.split.dim is None:
        return parts[0]
    dim = param.split.dim
    whole = parts[0].new_empty(param.shape)
    for tp_rank, part in enumerate(parts):
        cursor = 0
        for a, b in param.split.ranges(tp_rank, tp_size):
            whole.narrow(dim, a, b - a).copy_(part.narrow(dim, cursor, b - a))
            cursor += b - a
    return whole


def _read_stored(f: Any, want: StoredTensor, where: str) -> torch.Tensor:
    """Tensor `want` of an open rank file, checked against its planned dtype and shape."""
    if want.name not in f.keys():
        raise CheckpointError(f"{where} lacks {want.name}")
    tensor = f.get_tensor(want.name)
    if tuple(tensor.shape) != want.shape or tensor.dtype != want.dtype:
        raise CheckpointError(
            f"{want.name} in {where} is {tensor.dtype} {list(tensor.shape)}, expected {want.dtype} {list(want.shape)}"
        )
    return tensor


def load_llm_weights(checkpoint_dir: str | os.PathLike[str]) -> LLMWeights:
    """Reads every rank file of a converted checkpoint and reassembles the model."""
    from safetensors import SafetensorError, safe_open

    from ..common.torch_dtypes import TORCH_DTYPES

    root = Path(checkpoint_dir)
    _, config = read_trtllm_config(root)
    mapping = config.mapping
    dtype = TORCH_DTYPES[DTYPE_CHOICES[config.dtype]]
    scheme = config.scheme
    roles: dict[str, Any] = {}
    for pp_rank in range(mapping.pp_size):
        params = stage_params(config, pp_rank)
        with contextlib.ExitStack() as opened:  # the stage's rank files, closed on every path out
            files = []
            for tp_rank in range(mapping.tp_size):
                path = root / rank_file(mapping.rank(tp_rank, pp_rank))
                if not path.is_file():
                    raise CheckpointError(f"{root} lacks {path.name} (tp={mapping.tp_size}, pp={mapping.pp_size})")
                try:
                    files.append(opened.enter_context(safe_open(str(path), framework="pt")))
                except SafetensorError as e:
                    raise CheckpointError(
                        f"{path} is not a readable safetensors file ({e}); convert the checkpoint again"
                    ) from None
            for role, param in params.items():
                parts = []
                for tp_rank, f in enumerate(files):
                    where = rank_file(mapping.rank(tp_rank, pp_rank))
                    stored = [_read_stored(f, t, where) for t in param.stored(tp_rank, mapping.tp_size, dtype, scheme)]
                    if len(stored) == 1 or isinstance(scheme, FP8PerTensor):
                        parts.append(stored)
                    else:  # weight-only: the engine's weights are the stored values times their scales
                        assert isinstance(scheme, WeightOnly)
                        parts.append([WeightOnly.dequantize(scheme.from_stored(stored[0]), stored[1], dtype)])
                whole = merge(param, [p[0] for p in parts], mapping.tp_size)
                # FP8: one weight scale per tensor (or expert) and one activation scale, the same on every rank.
                roles[role] = FP8Weight(whole, parts[0][1], parts[0][2]) if len(parts[0]) == 3 else whole
    layers = [
        layer_weights(
            {role.split(".", 2)[2]: t for role, t in roles.items() if role.startswith(f"layers.{layer}.")}, config
        )
        for layer in range(config.num_hidden_layers)
    ]
    lm_head = roles["lm_head"][: config.vocab_size]
    return LLMWeights(config, roles["vocab_embedding"], layers, roles["ln_f"], lm_head)
