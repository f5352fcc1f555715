"""Quantized Hugging Face checkpoints: the ones qwen3vl-trt reads, refusal by name of the rest, and
their exact dequantization.

Qwen's FP8 releases (`Qwen/Qwen3-VL-*-FP8`) quantize the language model's linear layers to
fine-grained block FP8: `quantization_config = {quant_method: "fp8", activation_scheme: "dynamic",
weight_block_size: [128, 128], modules_to_not_convert: [...]}`; each quantized linear stores `weight`
as F8_E4M3 [N, K] and `weight_scale_inv` [ceil(N/bn), ceil(K/bk)] (the dequantized weight is each
block's values times its scale). Every reader of the checkpoint sees such a weight dequantized, in
float32 (checkpoint.Checkpoint.locate), so every stage accepts these checkpoints as it accepts bf16.
The arithmetic is transformers' (`integrations/finegrained_fp8.py`, Fp8Dequantize._dequantize_one:
float32 values times float32 scales, then the model dtype), bit for bit where the shape is a multiple
of the block; at ragged edges (which transformers refuses) the last block row/column is partial.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import CheckpointError, UnsupportedModelError

if TYPE_CHECKING:
    import torch

    from .safetensors_io import TensorLocation

FP8_METHOD = "fp8"
SCALE_SUFFIX = "_scale_inv"  # weight -> weight_scale_inv
FP8_TAG = "F8_E4M3"  # safetensors' dtype tag of the quantized weights

# transformers' quant_method values (utils/quantization_config.py, QuantizationMethod) and what they are,
# for a refusal that names the method.
_OTHER_METHODS = {
    "awq": "AWQ",
    "gptq": "GPTQ",
    "bitsandbytes": "bitsandbytes (4-/8-bit)",
    "compressed-tensors": "compressed-tensors (llm-compressor)",
    "fbgemm_fp8": "FBGEMM FP8",
    "torchao": "torchao",
    "hqq": "HQQ",
    "quanto": "Quanto",
    "eetq": "EETQ",
    "aqlm": "AQLM",
    "vptq": "VPTQ",
    "higgs": "HIGGS",
    "bitnet": "BitNet",
    "spqr": "SpQR",
    "fp_quant": "FP-Quant",
    "auto-round": "AutoRound",
    "mxfp4": "MXFP4",
    "modelopt": "NVIDIA ModelOpt",
}


@dataclass(frozen=True)
class BlockFP8:
    """A checkpoint's block-FP8 quantization, as its config.json declares it."""

    block: tuple[int, int]  # (rows, columns) of the weight one scale covers
    activation_scheme: str
    modules_to_not_convert: tuple[str, ...]
    method: str = FP8_METHOD

    def describe(self) -> dict[str, Any]:
        return {
            "method": f"{self.method} (block FP8, e4m3)",
            "block_size": list(self.block),
            "activation_scheme": self.activation_scheme,
            "modules_to_not_convert": list(self.modules_to_not_convert),
        }


def read_quantization(config: dict) -> BlockFP8 | None:
    """The checkpoint's quantization from config.json (top level, where transformers writes it, or
    text_config), None when it has none; UnsupportedModelError naming any other method."""
    declared = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config")
    if not declared:
        return None
    if not isinstance(declared, dict):
        raise CheckpointError("config.json: quantization_config must be an object")
    method = str(declared.get("quant_method", "")).lower()
    if method != FP8_METHOD:
        what = _OTHER_METHODS.get(method, "a quantization method")
        raise UnsupportedModelError(
            f"config.json declares quant_method {method or '(none)'!r} ({what}), which qwen3vl-trt does not read: "
            "it reads bf16/fp16/fp32 checkpoints and block-FP8 ones (quant_method 'fp8' with weight_block_size, "
            "as Qwen's -FP8 releases); build from the unquantized release and choose the engine's precision with "
            "--llm-quant"
        )
    block = declared.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise UnsupportedModelError(
            f"config.json: an fp8 quantization_config without a [rows, columns] weight_block_size (got {block!r}) "
            "is per-tensor FP8, which qwen3vl-trt does not read; it reads block FP8 as Qwen's -FP8 releases store it"
        )
    scheme = str(declared.get("activation_scheme", "dynamic"))
    if scheme != "dynamic":
        raise UnsupportedModelError(
            f"config.json: fp8 activation_scheme {scheme!r} carries static activation scales, which qwen3vl-trt "
            "does not read; it reads the dynamic scheme of Qwen's -FP8 releases"
        )
    fmt = str(declared.get("fmt", "e4m3"))
    if fmt != "e4m3":
        raise UnsupportedModelError(f"config.json: fp8 fmt {fmt!r} is not read; block FP8 weights must be e4m3")
    excluded = declared.get("modules_to_not_convert") or ()
    return BlockFP8((block[0], block[1]), scheme, tuple(str(m) for m in excluded))


def scale_grid(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """The scale tensor's shape for a weight of `shape` ([..., N, K]): one scale per block, ragged edges included."""
    *lead, n, k = shape
    return (*lead, -(-n // block[0]), -(-k // block[1]))


def dequantize_block_fp8(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], row_offset: int = 0
) -> torch.Tensor:
    """float32 [..., n, K] from e4m3 rows [..., n, K] and the scales of the blocks they lie in
    ([..., S, ceil(K/bk)], the first scale row being the block of row `row_offset`): each value times
    its block's scale, in float32 as transformers computes it."""
    import torch

    bn, bk = block
    n, k = weight.shape[-2:]
    rows = (torch.arange(n, device=weight.device) + row_offset) // bn - row_offset // bn
    scales = scale_inv.to(torch.float32).index_select(-2, rows)  # [..., n, ceil(K/bk)]
    scales = scales.repeat_interleave(bk, dim=-1)[..., :k]
    return weight.to(torch.float32) * scales


@dataclass(frozen=True)
class BlockFP8Location:
    """A block-FP8 weight on disk read as float32 rows (dim 0; for [E, N, K] expert stacks, experts)
    with its scales, for streaming conversion: a chunk reads its rows and their blocks' scales only."""

    weight: TensorLocation
    scale: TensorLocation
    block: tuple[int, int]

    @property
    def shape(self) -> tuple[int, ...]:
        return self.weight.shape

    @property
    def row_bytes(self) -> int:
        """Bytes of one row as read (float32): what bounds a chunk's memory."""
        return self.weight.row_bytes * 4

    def read_rows(self, start: int, stop: int) -> torch.Tensor:
        if len(self.shape) == 2:
            bn = self.block[0]
            scales = self.scale.read_rows(start // bn, -(-stop // bn))
            return dequantize_block_fp8(self.weight.read_rows(start, stop), scales, self.block, start)
        return dequantize_block_fp8(self.weight.read_rows(start, stop), self.scale.read_rows(start, stop), self.block)


def check_scale_shape(name: str, weight_shape: tuple[int, ...], scale_shape: tuple[int, ...], q: BlockFP8) -> None:
    want = scale_grid(weight_shape, q.block)
    if tuple(scale_shape) != want:
        raise CheckpointError(
            f"tensor '{name}{SCALE_SUFFIX}' has shape {list(scale_shape)}; a {list(weight_shape)} weight in "
            f"{q.block[0]}x{q.block[1]} blocks needs {list(want)}"
        )


def scale_names(names: Iterable[str]) -> set[str]:
    """The names among `names` that are block scales rather than tensors of the model."""
    return {n for n in names if n.endswith("weight" + SCALE_SUFFIX)}
