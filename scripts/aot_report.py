"""AOT-compiles every shipped varlen attention configuration for GPU targets and reports what ptxas says.

For each architecture and shipped (head_dim, dtype) tile configuration: compile on this machine (no GPU needed), strip
Triton's scratch parameters as the TensorRT plugin does, assemble the final PTX with the ptxas bundled in Triton's
wheel (-v), and print registers, spills, stack and shared memory. Exits 1 where a kernel spills or needs more shared
memory than a TensorRT launch gets.

    .venv/bin/python scripts/aot_report.py [--arch sm_80,sm_86,sm_89,sm_90] [--heads 16] [--json]
"""

import argparse
import json
import sys
from dataclasses import asdict, dataclass

from qwen3vl_trt.plugins.aot import (
    SHARED_MEMORY_LIMIT,
    assemble,
    compile_varlen_attention,
    parse_arch,
)
from qwen3vl_trt.plugins.varlen_kernel import SHIPPED_CONFIGS

DEFAULT_ARCHS = "sm_80,sm_86,sm_89,sm_90"
# Both Qwen3-VL vision towers have 16 heads; the head count only changes the compiled row stride.
DEFAULT_HEADS = 16


@dataclass(frozen=True)
class ReportRow:
    arch: str
    ptx_target: str
    ptx_isa: str
    dtype: str
    head_dim: int
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    registers: int
    spill_stores: int
    spill_loads: int
    stack_frame: int
    shared_memory: int

    @property
    def ok(self) -> bool:
        return self.spill_stores == 0 and self.spill_loads == 0 and self.shared_memory <= SHARED_MEMORY_LIMIT


def report_rows(archs: list[str], heads: int) -> list[ReportRow]:
    rows = []
    for arch in archs:
        capability = parse_arch(arch)
        for (head_dim, dtype), config in sorted(SHIPPED_CONFIGS.items()):
            kernel = compile_varlen_attention(capability, dtype, heads, head_dim, config)
            ptxas = assemble(kernel.ptx, kernel.ptx_target)
            rows.append(
                ReportRow(
                    arch=f"sm_{capability}",
                    ptx_target=kernel.ptx_target,
                    ptx_isa=kernel.ptx_isa,
                    dtype=dtype,
                    head_dim=head_dim,
                    block_m=config.block_m,
                    block_n=config.block_n,
                    num_warps=config.num_warps,
                    num_stages=config.num_stages,
                    registers=ptxas.registers,
                    spill_stores=ptxas.spill_stores,
                    spill_loads=ptxas.spill_loads,
                    stack_frame=ptxas.stack_frame,
                    # Triton kernels use dynamic shared memory only (ptxas sees no static allocation).
                    shared_memory=kernel.shared_memory + ptxas.static_shared_memory,
                )
            )
    return rows


def format_table(rows: list[ReportRow]) -> str:
    header = (
        "target",
        "PTX",
        "dtype",
        "head_dim",
        "tile MxN",
        "warps",
        "stages",
        "regs",
        "spill st/ld B",
        "stack B",
        "smem B",
    )
    lines = [
        (
            row.ptx_target,
            row.ptx_isa,
            row.dtype,
            str(row.head_dim),
            f"{row.block_m}x{row.block_n}",
            str(row.num_warps),
            str(row.num_stages),
            str(row.registers),
            f"{row.spill_stores}/{row.spill_loads}",
            str(row.stack_frame),
            str(row.shared_memory) + ("" if row.ok else "  <-- FAIL"),
        )
        for row in rows
    ]
    widths = [max(len(cell) for cell in column) for column in zip(header, *lines, strict=True)]
    return "\n".join(
        "  ".join(cell.rjust(width) for cell, width in zip(line, widths, strict=True)) for line in [header, *lines]
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default=DEFAULT_ARCHS, help=f"comma-separated GPU targets (default {DEFAULT_ARCHS})")
    parser.add_argument("--heads", type=int, default=DEFAULT_HEADS, help=f"attention heads (default {DEFAULT_HEADS})")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args()
    rows = report_rows([arch for arch in args.arch.split(",") if arch.strip()], args.heads)
    if args.json:
        print(
            json.dumps(
                {"shared_memory_limit": SHARED_MEMORY_LIMIT, "kernels": [asdict(row) | {"ok": row.ok} for row in rows]},
                indent=2,
            )
        )
    else:
        print(f"varlen attention, {args.heads} heads, shared memory limit {SHARED_MEMORY_LIMIT} B")
        print(format_table(rows))
    return 0 if all(row.ok for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
