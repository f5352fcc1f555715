"""Ahead-of-time compilation of the varlen attention kernel to PTX for a TensorRT plugin.

Runs on any machine (no GPU needed): Triton compiles for a named GPU target. The PTX is made loadable by TensorRT's
AOT plugin launch, which passes exactly the plugin's tensors (and int32 extra arguments) and nothing else:

- its ISA version is capped at PTX 9.0, the newest that CUDA 13.0 (the NGC image's CUDA) accepts, and at what the
  bundled ptxas accepts, so that ptxas can check the result here;
- Triton (>= 3.3) appends two hidden pointer parameters (global and profile scratch) to every kernel; they are
  removed from the PTX entry, which is only sound because the compiled kernel uses no scratch (asserted);
- dynamic shared memory must stay within 48 KB, what a launch gets without opting in to more.
"""

import inspect
import re
import subprocess
from dataclasses import dataclass
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas, ptx_get_version
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

from .varlen_kernel import TileConfig, kernel_constexprs, shipped_config, varlen_attention_kernel

# CUDA 13.0 accepts PTX ISA 9.0 at most.
MAX_PTX_VERSION = 90
SHARED_MEMORY_LIMIT = 48 * 1024
# The kernel's tensor arguments, in the TensorRT plugin's order: inputs, then the output.
TENSOR_ARGUMENTS = ("q_ptr", "k_ptr", "v_ptr", "cu_seqlens_ptr", "max_seqlen_carrier_ptr", "out_ptr")
# The attention tensors are compiled as 16-byte aligned (vector loads, cp.async), what Triton's JIT specializes on for
# such pointers. An AOT kernel cannot check at launch: this assumes TensorRT places plugin tensors at least 16-byte
# aligned in its execution memory (which it requires 256-byte aligned); an engine run on a GPU host confirms it.
ALIGNED_POINTERS = ("q_ptr", "k_ptr", "v_ptr", "out_ptr")
POINTER_ALIGNMENT = 16
# Triton's hidden trailing parameters: global scratch, then profile scratch.
_HIDDEN_PARAMETERS = 2


@dataclass(frozen=True)
class AotKernel:
    """One compiled kernel, as a TensorRT AOT plugin embeds it."""

    name: str
    ptx: str
    shared_memory: int
    num_warps: int
    # The PTX's .target, e.g. sm_90a: what ptxas assembles it for.
    ptx_target: str
    # The PTX's .version, e.g. 8.8.
    ptx_isa: str
    config: TileConfig

    @property
    def threads_per_block(self) -> int:
        # The PTX declares .reqntid: the launch must use exactly this block size.
        return self.num_warps * 32


def parse_arch(arch: str) -> int:
    """'sm_90' (or 'sm90', '90') -> 90."""
    match = re.fullmatch(r"(?:sm_?)?(\d{2,3})a?", arch.strip())
    if not match:
        raise ValueError(f"GPU architecture must look like sm_90, got {arch!r}")
    return int(match.group(1))


def ptxas_for(compute_capability: int) -> Any:
    """The ptxas tool (`.path`, `.version`) that Triton compiles this target with.

    The GPU image's Triton 3.5.1 has `get_ptxas()` without a parameter (triton/backends/nvidia/compiler.py, v3.5.1:
    `def get_ptxas() -> knobs.NvidiaTool`); newer versions take the compute capability, to pick a separate ptxas for
    Blackwell. Both are called as their signature says.
    """
    arguments: tuple[int, ...] = (compute_capability,) if inspect.signature(get_ptxas).parameters else ()
    return get_ptxas(*arguments)


def ptx_version(compute_capability: int) -> int:
    """The PTX ISA of the kernels for a target: 9.0 or the newest its bundled ptxas takes, whichever is older."""
    return min(MAX_PTX_VERSION, ptx_get_version(ptxas_for(compute_capability).version))


