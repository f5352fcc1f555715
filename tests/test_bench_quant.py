"""scripts/bench_quant.py --smoke: the benchmark runs end to end on the tiny checkpoint and prints its figures."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from qwen3vl_trt.common.dtypes import LLM_QUANT_CHOICES

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_quant.py"
SIZE = r"(\d+(?:\.\d+)?) (MiB|GiB)"


@pytest.mark.slow
@pytest.mark.once
def test_smoke_prints_conversion_and_weight_bytes(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--workdir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert re.search(rf"interpreter \+ imports alone: {SIZE} peak RSS", out), out

    # 1. One row per source: time in seconds, peak RSS with its unit, and the ratio to the largest shard.
    conversion = rf"\| {{}} \| {SIZE} \| (\d+\.\d) s \| {SIZE} \| {SIZE} \| (\d+\.\d+)x \|"
    for source in ("block FP8", "bf16 twin"):
        m = re.search(conversion.format(re.escape(source)), out)
        assert m, f"no conversion row for {source}:\n{out}"
        seconds, peak, ratio = float(m[3]), float(m[6]), float(m[8])
        assert seconds >= 0 and peak > 0 and ratio > 0

    # 2. Weight bytes: the sources' language models and an engine checkpoint per mode, against the bf16 one.
    weights = {
        m[1]: (float(m[2]), float(m[4]))
        for m in re.finditer(rf"^\| ((?:source|engine checkpoint)[^|]*?) \| {SIZE} \| (\d+\.\d+)x \|", out, re.M)
    }
    assert weights["engine checkpoint, none (bf16)"][1] == 1.0, out
    assert any(k.startswith("source block FP8") for k in weights) and any(k.startswith("source bf16") for k in weights)
    assert all(nbytes > 0 and ratio > 0 for nbytes, ratio in weights.values())
    for mode in LLM_QUANT_CHOICES:  # every mode has its row
        assert any(k.startswith(f"engine checkpoint, {mode}") for k in weights), out
    assert not list(tmp_path.iterdir()), "the work directory is removed without --keep"
