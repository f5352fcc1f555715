"""Registration of the varlen attention plugin with TensorRT (`tensorrt.plugin`, the TensorRT 10.14 QDP API).

`register_plugins()` declares `qwen3vl_trt::varlen_attention` to TensorRT's plugin registry: a shape/type function
(`tensorrt.plugin.register`) and an ahead-of-time implementation (`tensorrt.plugin.aot_impl`) that returns the
Triton kernel compiled to PTX for the engine's GPU, with its launch grid, block and shared memory as expressions of
the input shapes. The engine embeds that PTX: running it needs neither Python nor Triton.

Plugin inputs: q, k, v [N, heads, head_dim] (one dtype of fp16/bf16/fp32; heads and head_dim static), cu_seqlens
int32 [S + 1], max_seqlen_carrier [max_seqlen] (any dtype; only its shape is used). Output: [N, heads, head_dim] in
q's dtype. No attributes: the softmax scale is compiled in from head_dim.

Importing this module needs neither TensorRT nor a GPU; `register_plugins()` needs TensorRT >= 10.9.
"""

# No `from __future__ import annotations`: tensorrt.plugin checks the decorated functions' annotations as classes.
import functools
from typing import Any

from ..errors import GpuStackMissingError
from . import PLUGIN_NAME, PLUGIN_NAMESPACE
from .aot import AotKernel, compile_varlen_attention
from .varlen_kernel import shipped_config

PLUGIN_ID = f"{PLUGIN_NAMESPACE}::{PLUGIN_NAME}"
INPUT_NAMES = ("q", "k", "v", "cu_seqlens", "max_seqlen_carrier")

# The compute capability the plugin was registered for: TensorRT's registry is per process.
_registered_capability: int | None = None


def register_plugins(compute_capability: int | None = None) -> None:
    """Registers the plugin with TensorRT for one GPU target (default: the current CUDA device).

    Call before parsing the plugin ONNX variant; calling again for the same target does nothing.
    Raises GpuStackMissingError where tensorrt.plugin (TensorRT >= 10.9, with aot_impl) is not importable, or where
    no target is given and no CUDA device is visible.
    """
    global _registered_capability
    try:
        import tensorrt as trt
        import tensorrt.plugin as trtp
    except ImportError as error:
        raise GpuStackMissingError(
            f"registering the TensorRT plugin {PLUGIN_ID} needs TensorRT's python package with tensorrt.plugin "
            f"(TensorRT >= 10.9; the GPU image has it): {error}"
        ) from error
    if not hasattr(trtp, "aot_impl"):
        raise GpuStackMissingError(
            f"TensorRT {trt.__version__} has no tensorrt.plugin.aot_impl (ahead-of-time plugins need TensorRT >= 10.9)"
        )
    capability = compute_capability if compute_capability is not None else _current_device_capability()
    if _registered_capability is not None:
        if _registered_capability != capability:
            raise ValueError(
                f"{PLUGIN_ID} is registered for sm_{_registered_capability} in this process; "
                f"sm_{capability} needs another process"
            )
        return
    _declare(trt, trtp, capability)
    _registered_capability = capability


def _current_device_capability() -> int:
    import torch

    if not torch.cuda.is_available():
        raise GpuStackMissingError(
            f"no CUDA device to compile {PLUGIN_ID} for: pass the target GPU's compute capability (--arch sm_90)"
        )
    major, minor = torch.cuda.get_device_capability()
    return major * 10 + minor


def _declare(trt: Any, trtp: Any, capability: int) -> None:
    """The register and aot_impl functions, with annotations that tensorrt.plugin validates."""
    triton_dtypes = {trt.float16: "fp16", trt.bfloat16: "bf16", trt.float32: "fp32"}

    @functools.cache
    def compiled(dtype: str, heads: int, head_dim: int) -> AotKernel:
        return compile_varlen_attention(capability, dtype, heads, head_dim)

    @trtp.register(PLUGIN_ID)
    def varlen_attention_shapes(
        q: trtp.TensorDesc,
        k: trtp.TensorDesc,
        v: trtp.TensorDesc,
        cu_seqlens: trtp.TensorDesc,
        max_seqlen_carrier: trtp.TensorDesc,
    ) -> trtp.TensorDesc:
        if not (q.dtype == k.dtype == v.dtype) or q.dtype not in triton_dtypes:
            raise ValueError(
                f"{PLUGIN_ID}: q, k, v must share one dtype of fp16/bf16/fp32, got {q.dtype}, {k.dtype}, {v.dtype}"
            )
        if cu_seqlens.dtype != trt.int32:
            raise ValueError(f"{PLUGIN_ID}: cu_seqlens must be int32, got {cu_seqlens.dtype}")
        return q.like()

    @trtp.aot_impl(PLUGIN_ID)
    def varlen_attention_aot(
        q: trtp.TensorDesc,
        k: trtp.TensorDesc,
        v: trtp.TensorDesc,
        cu_seqlens: trtp.TensorDesc,
        max_seqlen_carrier: trtp.TensorDesc,
        outputs: tuple[trtp.TensorDesc],
        tactic: int,
    ) -> tuple[str | bytes, str | bytes, trtp.KernelLaunchParams, trtp.SymIntExprs]:
        heads, head_dim = _static_dim(q, 1, "heads"), _static_dim(q, 2, "head_dim")
        dtype = triton_dtypes[q.dtype]
        kernel = compiled(dtype, heads, head_dim)
        config = shipped_config(head_dim, dtype)
        launch = trtp.KernelLaunchParams()
        # The grid of varlen_kernel.launch_grid, from shapes only: (query blocks of the longest segment, S, heads).
        launch.grid_x = trtp.cdiv(max_seqlen_carrier.shape_expr[0], config.block_m)
        launch.grid_y = cu_seqlens.shape_expr[0] - 1
        launch.grid_z = heads
        launch.block_x = kernel.threads_per_block
        launch.shared_mem = kernel.shared_memory
        # The kernel takes no scalar arguments: everything it needs is compiled in or read from cu_seqlens.
        return kernel.name, kernel.ptx, launch, trtp.SymIntExprs(0)


def _static_dim(desc: Any, axis: int, what: str) -> int:
    size = int(desc.shape[axis])
    if size < 0:
        raise ValueError(f"{PLUGIN_ID}: {what} (axis {axis} of q) must be static in the network, it is dynamic")
    return size
