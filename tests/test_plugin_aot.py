"""AOT compilation of the varlen attention kernel and its TensorRT QDP registration, on a machine without a GPU.

- The kernel compiles for sm_80 and sm_90 here; the stripped PTX (no scratch parameters, PTX ISA <= 9.0) assembles
  with the bundled ptxas without spills and within 48 KB of shared memory. Every shipped configuration on every
  target: scripts/aot_report.py, in the slow test.
- Registration runs the real `tensorrt.plugin` Python sources (the tensorrt-cu12-bindings 10.14 wheel): its decorators
  validate the register/aot_impl signatures and annotations, and its AOT plugin class is driven through the calls
  TensorRT's builder makes (output types, output shapes, launch parameters, kernel). Only TensorRT's native module,
  which cannot load without TensorRT's libraries, is stood in for: enum members, base classes, and an expression builder
  that evaluates dimension expressions to integers.
"""

import importlib.util
import json
import re
import subprocess
import sys
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from qwen3vl_trt.errors import GpuStackMissingError
from qwen3vl_trt.plugins import PLUGIN_NAME, PLUGIN_NAMESPACE, PLUGIN_VERSION, registration
from qwen3vl_trt.plugins.aot import (
    MAX_PTX_VERSION,
    SHARED_MEMORY_LIMIT,
    TENSOR_ARGUMENTS,
    assemble,
    compile_varlen_attention,
    parse_arch,
    strip_scratch_parameters,
)
from qwen3vl_trt.plugins.varlen_kernel import launch_grid, shipped_config

REPO = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.once, pytest.mark.gpu_image]

HEADS = 16


def _entry_parameters(ptx: str, name: str) -> list[str]:
    entry = re.search(rf"\.visible \.entry {name}\((.*?)\)", ptx, re.DOTALL)
    assert entry is not None
    return [line.strip() for line in entry.group(1).strip().split(",\n")]


@pytest.mark.parametrize(("capability", "dtype"), [(90, "fp16"), (80, "bf16")])
def test_stripped_ptx_assembles_without_spills(capability: int, dtype: str) -> None:
    kernel = compile_varlen_attention(capability, dtype, HEADS, 72)
    version = re.search(r"^\.version (\d+)\.(\d+)", kernel.ptx, re.MULTILINE)
    assert version is not None and int(version.group(1)) * 10 + int(version.group(2)) <= MAX_PTX_VERSION
    assert kernel.ptx_target == ("sm_90a" if capability == 90 else f"sm_{capability}")
    # Exactly the plugin's tensors: q, k, v, cu_seqlens, the carrier, out; no scratch pointers.
    assert len(_entry_parameters(kernel.ptx, kernel.name)) == len(TENSOR_ARGUMENTS)
    assert f".reqntid {kernel.threads_per_block}" in kernel.ptx
    assert 0 < kernel.shared_memory <= SHARED_MEMORY_LIMIT
    report = assemble(kernel.ptx, kernel.ptx_target)
    assert report.spill_stores == report.spill_loads == report.stack_frame == 0
    assert report.registers <= 255


_PTX = """.version 8.8
.target sm_90a
.visible .entry k(
\t.param .u64 .ptr .global .align 1 k_param_0,
\t.param .u64 .ptr .global .align 1 k_param_1,
\t.param .u64 .ptr .global .align 1 k_param_2
)
.reqntid 128
{
\tld.param.b64 \t%rd1, [k_param_0];
\tret;
}
"""


def test_strip_scratch_parameters() -> None:
    stripped = strip_scratch_parameters(_PTX, "k", 1, 0, 0)
    assert stripped == _PTX.replace(
        "k_param_0,\n\t.param .u64 .ptr .global .align 1 k_param_1,\n\t.param .u64 .ptr .global .align 1 k_param_2\n",
        "k_param_0\n",
    )
    assert _entry_parameters(stripped, "k") == [".param .u64 .ptr .global .align 1 k_param_0"]
    with pytest.raises(ValueError, match="scratch memory"):
        strip_scratch_parameters(_PTX, "k", 1, 256, 0)
    with pytest.raises(ValueError, match="scratch memory"):
        strip_scratch_parameters(_PTX, "k", 1, 0, 64)
    with pytest.raises(ValueError, match="expected 2 arguments"):
        strip_scratch_parameters(_PTX, "k", 2, 0, 0)
    with pytest.raises(ValueError, match="reads its scratch parameter k_param_2"):
        strip_scratch_parameters(_PTX.replace("\tret;", "\tld.param.b64 \t%rd2, [k_param_2];\n\tret;"), "k", 1, 0, 0)


