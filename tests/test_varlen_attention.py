"""The varlen attention kernel in Triton's CPU interpreter against the per-segment torch SDPA reference.

@triton.jit and triton.language pick interpreter or compiler when they are imported (TRITON_INTERPRET), so the
kernel runs in one child process started with TRITON_INTERPRET=1 (this file as a script): this pytest process, and
every other test module in it, keeps the compiling Triton. The child runs every case once; the tests compare.

Error measure: max |kernel - reference| / max |reference|, the reference in fp32 on the same (rounded) inputs.
Tolerances: fp32 1e-5; fp16 1e-3 (one fp16 step: 9.8e-4); bf16 1.6e-2 (two bf16 steps). The kernel rounds the
softmax weights to the input dtype before the second dot (as flash attention does) and its output once, so its bf16
error is about twice that of torch's CPU SDPA in bf16, which rounds only the output (seeds 1-10 at head_dim 72: at most
3.9e-4 in fp16, 8.3e-3 in bf16). The tests print both errors.
"""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from qwen3vl_trt.plugins.reference import varlen_attention_reference

pytestmark = [pytest.mark.once, pytest.mark.gpu_image]

HEADS = 2
TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1.6e-2}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _segment_lengths(layout: str) -> list[int]:
    if layout == "single_tokens":
        return [1] * 12
    if layout == "one_long":
        # Three query blocks of 128 (the last one partial), several key blocks.
        return [300]
    if layout == "mixed_20":
        generator = torch.Generator().manual_seed(20)
        lengths = torch.randint(1, 97, (20,), generator=generator).tolist()
        lengths[3] = lengths[11] = 1
        return lengths
    raise ValueError(layout)


def _cu_seqlens(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _inputs(lengths: list[int], head_dim: int, dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    tokens = sum(lengths)
    q, k, v = (torch.randn(tokens, HEADS, head_dim, generator=generator).to(dtype) for _ in range(3))
    return {"q": q, "k": k, "v": v, "cu_seqlens": _cu_seqlens(lengths)}


# Segment whose keys and values the isolation cases replace, in the mixed layout.
ISOLATED_SEGMENT = 7


def _cases() -> dict[str, dict[str, torch.Tensor]]:
    cases = {}
    for dtype_name, dtype in DTYPES.items():
        for head_dim in (64, 72):
            for layout in ("single_tokens", "one_long", "mixed_20"):
                cases[f"{layout}-{head_dim}-{dtype_name}"] = _inputs(_segment_lengths(layout), head_dim, dtype, seed=1)
    for head_dim in (80, 128):
        cases[f"mixed_20-{head_dim}-fp16"] = _inputs(_segment_lengths("mixed_20"), head_dim, torch.float16, seed=2)
    for dtype_name in ("fp16", "bf16"):
        base = dict(cases[f"mixed_20-72-{dtype_name}"])
        bounds = base["cu_seqlens"].tolist()
        start, end = bounds[ISOLATED_SEGMENT], bounds[ISOLATED_SEGMENT + 1]
        for name in ("k", "v"):
            changed = base[name].clone()
            changed[start:end] = -3 * changed[start:end] + 1
            base[name] = changed
        cases[f"isolation-72-{dtype_name}"] = base
    return cases


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict]:
    """(inputs, kernel outputs) of every case, the outputs from the interpreter in a child process."""
    directory = tmp_path_factory.mktemp("varlen_interpreted")
    cases = _cases()
    torch.save(cases, directory / "inputs.pt")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), str(directory / "inputs.pt"), str(directory / "outputs.pt")],
        env=env,
        check=True,
        timeout=300,
    )
    return cases, torch.load(directory / "outputs.pt")


def _relative_error(case: dict[str, torch.Tensor], out: torch.Tensor) -> float:
    q, k, v = (case[name].float() for name in ("q", "k", "v"))
    reference = varlen_attention_reference(q, k, v, case["cu_seqlens"])
    return ((out.float() - reference).abs().max() / reference.abs().max()).item()


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("head_dim", [64, 72])
@pytest.mark.parametrize("layout", ["single_tokens", "one_long", "mixed_20"])
def test_kernel_matches_reference(interpreted: tuple[dict, dict], layout: str, head_dim: int, dtype_name: str) -> None:
    cases, outputs = interpreted
    name = f"{layout}-{head_dim}-{dtype_name}"
    out = outputs[name]
    assert out.dtype == DTYPES[dtype_name] and out.shape == cases[name]["q"].shape
    error = _relative_error(cases[name], out)
    case = cases[name]
    torch_error = _relative_error(case, varlen_attention_reference(case["q"], case["k"], case["v"], case["cu_seqlens"]))
    print(f"{name}: kernel {error:.3g}, torch SDPA in {dtype_name} {torch_error:.3g}")
    assert error <= TOLERANCE[DTYPES[dtype_name]]


