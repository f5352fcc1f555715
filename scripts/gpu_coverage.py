"""How much of the GPU-side code the CPU tests execute, per module, and why each line they leave is left.

Runs the tests that drive GPU-side code (the stand-ins of TensorRT, TensorRT-LLM, CUDA and the decoders replace only
what needs a device) under coverage, subprocesses included, then prints one row per GPU-side module (lines, executed,
share) and, per module, the lines no test executed, grouped by the function they are in, each with its reason: a
`NEEDS_DEVICE` entry (the function only calls CUDA or a GPU library) or a named gap. A function that holds unexecuted
lines and has no entry is listed as an unexplained gap.

Exit code: 0 at least AIM of the GPU-side lines executed and no unexplained function whose body never runs; 1 else.
Usage: scripts/gpu_coverage.sh [--json FILE] [--keep DIR] [pytest arguments for the tests, default TESTS]
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
AIM = 0.90

# The GPU-side modules, by what they are for (DESIGN.md, "What runs where"): what a GPU host runs and a CPU
# machine cannot, apart from the stand-ins.
MODULES: dict[str, list[str]] = {
    "vision engine build": ["build/vision/engine.py"],
    "vision engine runner": ["build/vision/trt_runner.py"],
    "plugins and registration": ["plugins/aot.py", "plugins/registration.py", "plugins/varlen_kernel.py"],
    "LLM conversion": [
        "build/llm/convert.py",
        "build/llm/checkpoint_format.py",
        "build/llm/ranges.py",
    ],
    "quantization": [
        "build/hf/quantization.py",
        "build/llm/fp8.py",
        "build/llm/weight_only.py",
        "build/llm/kv_cache.py",
        "build/llm/precision.py",
    ],
    "calibration": ["build/pipeline/calibration.py"],
    "engine model and build": ["build/llm/engine_model.py", "build/llm/engine_build.py"],
    "trtllm and GPU repository configs": ["build/serving/repository/trtllm_config.py"],
    "memory plan": ["build/serving/repository/gpu_memory.py"],
    "GPU decoding": ["build/preprocess/nvimgcodec_decoder.py", "build/preprocess/nvdec_decoder.py"],
    "image checks": ["build/gpu_image.py"],
    "acceptance": ["build/qa/acceptance.py"],
}

# The tests that execute GPU-side code (each through the stand-ins where it needs them).
TESTS = [
    "tests/test_vision_engine.py",
    "tests/test_vision_trt_standin.py",
    "tests/test_vision_plugin_variant.py",
    "tests/test_plugin_aot.py",
    "tests/test_varlen_attention.py",
    "tests/test_convert_llm.py",
    "tests/test_trtllm_model.py",
    "tests/test_trtllm_attention.py",
    "tests/test_weight_only.py",
    "tests/test_quantized_checkpoint.py",
    "tests/test_fp8_engine.py",
    "tests/test_llm_engine.py",
    "tests/test_trtllm_config.py",
    "tests/test_gpu_memory.py",
    "tests/test_repository.py",
    "tests/test_gpu_image.py",
    "tests/test_gpu_acceptance.py",
    "tests/test_acceptance_served.py",
    "tests/test_acceptance_checks.py",
    "tests/test_gpu_decoders.py",
]

# Two workers, a test file to each, as scripts/test.sh runs them (coverage follows them: patch = subprocess).
WORKERS = ["-n", "2", "--dist", "loadfile"]

# Functions (module path: qualified name) whose unexecuted lines only a device runs: each says why.
NEEDS_DEVICE: dict[str, str] = {
    "plugins/registration.py:_current_device_capability": "the build GPU's compute capability (the tests name --arch)",
    "build/serving/repository/gpu_memory.py:device_memory_bytes": "a GPU's memory (the tests give --gpu-memory-gib)",
    "build/qa/acceptance.py:Acceptance.kernel_rows.against_sdpa": "the kernel timed on the GPU",
    "build/qa/acceptance.py:Acceptance.kernel_rows.against_flash": "flash-attn's CUDA kernel",
    "build/qa/acceptance.py:_median_ms": "CUDA-synchronized timing",
    "build/qa/acceptance.py:_kernel_inputs": "CUDA tensors at Qwen3-VL's sizes",
    "build/qa/acceptance.py:_kernel_against_sdpa": "the kernel at Qwen3-VL's sizes (its numerics: Triton's "
    "interpreter in tests/test_varlen_attention.py)",
    "build/qa/acceptance.py:_flash_attn_ms": "flash-attn's CUDA kernel",
    "build/qa/acceptance.py:_weight_only_layout_against_upstream": "TensorRT-LLM's own quantizer (torch.ops.trtllm)",
}

# Functions with unexecuted lines that a CPU could run but no test does yet: each names the gap.
GAPS: dict[str, str] = {
    "build/qa/acceptance.py:Acceptance.decode_row.run": "its pixel check runs with device 'cpu' "
    "(test_acceptance_checks), not yet on the decoder stand-ins",
    "build/qa/acceptance.py:Acceptance.device_decode_rows.image": "as decode_row: the decoders run on their "
    "stand-ins in test_gpu_decoders, this row's call not yet",
    "build/qa/acceptance.py:Acceptance.device_decode_rows.video": "as device_decode_rows.image",
    "build/qa/acceptance.py:Acceptance.video_preprocess_row.run": "as decode_row",
    "build/qa/acceptance.py:Acceptance.vision_engine_build_row.run": "the build runs through the TensorRT stand-in in "
    "test_vision_trt_standin, this row's call not yet",
    "build/qa/acceptance.py:Acceptance.vision_engine_row.run": "as vision_engine_build_row",
    "build/qa/acceptance.py:_vision_engine_against_transformers": "as vision_engine_build_row",
    "build/qa/acceptance.py:Acceptance.build_cache_row.run": "a GPU-target `build --cache` needs both engine stages in "
    "one pipeline run, which no stand-in test makes yet",
    "build/qa/acceptance.py:_served_once": "serves a GPU-target build; the served checks themselves run against "
    "the CPU deployment (test_acceptance_served)",
}


@dataclass
class Function:
    qualname: str
    first: int
    last: int
    body: set[int] = field(default_factory=set)


def functions(path: Path) -> list[Function]:
    """Every function and method of a module with its line span, innermost last."""
    tree = ast.parse(path.read_text(), str(path))
    found: list[Function] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}"
                found.append(Function(name, child.lineno, child.end_lineno or child.lineno))
                visit(child, f"{name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(tree, "")
    return found


def owner(funcs: list[Function], line: int) -> str:
    """The innermost function holding `line`, or <module>."""
    inside = [f for f in funcs if f.first <= line <= f.last]
    return max(inside, key=lambda f: f.first).qualname if inside else "<module>"


def ranges(lines: list[int]) -> str:
    out: list[str] = []
    for line in sorted(lines):
        if out and out[-1][1] == line - 1:
            out[-1] = (out[-1][0], line)
        else:
            out.append((line, line))
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in out)


def run_tests(data_dir: Path, pytest_args: list[str]) -> int:
    rc = data_dir / "coveragerc"
    sources = sorted({str(ROOT / path) for paths in MODULES.values() for path in paths})
    rc.write_text(
        "[run]\n"
        f"data_file = {data_dir / '.coverage'}\n"
        "parallel = true\n"
        "patch = subprocess\n"  # the CLI's subprocesses and pytest-xdist's workers (coverage >= 7.10)
        "include =\n" + "".join(f"    {s}\n" for s in sources)
    )
    env = dict(os.environ, COVERAGE_RCFILE=str(rc))
    args = pytest_args or [t for t in TESTS if (ROOT / t).exists()]
    command = [sys.executable, "-m", "coverage", "run", "-m", "pytest", "-q", "-p", "no:cacheprovider", *WORKERS, *args]
    code = subprocess.call(command, cwd=ROOT, env=env)
    subprocess.check_call([sys.executable, "-m", "coverage", "combine", "-q"], cwd=ROOT, env=env)
    subprocess.check_call(
        [sys.executable, "-m", "coverage", "json", "-q", "-o", str(data_dir / "coverage.json")], cwd=ROOT, env=env
    )
    return code


def report(data: dict, out: list[str]) -> tuple[float, list[str], dict]:
    files = {str(Path(name).resolve().relative_to(ROOT)): entry for name, entry in data["files"].items()}
    rows = []
    unexplained: list[str] = []
    details: dict[str, list[dict]] = {}
    total_lines = total_run = 0
    for group, paths in MODULES.items():
        for path in paths:
            entry = files.get(path)
            funcs = functions(ROOT / path)
            if entry is None:  # imported by no test: every statement is missing
                import coverage

                analysis = coverage.Coverage(data_file=None).analysis2(str(ROOT / path))
                statements, missing = analysis[1], analysis[3]
            else:
                statements = entry["executed_lines"] + entry["missing_lines"]
                missing = entry["missing_lines"]
            n, run = len(statements), len(statements) - len(missing)
            total_lines, total_run = total_lines + n, total_run + run
            rows.append((group, path, n, run))
            by_function: dict[str, list[int]] = {}
            for line in missing:
                by_function.setdefault(owner(funcs, line), []).append(line)
            executed = set(statements) - set(missing)
            for name, lines in by_function.items():
                key = f"{path}:{name}"
                span = next((f for f in funcs if f.qualname == name), None)
                never = span is not None and not any(span.first < line <= span.last for line in executed)
                if key in NEEDS_DEVICE:
                    reason = f"needs a device: {NEEDS_DEVICE[key]}"
                elif key in GAPS:
                    reason = f"gap: {GAPS[key]}"
                else:
                    reason = "gap: no test of this run executes it" + (" (the body never runs)" if never else "")
                    if never:
                        unexplained.append(key)
                details.setdefault(path, []).append({"function": name, "lines": ranges(lines), "reason": reason})
    width = max(len(p) for _, p, _, _ in rows)
    out.append(f"{'module':<{width}} | {'lines':>5} | {'run':>5} | share")
    out.append(f"{'-' * width}-+-------+-------+------")
    for group, path, n, run in rows:
        out.append(f"{path:<{width}} | {n:>5} | {run:>5} | {run / max(n, 1):5.1%}  ({group})")
    share = total_run / max(total_lines, 1)
    out.append(f"{'GPU side':<{width}} | {total_lines:>5} | {total_run:>5} | {share:5.1%}  (aim {AIM:.0%})")
    out.append("")
    out.append("lines not executed on a CPU, by function:")
    for path, entries in details.items():
        out.append(f"  {path}")
        for e in entries:
            out.append(f"    {e['function']} [{e['lines']}]: {e['reason']}")
    stale = [
        k
        for k in (*NEEDS_DEVICE, *GAPS)
        if not any(k == f"{p}:{e['function']}" for p, es in details.items() for e in es)
    ]
    if stale:
        out.append("")
        out.append("entries whose functions now run in full (remove them): " + ", ".join(stale))
    summary = {
        "share": share,
        "aim": AIM,
        "lines": total_lines,
        "executed": total_run,
        "modules": [{"group": g, "module": p, "lines": n, "executed": r} for g, p, n, r in rows],
        "not_executed": details,
        "unexplained_never_run": unexplained,
    }
    return share, unexplained, summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the table and the lines left as JSON here")
    parser.add_argument("--keep", type=Path, help="keep coverage's data here (default: a temp directory)")
    args, pytest_args = parser.parse_known_args()
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = args.keep or Path(tmp)
        data_dir.mkdir(parents=True, exist_ok=True)
        tests_code = run_tests(data_dir, pytest_args)
        data = json.loads((data_dir / "coverage.json").read_text())
    lines: list[str] = []
    share, unexplained, summary = report(data, lines)
    print("\n".join(lines))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))
    if tests_code != 0:
        print(f"gpu_coverage: the tests failed (pytest exit {tests_code}): the figure counts what ran", file=sys.stderr)
    ok = share >= AIM and not unexplained and tests_code == 0
    if unexplained:
        print(
            "gpu_coverage: functions that never run on a CPU, with no reason: " + ", ".join(unexplained),
            file=sys.stderr,
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