def test_parse_arch() -> None:
    assert [parse_arch(arch) for arch in ("sm_80", "sm86", "89", "sm_90a")] == [80, 86, 89, 90]
    with pytest.raises(ValueError, match="sm_90"):
        parse_arch("hopper")


@pytest.mark.slow
def test_aot_report_every_shipped_config() -> None:
    """scripts/aot_report.py: every shipped configuration on sm_80/86/89/90 without spills, within 48 KB."""
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "aot_report.py"), "--json"],
        capture_output=True,
        text=True,
        check=False,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr + result.stdout
    report = json.loads(result.stdout)
    kernels = report["kernels"]
    assert {row["arch"] for row in kernels} == {"sm_80", "sm_86", "sm_89", "sm_90"}
    assert {(row["head_dim"], row["dtype"]) for row in kernels} >= {(72, "fp16"), (72, "bf16"), (64, "bf16")}
    for row in kernels:
        assert row["spill_stores"] == row["spill_loads"] == 0, row
        assert row["shared_memory"] <= SHARED_MEMORY_LIMIT, row


# --- The QDP registration against the real tensorrt.plugin sources -------------------------------------------------


class _Member(type):
    """A stood-in native class whose unknown class attributes (enum members, nested types) are new distinct classes."""

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        member = _Member(name, (_Native,), {})
        setattr(cls, name, member)
        return member


class _Native(metaclass=_Member):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args


class _NativeModule(types.ModuleType):
    """Stands in for tensorrt's native bindings: every unknown attribute is a distinct stood-in class."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        member = _Member(name, (_Native,), {})
        setattr(self, name, member)
        return member


def _native_tensorrt() -> _NativeModule:
    trt = _NativeModule("tensorrt")

    class Dims(list):
        MAX_DIMS = 8

    class DimsExprs(list):
        def __init__(self, length: int) -> None:
            super().__init__([None] * length)

    class IDimensionExpr:
        """A dimension expression evaluated to the integer it has for one concrete set of shapes."""

        def __init__(self, value: int, constant: bool) -> None:
            self.value, self.constant = value, constant

        def is_constant(self) -> bool:
            return self.constant

        def get_constant_value(self) -> int:
            assert self.constant, "value of a runtime dimension asked for at build time"
            return self.value

    class Logger(_Native):
        def log(self, severity: Any, message: str) -> None:
            pass

    class PluginRegistry:
        def __init__(self) -> None:
            self.creators: dict[tuple[str, str, str], Any] = {}

        def register_creator(self, creator: Any, namespace: str) -> None:
            self.creators[(creator.name, creator.plugin_version, namespace)] = creator

        def get_creator(self, name: str, version: str, namespace: str) -> Any:
            return self.creators[(name, version, namespace)]

    registry = PluginRegistry()
    members = {
        "Dims": Dims,
        "DimsExprs": DimsExprs,
        "IDimensionExpr": IDimensionExpr,
        "Logger": Logger,
        "get_plugin_registry": lambda: registry,
        "__version__": "10.14.1.48.post1",
    }
    for name, member in members.items():
        setattr(trt, name, member)
    return trt


class _ExprBuilder:
    """trt.IExprBuilder: constants and operations on IDimensionExpr, evaluated."""

    def __init__(self, trt: Any) -> None:
        op = trt.DimensionOperation
        self.trt = trt
        self.operations: dict[Any, Callable[[int, int], int]] = {
            op.SUM: lambda a, b: a + b,
            op.SUB: lambda a, b: a - b,
            op.PROD: lambda a, b: a * b,
            op.FLOOR_DIV: lambda a, b: a // b,
            op.CEIL_DIV: lambda a, b: -(-a // b),
            op.MAX: max,
            op.MIN: min,
        }

    def constant(self, value: int) -> Any:
        return self.trt.IDimensionExpr(value, True)

    def operation(self, op: Any, first: Any, second: Any) -> Any:
        return self.trt.IDimensionExpr(
            self.operations[op](first.value, second.value), first.constant and second.constant
        )


def _tensorrt_plugin_sources() -> Path | None:
    """tensorrt_bindings/plugin of the tensorrt-cu12-bindings 10.14 wheel: installed, or in the directory that
    scripts/tensorrt_stubs.sh fills for mypy."""
    bindings = importlib.util.find_spec("tensorrt_bindings")
    locations = (bindings.submodule_search_locations or []) if bindings else []
    candidates = [Path(location) / "plugin" for location in locations]
    candidates.append(REPO / ".venv" / "typing-tensorrt" / "tensorrt_bindings" / "plugin")
    return next((path for path in candidates if (path / "_lib.py").is_file()), None)


def _load_tensorrt_plugin(trt: Any) -> types.ModuleType:
    """The wheel's plugin package imported as tensorrt.plugin, as the tensorrt package does."""
    plugin_dir = _tensorrt_plugin_sources()
    if plugin_dir is None:
        pytest.skip(
            "no tensorrt.plugin sources: pip install --no-deps tensorrt-cu12-bindings==10.14.1.48.post1, "
            "or run scripts/tensorrt_stubs.sh"
        )
    spec = importlib.util.spec_from_file_location(
        "tensorrt.plugin", plugin_dir / "__init__.py", submodule_search_locations=[str(plugin_dir)]
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["tensorrt.plugin"] = module
    trt.plugin = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def tensorrt_plugin(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Any, Any]]:
    """(tensorrt stand-in, real tensorrt.plugin) in sys.modules, with register_plugins() not yet called."""
    saved = {name: module for name, module in sys.modules.items() if name == "tensorrt" or name.startswith("tensorrt.")}
    trt = _native_tensorrt()
    sys.modules["tensorrt"] = trt
    monkeypatch.setattr(registration, "_registered_capability", None)
    try:
        yield trt, _load_tensorrt_plugin(trt)
    finally:
        for name in [name for name in sys.modules if name == "tensorrt" or name.startswith("tensorrt.")]:
            del sys.modules[name]
        sys.modules.update(saved)


