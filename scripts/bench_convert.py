#!/usr/bin/env python
"""convert-llm's memory: peak RSS against the largest source shard, on a 2B-size language model.

Writes a synthetic Qwen3-VL checkpoint with the released 2B text shapes (hidden 2048, 28 layers,
16/8 heads of 128, intermediate 6144, vocab 151936, tied embeddings; random bf16 weights, several
shards, no vision weights: the converter never reads them), converts it with `qwen3vl-trt
convert-llm` in a child process and prints the child's peak RSS divided by the largest shard.
Aim: <= 1.5. --moe uses 30B-A3B-like expert shapes with fewer layers instead.

    .venv/bin/python scripts/bench_convert.py [--shard-gb 1.0] [--tp 1] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from qwen3vl_trt.hf.safetensors_io import StreamingWriter, TensorPlan
from qwen3vl_trt.qa.tiny import PRESETS, TinySpec, build_config
from tqdm import tqdm

TEXT_2B = dict(
    hidden_size=2048,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=6144,
    mrope_section=[24, 20, 20],
)
TEXT_MOE = dict(TEXT_2B, num_hidden_layers=3, num_attention_heads=32, num_key_value_heads=4, intermediate_size=6144)
MOE = dict(num_experts=128, moe_intermediate_size=768)
VOCAB = 151936
GiB = 2**30


def text_tensors(text: dict, moe: bool) -> dict[str, tuple[int, ...]]:
    d, hd, layers = text["hidden_size"], text["head_dim"], text["num_hidden_layers"]
    q, kv, inter = text["num_attention_heads"] * hd, text["num_key_value_heads"] * hd, text["intermediate_size"]
    shapes: dict[str, tuple[int, ...]] = {"model.language_model.embed_tokens.weight": (VOCAB, d)}
    for i in range(layers):
        p = f"model.language_model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (d,),
            p + "post_attention_layernorm.weight": (d,),
            p + "self_attn.q_proj.weight": (q, d),
            p + "self_attn.k_proj.weight": (kv, d),
            p + "self_attn.v_proj.weight": (kv, d),
            p + "self_attn.o_proj.weight": (d, q),
            p + "self_attn.q_norm.weight": (hd,),
            p + "self_attn.k_norm.weight": (hd,),
        }
        if moe:
            e, i_moe = MOE["num_experts"], MOE["moe_intermediate_size"]
            shapes |= {
                p + "mlp.gate.weight": (e, d),
                p + "mlp.experts.gate_up_proj": (e, d, 2 * i_moe),
                p + "mlp.experts.down_proj": (e, i_moe, d),
            }
        else:
            shapes |= {
                p + "mlp.gate_proj.weight": (inter, d),
                p + "mlp.up_proj.weight": (inter, d),
                p + "mlp.down_proj.weight": (d, inter),
            }
    shapes["model.language_model.norm.weight"] = (d,)
    return shapes


def write_checkpoint(out: Path, moe: bool, shard_bytes: int) -> list[int]:
    """The synthetic checkpoint; returns its shard sizes in bytes."""
    text = TEXT_MOE if moe else TEXT_2B
    config = build_config(TinySpec(PRESETS["2b-vision"].vision, text, tie_word_embeddings=True), moe)
    if moe:
        config["text_config"] |= MOE
    (out / "config.json").write_text(json.dumps(config, indent=2))
    shapes = text_tensors(config["text_config"], moe)
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        nbytes = int(np.prod(shape)) * 2
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    # One random block, reused: the benchmark measures memory, not numerics.
    block = (torch.randn(8 * 2**20) * 0.02).to(torch.bfloat16)
    weight_map, sizes = {}, []
    total = sum(int(np.prod(s)) * 2 for s in shapes.values())
    with tqdm(total=total, unit="B", unit_scale=True, desc="write synthetic checkpoint") as bar:
        for k, names in enumerate(shards, start=1):
            file = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
            writer = StreamingWriter(out / file, [TensorPlan(n, torch.bfloat16, shapes[n]) for n in names])
            for name in names:
                remaining = int(np.prod(shapes[name]))
                while remaining:
                    n = min(remaining, block.numel())
                    writer.write(name, block[:n])
                    remaining -= n
                    bar.update(2 * n)
            writer.close()
            weight_map |= dict.fromkeys(names, file)
            sizes.append((out / file).stat().st_size)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    return sizes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shard-gb", type=float, default=1.0, help="source shard size (GiB)")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--moe", action="store_true", help="MoE expert shapes (128 experts) instead of the dense 2B")
    ap.add_argument("--keep", type=Path, help="work in this directory and keep it (default: a temp dir, removed)")
    args = ap.parse_args()

    work = args.keep or Path(tempfile.mkdtemp(prefix="bench-convert-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        src, dst = work / "hf", work / "trtllm"
        if not (src / "model.safetensors.index.json").is_file():
            src.mkdir(exist_ok=True)
            sizes = write_checkpoint(src, args.moe, int(args.shard_gb * GiB))
        else:
            sizes = [p.stat().st_size for p in sorted(src.glob("*.safetensors"))]
        cmd = [sys.executable, "-m", "qwen3vl_trt.cli", "convert-llm", "--model", str(src), "--output", str(dst)]
        cmd += ["--tp", str(args.tp), "--force"]
        start = time.perf_counter()
        subprocess.run(cmd, check=True)
        seconds = time.perf_counter() - start
        peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # Linux: KiB
        baseline = subprocess.run(
            [
                sys.executable,
                "-c",
                "import resource, qwen3vl_trt.cli, qwen3vl_trt.llm.convert, torch; "
                "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)",
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        written = sum(p.stat().st_size for p in dst.glob("rank*.safetensors"))
        print(f"source: {len(sizes)} shards, {sum(sizes) / GiB:.2f} GiB, largest {max(sizes) / GiB:.2f} GiB")
        print(
            f"converted: {written / GiB:.2f} GiB in {seconds:.1f} s ({written / GiB / seconds:.2f} GiB/s), tp={args.tp}"
        )
        imports = int(baseline.stdout) / GiB
        print(f"peak RSS of convert-llm: {peak / GiB:.2f} GiB (interpreter + imports alone: {imports:.2f} GiB)")
        print(f"peak RSS / largest shard: {peak / max(sizes):.2f} (aim <= 1.5)")
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
