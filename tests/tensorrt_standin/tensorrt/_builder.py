"""Builder, network, ONNX parser, builder config, optimization profile and timing cache, as TensorRT 10.14's Python
API has them (tensorrt-stubs 10.13.0.35.1; NVIDIA/TensorRT include/NvInfer.h, NvInferRuntime.h at the 10.14 release
commit 3b4ddc1d). A build writes a plan that describes the engine instead of kernels (`_graph.serialize_plan`).

The ONNX parser follows onnx-tensorrt (onnxOpImporters.cpp FallbackPluginImporter and importerUtils.cpp createPlugin,
read at onnx/onnx-tensorrt 7ecb49a and a 10.x importerUtils.cpp): a node outside the default domain is a plugin named
by its op type, `plugin_version` (default "1") and `plugin_namespace` (default "") attributes, the creator's declared
fields read from the node's attributes, and an `aot` attribute asking strictly for the AOT (1) or JIT (0)
implementation (else the network's PREFER_*_PYTHON_PLUGINS flags). Default-domain operators must be in TensorRT
10.14's support table (qwen3vl_trt/data/trt_10_14_onnx_ops.txt, from onnx-tensorrt docs/operators.md).

A plugin is driven through the calls TensorRT's builder makes: output types and shapes when the parser adds its layer,
then for the profile the format combinations, configure, tactics, and for an AOT plugin its launch parameters and its
kernel (name and PTX), which the plan keeps with the launch expressions.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from importlib import resources
from typing import Any

import numpy as np
import onnx

from . import _graph
from ._native import (
    DataType,
    Dims,
    DimsExprs,
    DynamicPluginTensorDesc,
    IDimensionExpr,
    IExprBuilder,
    ILogger,
    IPluginCreatorV3Quick,
    IPluginV3QuickAOTBuild,
    ISymExprs,
    ITensor,
    KernelLaunchParams,
    NetworkDefinitionCreationFlag,
    PluginField,
    PluginFieldCollection,
    QuickPluginCreationRequest,
    TensorFormat,
    TensorRTPhase,
    evaluate,
    get_plugin_registry,
)

VERSION = "10.14.1.48.post1"
_ERROR = ILogger.Severity.ERROR
_TYPE_NAMES = {
    onnx.TensorProto.FLOAT: "FP32",
    onnx.TensorProto.FLOAT16: "FP16",
    onnx.TensorProto.BFLOAT16: "BF16",
    onnx.TensorProto.INT32: "INT32",
    onnx.TensorProto.INT64: "INT64",
    onnx.TensorProto.INT8: "INT8",
    onnx.TensorProto.UINT8: "UINT8",
    onnx.TensorProto.BOOL: "BOOL",
}


def current_device(logger: Any, what: str) -> dict[str, Any]:
    """The CUDA device TensorRT works on (torch.cuda's current one), or the failure TensorRT has without one."""
    import torch

    if not torch.cuda.is_available():
        logger.log(_ERROR, f"{what}: Error Code 6: API Usage Error (CUDA initialization failure with error: 35.)")
        raise TypeError("pybind11::init(): factory function returned nullptr")
    return {"name": torch.cuda.get_device_name(), "compute_capability": list(torch.cuda.get_device_capability())}


class IHostMemory(bytes):
    """Serialized data (a buffer: bytes(memory) and memoryview(memory) read it)."""

    @property
    def nbytes(self) -> int:
        return len(self)


def _onnx_table() -> tuple[dict[str, set[str]], tuple[int, int]]:
    text = (resources.files("qwen3vl_trt") / "data" / "trt_10_14_onnx_ops.txt").read_text()
    ops: dict[str, set[str]] = {}
    opsets = (0, 0)
    for line in text.splitlines():
        if line.startswith("# opset-range:"):
            lo, hi = line.split(":")[1].split()
            opsets = (int(lo), int(hi))
        elif line and not line.startswith("#"):
            name, types = line.split("\t")[:2]
            ops[name] = set(types.split(","))
    return ops, opsets


class _PluginLayer:
    """A plugin node of the network: the plugin its creator made, and what its shape function said."""

    def __init__(self, node: onnx.NodeProto, plugin: Any) -> None:
        self.node, self.plugin = node, plugin
        self.input_types: list[DataType] = []
        self.output_type = DataType.FLOAT
        self.output_trees: list[list] = []

    @staticmethod
    def symbolic_inputs(shapes: Sequence[Sequence[Any]], builder: IExprBuilder) -> list[DimsExprs]:
        """Each input's dimension expressions: constants where the network fixes a dim (an int), else the runtime
        dim (an expression TensorRT resolves per run)."""
        return [
            DimsExprs(
                builder.constant(d) if isinstance(d, int) and d >= 0 else IDimensionExpr(["dim", i, axis])
                for axis, d in enumerate(dims)
            )
            for i, dims in enumerate(shapes)
        ]

    def add_layer(self, infos: list[_graph.TensorInfo]) -> _graph.TensorInfo:
        """What INetworkDefinition.add_plugin_v3 asks the plugin: its output's type and shape expressions."""
        self.input_types = [_graph.ONNX_TO_TRT[elem] for elem, _ in infos]
        (self.output_type,) = self.plugin.get_output_data_types(self.input_types, [len(d) for _, d in infos])
        builder = IExprBuilder()
        (shape,) = self.plugin.get_output_shapes(self.symbolic_inputs([d for _, d in infos], builder), [], builder)
        self.output_trees = [expr.tree for expr in shape]
        dims = [tree[1] if tree[0] == "const" else None for tree in self.output_trees]
        return _graph.TRT_TO_ONNX[self.output_type], dims

    def concrete_output(self, infos: list[_graph.TensorInfo]) -> _graph.TensorInfo:
        shapes = [tuple(dims) for _, dims in infos]
        return _graph.TRT_TO_ONNX[self.output_type], [evaluate(tree, shapes) for tree in self.output_trees]


class INetworkDefinition:
    def __init__(self, flags: int) -> None:
        self.flags = flags
        self.inputs: list[ITensor] = []
        self.outputs: list[ITensor] = []
        self.model: onnx.ModelProto | None = None  # what the parser read, weights included
        self.plugin_layers: list[_PluginLayer] = []

    def get_flag(self, flag: NetworkDefinitionCreationFlag) -> bool:
        return bool(self.flags >> int(flag) & 1)

    @property
    def num_inputs(self) -> int:
        return len(self.inputs)

    def get_input(self, index: int) -> ITensor:
        return self.inputs[index]

    @property
    def num_outputs(self) -> int:
        return len(self.outputs)

    def get_output(self, index: int) -> ITensor:
        return self.outputs[index]


class ParserError:
    def __init__(self, desc: str, node: int = -1, node_name: str = "", node_operator: str = "") -> None:
        self._desc, self._node, self._node_name, self._node_operator = desc, node, node_name, node_operator

    def desc(self) -> str:
        return self._desc

    def node(self) -> int:
        return self._node

    def __str__(self) -> str:
        if self._node < 0:
            return self._desc
        return f"In node {self._node} with name: {self._node_name} and operator: {self._node_operator} ({self._desc})"


class _NodeError(Exception):
    def __init__(self, index: int, node: onnx.NodeProto, desc: str) -> None:
        super().__init__(desc)
        self.error = ParserError(desc, index, node.name, node.op_type)


class OnnxParser:
    def __init__(self, network: INetworkDefinition, logger: Any) -> None:
        self.network, self.logger = network, logger
        self.errors: list[ParserError] = []

    @property
    def num_errors(self) -> int:
        return len(self.errors)

    def get_error(self, index: int) -> ParserError:
        return self.errors[index]

    def _fail(self, error: ParserError) -> bool:
        self.errors.append(error)
        self.logger.log(_ERROR, f"ModelImporter.cpp: ERROR: {error}")
        return False

    def parse_from_file(self, model: str) -> bool:
        try:
            proto = onnx.load(model)  # external data beside the file, as the parser finds it
        except Exception as e:  # protobuf's and onnx's own errors: an unreadable file
            return self._fail(ParserError(f"Failed to parse ONNX model from file: {model} ({e})"))
        try:
            self._import(proto)
        except _NodeError as e:
            return self._fail(e.error)
        return True

    def _import(self, model: onnx.ModelProto) -> None:
        table, (lo, hi) = _onnx_table()
        opset = next((o.version for o in model.opset_import if o.domain in _graph.DEFAULT_DOMAINS), 0)
        if not lo <= opset <= hi:
            raise _NodeError(-1, onnx.NodeProto(), f"opset {opset} is outside TensorRT's supported range {lo}..{hi}")
        layers: dict[str, _PluginLayer] = {}
        for index, node in enumerate(model.graph.node):
            if _graph.is_plugin_node(node) or node.op_type not in table:
                layers[node.output[0]] = _PluginLayer(node, self._create_plugin(index, node))

        def add_layer(node: onnx.NodeProto, infos: list[_graph.TensorInfo]) -> _graph.TensorInfo:
            try:
                return layers[node.output[0]].add_layer(infos)
            except Exception as e:  # the plugin's own shape/type functions refuse the node's inputs
                index = [n.output[0] for n in model.graph.node].index(node.output[0])
                raise _NodeError(index, node, f"the plugin refused its inputs: {e}") from e

        graph = model.graph
        initializers = {t.name for t in graph.initializer}
        inputs = [v for v in graph.input if v.name not in initializers]
        symbols = {v.name: _graph.dims_of(v) for v in inputs}
        known = _graph.infer(model, symbols, add_layer)
        for index, node in enumerate(graph.node):
            if node.output[0] in layers or not node.input or not node.input[0]:
                continue
            elem = known.get(node.input[0], (0, []))[0]
            if elem and _TYPE_NAMES.get(elem) not in table[node.op_type]:
                raise _NodeError(index, node, f"{node.op_type} does not take {_TYPE_NAMES.get(elem, elem)} inputs")
        network = self.network
        network.inputs = [
            ITensor(
                v.name,
                _graph.ONNX_TO_TRT[v.type.tensor_type.elem_type],
                [-1 if not isinstance(d, int) else d for d in symbols[v.name]],
            )
            for v in inputs
        ]
        network.outputs = [
            ITensor(
                v.name,
                _graph.ONNX_TO_TRT[known[v.name][0]],
                [d if isinstance(d, int) else -1 for d in known[v.name][1]],
            )
            for v in graph.output
        ]
        network.model = model
        network.plugin_layers = [layers[n.output[0]] for n in graph.node if n.output[0] in layers]

    def _create_plugin(self, index: int, node: onnx.NodeProto) -> Any:
        attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        version = attributes.get("plugin_version", b"1")
        namespace = attributes.get("plugin_namespace", b"")
        version, namespace = (v.decode() if isinstance(v, bytes) else str(v) for v in (version, namespace))
        creator = get_plugin_registry().get_creator(node.op_type, version, namespace)
        if creator is None:
            raise _NodeError(
                index, node, 'creator && "Plugin not found, are the plugin name, version, and namespace correct?"'
            )
        if not isinstance(creator, IPluginCreatorV3Quick):
            raise _NodeError(index, node, "only Python (QDP) plugin creators are modelled by the stand-in")
        if len(node.output) != 1:
            raise _NodeError(index, node, "plugins with several outputs are not modelled by the stand-in")
        fields = PluginFieldCollection(
            PluginField(f.name, attributes[f.name], f.type) for f in creator.field_names if f.name in attributes
        )
        if "aot" in attributes:
            request = (
                QuickPluginCreationRequest.STRICT_AOT if attributes["aot"] else QuickPluginCreationRequest.STRICT_JIT
            )
        elif self.network.get_flag(NetworkDefinitionCreationFlag.PREFER_AOT_PYTHON_PLUGINS):
            request = QuickPluginCreationRequest.PREFER_AOT
        elif self.network.get_flag(NetworkDefinitionCreationFlag.PREFER_JIT_PYTHON_PLUGINS):
            request = QuickPluginCreationRequest.PREFER_JIT
        else:
            request = QuickPluginCreationRequest.UNKNOWN
        try:
            # The QDP creator looks the plugin up by the name it was registered with: the node's op type.
            return creator.create_plugin(node.op_type, namespace, fields, TensorRTPhase.BUILD, request)
        except Exception as e:
            raise _NodeError(index, node, f"Could not create the plugin: {e}") from e


class IOptimizationProfile:
    def __init__(self) -> None:
        self.shapes: dict[str, tuple[Dims, Dims, Dims]] = {}

    def set_shape(self, input: str, min: Sequence[int], opt: Sequence[int], max: Sequence[int]) -> None:
        points = (Dims(min), Dims(opt), Dims(max))
        if len({len(p) for p in points}) != 1 or not all(0 <= a <= b <= c for a, b, c in zip(*points, strict=True)):
            raise ValueError(f"inconsistent min/opt/max dimensions for {input}: {[list(p) for p in points]}")
        self.shapes[input] = points

    def get_shape(self, input: str) -> list[Dims]:
        return list(self.shapes.get(input, ()))

    def __bool__(self) -> bool:
        return True  # set_shape refused whatever would be invalid


_CACHE_MAGIC = b"TRT-STANDIN-TIMING-CACHE"


class ITimingCache:
    """Tactic timings of layers, and the TensorRT version and device they were measured with."""

    def __init__(self, device: dict[str, Any], entries: dict[str, Any]) -> None:
        self.device, self.entries = device, entries

    def serialize(self) -> IHostMemory:
        record = {"tensorrt_version": VERSION, "device": self.device, "entries": self.entries}
        return IHostMemory(_CACHE_MAGIC + json.dumps(record).encode())


def read_timing_cache(data: bytes) -> dict[str, Any] | None:
    """The record of a serialized timing cache, None for bytes that are not one."""
    if not data.startswith(_CACHE_MAGIC):
        return None
    try:
        return json.loads(data[len(_CACHE_MAGIC) :])
    except ValueError:
        return None


class IBuilderConfig:
    def __init__(self, logger: Any, device: dict[str, Any]) -> None:
        self.logger, self.device = logger, device
        self.builder_optimization_level = 3
        self.profiles: list[IOptimizationProfile] = []
        self.timing_cache: ITimingCache | None = None

    def create_timing_cache(self, serialized_timing_cache: bytes) -> ITimingCache | None:
        """An empty cache for b""; None (and an error logged) for bytes that are no cache of this TensorRT."""
        data = bytes(serialized_timing_cache)
        if not data:
            return ITimingCache(self.device, {})
        record = read_timing_cache(data)
        if record is None:
            self.logger.log(
                _ERROR,
                "Error Code 1: Serialization (Serialization assertion magicTagRead == kMAGIC_TAG failed."
                "Magic tag does not match)",
            )
            return None
        if record["tensorrt_version"] != VERSION:
            self.logger.log(
                _ERROR,
                f"Error Code 1: Serialization (the timing cache was created by TensorRT {record['tensorrt_version']}, "
                f"this is {VERSION})",
            )
            return None
        return ITimingCache(record["device"], dict(record["entries"]))

    def set_timing_cache(self, cache: ITimingCache, ignore_mismatch: bool) -> bool:
        # The cache's verification header holds the CUDA device's properties (IBuilderConfig::setTimingCache).
        if cache.device != self.device and not ignore_mismatch:
            self.logger.log(
                _ERROR,
                f"Error Code 2: Internal Error (the timing cache was created on {cache.device}, "
                f"this device is {self.device})",
            )
            return False
        self.timing_cache = cache
        return True

    def get_timing_cache(self) -> ITimingCache | None:
        return self.timing_cache

    def add_optimization_profile(self, profile: IOptimizationProfile) -> int:
        if not profile:
            return -1
        self.profiles.append(profile)
        return len(self.profiles) - 1


class Builder:
    def __init__(self, logger: Any) -> None:
        self.logger = logger
        self.device = current_device(logger, "createInferBuilder")

    def create_network(self, flags: int = 0) -> INetworkDefinition:
        return INetworkDefinition(flags)

    def create_builder_config(self) -> IBuilderConfig:
        return IBuilderConfig(self.logger, self.device)

    def create_optimization_profile(self) -> IOptimizationProfile:
        return IOptimizationProfile()

    def build_serialized_network(self, network: INetworkDefinition, config: IBuilderConfig) -> IHostMemory | None:
        try:
            return IHostMemory(self._build(network, config))
        except _BuildError as e:
            self.logger.log(_ERROR, f"IBuilder::buildSerializedNetwork: {e}")
            return None

    def _build(self, network: INetworkDefinition, config: IBuilderConfig) -> bytes:
        if network.model is None:
            raise _BuildError("Error Code 4: API Usage Error (Network must have at least one output.)")
        points = self._profile_points(network, config)
        layers = {layer.node.output[0]: layer for layer in network.plugin_layers}

        def concrete(node: onnx.NodeProto, infos: list[_graph.TensorInfo]) -> _graph.TensorInfo:
            return layers[node.output[0]].concrete_output(infos)

        model = network.model
        at = [_graph.infer(model, shapes, concrete) for shapes in points]
        plugins = [self._build_plugin(layer, at) for layer in network.plugin_layers]
        graph = model.graph
        io = {v.name for v in [*graph.input, *graph.output]} | {t.name for t in graph.initializer}
        activations = sum(
            int(np.prod(dims)) * onnx.helper.tensor_dtype_to_np_dtype(elem).itemsize
            for name, (elem, dims) in at[2].items()
            if name not in io and all(isinstance(d, int) for d in dims)
        )
        # A layer's timing is keyed by its operation and its inputs at the profile's opt shapes.
        cache = config.timing_cache or ITimingCache(config.device, {})
        cached, hits = set(cache.entries), 0
        tactics = {p["output"]: p["tactic"] for p in plugins}
        for node in graph.node:
            key = hashlib.sha256(json.dumps([node.op_type, [at[1].get(i) for i in node.input]]).encode()).hexdigest()
            hits += key in cached
            cache.entries[key] = {"op": node.op_type, "tactic": tactics.get(node.output[0], 0)}
        header = {
            "tensorrt_version": VERSION,
            "device": config.device,
            "strongly_typed": network.get_flag(NetworkDefinitionCreationFlag.STRONGLY_TYPED),
            "builder_optimization_level": config.builder_optimization_level,
            "timing_cache": {"hits": hits, "misses": len(graph.node) - hits},
            "io": [
                {"name": t.name, "mode": mode, "dtype": int(t.dtype), "shape": list(t.shape)}
                for mode, tensors in (("input", network.inputs), ("output", network.outputs))
                for t in tensors
            ],
            "profile": {name: [list(p) for p in shapes] for name, shapes in config.profiles[0].shapes.items()},
            "plugins": plugins,
            "device_memory_size": activations,
        }
        return _graph.serialize_plan(header, model.SerializeToString())

    def _profile_points(self, network: INetworkDefinition, config: IBuilderConfig) -> list[dict[str, list[int]]]:
        """The network inputs' shapes at the profile's min, opt and max, after TensorRT's checks of the profile."""
        dynamic = [t for t in network.inputs if -1 in t.shape]
        if dynamic and not config.profiles:
            raise _BuildError(
                "Error Code 4: API Usage Error (Network has dynamic or shape inputs, but no optimization profile has "
                "been defined.)"
            )
        profile = config.profiles[0].shapes if config.profiles else {}
        names = {t.name for t in network.inputs}
        for name in profile:
            if name not in names:
                raise _BuildError(f"Error Code 4: API Usage Error ({name} is not an input of the network)")
        points: list[dict[str, list[int]]] = [{}, {}, {}]
        for tensor in network.inputs:
            if tensor.name not in profile:
                if -1 in tensor.shape:
                    raise _BuildError(
                        f"Error Code 4: Internal Error ({tensor.name}: dynamic input is missing dimensions "
                        "in profile 0.)"
                    )
                shapes = (tensor.shape,) * 3
            else:
                shapes = profile[tensor.name]
            for point, dims in zip(points, shapes, strict=True):
                if len(dims) != len(tensor.shape) or any(
                    s not in (-1, d) for s, d in zip(tensor.shape, dims, strict=True)
                ):
                    raise _BuildError(
                        f"Error Code 4: API Usage Error ({tensor.name}: profile dimensions {list(dims)} do not match "
                        f"the network's {list(tensor.shape)})"
                    )
                point[tensor.name] = list(dims)
        return points

    def _build_plugin(self, layer: _PluginLayer, at: list[dict[str, _graph.TensorInfo]]) -> dict[str, Any]:
        """The builder's calls on a plugin for the profile; what the plan keeps of it."""
        node, plugin = layer.node, layer.plugin
        names = [*node.input, *node.output]
        descs = []
        for name in names:
            elem, _ = at[0][name]
            mins, opts, maxs = (Dims(point[name][1]) for point in at)
            desc = DynamicPluginTensorDesc()
            desc.desc.dims = Dims(a if a == b == c else -1 for a, b, c in zip(mins, opts, maxs, strict=True))
            desc.desc.type = _graph.ONNX_TO_TRT[elem]
            desc.min, desc.opt, desc.max = mins, opts, maxs
            descs.append(desc)
        inputs, outputs = descs[: len(node.input)], descs[len(node.input) :]
        try:
            combos = plugin.get_supported_format_combinations(descs, len(inputs))
            wanted = [(d.desc.type, TensorFormat.LINEAR) for d in descs]
            groups = [combos[i : i + len(descs)] for i in range(0, len(combos), len(descs))]
            if not any([(c.type, c.format) for c in group] == wanted for group in groups):
                raise _BuildError(
                    f"Error Code 10: Internal Error (Could not find any implementation for node {node.name}.)"
                )
            plugin.configure_plugin(inputs, outputs)
            tactics = plugin.get_valid_tactics()
            tactic = tactics[0] if tactics else 0  # TensorRT times each tactic; the stand-in takes the first
            plugin.set_tactic(tactic)
            if not isinstance(plugin, IPluginV3QuickAOTBuild):
                raise _BuildError(f"{node.name}: JIT (Python) plugin implementations are not modelled by the stand-in")
            builder = IExprBuilder()
            symbolic = layer.symbolic_inputs([d.desc.dims for d in inputs], builder)
            launch, extra = KernelLaunchParams(), ISymExprs()
            plugin.get_launch_params(symbolic, descs, len(inputs), launch, extra, builder)
            kernel, ptx = plugin.get_kernel([d.desc for d in inputs], [d.desc for d in outputs])
        except _BuildError:
            raise
        except Exception as e:  # the plugin's Python raised: TensorRT reports it and the build fails
            raise _BuildError(f"Error Code 9: Internal Error ({node.name}: plugin call failed: {e!r})") from e
        kernel = kernel.decode() if isinstance(kernel, bytes) else kernel
        ptx = ptx.decode() if isinstance(ptx, bytes) else ptx
        if not re.search(rf"\.entry\s+{re.escape(kernel)}\s*\(", ptx):
            raise _BuildError(f"Error Code 9: Internal Error ({node.name}: the PTX has no kernel named {kernel})")
        return {
            "node": node.name,
            "plugin": f"{plugin.plugin_namespace}::{plugin.plugin_name}",
            "inputs": list(node.input),
            "output": node.output[0],
            "input_types": [int(t) for t in layer.input_types],
            "output_type": int(layer.output_type),
            "output_shape": layer.output_trees,
            "tactic": tactic,
            "kernel": kernel,
            "ptx": ptx,
            "launch": {axis: getattr(launch, axis).expr.tree for axis in _LAUNCH},
            "extra_args": [extra.exprs[i].expr.tree for i in range(extra.nbSymExprs)],
        }


_LAUNCH = ("grid_x", "grid_y", "grid_z", "block_x", "block_y", "block_z", "shared_mem")


class _BuildError(Exception):
    pass