def _dynamic_desc(trt: Any, dtype: Any, dims: tuple[int, ...]) -> Any:
    """A DynamicPluginTensorDesc as the builder passes it: -1 for the dimensions the profile leaves open."""
    desc = trt.DynamicPluginTensorDesc()
    desc.desc = types.SimpleNamespace(dims=dims, type=dtype, format=trt.TensorFormat.LINEAR, scale=1.0)
    return desc


@pytest.mark.parametrize(("dtype_name", "head_dim"), [("float16", 72), ("bfloat16", 64)])
def test_registered_plugin_through_the_builder_calls(
    tensorrt_plugin: tuple[Any, Any], dtype_name: str, head_dim: int
) -> None:
    trt, trtp = tensorrt_plugin
    registration.register_plugins(compute_capability=90)
    registration.register_plugins(compute_capability=90)  # again: nothing to do
    with pytest.raises(ValueError, match="another process"):
        registration.register_plugins(compute_capability=80)

    plugin_def = trtp._lib.QDP_REGISTRY[registration.PLUGIN_ID]
    assert registration.PLUGIN_ID == f"{PLUGIN_NAMESPACE}::{PLUGIN_NAME}"
    assert plugin_def.input_tensor_names == list(registration.INPUT_NAMES)
    assert plugin_def.input_attrs == {} and plugin_def.num_outputs == 1
    assert plugin_def.aot_impl_func is not None and plugin_def.impl_func is None

    # What the ONNX parser does for the node (`aot` = 1): the registered creator, a strictly AOT plugin.
    creator = trt.get_plugin_registry().get_creator(PLUGIN_NAME, "1", PLUGIN_NAMESPACE)
    plugin = creator.create_plugin(
        PLUGIN_NAME, PLUGIN_NAMESPACE, [], trt.TensorRTPhase.BUILD, trt.QuickPluginCreationRequest.STRICT_AOT
    )
    assert isinstance(plugin, trtp._plugin_class._TemplateAOTPlugin)
    assert creator.plugin_version == plugin.plugin_version == PLUGIN_VERSION

    dtype = getattr(trt, dtype_name)
    input_types = [dtype, dtype, dtype, trt.int32, trt.int32]
    with pytest.raises(ValueError, match="int32"):
        plugin.get_output_data_types([dtype, dtype, dtype, trt.int64, trt.int32], [3, 3, 3, 1, 1])
    with pytest.raises(ValueError, match="one dtype"):
        plugin.get_output_data_types([dtype, trt.float32, dtype, trt.int32, trt.int32], [3, 3, 3, 1, 1])
    assert plugin.get_output_data_types(input_types, [3, 3, 3, 1, 1]) == [dtype]

    # One runtime shape: 3 segments of 700 patches at most, 1500 patches; heads and head_dim static.
    tokens, segments, longest = 1500, 3, 700
    builder = _ExprBuilder(trt)
    runtime = trt.IDimensionExpr
    qkv = [runtime(tokens, False), builder.constant(HEADS), builder.constant(head_dim)]
    inputs = [qkv, qkv, qkv, [runtime(segments + 1, False)], [runtime(longest, False)]]
    output_shapes = plugin.get_output_shapes(inputs, [], builder)
    assert [[dim.value for dim in shape] for shape in output_shapes] == [[tokens, HEADS, head_dim]]

    plugin.set_tactic(0)
    qkv_desc = _dynamic_desc(trt, dtype, (-1, HEADS, head_dim))
    in_out = [
        qkv_desc,
        qkv_desc,
        qkv_desc,
        _dynamic_desc(trt, trt.int32, (-1,)),
        _dynamic_desc(trt, trt.int32, (-1,)),
        qkv_desc,
    ]
    launch = types.SimpleNamespace()
    extra_args = types.SimpleNamespace(nbSymExprs=None)
    plugin.get_launch_params(inputs, in_out, 5, launch, extra_args, builder)

    config = shipped_config(head_dim, {"float16": "fp16", "bfloat16": "bf16"}[dtype_name])
    kernel = compile_varlen_attention(90, {"float16": "fp16", "bfloat16": "bf16"}[dtype_name], HEADS, head_dim)
    grid = tuple(getattr(launch, f"grid_{axis}").expr.value for axis in "xyz")
    assert grid == launch_grid(longest, segments, HEADS, config)
    block = tuple(getattr(launch, f"block_{axis}").expr.value for axis in "xyz")
    assert block == (config.num_warps * 32, 1, 1) == (kernel.threads_per_block, 1, 1)
    assert launch.shared_mem.expr.value == kernel.shared_memory <= SHARED_MEMORY_LIMIT
    assert extra_args.nbSymExprs == 0  # no scalar arguments: inputs then the output

    name, ptx = plugin.get_kernel([desc.desc for desc in in_out[:5]], [desc.desc for desc in in_out[5:]])
    assert name == kernel.name and ptx == kernel.ptx.encode()
    assert f".visible .entry {name}(" in kernel.ptx


def test_dynamic_heads_are_refused(tensorrt_plugin: tuple[Any, Any]) -> None:
    trt, trtp = tensorrt_plugin
    registration.register_plugins(compute_capability=90)
    aot_impl = trtp._lib.QDP_REGISTRY[registration.PLUGIN_ID].aot_impl_func
    q = trtp.TensorDesc(dtype=trt.float16)
    q.shape = trtp.Shape((-1, -1, 72))
    with pytest.raises(ValueError, match="heads .* must be static"):
        aot_impl(q, q, q, q, q, (q,), 0)


def test_register_plugins_without_tensorrt(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # import tensorrt raises ImportError
    with pytest.raises(GpuStackMissingError, match="tensorrt.plugin"):
        registration.register_plugins(compute_capability=90)


def test_importing_the_package_needs_no_tensorrt() -> None:
    code = (
        "import sys; import qwen3vl_trt.plugins.registration, qwen3vl_trt.plugins.aot; "
        "assert not any(name.split('.')[0] in ('tensorrt', 'tensorrt_bindings') for name in sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
