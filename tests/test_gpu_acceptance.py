"""scripts/gpu_acceptance.sh, what a GPU host runs first: here (no GPU, no TensorRT) every row is SKIPPED with its
reason, the table and acceptance.json say so, and the exit code is the documented 3; the verdict rules hold."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from qwen3vl_trt.qa.acceptance import (
    EXIT_FAILED,
    EXIT_PASSED,
    EXIT_SKIPPED,
    FAIL,
    PASS,
    SKIPPED,
    Acceptance,
    Report,
    Row,
)

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.once

CHECKS = [
    "varlen kernel vs per-segment SDPA",
    "varlen kernel vs flash-attn varlen",
    "nvImageCodec decode + GPU resize vs Pillow + CPU resize",
    "weight-only checkpoint layout + the build's hook vs TensorRT-LLM's quantizer",
    *[
        f"{check} ({name})"
        for name in ("dense", "moe")
        for check in (
            "qwen3vl-trt build, every stage",
            "vision engine (plugin, bf16) vs transformers tower fp32",
            *(["build --cache: a miss builds the engines, a hit links them and is served"] if name == "dense" else []),
            "serve the GPU repository",
            "served tokens vs transformers greedy, text only",
            "served tokens vs transformers greedy, one JPEG",
            "served tokens vs transformers greedy, an H.264 video",
            "serve's warm-up through every model, then the first request against the next ten",
            "the same requests at the batch lines' priority get the same tokens",
            "the tokens ensemble streams the engine's ids, decoded by the client as the text ensemble",
            "top_logprobs from the engine's generation logits vs transformers' log-softmax",
            "a repeated image: a visual cache hit, no decode, no vision encoder",
            "guided decoding on the engine: a json_schema answer and a required tool call",
            "logit bias, presence penalty and log probs on the engine",
            "metrics published; a killed vision_encoder stub comes back",
            "a stop lets a stream in flight finish",
            "the vision pool: a member and a language replica (--role language) answer as the colocated",
        )
    ],
    *[
        f"{check} ({name})"
        for name, served in (
            *[
                (f"block-FP8 {model}, --llm-quant {mode}", "served tokens vs transformers greedy on the bf16 twin")
                for model, modes in (
                    (
                        "dense",
                        ("none", "int8-wo", "int4-wo", "fp8", "fp8 --kv-cache-dtype fp8", "none --kv-cache-dtype int8"),
                    ),
                    ("MoE", ("int8-wo", "fp8")),
                )
                for mode in modes
            ],
            ("dense, --llm-dtype fp32", "KV-cache reuse and chunked context off; served tokens vs transformers greedy"),
            (
                "dense, max_num_tokens 128",
                "a prompt longer than max_num_tokens, prefilled in chunks; served tokens vs transformers greedy",
            ),
            ("dense, tp 2", "served tokens vs transformers greedy"),
        )
        for check in ("qwen3vl-trt build, every stage", served)
    ],
]


def test_on_a_cpu_machine_every_row_is_skipped_with_its_reason(tmp_path):
    result = subprocess.run(
        [str(ROOT / "scripts" / "gpu_acceptance.sh"), "--output", str(tmp_path / "out"), "--work", str(tmp_path / "w")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == EXIT_SKIPPED, result.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "acceptance.json").read_text())
    assert report["exit_code"] == EXIT_SKIPPED and report["counts"] == {PASS: 0, FAIL: 0, SKIPPED: len(CHECKS)}
    rows = report["rows"]
    assert len(rows) == len(CHECKS)
    for row, check in zip(rows, CHECKS, strict=True):
        assert row["check"].startswith(check) and row["status"] == SKIPPED and row["limit"], row
        assert "no CUDA device is visible" in row["detail"] or row["detail"] == "the repository was not served", row
    assert "tensorrt is not importable" in rows[4]["detail"] and "tensorrt_llm is not importable" in rows[4]["detail"]
    assert all("(it needs 2)" in row["detail"] for row in rows[-2:])  # tp 2
    # Every model the rows build has grouped-query attention, as every release: with as many key/value heads as query
    # heads TensorRT-LLM's attention reads the fused qkv interleaved per head (build/qa/acceptance.py, QUANT_TEXT).
    configs = sorted((tmp_path / "w").glob("tiny-*/config.json"))
    assert len(configs) == 8  # dense, MoE, and the block-FP8 dense and MoE with their bf16 and twin checkpoints
    for config in configs:
        text = json.loads(config.read_text())["text_config"]
        assert text["num_attention_heads"] > text["num_key_value_heads"], config
    # The table: a header, a rule, one line per row, then the reasons.
    lines = result.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("check "))
    assert [cell.strip() for cell in lines[header].split("|")] == ["check", "status", "figure", "limit"]
    assert set(lines[header + 1]) <= {"-", "+"}
    table = lines[header + 2 : header + 2 + len(CHECKS)]
    assert all(" | SKIPPED | " in line for line in table)
    assert "notes:" in lines and f"exit code {EXIT_SKIPPED}" in result.stdout


def test_verdicts_and_exit_codes():
    report = Report(rows=[Row("a", PASS), Row("b", SKIPPED)])
    assert report.exit_code == EXIT_SKIPPED
    report.rows.append(Row("c", FAIL))
    assert report.exit_code == EXIT_FAILED
    assert Report(rows=[Row("a", PASS)]).exit_code == EXIT_PASSED


def test_a_row_that_raises_fails_and_the_run_goes_on(tmp_path):
    acceptance = Acceptance(tmp_path, log=lambda _line: None)

    def broken() -> tuple[bool, str]:
        raise RuntimeError("engine would not load")

    failed = acceptance.row("broken", "works", [], broken)
    passed = acceptance.row("fine", "works", [], lambda: (True, "1.0e-3"))
    low = acceptance.row("over its limit", "<= 1e-3", [], lambda: (False, "2.0e-3"))
    skipped = acceptance.row("needs a GPU", "works", [lambda: "no GPU here"], lambda: (True, ""))
    assert (failed.status, failed.detail) == (FAIL, "RuntimeError: engine would not load")
    assert (passed.status, passed.figure) == (PASS, "1.0e-3")
    assert low.status == FAIL and (skipped.status, skipped.detail) == (SKIPPED, "no GPU here")
    assert acceptance.report.exit_code == EXIT_FAILED
