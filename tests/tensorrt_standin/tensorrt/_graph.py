"""The stand-in's network graph: the parsed ONNX model, shapes inferred as TensorRT's builder derives them, and the
serialized plan (a description of the engine: JSON header, then the ONNX model with its weights)."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import onnx
from onnx import helper, shape_inference

from ._native import DataType

# ONNX element types TensorRT 10.14 takes at a network's inputs and outputs.
ONNX_TO_TRT = {
    onnx.TensorProto.FLOAT: DataType.FLOAT,
    onnx.TensorProto.FLOAT16: DataType.HALF,
    onnx.TensorProto.BFLOAT16: DataType.BF16,
    onnx.TensorProto.INT8: DataType.INT8,
    onnx.TensorProto.UINT8: DataType.UINT8,
    onnx.TensorProto.INT32: DataType.INT32,
    onnx.TensorProto.INT64: DataType.INT64,
    onnx.TensorProto.BOOL: DataType.BOOL,
}
TRT_TO_ONNX = {trt: elem for elem, trt in ONNX_TO_TRT.items()}
DEFAULT_DOMAINS = ("", "ai.onnx")

# A tensor's (ONNX element type, dims); a dim is an int, a symbol (str) or None (unknown).
TensorInfo = tuple[int, list[Any]]
PluginShape = Callable[[onnx.NodeProto, list[TensorInfo]], TensorInfo]


def is_plugin_node(node: onnx.NodeProto) -> bool:
    return node.domain not in DEFAULT_DOMAINS


def dims_of(value: onnx.ValueInfoProto) -> list[Any]:
    return [
        d.dim_value if d.HasField("dim_value") else (d.dim_param if d.HasField("dim_param") else None)
        for d in value.type.tensor_type.shape.dim
    ]


def infer(
    skeleton: onnx.ModelProto, inputs: Mapping[str, Sequence[Any]], plugin_shape: PluginShape
) -> dict[str, TensorInfo]:
    """Every tensor's type and dims for input dims `inputs` (ints or symbols): ONNX shape inference (with data
    propagation), a plugin node's output from plugin_shape (what the plugin's shape function says), repeated until no
    plugin output is left to add. skeleton: the model without its external weights (shapes need none)."""
    model = onnx.ModelProto()
    model.CopyFrom(skeleton)
    del model.graph.value_info[:]  # the parser derives shapes itself
    for value in model.graph.input:
        if value.name in inputs:
            shape = value.type.tensor_type.shape
            del shape.dim[:]
            for d in inputs[value.name]:
                dim = shape.dim.add()
                if isinstance(d, int):
                    dim.dim_value = d
                elif d is not None:
                    dim.dim_param = d
    for value in model.graph.output:
        value.type.tensor_type.ClearField("shape")
    added: dict[str, TensorInfo] = {}
    while True:
        inferred = shape_inference.infer_shapes(model, data_prop=True)
        graph = inferred.graph
        known = {
            v.name: (v.type.tensor_type.elem_type, dims_of(v))
            for v in [*graph.input, *graph.value_info, *graph.output]
            if v.type.tensor_type.elem_type
        }
        known.update({t.name: (t.data_type, list(t.dims)) for t in graph.initializer})
        known.update(added)
        progress = False
        for node in graph.node:
            if is_plugin_node(node) and node.output[0] not in added and all(i in known for i in node.input):
                elem, dims = added[node.output[0]] = plugin_shape(node, [known[i] for i in node.input])
                model.graph.value_info.append(helper.make_tensor_value_info(node.output[0], elem, dims))
                progress = True
        if not progress:
            return known


PLAN_MAGIC = b"TRT-STANDIN-PLAN"


def serialize_plan(header: Mapping[str, Any], model: bytes) -> bytes:
    head = json.dumps(header).encode()
    return PLAN_MAGIC + struct.pack("<Q", len(head)) + head + model


def read_plan(plan: bytes) -> tuple[dict[str, Any], bytes] | None:
    """(header, ONNX model) of a serialized plan, None for bytes that are not one."""
    if not plan.startswith(PLAN_MAGIC) or len(plan) < len(PLAN_MAGIC) + 8:
        return None
    (length,) = struct.unpack_from("<Q", plan, len(PLAN_MAGIC))
    start = len(PLAN_MAGIC) + 8
    try:
        header = json.loads(plan[start : start + length])
    except ValueError:
        return None
    return header, plan[start + length :]