@pytest.mark.parametrize("head_dim", [80, 128])
def test_optional_head_dims(interpreted: tuple[dict, dict], head_dim: int) -> None:
    cases, outputs = interpreted
    name = f"mixed_20-{head_dim}-fp16"
    assert _relative_error(cases[name], outputs[name]) <= TOLERANCE[torch.float16]


def test_single_token_segments_return_their_values(interpreted: tuple[dict, dict]) -> None:
    # A segment of one token attends only to itself: the output is its value, exactly.
    cases, outputs = interpreted
    for dtype_name in DTYPES:
        name = f"single_tokens-72-{dtype_name}"
        assert torch.equal(outputs[name], cases[name]["v"])


@pytest.mark.parametrize("dtype_name", ["fp16", "bf16"])
def test_segments_are_isolated(interpreted: tuple[dict, dict], dtype_name: str) -> None:
    """Changing one segment's keys and values changes that segment's output and no other bit."""
    cases, outputs = interpreted
    original = outputs[f"mixed_20-72-{dtype_name}"]
    changed = outputs[f"isolation-72-{dtype_name}"]
    bounds = cases[f"isolation-72-{dtype_name}"]["cu_seqlens"].tolist()
    start, end = bounds[ISOLATED_SEGMENT], bounds[ISOLATED_SEGMENT + 1]
    assert torch.equal(original[:start], changed[:start])
    assert torch.equal(original[end:], changed[end:])
    assert not torch.equal(original[start:end], changed[start:end])
    assert _relative_error(cases[f"isolation-72-{dtype_name}"], changed) <= TOLERANCE[DTYPES[dtype_name]]


def test_reference_is_per_segment_sdpa() -> None:
    """The reference against a dense softmax with a block-diagonal mask (what the portable ONNX computes)."""
    case = _inputs([5, 1, 9], 72, torch.float32, seed=3)
    q, k, v, cu_seqlens = case["q"], case["k"], case["v"], case["cu_seqlens"]
    segment = torch.repeat_interleave(torch.arange(3), torch.diff(cu_seqlens))
    scores = torch.einsum("nhd,mhd->hnm", q, k) / math.sqrt(72)
    scores = scores.masked_fill(segment[:, None] != segment[None, :], float("-inf"))
    dense = torch.einsum("hnm,mhd->nhd", scores.softmax(-1), v)
    torch.testing.assert_close(varlen_attention_reference(q, k, v, cu_seqlens), dense, rtol=1e-5, atol=1e-6)
    half = varlen_attention_reference(q.half(), k.half(), v.half(), cu_seqlens)
    assert half.dtype == torch.float16


def test_package_exports_the_entry_point_not_the_module() -> None:
    import types

    from qwen3vl_trt import plugins
    from qwen3vl_trt.plugins import varlen_attention
    from qwen3vl_trt.plugins.varlen_kernel import varlen_attention as kernel_entry

    assert not isinstance(varlen_attention, types.ModuleType) and varlen_attention is kernel_entry
    with pytest.raises(AttributeError):
        plugins.no_such_name  # noqa: B018


def test_entry_point_rejects_bad_inputs() -> None:
    from qwen3vl_trt.plugins import varlen_attention

    case = _inputs([4, 4], 72, torch.float16, seed=4)
    q, k, v, cu_seqlens = case["q"], case["k"], case["v"], case["cu_seqlens"]
    with pytest.raises(ValueError, match="one dtype"):
        varlen_attention(q, k.float(), v, cu_seqlens, 4)
    with pytest.raises(ValueError, match="int32"):
        varlen_attention(q, k, v, cu_seqlens.long(), 4)
    with pytest.raises(ValueError, match="head_dim"):
        varlen_attention(q[..., :48], k[..., :48], v[..., :48], cu_seqlens, 4)
    with pytest.raises(ValueError, match="shape"):
        varlen_attention(q, k[:4], v, cu_seqlens, 4)


def _run_cases(inputs_path: str, outputs_path: str) -> None:
    """Child process (TRITON_INTERPRET=1): the kernel on every case, at its shipped tile configuration."""
    from qwen3vl_trt.plugins.varlen_kernel import varlen_attention

    cases = torch.load(inputs_path)
    outputs = {}
    for name, case in cases.items():
        longest = int(torch.diff(case["cu_seqlens"]).max())
        outputs[name] = varlen_attention(case["q"], case["k"], case["v"], case["cu_seqlens"], longest)
    torch.save(outputs, outputs_path)


if __name__ == "__main__":
    _run_cases(sys.argv[1], sys.argv[2])
