"""The value types, enums, logger and plugin interfaces of TensorRT 10.14's native module (tensorrt_bindings'
tensorrt.so), with the names, members and values its type stubs give (tensorrt-stubs 10.13.0.35.1 and the
tensorrt-cu12-bindings 10.14.1.48.post1 wheel's __init__.py: the dtype aliases, Logger's severities, itemsize).

Dimension expressions (IDimensionExpr) are symbolic here: a constant, a dimension of a plugin input, or an operation
of two expressions, so an engine can evaluate a plugin's launch parameters for each run's shapes as TensorRT does.
"""

from __future__ import annotations

import enum
import sys
from collections.abc import Iterable
from typing import Any

import numpy as np


class DataType(enum.IntEnum):
    FLOAT = 0
    HALF = 1
    INT8 = 2
    INT32 = 3
    BOOL = 4
    UINT8 = 5
    FP8 = 6
    BF16 = 7
    INT64 = 8
    INT4 = 9
    FP4 = 10
    E8M0 = 11

    @property
    def itemsize(self) -> float:
        return _ITEMSIZE[self]


_ITEMSIZE = {
    DataType.FLOAT: 4,
    DataType.HALF: 2,
    DataType.BF16: 2,
    DataType.INT8: 1,
    DataType.INT32: 4,
    DataType.INT64: 8,
    DataType.BOOL: 1,
    DataType.UINT8: 1,
    DataType.FP8: 1,
    DataType.INT4: 0.5,
    DataType.FP4: 0.5,
}


class TensorIOMode(enum.IntEnum):
    NONE = 0
    INPUT = 1
    OUTPUT = 2


class TensorFormat(enum.IntEnum):
    LINEAR = 0
    CHW2 = 1
    HWC8 = 2
    CHW4 = 3
    CHW16 = 4
    CHW32 = 5
    DHWC8 = 6
    CDHW32 = 7
    HWC = 8
    DLA_LINEAR = 9
    DLA_HWC4 = 10
    HWC16 = 11
    DHWC = 12


class NetworkDefinitionCreationFlag(enum.IntEnum):
    EXPLICIT_BATCH = 0
    STRONGLY_TYPED = 1
    PREFER_JIT_PYTHON_PLUGINS = 2
    PREFER_AOT_PYTHON_PLUGINS = 3


class DimensionOperation(enum.IntEnum):
    SUM = 0
    PROD = 1
    MAX = 2
    MIN = 3
    SUB = 4
    EQUAL = 5
    LESS = 6
    FLOOR_DIV = 7
    CEIL_DIV = 8


class PluginFieldType(enum.IntEnum):
    FLOAT16 = 0
    FLOAT32 = 1
    FLOAT64 = 2
    INT8 = 3
    INT16 = 4
    INT32 = 5
    CHAR = 6
    DIMS = 7
    UNKNOWN = 8
    BF16 = 9
    INT64 = 10
    FP8 = 11
    INT4 = 12
    FP4 = 13


class QuickPluginCreationRequest(enum.IntEnum):
    UNKNOWN = 0
    PREFER_JIT = 1
    PREFER_AOT = 2
    STRICT_JIT = 3
    STRICT_AOT = 4


class TensorRTPhase(enum.IntEnum):
    BUILD = 0
    RUNTIME = 1


class PluginArgType(enum.IntEnum):
    INT = 0


class PluginArgDataType(enum.IntEnum):
    INT8 = 0
    INT16 = 1
    INT32 = 2


class Dims(list):
    """Behaves like a tuple of ints (Dims == tuple compares the values); -1 marks a runtime dimension."""

    MAX_DIMS = 8
    __hash__ = None  # type: ignore[assignment]

    def __init__(self, shape: Iterable[int] = ()) -> None:
        super().__init__(int(d) for d in shape)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, list | tuple) and tuple(self) == tuple(other)


class ILogger:
    class Severity(enum.IntEnum):
        INTERNAL_ERROR = 0
        ERROR = 1
        WARNING = 2
        INFO = 3
        VERBOSE = 4


class Logger(ILogger):
    """Prints the messages of min_severity and worse, as TensorRT's default logger does."""

    INTERNAL_ERROR = ILogger.Severity.INTERNAL_ERROR
    ERROR = ILogger.Severity.ERROR
    WARNING = ILogger.Severity.WARNING
    INFO = ILogger.Severity.INFO
    VERBOSE = ILogger.Severity.VERBOSE

    def __init__(self, min_severity: ILogger.Severity = ILogger.Severity.WARNING) -> None:
        self.min_severity = min_severity

    def log(self, severity: ILogger.Severity, msg: str) -> None:
        if severity <= self.min_severity:
            print(f"[TRT] [{'FEWIV'[severity]}] {msg}", file=sys.stderr)


# --- plugins: what tensorrt.plugin (the wheel's Python sources) builds on ---------------------------------------


class IVersionedInterface:
    def __init__(self, *args: Any) -> None:
        pass


class IPluginCapability(IVersionedInterface):
    pass


class IPluginV3(IVersionedInterface):
    pass


class IPluginV3QuickCore(IPluginCapability):
    pass


class IPluginV3QuickBuild(IPluginCapability):
    pass


class IPluginV3QuickAOTBuild(IPluginV3QuickBuild):
    pass


