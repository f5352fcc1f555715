"""tensorrt_llm/models/qwen/model.py: QWenDecoderLayer (Attention built without an eps), QWenModel, QWenForCausalLM
(config_class QWenConfig) and its per-rank inputs (models/generation_mixin.py, prepare_basic_inputs). Decoder layers
double their input, so outputs say after which layer something arrived; their Attention, with the weights load()
gives it, runs on its own (layers.Attention)."""

from types import SimpleNamespace

from ... import functional
from ...layers import Attention, Embedding, KeyValueCacheParams, Module
from ..modeling_utils import DecoderLayerList, PretrainedModel
from .config import QWenConfig


class Declared(str):
    """An engine input as prepare_inputs declares it: the runtime binds a tensor to the name."""


class QWenDecoderLayer(Module):
    def __init__(self, config, layer_idx):
        self.layer_idx = layer_idx
        qk_layernorm = config.qwen_type in ("qwen3", "qwen3_moe")
        # Upstream's arguments that shape the attention (no eps); quant_mode here is the QuantConfig's quant_algo.
        self.attention = Attention(
            hidden_size=config.hidden_size,
            attention_head_size=config.head_size,
            num_attention_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            tp_size=config.mapping.tp_size,
            quant_mode=config.quantization.quant_algo,
            qk_layernorm=qk_layernorm,
        )
        self.seen_mrope_params = None

    def forward(
        self,
        hidden_states,
        attention_mask=None,
        use_cache=False,
        spec_decoding_params=None,
        kv_cache_params=None,
        attention_params=None,
        lora_layer_params=None,
        mrope_params=None,
    ):
        assert len(kv_cache_params.past_key_value) == 1  # this layer's own past
        self.seen_mrope_params = mrope_params
        out = 2 * hidden_states
        return (out, f"kv{self.layer_idx}") if use_cache else out


class QWenModel:
    def __init__(self, config):
        self.mapping = config.mapping
        if self.mapping.is_first_pp_rank():
            self.vocab_embedding = Embedding(config)
        self.layers = DecoderLayerList(QWenDecoderLayer, config)
        if self.mapping.is_last_pp_rank():
            self.ln_f = lambda hidden_states: hidden_states

    def forward(
        self, input_ids, position_ids=None, use_cache=False, kv_cache_params=None, hidden_states=None, **kwargs
    ):
        ptuning = [kwargs.pop(k, None) for k in ("prompt_embedding_table", "prompt_tasks", "prompt_vocab_size")]
        if self.mapping.is_first_pp_rank():
            hidden_states = self.vocab_embedding(input_ids, *ptuning)
        else:
            hidden_states = functional.recv(hidden_states, self.mapping.prev_pp_rank())
        out = self.layers.forward(hidden_states, use_cache=use_cache, kv_cache_params=kv_cache_params, **kwargs)
        hidden_states, presents = out if use_cache else (out, None)
        if self.mapping.is_last_pp_rank():
            hidden_states = self.ln_f(hidden_states)
        else:
            hidden_states = functional.send(hidden_states, self.mapping.next_pp_rank())
        return (hidden_states, tuple(presents)) if use_cache else hidden_states


