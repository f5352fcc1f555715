#!/usr/bin/env python
"""convert-llm on block-FP8 checkpoints: time and peak RSS against the bf16 twin, and weight bytes per engine mode.

Writes a random-weight checkpoint with the 8B language model's real layer shapes (hidden 4096, intermediate
12288, 32/8 heads of 128, vocab 151936, untied head; a few layers, a one-block vision tower the converter never
reads), quantizes it to block FP8 as Qwen's -FP8 releases store it (e4m3 weights, float32 scales per 128x128
block, ~1000 MB shards) and writes its dequantized bf16 twin. Then, each conversion in a fresh child process:

1. converts both to a bf16 TensorRT-LLM checkpoint: seconds, peak RSS of the child, and peak RSS divided by the
   source's largest shard (aim: <= 1.5);
2. converts the FP8 checkpoint once per engine precision (--llm-quant: none, int8-wo, int4-wo, fp8)
   and prints the bytes of the rank files, with the source's language-model bytes, against the bf16 engine's.

    .venv/bin/python scripts/bench_quant.py [--layers 2] [--shard-mb 1000] [--repeats 1] [--workdir DIR] [--keep]
    .venv/bin/python scripts/bench_quant.py --smoke      # the default tiny checkpoint, in seconds (the test's run)
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench_convert import GiB
from benchutil import time_interleaved
from qwen3vl_trt.common.dtypes import LLM_QUANT_CHOICES
from qwen3vl_trt.hf.checkpoint import Checkpoint
from qwen3vl_trt.hf.quantization import SCALE_SUFFIX
from qwen3vl_trt.llm import convert
from qwen3vl_trt.qa.quantized import dequantized_twin, quantize_block_fp8
from qwen3vl_trt.qa.tiny import make_tiny_checkpoint

MiB = 2**20
# The 8B language model's layer shapes (Qwen3-VL-8B text_config); the preset supplies hidden 4096 and the vocab.
TEXT_8B = dict(intermediate_size=12288, num_attention_heads=32, num_key_value_heads=8, head_dim=128)
# One vision block (DeepStack taps must name layers of the tower): convert-llm never reads the tower.
VISION_SMALL = dict(depth=1, deepstack_visual_indexes=[0])

# Run in a fresh interpreter per conversion: the same imports as convert-llm, the conversion timed inside it, and
# the child's own peak RSS. No model: the interpreter and imports alone. The peak is VmHWM (this address space's
# high-water mark, KiB), not getrusage's ru_maxrss: Linux carries the parent's high-water mark over the exec into
# ru_maxrss, so a child of this process (several GiB after writing the checkpoints) would report the parent's.
CHILD = """
import json, sys, time
from qwen3vl_trt.pipeline.calibration import convert_calibrated
model, output, quant = sys.argv[1:4]
start = time.perf_counter()
if model != "-":
    convert_calibrated(model, output, quant=quant, force=True, progress=False)
seconds = time.perf_counter() - start
with open("/proc/self/status") as status:
    peak = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))
print(json.dumps({"seconds": seconds, "peak": peak}))
"""


@dataclass
class Run:
    seconds: list[float]
    peak: int = 0  # bytes, the highest over repeats
    error: str | None = None


def size(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / MiB:.1f} MiB"


def child_convert(model: Path | None, output: Path, quant: str, run: Run) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(model or "-"), str(output), quant], capture_output=True, text=True
    )
    if proc.returncode:
        lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
        run.error = lines[-1] if lines else f"exit status {proc.returncode}"
        return
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    run.seconds.append(result["seconds"])
    run.peak = max(run.peak, int(result["peak"]))


def shard_sizes(model: Path) -> list[int]:
    return [(model / s).stat().st_size for s in Checkpoint(model).shard_files]


def language_model_bytes(model: Path) -> int:
    """Bytes on disk of the language model's tensors (embedding, layers, norm, head), block scales included."""
    ckpt = Checkpoint(model)
    names = ckpt.tensor_names(convert.TEXT_PREFIX) + ckpt.tensor_names(convert.LM_HEAD)
    scales = [n + SCALE_SUFFIX for n in ckpt.quantized_tensor_names(convert.TEXT_PREFIX)]
    scales += [n + SCALE_SUFFIX for n in ckpt.quantized_tensor_names(convert.LM_HEAD)]
    return ckpt.tensor_bytes(names + scales)


def rank_bytes(engine: Path) -> int:
    return sum(p.stat().st_size for p in engine.glob("rank*.safetensors"))