class IPluginV3QuickRuntime(IPluginCapability):
    pass


class IPluginCreatorInterface(IVersionedInterface):
    pass


class IPluginCreatorV3Quick(IPluginCreatorInterface):
    pass


class ISymExpr:
    def __init__(self) -> None:
        pass


class ITensor:
    """A network tensor: name, dtype and shape (-1 for runtime dimensions)."""

    def __init__(self, name: str, dtype: DataType, shape: Iterable[int]) -> None:
        self.name, self.dtype, self.shape = name, dtype, Dims(shape)


class PluginField:
    def __init__(self, name: str = "", data: Any = None, type: PluginFieldType = PluginFieldType.UNKNOWN) -> None:
        self.name, self.type = name, type
        self.data = np.frombuffer(data, dtype=np.uint8) if isinstance(data, bytes) else np.asarray(data)
        self.size = int(self.data.size)


class PluginFieldCollection(list):
    pass


class PluginTensorDesc:
    def __init__(self) -> None:
        self.dims = Dims()
        self.format = TensorFormat.LINEAR
        self.type = DataType.FLOAT
        self.scale = 1.0


class DynamicPluginTensorDesc:
    def __init__(self) -> None:
        self.desc = PluginTensorDesc()
        self.min, self.opt, self.max = Dims(), Dims(), Dims()


class KernelLaunchParams:
    """Where get_launch_params puts its ISymExprs (grid, block, shared memory)."""

    grid_x: Any
    grid_y: Any
    grid_z: Any
    block_x: Any
    block_y: Any
    block_z: Any
    shared_mem: Any


class ISymExprs:
    """The extra scalar kernel arguments get_launch_params sets (nbSymExprs, then each by index)."""

    def __init__(self) -> None:
        self.nbSymExprs = 0
        self.exprs: dict[int, Any] = {}

    def __setitem__(self, index: int, expr: Any) -> bool:
        self.exprs[index] = expr
        return True

    def __len__(self) -> int:
        return self.nbSymExprs


class IPluginRegistry:
    """The process's plugin creators by (name, version, namespace)."""

    def __init__(self) -> None:
        self._creators: dict[tuple[str, str, str], Any] = {}

    def register_creator(self, creator: Any, plugin_namespace: str = "") -> bool:
        key = (creator.name, creator.plugin_version, plugin_namespace)
        if key in self._creators:
            return False
        self._creators[key] = creator
        return True

    def get_creator(self, type: str, version: str, plugin_namespace: str = "") -> Any:
        return self._creators.get((type, version, plugin_namespace))


_REGISTRY = IPluginRegistry()


def get_plugin_registry() -> IPluginRegistry:
    return _REGISTRY


# --- dimension expressions --------------------------------------------------------------------------------------

_INT64_MIN = -(2**63)

_OPERATIONS = {
    DimensionOperation.SUM: lambda a, b: a + b,
    DimensionOperation.PROD: lambda a, b: a * b,
    DimensionOperation.MAX: max,
    DimensionOperation.MIN: min,
    DimensionOperation.SUB: lambda a, b: a - b,
    DimensionOperation.EQUAL: lambda a, b: int(a == b),
    DimensionOperation.LESS: lambda a, b: int(a < b),
    DimensionOperation.FLOOR_DIV: lambda a, b: a // b,
    DimensionOperation.CEIL_DIV: lambda a, b: -(-a // b),
}


class IDimensionExpr:
    """A dimension expression as a tree: ["const", value], ["dim", input index, axis] (a runtime dimension of a
    plugin input) or [operation, left, right]; JSON-serializable, so a plan can carry it."""

    def __init__(self, tree: list) -> None:
        self.tree = tree

    def is_constant(self) -> bool:
        return self.tree[0] == "const"

    def get_constant_value(self) -> int:
        # IDimensionExpr::getConstantValue: the int64 minimum for an expression that is not a build-time constant.
        return int(self.tree[1]) if self.is_constant() else _INT64_MIN

    def is_size_tensor(self) -> bool:
        return False


def evaluate(tree: list, shapes: list[tuple[int, ...]]) -> int:
    """The value of an expression tree for the plugin inputs' runtime shapes."""
    if tree[0] == "const":
        return int(tree[1])
    if tree[0] == "dim":
        return int(shapes[tree[1]][tree[2]])
    return int(_OPERATIONS[DimensionOperation(tree[0])](evaluate(tree[1], shapes), evaluate(tree[2], shapes)))


class IExprBuilder:
    """Constants and operations; operations of constants fold to constants, as TensorRT's builder does."""

    def constant(self, value: int) -> IDimensionExpr:
        return IDimensionExpr(["const", int(value)])

    def operation(self, op: DimensionOperation, first: IDimensionExpr, second: IDimensionExpr) -> IDimensionExpr:
        tree = [int(op), first.tree, second.tree]
        return (
            self.constant(evaluate(tree, [])) if first.is_constant() and second.is_constant() else IDimensionExpr(tree)
        )


class DimsExprs(list):
    def __init__(self, length_or_exprs: int | Iterable[IDimensionExpr] = 0) -> None:
        super().__init__([None] * length_or_exprs if isinstance(length_or_exprs, int) else length_or_exprs)
