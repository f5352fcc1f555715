"""The vision stage's sidecar files, each one class that writes it and reads it back.

`VisionSidecar` is vision_config.json beside an ONNX export (what was exported from which checkpoint,
its graph contract and the tower's sizes); `VisionEngineSidecar` is vision_engine.json beside a
TensorRT engine (the TensorRT, GPU and `VisionEngineProfile` it was built for, its contract hash).
The file names are contracts.VISION_SIDECAR_FILE and contracts.VISION_ENGINE_SIDECAR_FILE. Readers
check the entries they use, so a damaged or foreign file is refused with the command that rewrites it.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from .. import __version__
from ..common.contracts import (
    CU_SEQLENS,
    MAX_SEQLEN_CARRIER,
    PIXEL_VALUES,
    PLUGIN,
    VISION_ENGINE_FILE,
    VISION_ENGINE_SIDECAR_FILE,
    VISION_GRAPH_INPUTS,
    VISION_ONNX_DATA_FILE,
    VISION_ONNX_FILE,
    VISION_SIDECAR_FILE,
    contract_sha256,
    vision_graph_contract,
)
from ..common.dtypes import DTYPE_NAMES
from ..common.fsutil import json_entry, read_json
from ..errors import CheckpointError, LimitsError
from ..hf.checkpoint import Checkpoint

EXPORT_FORMAT_VERSION = 1
ENGINE_FORMAT_VERSION = 1
# Parts of the export computed in fp32 whatever its dtype (vision.model).
FP32_ISLANDS = ("rope", "layernorm", "softmax", "pos_embed")


def _write(path: Path, record: Mapping[str, Any]) -> Path:
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path


def _has(raw: Mapping[str, Any], key: str, kind: type) -> bool:
    value: object = raw
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return isinstance(value, kind) and not isinstance(value, bool)


# vision_config.json entries the runtimes read, with their types; "a.b" is entry b of object a.
_EXPORT_ENTRIES: dict[str, type] = {
    "graph_variant": str,
    "onnx_file": str,
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
    """vision_config.json of an exported encoder; `raw` is the file's content."""

    raw: dict[str, Any]

    @classmethod
    def of_export(
        cls,
        ckpt: Checkpoint,
        dtype: str,
        variant: str,
        weights_sha256: str,
        opset: int,
        attention_plugin: Mapping[str, object] | None,
        exported_with: Mapping[str, str],
    ) -> VisionSidecar:
        """The sidecar of an export of ckpt's tower in `dtype` (fp32|fp16|bf16) as graph `variant`; the
        plugin variant names its attention node (attention_plugin), exported_with the exporting packages."""
        cfg = ckpt.info.vision
        contract = vision_graph_contract(
            variant, DTYPE_NAMES[dtype], cfg.patch_dim, cfg.out_hidden_size, len(cfg.deepstack_visual_indexes)
        )
        return cls(
            {
                "format_version": EXPORT_FORMAT_VERSION,
                "graph_variant": variant,
                **({"attention_plugin": dict(attention_plugin)} if attention_plugin is not None else {}),
                "onnx_file": VISION_ONNX_FILE,
                "external_data_file": VISION_ONNX_DATA_FILE,
                "opset": opset,
                "dtype": dtype,
                "fp32_islands": list(FP32_ISLANDS),
                **contract,
                "patch_dim": cfg.patch_dim,
                "patch_size": cfg.patch_size,
                "temporal_patch_size": cfg.temporal_patch_size,
                "spatial_merge_size": cfg.spatial_merge_size,
                "num_grid_per_side": cfg.num_grid_per_side,
                "depth": cfg.depth,
                "hidden_size": cfg.hidden_size,
                "num_heads": cfg.num_heads,
                "head_dim": cfg.head_dim,
                "out_hidden_size": cfg.out_hidden_size,
                "deepstack_count": len(cfg.deepstack_visual_indexes),
                "deepstack_visual_indexes": list(cfg.deepstack_visual_indexes),
                "source_checkpoint": {
                    "path": str(ckpt.path.absolute()),
                    "model_type": ckpt.info.model_type,
                    "size": ckpt.info.size_name,
                    "config_sha256": ckpt.config_sha256(),
                    "visual_weights_sha256": weights_sha256,
                },
                "exported_with": {"qwen3vl_trt": __version__, **exported_with},
            }
        )

    def with_verification(self, verification: Mapping[str, object]) -> VisionSidecar:
        """This sidecar recording a parity check (its `max_rel_error` is what the build manifest shows)."""
        return replace(self, raw={**self.raw, "verification": dict(verification)})

    def write(self, directory: str | os.PathLike[str]) -> Path:
        return _write(Path(directory) / VISION_SIDECAR_FILE, self.raw)

    @classmethod
    def load(cls, onnx_dir: str | os.PathLike[str]) -> VisionSidecar:
        path = Path(onnx_dir) / VISION_SIDECAR_FILE
        raw = read_json(path, f"{onnx_dir} has no {VISION_SIDECAR_FILE}: is it an export-vision output directory?")
        problems = [
            f"'{key}' is not a {kind.__name__}" for key, kind in _EXPORT_ENTRIES.items() if not _has(raw, key, kind)
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
    def onnx_file(self) -> str:
        return str(self.raw["onnx_file"])

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
    def num_heads(self) -> int:
        return int(self.raw["num_heads"])

    @property
    def dtype(self) -> str:
        return str(self.raw["dtype"])

    @property
    def graph_variant(self) -> str:
        return str(self.raw["graph_variant"])

    @property
    def source_checkpoint(self) -> dict[str, Any]:
        return dict(self.raw["source_checkpoint"])

    @property
    def max_rel_error(self) -> float | None:
        """The parity check's max relative error against transformers, None where the export was not verified."""
        verification = self.raw.get("verification")
        return verification.get("max_rel_error") if isinstance(verification, dict) else None

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

    def features_digest(self) -> str:
        """What the tower's features are made from, hashed: its weights and config (the source checkpoint's digests),
        the graph's contract and variant, and its dtype. Two exports with one digest encode an image alike."""
        source = self.source_checkpoint
        parts = [source.get("visual_weights_sha256"), source.get("config_sha256"), self.contract_sha256()]
        return hashlib.sha256(json.dumps([*parts, self.graph_variant, self.dtype]).encode()).hexdigest()[:32]

    def records_this_contract(self) -> bool:
        """Whether the inputs and outputs the file records are this version's contract for the export."""
        recorded = [*self.raw.get("inputs", []), *self.raw.get("outputs", [])]
        return contract_sha256(recorded) == self.contract_sha256()

    def check_source(self, model_dir: Path, config_sha256: str, rebuild: str) -> None:
        """Refuses a model directory whose config.json (its sha256) is not the exported checkpoint's;
        `rebuild` is the command that would make a matching export."""
        source = self.source_checkpoint
        if source["config_sha256"] != config_sha256:
            raise CheckpointError(
                f"the vision export was made from the checkpoint {source['path']} (config.json sha256 "
                f"{source['config_sha256'][:12]}), but {model_dir} has config.json sha256 {config_sha256[:12]}: "
                f"pass that checkpoint, or rebuild for this one with `{rebuild}`"
            )


@dataclass(frozen=True)
class VisionEngineProfile:
    """The batch shapes an engine accepts: patches of all images of a run, and its attention segments
    (images; a video counts once per temporal patch). TensorRT tunes for opt: one image of opt_patches."""

    min_patches: int = 4
    opt_patches: int = 4096
    max_patches: int = 32768
    max_images: int = 64

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise LimitsError(f"vision engine {name.replace('_', '-')} must be a positive integer, got {value!r}")
        if not self.min_patches <= self.opt_patches <= self.max_patches:
            raise LimitsError(
                f"vision engine patches must satisfy min <= opt <= max, got {self.min_patches}, "
                f"{self.opt_patches}, {self.max_patches}"
            )

    @classmethod
    def for_visual_tokens(cls, max_visual_tokens: int, merge_unit: int) -> VisionEngineProfile:
        """A profile whose largest run is one request with the most visual tokens the LLM engine takes."""
        max_patches = max_visual_tokens * merge_unit
        return cls(min_patches=merge_unit, opt_patches=min(cls.opt_patches, max_patches), max_patches=max_patches)

    def check_merge_unit(self, merge_unit: int) -> None:
        """Batches hold whole merge blocks, so every profile size must be a multiple of merge_unit."""
        odd = {k: v for k, v in asdict(self).items() if k.endswith("_patches") and v % merge_unit}
        if odd:
            raise LimitsError(
                f"vision engine patch counts must be multiples of {merge_unit} (one merge block): "
                + ", ".join(f"{k.replace('_', '-')} {v}" for k, v in odd.items())
            )

    def dim_ranges(self) -> dict[str, tuple[int, int, int]]:
        """(min, opt, max) of each dynamic dim of the vision contracts."""
        return {
            str(PIXEL_VALUES.shape[0]): (self.min_patches, self.opt_patches, self.max_patches),
            str(CU_SEQLENS.shape[0]): (2, 2, self.max_images + 1),
            # A segment can be as short as one merge block, whatever min_patches says.
            str(MAX_SEQLEN_CARRIER.shape[0]): (1, self.opt_patches, self.max_patches),
        }

    def input_shapes(self, inputs: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, list[int]]]:
        """{input: {"min"|"opt"|"max": shape}} for resolved contract inputs (fixed dims as they are)."""
        ranges = self.dim_ranges()
        shapes: dict[str, dict[str, list[int]]] = {}
        for spec in inputs:
            by_point: dict[str, list[int]] = {"min": [], "opt": [], "max": []}
            for dim in spec["shape"]:
                for i, point in enumerate(by_point):
                    by_point[point].append(ranges[dim][i] if isinstance(dim, str) else int(dim))
            shapes[str(spec["name"])] = by_point
        return shapes