def make_sources(root: Path, smoke: bool, layers: int, shard_mb: int) -> tuple[Path, Path, str]:
    """(block-FP8 checkpoint, its bf16 twin, what they are); reused when a kept work dir already has them."""
    fp8, twin = root / "fp8", root / "bf16-twin"
    if smoke:
        what = "the default tiny checkpoint (make-tiny: hidden 64, 5 layers, vocab 151936)"
    else:
        what = (
            f"8B-shaped language model, {layers} layers: hidden 4096, intermediate 12288, 32 heads x 128 with 8 kv "
            "heads, vocab 151936, untied head"
        )
    if (fp8 / "model.safetensors.index.json").is_file() and (twin / "model.safetensors.index.json").is_file():
        return fp8, twin, what
    bf16 = root / "hf"
    if smoke:
        make_tiny_checkpoint(bf16, force=True)
    else:
        text = dict(TEXT_8B, num_hidden_layers=layers)
        make_tiny_checkpoint(
            bf16, preset="8b-vision", text_overrides=text, vision_overrides=VISION_SMALL, shard_mb=shard_mb, force=True
        )
        assert Checkpoint(bf16).info.text.intermediate_size == 12288  # the overrides were taken
    gc.collect()
    quantize_block_fp8(bf16, fp8, shard_mb=shard_mb)
    gc.collect()
    dequantized_twin(fp8, twin, shard_mb=shard_mb)
    shutil.rmtree(bf16)  # the twin is the bf16 reference (the FP8 values, exactly)
    return fp8, twin, what


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=2, help="decoder layers of the 8B-shaped language model")
    ap.add_argument("--shard-mb", type=int, default=1000, help="source shard size (MiB; a tensor larger is alone)")
    ap.add_argument("--repeats", type=int, default=1, help="conversions of each source, interleaved (median time)")
    ap.add_argument("--smoke", action="store_true", help="the default tiny checkpoint instead (seconds; for tests)")
    ap.add_argument("--workdir", type=Path, help="parent of the work directory (default: the system temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory (a later run reuses its checkpoints)")
    args = ap.parse_args()

    name = "bench-quant-smoke" if args.smoke else f"bench-quant-{args.layers}L-{args.shard_mb}mb"
    if args.workdir is not None:
        root = args.workdir / name
        root.mkdir(parents=True, exist_ok=True)
    else:
        root = Path(tempfile.mkdtemp(prefix=name + "-"))
    try:
        start = time.perf_counter()
        fp8, twin, what = make_sources(root, args.smoke, args.layers, args.shard_mb)
        prepared = time.perf_counter() - start
        print(f"source: {what}")
        for label, model in (("block FP8", fp8), ("bf16 twin", twin)):
            sizes = shard_sizes(model)
            print(f"  {label}: {len(sizes)} shards, {size(sum(sizes))}, largest {size(max(sizes))}")

        # 1. Both sources to a bf16 engine checkpoint, interleaved (noise hits both alike).
        baseline = Run([])
        child_convert(None, root / "unused", "none", baseline)
        sources = {"block FP8": fp8, "bf16 twin": twin}
        runs = {label: Run([]) for label in sources}
        engines = {label: root / f"engine-{'fp8' if label == 'block FP8' else 'twin'}-none" for label in sources}
        time_interleaved(
            [
                lambda m=model, e=engines[label], r=runs[label]: child_convert(m, e, "none", r)
                for label, model in sources.items()
            ],
            warmup=0,
            repeats=args.repeats,
        )
        print()
        print(
            f"convert_llm to a bf16 TensorRT-LLM checkpoint, each in a fresh child process, {args.repeats} run(s) "
            f"each (interpreter + imports alone: {size(baseline.peak)} peak RSS; time excludes them):"
        )
        print("| source | largest shard | time | written | peak RSS | peak RSS / largest shard |")
        print("| --- | --- | --- | --- | --- | --- |")
        for label, model in sources.items():
            run, largest = runs[label], max(shard_sizes(model))
            if run.error:
                raise SystemExit(f"converting the {label} checkpoint failed: {run.error}")
            written = rank_bytes(engines[label])
            print(
                f"| {label} | {size(largest)} | {statistics.median(run.seconds):.1f} s | {size(written)} | "
                f"{size(run.peak)} | {run.peak / largest:.2f}x |"
            )
        print("aim: peak RSS <= 1.5x the largest shard")

        # 2. Weight bytes per engine precision, from the FP8 checkpoint ("none" is the conversion above).
        print()
        print(f"weight bytes per --llm-quant mode ({', '.join(LLM_QUANT_CHOICES)}), from the FP8 checkpoint:")
        reference = rank_bytes(engines["block FP8"])
        rows = [
            ("source block FP8, language model (weights + scales)", language_model_bytes(fp8), None),
            ("source bf16 twin, language model", language_model_bytes(twin), None),
            ("engine checkpoint, none (bf16)", reference, runs["block FP8"]),
        ]
        for mode in [m for m in LLM_QUANT_CHOICES if m != "none"]:
            engine, run = root / f"engine-fp8-{mode}", Run([])
            child_convert(fp8, engine, mode, run)
            if run.error:
                print(f"  {mode}: convert_llm refused it: {run.error}")
                continue
            rows.append((f"engine checkpoint, {mode}", rank_bytes(engine), run))
            if not args.keep:
                shutil.rmtree(engine)  # disk: one engine checkpoint at a time
        print("| weights | bytes | / bf16 engine checkpoint | conversion time | conversion peak RSS |")
        print("| --- | --- | --- | --- | --- |")
        for label, nbytes, run in rows:
            seconds, peak = (f"{statistics.median(run.seconds):.1f} s", size(run.peak)) if run else ("-", "-")
            print(f"| {label} | {size(nbytes)} | {nbytes / reference:.2f}x | {seconds} | {peak} |")
        total = time.perf_counter() - start
        print(f"\nbenchmark: {total:.0f} s in all, {prepared:.0f} s of it writing the checkpoints")
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
