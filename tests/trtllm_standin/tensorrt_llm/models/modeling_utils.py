"""tensorrt_llm/models/modeling_utils.py (1.2 line, b35ac1b6): PretrainedConfig's loading, QuantConfig,
PretrainedModel's from_checkpoint, preprocess_weights and load, DecoderLayerList. Loading is upstream's to the letter
where our code depends on it: from_dict looks the architecture up in MODEL_MAP (unknown -> KeyError) and builds that
model class's config_class; from_checkpoint reads the rank's weights, runs preprocess_weights_hook, then
preprocess_weights, builds the model and loads the weights, which must be every parameter the (quantized) model
declares, in its shape."""

import copy
import dataclasses
import fnmatch
import json
import os
import warnings

from ..mapping import Mapping


@dataclasses.dataclass
class QuantConfig:
    """Upstream's fields and defaults; any other key is a TypeError, as upstream's dataclass raises."""

    quant_algo: str | None = None
    kv_cache_quant_algo: str | None = None
    group_size: int = 128
    smoothquant_val: float = 0.5
    clamp_val: list | None = None
    use_meta_recipe: bool = False
    has_zero_point: bool = False
    pre_quant_scale: bool = False
    exclude_modules: list | None = None
    mamba_ssm_cache_dtype: str | None = None


WEIGHT_ONLY_ALGOS = ("W8A16", "W4A16")
# convert_utils.weight_only_quantize_dict: the weights it quantizes, by substring of the tensor name.
QUANT_WEIGHTS = ("qkv.weight", "dense.weight", "fc.weight", "proj.weight", "gate.weight")


def preprocess_weights(weights, model_config, from_pruned=False):
    """Upstream's branches for what convert-llm writes. KV-cache scales: a missing `kv_cache_rcp_scaling_factor`
    becomes 1 / `kv_cache_scaling_factor`. FP8: int8 `*weight` tensors are viewed as e4m3 (F8_E4M3 ones pass as
    they are); a lm_head that is not FP8 loses its scales. W8A16/W4A16: `weight_only_quantize_dict(weights,
    quant_algo, exclude_modules=..., plugin=True)` quantizes every float weight named in QUANT_WEIGHTS (not excluded
    by fnmatch) with torch.ops.trtllm (CUDA here: refused) and leaves int8 weights as they are (taken as already
    processed)."""
    import torch

    quant = model_config.quantization
    for name in [n for n in weights if n.endswith("kv_cache_scaling_factor")]:
        rcp = name.replace("kv_cache_scaling_factor", "kv_cache_rcp_scaling_factor")
        if rcp not in weights:
            weights[rcp] = torch.reciprocal(weights[name])
    if quant.quant_algo == "FP8":
        for name, tensor in list(weights.items()):
            if name.endswith("weight") and tensor.dtype == torch.int8:
                weights[name] = tensor.view(torch.float8_e4m3fn)
        if "lm_head.weight" in weights and weights["lm_head.weight"].dtype != torch.float8_e4m3fn:
            weights.pop("lm_head.weights_scaling_factor", None)
            weights.pop("lm_head.activation_scaling_factor", None)
        return weights
    if quant.quant_algo not in WEIGHT_ONLY_ALGOS:
        return weights
    excluded = quant.exclude_modules or ["*shared_expert_gate.weight"]
    for name, tensor in weights.items():
        if any(fnmatch.fnmatchcase(name, pattern) for pattern in excluded):
            continue
        if any(key in name for key in QUANT_WEIGHTS) and tensor.dtype != torch.int8:
            raise RuntimeError(f"{name}: a float weight would be quantized by torch.ops.trtllm, which needs CUDA")
    return weights


