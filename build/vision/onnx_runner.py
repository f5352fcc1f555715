"""Runs an exported vision encoder with ONNX Runtime.

`OnnxVisionRunner(onnx_dir).encode(pixel_values, grid_thw)` takes exactly what the transformers
processor produces and returns the LLM's visual inputs. The grid-dependent inputs come from
vision_metadata, the same module preprocessing uses. `run` takes the per-patch inputs
(contracts.VISION_INPUTS, several requests' concatenated) for either graph variant; the plugin
variant's cu_seqlens are derived from them (metadata.graph_feeds) and its attention nodes run as a
Python custom op (ort_plugin: verification, not serving).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from ..common.contracts import DEEPSTACK_EMBEDS, IMAGE_EMBEDS, PIXEL_VALUES, PLUGIN, VISION_INPUTS, VISION_ONNX_FILE
from ..errors import CheckpointError, InputError, Qwen3VLTrtError
from .metadata import check_grid_thw, graph_feeds, num_patches, vision_metadata
from .sidecar import VisionSidecar


def _as_numpy(x: Any) -> np.ndarray:
    if hasattr(x, "detach"):  # torch.Tensor, without importing torch here
        x = x.detach().cpu()
        if str(x.dtype) == "torch.bfloat16":
            x = x.float()
        return x.numpy()
    return np.asarray(x)


class OnnxVisionRunner:
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
