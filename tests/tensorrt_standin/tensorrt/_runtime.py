"""Runtime, engine and execution context, as TensorRT 10.14's Python API has them (tensorrt-stubs 10.13.0.35.1;
NVIDIA/TensorRT include/NvInferRuntime.h at the 10.14 release commit 3b4ddc1d).

An engine is the plan's ONNX model run by ONNX Runtime on the host: execute_async_v3 reads each input from the address
set for it (set_tensor_address; ctypes over the address, as a kernel reads device memory) in the engine's dtype and
the shape set for it, and writes each output to its address, so a wrong binding, shape or dtype gives wrong numbers.
A plugin node runs as its torch reference (qwen3vl_trt.vision.ort_plugin) in place of its AOT kernel; each run
evaluates the kernel's launch parameters for that run's shapes and checks its PTX takes the arguments TensorRT
passes (inputs, extra scalars, outputs), recording each launch in `IExecutionContext.launches`.
"""

from __future__ import annotations

import ctypes
import re
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from . import _graph
from ._builder import VERSION, current_device
from ._native import DataType, Dims, ILogger, TensorIOMode, evaluate

_NUMPY = {
    DataType.FLOAT: np.float32,
    DataType.HALF: np.float16,
    DataType.INT8: np.int8,
    DataType.UINT8: np.uint8,
    DataType.INT32: np.int32,
    DataType.INT64: np.int64,
    DataType.BOOL: np.bool_,
}


class Runtime:
    def __init__(self, logger: Any) -> None:
        self.logger = logger
        self.device = current_device(logger, "createInferRuntime")

    def deserialize_cuda_engine(self, serialized_engine: Any) -> ICudaEngine | None:
        """The engine of a plan, or None (with the error logged) for a plan of another TensorRT or device."""
        read = _graph.read_plan(bytes(serialized_engine))
        what = "IRuntime::deserializeCudaEngine: Error Code 1: Serialization"
        if read is None:
            self.logger.log(
                ILogger.Severity.ERROR,
                f"{what} (Serialization assertion magicTagRead == kMAGIC_TAG failed.Magic tag does not match)",
            )
            return None
        header, model = read
        if header["tensorrt_version"] != VERSION:
            self.logger.log(
                ILogger.Severity.ERROR,
                f"{what} (The engine plan file is not compatible with this version of TensorRT, expecting library "
                f"version {VERSION} got {header['tensorrt_version']}, please rebuild.)",
            )
            return None
        built, here = header["device"]["compute_capability"], self.device["compute_capability"]
        if built != here:
            self.logger.log(
                ILogger.Severity.ERROR,
                f"{what} (The engine plan file is generated on an incompatible device, expecting compute "
                f"{here[0]}.{here[1]} got compute {built[0]}.{built[1]}, please rebuild.)",
            )
            return None
        return ICudaEngine(header, model, self.logger)


class ICudaEngine:
    def __init__(self, header: dict[str, Any], model: bytes, logger: Any) -> None:
        self.header, self.logger = header, logger
        self.model = onnx.load_from_string(model)
        self._io = {t["name"]: t for t in header["io"]}
        self._names = [t["name"] for t in header["io"]]
        self._session: Any = None

    @property
    def num_io_tensors(self) -> int:
        return len(self._names)

    def get_tensor_name(self, index: int) -> str:
        return self._names[index]

    def get_tensor_mode(self, name: str) -> TensorIOMode:
        tensor = self._io.get(name)
        if tensor is None:
            return TensorIOMode.NONE
        return TensorIOMode.INPUT if tensor["mode"] == "input" else TensorIOMode.OUTPUT

    def get_tensor_dtype(self, name: str) -> DataType:
        return DataType(self._io[name]["dtype"])

    def get_tensor_shape(self, name: str) -> Dims:
        return Dims(self._io[name]["shape"])

    def get_tensor_profile_shape(self, name: str, profile_index: int) -> list[Dims]:
        return [Dims(p) for p in self.header["profile"][name]]

    @property
    def num_optimization_profiles(self) -> int:
        return 1

    @property
    def device_memory_size_v2(self) -> int:
        return int(self.header["device_memory_size"])

    def create_execution_context(self) -> IExecutionContext:
        return IExecutionContext(self)

    def session(self) -> Any:
        """The ONNX Runtime session that stands in for the engine's kernels; it also returns every plugin node's
        inputs and output (the shapes its launch is evaluated for)."""
        if self._session is not None:
            return self._session
        import onnxruntime as ort

        model = onnx.ModelProto()
        model.CopyFrom(self.model)
        graph_inputs = {v.name for v in model.graph.input}
        outputs = {v.name for v in model.graph.output}
        for plugin in self.header["plugins"]:
            for name, elem in zip(plugin["inputs"], plugin["input_types"], strict=True):
                if name not in graph_inputs | outputs:
                    model.graph.output.append(
                        onnx.helper.make_tensor_value_info(name, _graph.TRT_TO_ONNX[DataType(elem)], None)
                    )
                    outputs.add(name)
            if plugin["output"] not in outputs:
                elem = _graph.TRT_TO_ONNX[DataType(plugin["output_type"])]
                model.graph.output.append(onnx.helper.make_tensor_value_info(plugin["output"], elem, None))
                outputs.add(plugin["output"])
        options = ort.SessionOptions()
        options.enable_cpu_mem_arena = False
        if self.header["plugins"]:
            from qwen3vl_trt.plugins import PLUGIN_NAME, PLUGIN_NAMESPACE
            from qwen3vl_trt.vision.ort_plugin import plugin_session

            unknown = {p["plugin"] for p in self.header["plugins"]} - {f"{PLUGIN_NAMESPACE}::{PLUGIN_NAME}"}
            if unknown:
                raise NotImplementedError(f"the stand-in runs only the varlen attention plugin, not {unknown}")
            # The session has read the file once made: none is left behind by a process stopped with a kill.
            with tempfile.TemporaryDirectory(prefix="trt-standin-") as directory:
                path = Path(directory) / "engine.onnx"
                onnx.save(model, str(path))
                self._session = plugin_session(path, options, ["CPUExecutionProvider"])
        else:
            self._session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        return self._session


