"""ONNX Runtime sessions over the plugin graph variant, for verification on CPU.

ONNX Runtime has no TensorRT plugins; onnxruntime-extensions runs Python custom ops, and the varlen
attention node gets one that calls the plugin's torch reference (per-segment SDPA). Its Python ops live
in the extensions' own domain, so the session gets a copy of the graph whose plugin nodes are moved
there; the exported file is never changed. Each node costs a Python call and host copies: this path
proves numerics (fp32), it does not serve.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch

from ..errors import Qwen3VLTrtError
from ..plugins import PLUGIN_NAME, PLUGIN_NAMESPACE
from ..plugins.reference import varlen_attention_reference
from .plugin_op import PLUGIN_NODE_ATTRIBUTES

_registered_domain: str | None = None


def _register_custom_op() -> str:
    """Registers the Python op once per process; returns the domain its nodes must have."""
    global _registered_domain
    if _registered_domain is not None:
        return _registered_domain
    try:
        from onnxruntime_extensions import PyCustomOpDef, default_opset_domain, onnx_op
    except ImportError as e:
        raise Qwen3VLTrtError(
            "running the plugin vision export with ONNX Runtime needs onnxruntime-extensions "
            f"(pip install onnxruntime-extensions): {e}"
        ) from None
    fp32, int32 = PyCustomOpDef.dt_float, PyCustomOpDef.dt_int32
    attr_types = {
        name: PyCustomOpDef.dt_int64 if isinstance(value, int) else PyCustomOpDef.dt_string
        for name, value in PLUGIN_NODE_ATTRIBUTES.items()
    }

    @onnx_op(op_type=PLUGIN_NAME, inputs=[fp32, fp32, fp32, int32, int32], outputs=[fp32], attrs=attr_types)
    def _varlen_attention(q, k, v, cu_seqlens, max_seqlen_carrier, **attributes):
        if attributes != PLUGIN_NODE_ATTRIBUTES:
            raise ValueError(f"{PLUGIN_NAME} attributes {attributes} are not the plugin's {PLUGIN_NODE_ATTRIBUTES}")
        longest = int(np.diff(cu_seqlens).max())
        if max_seqlen_carrier.shape[0] < longest:  # the kernel's grid would miss rows of the longest segment
            raise ValueError(f"max_seqlen_carrier carries {max_seqlen_carrier.shape[0]}, the longest segment {longest}")
        tensors = (torch.from_numpy(np.ascontiguousarray(t)) for t in (q, k, v, cu_seqlens))
        return varlen_attention_reference(*tensors).numpy()

    _registered_domain = default_opset_domain()
    return _registered_domain


def plugin_session(onnx_file: Path, options: Any, providers: list[str]) -> Any:
    """An onnxruntime.InferenceSession over `onnx_file` (plugin variant, fp32) with the Python op."""
    import onnxruntime as ort
    from onnxruntime_extensions import get_library_path

    domain = _register_custom_op()
    model = onnx.load(str(onnx_file), load_external_data=False)
    for node in model.graph.node:
        if node.domain == PLUGIN_NAMESPACE and node.op_type == PLUGIN_NAME:
            node.domain = domain
    imports = [o for o in model.opset_import if o.domain != PLUGIN_NAMESPACE]
    del model.opset_import[:]
    model.opset_import.extend([*imports, onnx.helper.make_opsetid(domain, 1)])
    options.register_custom_ops_library(get_library_path())
    # The graph is handed over as bytes: its external weights are found beside the exported file.
    options.add_session_config_entry("session.model_external_initializers_file_folder_path", str(onnx_file.parent))
    return ort.InferenceSession(model.SerializeToString(), options, providers=providers)
