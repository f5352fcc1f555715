"""The plugin variant's attention as a torch custom op that exports to one ONNX node per block.

The node is what TensorRT's ONNX parser resolves to the registered `tensorrt.plugin` plugin: op type =
the plugin name, domain and `plugin_namespace` = its namespace, `plugin_version`, and `aot` = 1 (use
the ahead-of-time implementation, whose kernel the engine embeds). Inputs: q, k, v [N, heads, head_dim]
in the compute dtype, cu_seqlens int32 [S+1] and the max-seqlen shape carrier int32 [L]; output
[N, heads, head_dim]. In eager torch the op runs the plugin's torch reference, so the plugin tower is
testable against the portable one without TensorRT.
"""

from __future__ import annotations

import onnx
import torch
from onnxscript.values import Opset

from ..plugins import PLUGIN_NAME, PLUGIN_NAMESPACE, PLUGIN_VERSION
from ..plugins.reference import varlen_attention_reference

# The node's attributes, as the parser reads them.
PLUGIN_NODE_ATTRIBUTES: dict[str, str | int] = {
    "plugin_namespace": PLUGIN_NAMESPACE,
    "plugin_version": PLUGIN_VERSION,
    "aot": 1,
}
# Version of the node's ONNX domain in the model's opset imports.
PLUGIN_DOMAIN_VERSION = 1


@torch.library.custom_op(f"{PLUGIN_NAMESPACE}::{PLUGIN_NAME}", mutates_args=())
def varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen_carrier: torch.Tensor
) -> torch.Tensor:
    return varlen_attention_reference(q, k, v, cu_seqlens)


@varlen_attention.register_fake
def _varlen_attention_shape(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen_carrier: torch.Tensor
) -> torch.Tensor:
    return torch.empty_like(q)


def _register_onnx_schema() -> None:
    """Declares the node to onnx (checker, shape inference, onnxscript's op builder); once per process."""
    if onnx.defs.has(PLUGIN_NAME, PLUGIN_NAMESPACE):
        return
    param = onnx.defs.OpSchema.FormalParameter
    attr = onnx.defs.OpSchema.Attribute
    kind = onnx.defs.OpSchema.AttrType
    onnx.defs.register_schema(
        onnx.defs.OpSchema(
            PLUGIN_NAME,
            PLUGIN_NAMESPACE,
            PLUGIN_DOMAIN_VERSION,
            "Varlen non-causal attention within each cu_seqlens segment (the qwen3vl_trt TensorRT plugin).",
            inputs=[
                param("q", "T"),
                param("k", "T"),
                param("v", "T"),
                param("cu_seqlens", "tensor(int32)"),
                param("max_seqlen_carrier", "tensor(int32)"),
            ],
            outputs=[param("out", "T")],
            type_constraints=[("T", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"], "compute dtype")],
            attributes=[
                attr("plugin_namespace", kind.STRING, "TensorRT plugin namespace"),
                attr("plugin_version", kind.STRING, "TensorRT plugin version"),
                attr("aot", kind.INT, "1: the ahead-of-time implementation"),
            ],
        )
    )


_register_onnx_schema()
_PLUGIN_OPSET = Opset(PLUGIN_NAMESPACE, PLUGIN_DOMAIN_VERSION)


def _onnx_varlen_attention(q, k, v, cu_seqlens, max_seqlen_carrier):  # onnxscript values, untyped by design
    node = getattr(_PLUGIN_OPSET, PLUGIN_NAME)
    return node(q, k, v, cu_seqlens, max_seqlen_carrier, **PLUGIN_NODE_ATTRIBUTES)


# torch.onnx.export(custom_translation_table=...): the op becomes the plugin node.
ONNX_TRANSLATION = {getattr(getattr(torch.ops, PLUGIN_NAMESPACE), PLUGIN_NAME).default: _onnx_varlen_attention}
