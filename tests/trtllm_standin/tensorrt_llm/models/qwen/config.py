"""tensorrt_llm/models/qwen/config.py: QWenConfig's keyword arguments; qwen_type and the Qwen3 fields arrive through
**kwargs (upstream sets them with a warning). The only validation is the MoE config's."""

from ..modeling_utils import PretrainedConfig


class QWenConfig(PretrainedConfig):
    def __init__(
        self,
        *,
        mlp_bias=False,
        attn_bias=True,
        rotary_base=10000.0,
        rotary_scaling=None,
        disable_weight_only_quant_plugin=False,
        use_logn_attn=False,
        moe=None,
        num_labels=1,
        **kwargs,
    ):
        self.mlp_bias, self.attn_bias, self.rotary_base, self.rotary_scaling = (
            mlp_bias,
            attn_bias,
            rotary_base,
            rotary_scaling,
        )
        self.disable_weight_only_quant_plugin, self.use_logn_attn, self.num_labels = (
            disable_weight_only_quant_plugin,
            use_logn_attn,
            num_labels,
        )
        moe = dict(moe or {})
        # layers/moe.py MoeConfig.validate: experts and top_k are both set or both zero.
        if bool(moe.get("num_experts", 0)) != bool(moe.get("top_k", 0)):
            raise ValueError("Both or neither of num_experts and top_k must be set")
        self.moe = moe
        super().__init__(**kwargs)