# vision_engine.json entries the runner reads, with their types ("a.b" is entry b of object a).
_ENGINE_ENTRIES: dict[str, type] = {
    "engine_file": str,
    "graph_variant": str,
    "tensorrt_version": str,
    "contract_sha256": str,
    "gpu.name": str,
    "gpu.compute_capability": str,
    "profile.max_patches": int,
    "profile.max_images": int,
    "device_memory_bytes": int,
}


@dataclass(frozen=True)
class VisionEngineSidecar:
    """vision_engine.json of a built engine; `raw` is the file's content."""

    raw: dict[str, Any]

    @classmethod
    def of_build(
        cls,
        export: VisionSidecar,
        profile: VisionEngineProfile,
        tensorrt_version: str,
        gpu_name: str,
        compute_capability: tuple[int, int],
        plugin_capability: int,
        optimization_level: int,
        timing_cache: str,
        device_memory_bytes: int,
    ) -> VisionEngineSidecar:
        """The sidecar of an engine built from `export` with these settings on this GPU; device_memory_bytes is
        what one execution context allocates for activations (the GPU memory plan of the deployment counts it)."""
        return cls(
            {
                "format_version": ENGINE_FORMAT_VERSION,
                "engine_file": VISION_ENGINE_FILE,
                "graph_variant": export.graph_variant,
                "dtype": export.dtype,
                "contract_sha256": export.contract_sha256(),
                "tensorrt_version": tensorrt_version,
                "gpu": {"name": gpu_name, "compute_capability": f"{compute_capability[0]}.{compute_capability[1]}"},
                "plugin_arch": f"sm_{plugin_capability}" if export.graph_variant == PLUGIN else None,
                "builder_optimization_level": optimization_level,
                "strongly_typed": True,
                "profile": {**asdict(profile), "shapes": profile.input_shapes(export.contract()["inputs"])},
                "timing_cache": timing_cache,
                "device_memory_bytes": device_memory_bytes,
                "source_checkpoint": export.source_checkpoint,
                "built_with": {"qwen3vl_trt": __version__},
            }
        )

    def write(self, directory: str | os.PathLike[str]) -> Path:
        return _write(Path(directory) / VISION_ENGINE_SIDECAR_FILE, self.raw)

    @classmethod
    def load(cls, engine_dir: str | os.PathLike[str]) -> VisionEngineSidecar:
        path = Path(engine_dir) / VISION_ENGINE_SIDECAR_FILE
        raw = read_json(path, f"{engine_dir} has no {VISION_ENGINE_SIDECAR_FILE}: is it a build-vision-engine output?")
        fix = "build the engine again with `qwen3vl-trt build-vision-engine`"
        if raw.get("format_version") != ENGINE_FORMAT_VERSION:
            raise CheckpointError(
                f"{path} has format_version {raw.get('format_version')!r}, this version reads "
                f"{ENGINE_FORMAT_VERSION}; {fix}"
            )
        for key, kind in _ENGINE_ENTRIES.items():
            json_entry(raw, key, kind, str(path), fix)
        return cls(raw)

    @property
    def engine_file(self) -> str:
        return str(self.raw["engine_file"])

    @property
    def max_patches(self) -> int:
        return int(self.raw["profile"]["max_patches"])

    @property
    def max_images(self) -> int:
        return int(self.raw["profile"]["max_images"])

    @property
    def device_memory_bytes(self) -> int:
        """Activation memory of one execution context at the profile's largest run (device_memory_size_v2)."""
        return int(self.raw["device_memory_bytes"])

    def check_runtime(self, export: VisionSidecar, tensorrt_version: str, compute_capability: tuple[int, int]) -> None:
        """Refuses an engine that this code, this TensorRT or this GPU cannot run as built."""
        rebuild = "rebuild it on this host with `qwen3vl-trt build-vision-engine` (or `qwen3vl-trt build`)"
        if self.raw["contract_sha256"] != export.contract_sha256():
            raise CheckpointError(
                f"the vision engine was built for another input/output contract (sha256 "
                f"{self.raw['contract_sha256'][:12]}) than this version's {export.graph_variant} graph "
                f"({export.contract_sha256()[:12]}): export and build it again with this version"
            )
        if self.raw["tensorrt_version"] != tensorrt_version:
            raise CheckpointError(
                f"the vision engine was built with TensorRT {self.raw['tensorrt_version']}, this host has "
                f"{tensorrt_version} (engines do not carry across versions); {rebuild}"
            )
        built_for = self.raw["gpu"]["compute_capability"]
        here = f"{compute_capability[0]}.{compute_capability[1]}"
        if built_for != here:
            raise CheckpointError(
                f"the vision engine was built for compute capability {built_for} ({self.raw['gpu']['name']}), "
                f"this GPU is {here}; {rebuild}"
            )