def compile_varlen_attention(
    compute_capability: int, dtype: str, heads: int, head_dim: int, config: TileConfig | None = None
) -> AotKernel:
    """Compiles the kernel for one GPU target and input layout; returns the stripped PTX and its launch needs.

    dtype is the triton name of q/k/v/out ("fp16", "bf16" or "fp32"); heads and head_dim are compile-time constants.
    """
    if not isinstance(varlen_attention_kernel, JITFunction):
        raise RuntimeError("AOT compilation needs the kernel compiled, not interpreted: unset TRITON_INTERPRET")
    config = config or shipped_config(head_dim, dtype)
    pointer_types = {name: f"*{dtype}" for name in TENSOR_ARGUMENTS}
    pointer_types["cu_seqlens_ptr"] = "*i32"
    # The carrier's data is never read: any pointer type gives the same PTX parameter.
    pointer_types["max_seqlen_carrier_ptr"] = "*i32"
    constexprs = kernel_constexprs(heads, head_dim, config)
    # In the kernel's argument order: Triton 3.5.1's code generator matches constexprs to the signature by position
    # (triton/compiler/code_generator.py, ast_to_ttir).
    signature = {**pointer_types, **dict.fromkeys(constexprs, "constexpr")}
    attrs = {
        (varlen_attention_kernel.arg_names.index(name),): [["tt.divisibility", POINTER_ALIGNMENT]]
        for name in ALIGNED_POINTERS
    }
    source = ASTSource(fn=varlen_attention_kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(
        source,
        target=GPUTarget("cuda", compute_capability, 32),
        options={
            "num_warps": config.num_warps,
            "num_stages": config.num_stages,
            "ptx_version": ptx_version(compute_capability),
        },
    )
    metadata = compiled.metadata
    if metadata.shared > SHARED_MEMORY_LIMIT:
        raise ValueError(
            f"{dtype} head_dim {head_dim} {config} needs {metadata.shared} bytes of shared memory on "
            f"sm_{compute_capability}, over the {SHARED_MEMORY_LIMIT} a TensorRT launch gets"
        )
    ptx = strip_scratch_parameters(
        compiled.asm["ptx"],
        metadata.name,
        len(TENSOR_ARGUMENTS),
        metadata.global_scratch_size,
        metadata.profile_scratch_size,
    )
    target = re.search(r"^\.target (\S+)", ptx, re.MULTILINE)
    isa = re.search(r"^\.version (\S+)", ptx, re.MULTILINE)
    assert target is not None and isa is not None, "PTX without .target or .version"
    return AotKernel(
        name=metadata.name,
        ptx=ptx,
        shared_memory=metadata.shared,
        num_warps=metadata.num_warps,
        ptx_target=target.group(1),
        ptx_isa=isa.group(1),
        config=config,
    )


def strip_scratch_parameters(
    ptx: str, kernel_name: str, num_arguments: int, global_scratch_size: int, profile_scratch_size: int
) -> str:
    """Removes Triton's two hidden trailing scratch pointers from the kernel entry of the PTX.

    TensorRT's launch passes only the plugin's arguments; dropping the scratch pointers is right only when the kernel
    needs no scratch, so nonzero sizes are an error. The body must not reference the removed parameters.
    """
    if global_scratch_size or profile_scratch_size:
        raise ValueError(
            f"{kernel_name} needs scratch memory (global {global_scratch_size}, profile {profile_scratch_size} bytes), "
            "which a TensorRT AOT plugin launch cannot provide"
        )
    entry = re.search(rf"\.visible \.entry {re.escape(kernel_name)}\(\n(.*?)\n\)", ptx, re.DOTALL)
    if entry is None:
        raise ValueError(f"no .entry {kernel_name} in the PTX")
    parameters = entry.group(1).split(",\n")
    if len(parameters) != num_arguments + _HIDDEN_PARAMETERS:
        raise ValueError(
            f"{kernel_name} has {len(parameters)} PTX parameters, expected {num_arguments} arguments "
            f"+ {_HIDDEN_PARAMETERS} scratch pointers"
        )
    hidden = parameters[num_arguments:]
    hidden_names = [parameter.split()[-1] for parameter in hidden]
    if not all(".u64 .ptr" in parameter for parameter in hidden):
        raise ValueError(f"the trailing PTX parameters of {kernel_name} are not pointers: {hidden}")
    body = ptx[entry.end() :]
    for name in hidden_names:
        if re.search(rf"\b{name}\b", body):
            raise ValueError(f"{kernel_name} reads its scratch parameter {name}")
    kept = ",\n".join(parameters[:num_arguments])
    return ptx[: entry.start(1)] + kept + ptx[entry.end(1) :]


@dataclass(frozen=True)
class PtxasReport:
    """What ptxas -v says about one kernel."""

    registers: int
    spill_stores: int
    spill_loads: int
    stack_frame: int
    static_shared_memory: int


def assemble(ptx: str, ptx_target: str) -> PtxasReport:
    """Assembles PTX with the ptxas bundled in Triton's wheel (-v) and reads registers, spills and stack.

    ptx_target is the PTX's .target (sm_90a); raises on assembly errors.
    """
    ptxas = ptxas_for(parse_arch(ptx_target)).path
    result = subprocess.run(
        [ptxas, "-v", f"--gpu-name={ptx_target}", "-", "-o", "/dev/null"],
        input=ptx,
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        raise RuntimeError(f"ptxas failed for {ptx_target}:\n{result.stderr}")
    log = result.stderr

    def number(pattern: str) -> int:
        found = re.search(pattern, log)
        if found is None:
            raise RuntimeError(f"ptxas -v output without /{pattern}/:\n{log}")
        return int(found.group(1))

    return PtxasReport(
        registers=number(r"Used (\d+) registers"),
        spill_stores=number(r"(\d+) bytes spill stores"),
        spill_loads=number(r"(\d+) bytes spill loads"),
        stack_frame=number(r"(\d+) bytes stack frame"),
        static_shared_memory=int(found.group(1)) if (found := re.search(r"(\d+) bytes smem", log)) else 0,
    )