class IExecutionContext:
    def __init__(self, engine: ICudaEngine) -> None:
        self.engine = engine
        self._shapes: dict[str, Dims] = {}
        self._addresses: dict[str, int] = {}
        self._inferred: dict[tuple, dict[str, _graph.TensorInfo]] = {}
        self.launches: list[dict[str, Any]] = []

    def _error(self, message: str) -> bool:
        self.engine.logger.log(ILogger.Severity.ERROR, message)
        return False

    def set_input_shape(self, name: str, shape: Any) -> bool:
        engine = self.engine
        if engine.get_tensor_mode(name) != TensorIOMode.INPUT:
            return self._error(
                f"IExecutionContext::setInputShape: Error Code 3: API Usage Error ({name} is not an input)"
            )
        dims, declared = Dims(shape), engine.get_tensor_shape(name)
        lo, _, hi = engine.get_tensor_profile_shape(name, 0) if name in engine.header["profile"] else (declared,) * 3
        if len(dims) != len(declared):
            return self._error(
                f"IExecutionContext::setInputShape: Error Code 3: API Usage Error ({name}: rank {len(dims)}, "
                f"expected {len(declared)})"
            )
        for i, (d, fixed, a, b) in enumerate(zip(dims, declared, lo, hi, strict=True)):
            if fixed >= 0 and d != fixed:
                return self._error(
                    f"IExecutionContext::setInputShape: Error Code 3: API Usage Error (Static dimension mismatch while "
                    f"setting input shape for {name}. Set dimensions are {list(dims)}. "
                    f"Expected dimensions are {list(declared)}.)"
                )
            if not a <= d <= b:
                return self._error(
                    f"IExecutionContext::setInputShape: Error Code 3: API Usage Error (Supplied binding dimension "
                    f"{list(dims)} for bindings[{name}] exceed min ~ max range at index {i}, maximum dimension in "
                    f"profile is {b}, minimum dimension in profile is {a}, but supplied dimension is {d}.)"
                )
        self._shapes[name] = dims
        return True

    def _inputs(self) -> list[str]:
        engine = self.engine
        return [n for n in engine._names if engine.get_tensor_mode(n) == TensorIOMode.INPUT]

    def _infer(self) -> dict[str, _graph.TensorInfo] | None:
        """Every tensor's shape for the input shapes set, None until all are."""
        if any(name not in self._shapes for name in self._inputs()):
            return None
        key = tuple(tuple(self._shapes[n]) for n in self._inputs())
        if key not in self._inferred:
            plugins = {p["output"]: p for p in self.engine.header["plugins"]}

            def plugin_output(node: onnx.NodeProto, infos: list[_graph.TensorInfo]) -> _graph.TensorInfo:
                plugin = plugins[node.output[0]]
                shapes = [tuple(dims) for _, dims in infos]
                elem = _graph.TRT_TO_ONNX[DataType(plugin["output_type"])]
                return elem, [evaluate(tree, shapes) for tree in plugin["output_shape"]]

            shapes = {n: list(self._shapes[n]) for n in self._inputs()}
            self._inferred[key] = _graph.infer(self.engine.model, shapes, plugin_output)
        return self._inferred[key]

    def get_tensor_shape(self, name: str) -> Dims:
        if name in self._shapes:
            return Dims(self._shapes[name])
        inferred = self._infer()
        if inferred is None or self.engine.get_tensor_mode(name) != TensorIOMode.OUTPUT:
            return self.engine.get_tensor_shape(name)
        return Dims(inferred[name][1])

    def set_tensor_address(self, name: str, memory: int) -> bool:
        if self.engine.get_tensor_mode(name) == TensorIOMode.NONE:
            return self._error(
                f"IExecutionContext::setTensorAddress: Error Code 3: API Usage Error ({name} is not an input or output)"
            )
        self._addresses[name] = int(memory)
        return True

    def execute_async_v3(self, stream_handle: int) -> bool:
        engine = self.engine
        for name in engine._names:
            if not self._addresses.get(name):
                return self._error(
                    "IExecutionContext::enqueueV3: Error Code 3: API Usage Error (Neither address or allocator is set "
                    f"for {name}.)"
                )
        if self._infer() is None:
            missing = [n for n in self._inputs() if n not in self._shapes]
            return self._error(
                f"IExecutionContext::enqueueV3: Error Code 3: API Usage Error (input shapes not set: {missing})"
            )
        if stream_handle == 0:
            engine.logger.log(
                ILogger.Severity.WARNING,
                "Using default stream in enqueueV3() may lead to performance issues due to additional calls to "
                "cudaStreamSynchronize() by TensorRT to ensure correct synchronization. Please use non-default stream "
                "instead.",
            )
        feeds = {name: self._read(name) for name in self._inputs()}
        session = engine.session()
        names = [o.name for o in session.get_outputs()]
        try:
            values = dict(zip(names, session.run(names, feeds), strict=True))
        except Exception as e:  # ONNX Runtime refused the inputs: what would be a failed kernel on a GPU
            return self._error(f"IExecutionContext::enqueueV3: Error Code 1: Cuda Runtime (a kernel failed: {e})")
        values.update(feeds)
        launches = []
        for plugin in engine.header["plugins"]:
            shapes = [tuple(values[n].shape) for n in plugin["inputs"]]
            launch = {axis: evaluate(tree, shapes) for axis, tree in plugin["launch"].items()}
            expected = [evaluate(tree, shapes) for tree in plugin["output_shape"]]
            if list(values[plugin["output"]].shape) != expected:
                return self._error(
                    f"{plugin['node']}: the plugin's output is {list(values[plugin['output']].shape)}, its shape "
                    f"function says {expected}"
                )
            parameters = _kernel_parameters(plugin["ptx"], plugin["kernel"])
            passed = len(plugin["inputs"]) + len(plugin["extra_args"]) + 1
            if parameters != passed:
                return self._error(
                    f"{plugin['node']}: kernel {plugin['kernel']} takes {parameters} parameters, TensorRT passes "
                    f"{passed} (inputs, extra arguments, outputs)"
                )
            launches.append({"node": plugin["node"], "kernel": plugin["kernel"], **launch})
        for name in engine._names:
            if engine.get_tensor_mode(name) == TensorIOMode.OUTPUT:
                self._write(name, values[name])
        self.launches.extend(launches)
        return True

    def _read(self, name: str) -> np.ndarray:
        dtype = np.dtype(_NUMPY[self.engine.get_tensor_dtype(name)])
        shape = tuple(self._shapes[name])
        count = int(np.prod(shape))
        buffer = (ctypes.c_char * (count * dtype.itemsize)).from_address(self._addresses[name])
        return np.frombuffer(buffer, dtype=dtype, count=count).reshape(shape).copy()

    def _write(self, name: str, value: np.ndarray) -> None:
        dtype = np.dtype(_NUMPY[self.engine.get_tensor_dtype(name)])
        shape = tuple(self.get_tensor_shape(name))
        if tuple(value.shape) != shape:
            raise AssertionError(f"{name}: the network computed {value.shape}, the engine's shape is {shape}")
        array = np.ascontiguousarray(value, dtype=dtype)
        ctypes.memmove(self._addresses[name], array.ctypes.data, array.nbytes)


def _kernel_parameters(ptx: str, kernel: str) -> int:
    entry = re.search(rf"\.entry\s+{re.escape(kernel)}\s*\((.*?)\)", ptx, re.DOTALL)
    assert entry is not None  # the build checked the entry
    return len([p for p in entry.group(1).split(",") if p.strip()])
