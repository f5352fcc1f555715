"""A stand-in for TensorRT 10.14's Python package (tests only; tests/tensorrt_standin/README.md).

`tensorrt.plugin` is TensorRT's own: the Python sources of the tensorrt-cu12-bindings 10.14.1.48.post1 wheel
(installed, or where scripts/tensorrt_stubs.sh puts them), imported over this module as the wheel's package does.
"""

# ruff: noqa: F401 (the package is what it re-exports)
import importlib.util
from pathlib import Path

from ._builder import (
    VERSION,
    Builder,
    IBuilderConfig,
    IHostMemory,
    INetworkDefinition,
    IOptimizationProfile,
    ITimingCache,
    OnnxParser,
    ParserError,
)
from ._native import (
    DataType,
    DimensionOperation,
    Dims,
    DimsExprs,
    DynamicPluginTensorDesc,
    IDimensionExpr,
    IExprBuilder,
    ILogger,
    IPluginCapability,
    IPluginCreatorInterface,
    IPluginCreatorV3Quick,
    IPluginRegistry,
    IPluginV3,
    IPluginV3QuickAOTBuild,
    IPluginV3QuickBuild,
    IPluginV3QuickCore,
    IPluginV3QuickRuntime,
    ISymExpr,
    ISymExprs,
    ITensor,
    IVersionedInterface,
    KernelLaunchParams,
    Logger,
    NetworkDefinitionCreationFlag,
    PluginArgDataType,
    PluginArgType,
    PluginField,
    PluginFieldCollection,
    PluginFieldType,
    PluginTensorDesc,
    QuickPluginCreationRequest,
    TensorFormat,
    TensorIOMode,
    TensorRTPhase,
    get_plugin_registry,
)
from ._runtime import ICudaEngine, IExecutionContext, Runtime

__version__ = VERSION

# The wheel's DataType aliases (tensorrt_bindings/__init__.py).
float32 = DataType.FLOAT
float16 = DataType.HALF
bfloat16 = DataType.BF16
int8 = DataType.INT8
int32 = DataType.INT32
int64 = DataType.INT64
uint8 = DataType.UINT8
fp8 = DataType.FP8
int4 = DataType.INT4
fp4 = DataType.FP4
bool = DataType.BOOL  # noqa: A001 (TensorRT's own name)


def _plugin_sources() -> Path | None:
    """The bindings wheel's directory holding plugin/ (tensorrt.plugin's Python sources)."""
    spec = importlib.util.find_spec("tensorrt_bindings")
    candidates = [Path(p) for p in (spec.submodule_search_locations or [])] if spec else []
    candidates.append(Path(__file__).resolve().parents[3] / ".venv" / "typing-tensorrt" / "tensorrt_bindings")
    return next((p for p in candidates if (p / "plugin" / "_lib.py").is_file()), None)


_sources = _plugin_sources()
if _sources is not None:
    __path__.append(str(_sources))  # `import tensorrt.plugin` finds the wheel's plugin package