class QWenForCausalLM(PretrainedModel):
    config_class = QWenConfig

    def __init__(self, config):
        self.config = config
        self.transformer = QWenModel(config)

    def declared_parameters(self):
        """name -> (dtype, shape) of this rank's parameters, as QWenForCausalLM's layers declare them after
        quantize(): ColumnLinear [out/tp, in], RowLinear [out, in/tp] (layers/linear.py); Attention's fused qkv with
        key/value heads repeated when tp exceeds them (layers/attention.py); MOE fc [E, 2I/tp, H] (up; gate) and
        proj [E, H, I/tp], the router [E, H] float32 (layers/moe.py). Weight-only (quantization/layers.py):
        WeightOnlyQuant{Column,Row}Linear `weight` int8 [in, out * bits/8] and `per_channel_scale` [out], the
        layer's whole in and out features (the split one tp times a rank's) padded to multiples of 64 * tp before
        the split (quantize.py, quantize_layers: a ColumnLinear's out_features * tp_size, a RowLinear's in_features
        * tp_size); MOE `weight` int8 [E, in, out * bits/8] and
        `per_channel_scale` [E, out]. FP8 (FP8Linear / FP8RowLinear): `weight` e4m3 [out, in],
        `weights_scaling_factor` and `activation_scaling_factor` (1,) float32; MOE `weight` e4m3 [E, out, in],
        `weights_scaling_factor` (E, 1), `activation_scaling_factor` (1,). A quantized KV cache
        (kv_cache_quantize): every Attention's `kv_cache_scaling_factor` and `kv_cache_rcp_scaling_factor` (1,)
        float32. The router, embedding and lm_head stay unquantized (quantize_layers' exclusions)."""
        import math

        import torch

        from ..._utils import str_dtype_to_torch

        c, m = self.config, self.config.mapping
        tp, dtype = m.tp_size, str_dtype_to_torch(c.dtype)
        algo = c.quantization.quant_algo
        bits = {"W8A16": 8, "W4A16": 4}.get(algo)
        hd, d = c.head_size, c.hidden_size
        kv_r = max(c.num_key_value_heads // tp, 1)
        declared = {}

        def pad(n):
            return math.ceil(n / (64 * tp)) * 64 * tp

        def linear(name, out_r, in_r, split_dim):
            if algo == "FP8":
                declared[name + ".weight"] = (torch.float8_e4m3fn, (out_r, in_r))
                declared[name + ".weights_scaling_factor"] = (torch.float32, (1,))
                declared[name + ".activation_scaling_factor"] = (torch.float32, (1,))
                return
            if bits is None:
                declared[name + ".weight"] = (dtype, (out_r, in_r))
                return
            if split_dim == 0:  # column: out split, in whole
                out_r, in_r = pad(out_r * tp) // tp, pad(in_r)
            else:  # row: in split, out whole
                out_r, in_r = pad(out_r), pad(in_r * tp) // tp
            declared[name + ".weight"] = (torch.int8, (in_r, out_r * bits // 8))
            declared[name + ".per_channel_scale"] = (dtype, (out_r,))

        def experts(name, e, out_r, in_r):
            if algo == "FP8":
                declared[name + ".weight"] = (torch.float8_e4m3fn, (e, out_r, in_r))
                declared[name + ".weights_scaling_factor"] = (torch.float32, (e, 1))
                declared[name + ".activation_scaling_factor"] = (torch.float32, (1,))
                return
            if bits is None:
                declared[name + ".weight"] = (dtype, (e, out_r, in_r))
                return
            declared[name + ".weight"] = (torch.int8, (e, in_r, out_r * bits // 8))
            declared[name + ".per_channel_scale"] = (dtype, (e, out_r))

        if m.is_first_pp_rank():
            declared["transformer.vocab_embedding.weight"] = (dtype, (c.vocab_size, d))
        for local, _ in enumerate(m.pp_layers(c.num_hidden_layers)):
            p = f"transformer.layers.{local}."
            declared[p + "input_layernorm.weight"] = (dtype, (d,))
            declared[p + "post_layernorm.weight"] = (dtype, (d,))
            declared[p + "attention.q_layernorm.weight"] = (dtype, (hd,))
            declared[p + "attention.k_layernorm.weight"] = (dtype, (hd,))
            if c.quantization.kv_cache_quant_algo in ("FP8", "INT8"):
                declared[p + "attention.kv_cache_scaling_factor"] = (torch.float32, (1,))
                declared[p + "attention.kv_cache_rcp_scaling_factor"] = (torch.float32, (1,))
            linear(p + "attention.qkv", (c.num_attention_heads // tp + 2 * kv_r) * hd, d, 0)
            linear(p + "attention.dense", d, c.num_attention_heads * hd // tp, 1)
            moe = c.moe if isinstance(c.moe, dict) else {}
            if moe.get("num_experts", 0):
                e, i = moe["num_experts"], c.moe_intermediate_size // tp
                declared[p + "mlp.router.weight"] = (torch.float32, (e, d))
                experts(p + "mlp.fc", e, 2 * i, d)
                experts(p + "mlp.proj", e, d, i)
            else:
                i = c.intermediate_size // tp
                linear(p + "mlp.fc", i, d, 0)
                linear(p + "mlp.gate", i, d, 0)
                linear(p + "mlp.proj", d, i, 1)
        if m.is_last_pp_rank():
            declared["transformer.ln_f.weight"] = (dtype, (d,))
            declared["lm_head.weight"] = (dtype, (math.ceil(c.vocab_size / tp), d))
        return declared

    def prepare_inputs(self, use_cache=True, prompt_embedding_table_size=0, mrope_rotary_cos_sin_size=None, **_):
        first = self.config.mapping.is_first_pp_rank()
        inputs = {
            "input_ids": Declared("input_ids") if first else None,
            "use_cache": use_cache,
            "kv_cache_params": KeyValueCacheParams(),
            "attention_params": SimpleNamespace(),
        }
        if not first:
            inputs["hidden_states"] = Declared("hidden_states_input")
        if prompt_embedding_table_size > 0:
            inputs |= {
                "prompt_embedding_table": Declared("prompt_embedding_table"),
                "prompt_tasks": Declared("tasks"),
                "prompt_vocab_size": Declared("prompt_vocab_size"),
            }
        if mrope_rotary_cos_sin_size is not None:
            inputs["mrope_params"] = SimpleNamespace(size=mrope_rotary_cos_sin_size)
        return inputs

    def forward(self, input_ids, last_token_ids=None, position_ids=None, **kwargs):  # DecoderModelForCausalLM
        return self.transformer.forward(input_ids, position_ids=position_ids, **kwargs)