class PretrainedConfig:
    def __init__(
        self,
        *,
        architecture,
        dtype,
        hidden_size,
        num_hidden_layers,
        num_attention_heads,
        vocab_size=None,
        hidden_act="gelu",
        logits_dtype="float32",
        norm_epsilon=1e-5,
        position_embedding_type="learned_absolute",
        max_position_embeddings=None,
        rotary_embedding_dim=None,
        num_key_value_heads=None,
        intermediate_size=None,
        mapping=None,
        quantization=None,
        use_parallel_embedding=False,
        embedding_sharding_dim=0,
        head_size=None,
        **kwargs,
    ):
        self.architecture, self.dtype, self.logits_dtype = architecture, dtype, logits_dtype
        self.hidden_size, self.num_hidden_layers, self.num_attention_heads = (
            hidden_size,
            num_hidden_layers,
            num_attention_heads,
        )
        self.vocab_size, self.hidden_act, self.norm_epsilon = vocab_size, hidden_act, norm_epsilon
        self.position_embedding_type = position_embedding_type
        self.max_position_embeddings = max_position_embeddings
        self.num_key_value_heads = num_key_value_heads if num_key_value_heads is not None else num_attention_heads
        self.intermediate_size = intermediate_size if intermediate_size is not None else hidden_size * 4
        if mapping is None:
            mapping = Mapping()
        elif isinstance(mapping, dict):
            mapping = Mapping.from_dict(mapping)
        self.mapping = mapping
        self.quantization = QuantConfig(**(quantization or {}))
        self.use_parallel_embedding, self.embedding_sharding_dim = use_parallel_embedding, embedding_sharding_dim
        self.head_size = hidden_size // num_attention_heads if head_size is None else head_size
        self.rotary_embedding_dim = rotary_embedding_dim if rotary_embedding_dim is not None else self.head_size
        for key, value in kwargs.items():  # upstream: setattr with an "Implicitly setting" warning
            setattr(self, key, value)

    @classmethod
    def from_dict(cls, config: dict):
        # Upstream, verbatim in effect: `from . import MODEL_MAP; model_cls = MODEL_MAP[config['architecture']];
        # config_cls = getattr(model_cls, 'config_class', cls); return config_cls(**config)`.
        from . import MODEL_MAP

        model_cls = MODEL_MAP[config["architecture"]]
        config_cls = getattr(model_cls, "config_class", cls)
        return config_cls(**config)

    @classmethod
    def from_json_file(cls, config_file: str):
        with open(config_file) as f:
            config = json.load(f)
        return cls.from_dict(config)

    @classmethod
    def from_checkpoint(cls, ckpt_dir: str):
        return cls.from_json_file(os.path.join(ckpt_dir, "config.json"))

    def set_rank(self, rank):
        self.mapping.rank = rank

    def to_dict(self):
        output = copy.deepcopy(self.__dict__)
        output["mapping"] = self.mapping.to_dict()
        output["mapping"].pop("rank")
        output["quantization"] = dataclasses.asdict(self.quantization)
        return output


class PretrainedModel:
    config_class = PretrainedConfig

    @classmethod
    def from_checkpoint(cls, ckpt_dir: str, rank=None, config=None, *, preprocess_weights_hook=None):
        # Upstream re-reads config.json (through MODEL_MAP) only when no config is given.
        if config is None:
            config = PretrainedConfig.from_json_file(os.path.join(ckpt_dir, "config.json"))
        if rank is not None:
            config.set_rank(rank)
        rank = config.mapping.rank
        weights_path = os.path.join(ckpt_dir, f"rank{rank}.safetensors")
        if not os.path.isfile(weights_path):
            raise FileNotFoundError(weights_path)
        from safetensors.torch import load_file

        weights = load_file(weights_path)
        if preprocess_weights_hook is not None:
            weights = preprocess_weights_hook(weights)
        weights = preprocess_weights(weights, config)
        model = cls(config)
        model.weights_file = weights_path
        model.load(weights)
        return model

    def load(self, weights):
        """Upstream's load: every declared parameter provided (else "Required but not provided tensors"), each in
        its declared shape (else an error); a dtype mismatch is a warning; extra tensors are a warning. Then each
        parameter's value is set; here on the modules the stand-in models (the attention's)."""
        declared = self.declared_parameters()
        missing = sorted(set(declared) - set(weights))
        if missing:
            raise RuntimeError(f"Required but not provided tensors: {missing}")
        for name, (dtype, shape) in declared.items():
            if tuple(weights[name].shape) != tuple(shape):
                raise RuntimeError(f"{name}: shape {list(weights[name].shape)} is not the declared {list(shape)}")
            if weights[name].dtype != dtype:
                warnings.warn(f"{name}: dtype {weights[name].dtype} is not the declared {dtype}", stacklevel=2)
        extra = sorted(set(weights) - set(declared))
        if extra:
            warnings.warn(f"Provided but not required tensors: {extra}", stacklevel=2)
        self.loaded_weights = weights
        for name in declared:
            *path, leaf = name.split(".")
            owner = self
            for part in path:
                owner = owner[int(part)] if isinstance(owner, list) else getattr(owner, part, None)
            if owner is not None and hasattr(owner, leaf):
                setattr(owner, leaf, weights[name])


class DecoderLayerList(list):
    def __init__(self, cls, config):
        self.layer_list = config.mapping.pp_layers(config.num_hidden_layers)
        super().__init__(cls(config, idx) for idx in self.layer_list)

    def forward(self, hidden_states, use_cache=False, kv_cache_params=None, **kwargs):
        from ..layers import KeyValueCacheParams

        kv_cache_params.fill_none_tensor_list(len(self.layer_list))
        presents = []
        for layer, past in zip(self, kv_cache_params.past_key_value, strict=True):
            out = layer(hidden_states, use_cache=use_cache, kv_cache_params=KeyValueCacheParams([past]), **kwargs)
            hidden_states, present = out if use_cache else (out, None)
            presents.append(present)
        return (hidden_states, presents) if use_cache else hidden_states
