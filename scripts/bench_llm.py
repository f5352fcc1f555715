#!/usr/bin/env python3
"""Reference LLM runtime vs transformers `generate`: generated tokens/s at batch 1, 4 and 16.

Builds a random-weight Qwen3-VL with the released 2B text shapes (hidden 2048, 16/8 heads of 128,
intermediate 6144, vocab 151936, tied embeddings) but only a few decoder layers, writes it with
save_pretrained, converts its language model with convert_llm, and runs greedy generation of the
same prompts through both in this process: same weights, dtype and thread count, runs interleaved.
Prompts are random text ids of one length (no padding needed); every request generates exactly
--new-tokens tokens (no end id). The time covers prefill and decoding. Weights are random; speed
does not depend on their values. The default dtype is bf16, the released checkpoints' dtype, which
CPUs with AVX512-BF16 or AMX multiply natively (both sides run the same torch kernels for their
linear layers); --dtype fp32 runs both in float32 (slower, and a few minutes longer).

Aim: batch 1 at least as fast as transformers; batch 16 at least 6x the tokens/s of batch 1.

    .venv/bin/python scripts/bench_llm.py [--layers 4] [--prompt-len 64] [--new-tokens 32]
        [--batch-sizes 1 4 16] [--dtype bf16|fp32] [--repeats 3] [--threads N] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from functools import partial
from pathlib import Path

import numpy as np
import torch
from bench_convert import TEXT_2B
from benchutil import time_interleaved
from qwen3vl_trt.common.torch_dtypes import TORCH_DTYPES


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--workdir", type=Path, help="keeps the checkpoints for reruns (default: temp dir)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-llm-") as scratch:
        run(args, args.workdir or Path(scratch))


def write_hf_checkpoint(model_dir: Path, layers: int, dtype: torch.dtype) -> None:
    """A random-weight Qwen3-VL (tiny vision tower, 2B text shapes) in save_pretrained's format."""
    from qwen3vl_trt.qa.tiny import PRESETS, TinySpec, build_config
    from transformers import AutoConfig, AutoModelForImageTextToText

    spec = TinySpec(PRESETS["tiny"].vision, dict(TEXT_2B, num_hidden_layers=layers), tie_word_embeddings=True)
    model_dir.mkdir(parents=True)
    (model_dir / "config.json").write_text(json.dumps(build_config(spec, moe=False)))
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(model_dir))
    model.to(dtype).save_pretrained(model_dir)


def run(args: argparse.Namespace, workdir: Path) -> None:
    from qwen3vl_trt.llm.convert import convert_llm
    from qwen3vl_trt.qa.tiny import ENDOFTEXT_ID
    from qwen3vl_trt.runtime import LLMRequest, ReferenceLLM, SamplingParams
    from transformers import AutoModelForImageTextToText

    torch.set_num_threads(args.threads)
    dtype = TORCH_DTYPES[args.dtype]
    model_dir, llm_dir = workdir / f"hf-{args.layers}l-{args.dtype}", workdir / f"trtllm-{args.layers}l-{args.dtype}"
    if not model_dir.exists():
        print(f"writing a random {args.layers}-layer checkpoint in {model_dir}")
        write_hf_checkpoint(model_dir, args.layers, dtype)
    if not llm_dir.exists():
        convert_llm(model_dir, llm_dir, dtype=args.dtype, progress=False)
    hf = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=dtype).eval()
    reference = ReferenceLLM.from_checkpoint(llm_dir)

    rng = np.random.default_rng(0)
    prompts = rng.integers(0, ENDOFTEXT_ID, size=(max(args.batch_sizes), args.prompt_len))
    new = args.new_tokens

    def transformers_generate(batch: int) -> list[list[int]]:
        ids = torch.from_numpy(prompts[:batch])
        out = hf.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new,
            min_new_tokens=new,  # no early end: both generate the same number of tokens
            do_sample=False,
            pad_token_id=0,
        )
        return out[:, args.prompt_len :].tolist()

    def reference_generate(batch: int) -> list[list[int]]:
        requests = [
            LLMRequest(prompts[i].astype(np.int32), sampling=SamplingParams(max_new_tokens=new)) for i in range(batch)
        ]
        return [r.output_ids for r in reference.generate(requests)]

    pairs = zip(transformers_generate(1)[0], reference_generate(1)[0], strict=True)
    agree = next((i for i, (theirs, ours) in enumerate(pairs) if theirs != ours), new)
    print(
        f"Qwen3-VL 2B text shapes, {args.layers} layers, {args.dtype}, {args.threads} threads; prompts of "
        f"{args.prompt_len} tokens, {new} new tokens each; median of {args.repeats} interleaved runs"
    )
    print(f"  greedy tokens at batch 1: the first {agree} of {new} equal transformers'")
    print(f"  {'batch':>5}  {'transformers tok/s':>18}  {'reference tok/s':>15}  {'reference / transformers':>24}")
    rates: dict[int, tuple[float, float]] = {}
    for batch in args.batch_sizes:
        times = time_interleaved(
            [partial(transformers_generate, batch), partial(reference_generate, batch)], args.warmup, args.repeats
        )
        hf_rate, our_rate = (batch * new / statistics.median(t) for t in times)
        rates[batch] = (hf_rate, our_rate)
        print(f"  {batch:>5}  {hf_rate:>18.1f}  {our_rate:>15.1f}  {our_rate / hf_rate:>23.2f}x")
    small, large = min(rates), max(rates)
    if large != small:
        print(
            f"  batch {large} / batch {small} tokens/s: reference {rates[large][1] / rates[small][1]:.2f}x "
            f"(aim >= 6x), transformers {rates[large][0] / rates[small][0]:.2f}x"
        )


if __name__ == "__main__":
    main()
