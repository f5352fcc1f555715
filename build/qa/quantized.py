"""Quantized test checkpoints made the way Qwen's -FP8 releases store them, and their dequantized twins.

`quantize_block_fp8` turns a bf16 checkpoint (make_tiny_checkpoint's) into a block-FP8 one: every linear
weight of the language model not in modules_to_not_convert becomes e4m3 [N, K] with float32
`weight_scale_inv` [ceil(N/128), ceil(K/128)] (each block's amax / 448: DeepSeek-V3's and Qwen's
recipe), `quantization_config` goes to config.json's top level with every module left unquantized
named in modules_to_not_convert (the vision tower's linears, the MoE routers, embed_tokens, lm_head), and
the MoE experts are stored one nn.Linear per expert (`mlp.experts.{e}.gate_proj.weight`, ...), the
layout vLLM's per-expert mapping loads block scales from (its fused path has none). The releases' scales
are bf16 or float32 (read from the headers); both are made here. `dequantized_twin` writes the bf16
checkpoint that the FP8 one stands for (experts fused again, as the bf16 releases store them): the
reference for what transformers cannot load on a CPU.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file

from ..common.fsutil import atomic_output_dir
from ..hf.checkpoint import INDEX_FILE, Checkpoint
from ..hf.quantization import SCALE_SUFFIX, dequantize_block_fp8
from .tiny import _write_shards

E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448
BLOCK = (128, 128)
TEXT_PREFIX = "model.language_model."
VISUAL_PREFIX = "model.visual."


def _linear_modules(state: dict[str, torch.Tensor]) -> list[str]:
    """Module names of the 2-D weights (nn.Linear and the embeddings), as modules_to_not_convert names them."""
    return sorted(n[: -len(".weight")] for n, t in state.items() if n.endswith(".weight") and t.ndim == 2)


def _quantized_modules(modules: list[str], vision: bool) -> list[str]:
    """The language model's projections (not its MoE routers, `mlp.gate`, nor the embedding or head), and the
    vision tower's linears when asked: what the releases quantize, and a tower quantized for the tests."""
    text = [m for m in modules if m.startswith(TEXT_PREFIX) and m.endswith("_proj")]
    tower = [m for m in modules if m.startswith(VISUAL_PREFIX) and not m.endswith("pos_embed")] if vision else []
    return text + tower


def quantize_weight(weight: torch.Tensor, block: tuple[int, int] = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, float32 scale_inv) of a [N, K] weight: each block scaled by its amax / 448."""
    n, k = weight.shape
    bn, bk = block
    rows, cols = -(-n // bn), -(-k // bk)
    padded = torch.zeros(rows * bn, cols * bk, dtype=torch.float32)
    padded[:n, :k] = weight.float()
    blocks = padded.view(rows, bn, cols, bk)
    scale = blocks.abs().amax(dim=(1, 3)) / E4M3_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (blocks / scale[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).view(rows * bn, cols * bk)[:n, :k]
    return q.to(torch.float8_e4m3fn).contiguous(), scale


def _split_experts(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """A fused released expert tensor ([E, in, out], transformers 4.x's layout) as per-expert nn.Linear weights."""
    prefix = name[: -len("gate_up_proj")] if name.endswith("gate_up_proj") else name[: -len("down_proj")]
    out: dict[str, torch.Tensor] = {}
    for e, w in enumerate(tensor.transpose(1, 2)):  # [out, in] per expert
        if name.endswith("gate_up_proj"):
            gate, up = w.chunk(2, dim=0)
            out[f"{prefix}{e}.gate_proj.weight"], out[f"{prefix}{e}.up_proj.weight"] = gate, up
        else:
            out[f"{prefix}{e}.down_proj.weight"] = w
    return out


def _state(model_dir: Path) -> dict[str, torch.Tensor]:
    ckpt = Checkpoint(model_dir)
    state: dict[str, torch.Tensor] = {}
    for shard in ckpt.shard_files:
        state.update(load_file(str(model_dir / shard)))
    return state


def _copy_side_files(src: Path, dst: Path) -> None:
    for path in src.iterdir():
        if path.is_file() and not path.name.endswith(".safetensors") and path.name not in (INDEX_FILE, "config.json"):
            shutil.copy2(path, dst / path.name)


def quantize_block_fp8(
    model: str | os.PathLike[str],
    output: str | os.PathLike[str],
    scale_dtype: torch.dtype = torch.float32,
    vision: bool = False,
    shard_mb: int = 20,
    force: bool = False,
) -> Path:
    """Writes the block-FP8 checkpoint of a bf16 one (its vision tower too if `vision`) and returns its directory."""
    src = Path(model)
    config = json.loads((src / "config.json").read_text())
    state: dict[str, torch.Tensor] = {}
    for name, tensor in _state(src).items():
        if name.startswith(TEXT_PREFIX) and name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            state.update(_split_experts(name, tensor))
        else:
            state[name] = tensor
    modules = _linear_modules(state)
    quantized = _quantized_modules(modules, vision)
    for module in quantized:
        q, scale = quantize_weight(state[module + ".weight"])
        state[module + ".weight"], state[module + ".weight" + SCALE_SUFFIX] = q, scale.to(scale_dtype)
    config["quantization_config"] = {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": list(BLOCK),
        "modules_to_not_convert": sorted(set(modules) - set(quantized)),
    }
    with atomic_output_dir(output, force=force) as tmp:
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        _copy_side_files(src, tmp)
        _write_shards(state, tmp, shard_mb * 2**20)
    return Path(output)


def dequantized_twin(
    model: str | os.PathLike[str], output: str | os.PathLike[str], shard_mb: int = 20, force: bool = False
) -> Path:
    """Writes the bf16 checkpoint a block-FP8 one stands for (weights dequantized in float32 and rounded
    once, experts fused in the released [E, in, out] layout) and returns its directory."""
    src = Path(model)
    config = json.loads((src / "config.json").read_text())
    block = tuple(config.pop("quantization_config")["weight_block_size"])
    raw = _state(src)
    state: dict[str, torch.Tensor] = {}
    for name, tensor in raw.items():
        if name.endswith(SCALE_SUFFIX):
            continue
        if tensor.dtype == torch.float8_e4m3fn:
            tensor = dequantize_block_fp8(tensor, raw[name + SCALE_SUFFIX], (block[0], block[1]))
        state[name] = tensor.to(torch.bfloat16)
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for name in [n for n in state if ".mlp.experts." in n]:
        prefix, rest = name.split(".mlp.experts.")
        e, projection = rest.split(".", 1)
        experts.setdefault(prefix, {}).setdefault(int(e), {})[projection] = state.pop(name)
    for prefix, by_expert in experts.items():
        ordered = [by_expert[e] for e in sorted(by_expert)]
        gate_up = [torch.cat([w["gate_proj.weight"], w["up_proj.weight"]]).T for w in ordered]  # [in, 2I]
        state[f"{prefix}.mlp.experts.gate_up_proj"] = torch.stack(gate_up).contiguous()
        state[f"{prefix}.mlp.experts.down_proj"] = torch.stack([w["down_proj.weight"].T for w in ordered]).contiguous()
    with atomic_output_dir(output, force=force) as tmp:
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        _copy_side_files(src, tmp)
        _write_shards(state, tmp, shard_mb * 2**20)
    return Path(output)
