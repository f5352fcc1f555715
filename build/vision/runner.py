"""Runs an exported vision encoder with ONNX Runtime.

`VisionEncoder(onnx_dir).encode(pixel_values, grid_thw)` takes exactly what the transformers
processor produces and returns the LLM's visual inputs. The grid-dependent inputs come from
vision_metadata, the same module preprocessing uses. `run` takes the per-patch inputs
(contracts.VISION_INPUTS, several requests' concatenated) for either graph variant; the plugin
variant's cu_seqlens are derived from them (metadata.graph_feeds) and its attention nodes run as a
Python custom op (ort_plugin: verification, not serving).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..contracts import (
    DEEPSTACK_EMBEDS,
    IMAGE_EMBEDS,
    PIXEL_VALUES,
    PLUGIN,
    VISION_GRAPH_INPUTS,
    VISION_INPUTS,
    VISION_ONNX_FILE,
    VISION_SIDECAR_FILE,
    contract_sha256,
    vision_graph_contract,
)
from ..dtypes import DTYPE_NAMES
from ..errors import CheckpointError, InputError, Qwen3VLTrtError
from ..fsutil import read_json
from .metadata import check_grid_thw, graph_feeds, num_patches, vision_metadata

# Sidecar entries the runtimes read, with their types; "a.b" is entry b of object a.
_SIDECAR_ENTRIES: dict[str, type] = {
    "graph_variant": str,
    "patch_dim": int,
    "spatial_merge_size": int,
    "num_grid_per_side": int,
    "num_heads": int,
    "out_hidden_size": int,
    "deepstack_count": int,
    "dtype": str,
    "source_checkpoint.path": str,
    "source_checkpoint.config_sha256": str,
}


@dataclass(frozen=True)
class VisionSidecar:
    """What vision_config.json says about an exported encoder."""

    raw: dict

    @classmethod
    def load(cls, onnx_dir: str | os.PathLike[str]) -> VisionSidecar:
        path = Path(onnx_dir) / VISION_SIDECAR_FILE
        raw = read_json(path, f"{onnx_dir} has no {VISION_SIDECAR_FILE}: is it an export-vision output directory?")
        problems = [
            f"'{key}' is not a {kind.__name__}" for key, kind in _SIDECAR_ENTRIES.items() if not _has(raw, key, kind)
        ]
        if raw.get("graph_variant") not in (*VISION_GRAPH_INPUTS, None):
            problems.append(f"graph_variant {raw['graph_variant']!r} is none of {', '.join(VISION_GRAPH_INPUTS)}")
        if raw.get("dtype") not in (*DTYPE_NAMES, None):
            problems.append(f"dtype {raw['dtype']!r} is none of {', '.join(DTYPE_NAMES)}")
        if problems:
            raise CheckpointError(
                f"{path} is not a vision export sidecar this version reads ({'; '.join(problems)}); "
                "export again with `qwen3vl-trt export-vision` (or `qwen3vl-trt build`)"
            )
        return cls(raw)

    @property
    def patch_dim(self) -> int:
        return int(self.raw["patch_dim"])

    @property
    def spatial_merge_size(self) -> int:
        return int(self.raw["spatial_merge_size"])

    @property
    def num_grid_per_side(self) -> int:
        return int(self.raw["num_grid_per_side"])

    @property
    def dtype(self) -> str:
        return str(self.raw["dtype"])

    @property
    def graph_variant(self) -> str:
        return str(self.raw["graph_variant"])

    def contract(self) -> dict[str, list[dict[str, object]]]:
        """The graph's inputs and outputs as this version's contracts define them for this export."""
        return vision_graph_contract(
            self.graph_variant,
            DTYPE_NAMES[self.dtype],
            self.patch_dim,
            int(self.raw["out_hidden_size"]),
            int(self.raw["deepstack_count"]),
        )

    def contract_sha256(self) -> str:
        contract = self.contract()
        return contract_sha256(contract["inputs"] + contract["outputs"])

    def check_source(self, model_dir: Path, config_sha256: str, rebuild: str) -> None:
        """Refuses a model directory whose config.json (its sha256) is not the exported checkpoint's;
        `rebuild` is the command that would make a matching export."""
        source = self.raw["source_checkpoint"]
        if source["config_sha256"] != config_sha256:
            raise CheckpointError(
                f"the vision export was made from the checkpoint {source['path']} (config.json sha256 "
                f"{source['config_sha256'][:12]}), but {model_dir} has config.json sha256 {config_sha256[:12]}: "
                f"pass that checkpoint, or rebuild for this one with `{rebuild}`"
            )


def _has(raw: dict, key: str, kind: type) -> bool:
    value: object = raw
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return isinstance(value, kind) and not isinstance(value, bool)


def _as_numpy(x: Any) -> np.ndarray:
    if hasattr(x, "detach"):  # torch.Tensor, without importing torch here
        x = x.detach().cpu()
        if str(x.dtype) == "torch.bfloat16":
            x = x.float()
        return x.numpy()
    return np.asarray(x)


class VisionEncoder:
    """ONNX Runtime session over an export-vision output directory."""

    def __init__(self, onnx_dir: str | os.PathLike[str], intra_op_threads: int | None = None):
        import onnxruntime as ort

        self.onnx_dir = Path(onnx_dir)
        self.sidecar = VisionSidecar.load(self.onnx_dir)
        if self.sidecar.dtype == "bf16":
            raise Qwen3VLTrtError(
                "ONNX Runtime's CPU provider cannot run the bf16 export; export with --dtype fp32 (or fp16) for ORT, "
                "and build bf16 TensorRT engines from the bf16 ONNX on a GPU host"
            )
        onnx_file = self.onnx_dir / VISION_ONNX_FILE
        if not onnx_file.is_file():
            raise CheckpointError(
                f"{self.onnx_dir} has no {VISION_ONNX_FILE}; export it again with `qwen3vl-trt export-vision`"
            )
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        # Every request batch has its own patch count: ORT's arena and memory patterns, which suit
        # fixed shapes, would keep growing a long-running server by each new shape's buffers.
        options.enable_cpu_mem_arena = False
        options.enable_mem_pattern = False
        if intra_op_threads:
            options.intra_op_num_threads = intra_op_threads
        providers = ["CPUExecutionProvider"]
        if self.sidecar.graph_variant == PLUGIN and self.sidecar.dtype != "fp32":
            raise Qwen3VLTrtError(
                "ONNX Runtime runs the plugin vision export in fp32 only (its attention is a Python custom op), "
                f"this one is {self.sidecar.dtype}: build a TensorRT engine from it "
                "(`qwen3vl-trt build-vision-engine`), or export with --dtype fp32 to check it on ONNX Runtime"
            )
        try:
            if self.sidecar.graph_variant == PLUGIN:
                from .ort_plugin import plugin_session

                self.session = plugin_session(onnx_file, options, providers)
            else:
                self.session = ort.InferenceSession(str(onnx_file), options, providers=providers)
        except Qwen3VLTrtError:
            raise
        except Exception as e:  # ONNX Runtime's own error types: a corrupt graph or external data file
            raise CheckpointError(
                f"ONNX Runtime cannot load {onnx_file} ({str(e).strip().splitlines()[0]}); "
                "export again with `qwen3vl-trt export-vision`"
            ) from e

    def inputs_for(self, pixel_values: Any, grid_thw: Any) -> dict[str, np.ndarray]:
        """The encoder's full input feed for processor outputs; checks them against the contract."""
        pixels = _as_numpy(pixel_values)
        grid = check_grid_thw(_as_numpy(grid_thw), self.sidecar.spatial_merge_size)
        if pixels.ndim != 2 or pixels.shape[1] != self.sidecar.patch_dim:
            raise InputError(
                f"{PIXEL_VALUES.name} must have shape [N, {self.sidecar.patch_dim}], got {list(pixels.shape)}"
            )
        if pixels.shape[0] != num_patches(grid):
            raise InputError(
                f"{PIXEL_VALUES.name} has {pixels.shape[0]} patches but grid_thw {grid.tolist()} "
                f"describes {num_patches(grid)}"
            )
        feeds = {PIXEL_VALUES.name: np.ascontiguousarray(pixels, dtype=np.float32)}
        feeds.update(vision_metadata(grid, self.sidecar.spatial_merge_size, self.sidecar.num_grid_per_side))
        assert set(feeds) == {spec.name for spec in VISION_INPUTS}
        return feeds

    def run(self, feeds: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """Outputs for per-patch inputs (contracts.VISION_INPUTS), of one request or several concatenated."""
        graph_inputs = graph_feeds(feeds, self.sidecar.graph_variant)
        image_embeds, deepstack_embeds = self.session.run([IMAGE_EMBEDS.name, DEEPSTACK_EMBEDS.name], graph_inputs)
        return image_embeds, deepstack_embeds

    def encode(self, pixel_values: Any, grid_thw: Any) -> tuple[np.ndarray, np.ndarray]:
        """(image_embeds [M, D], deepstack_embeds [K, M, D]) for processor outputs."""
        return self.run(self.inputs_for(pixel_values, grid_thw))
