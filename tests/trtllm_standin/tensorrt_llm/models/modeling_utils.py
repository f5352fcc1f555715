"""tensorrt_llm/models/modeling_utils.py (1.2 line, b35ac1b6): PretrainedConfig's loading, PretrainedModel's
from_checkpoint, DecoderLayerList. Loading is upstream's to the letter where our code depends on it: from_dict looks
the architecture up in MODEL_MAP (unknown -> KeyError) and builds that model class's config_class."""

import copy
import json
import os

from ..mapping import Mapping


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
        self.quantization = quantization or {}
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
        model = cls(config)
        model.weights_file = weights_path  # upstream: safetensors.safe_open(...), then model.load(weights)
        return model


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
