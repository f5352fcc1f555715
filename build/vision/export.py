"""Stage export-vision: the ViT, its patch merger and the DeepStack mergers to ONNX.

Reads only the checkpoint's visual tensors, exports one graph with a dynamic patch count, writes
weights as external data beside it and a vision_config.json sidecar, and optionally checks the
result against the transformers tower before publishing the directory atomically. Two graph
variants: portable (standard ONNX ops only, parsed by TensorRT 10.14 and run by ONNX Runtime) and
plugin (each block's attention one node of the varlen attention TensorRT plugin, on cu_seqlens: no
N x N mask; ONNX Runtime runs it through a Python custom op, see ort_plugin).
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import torch
from tqdm import tqdm

from ..common.contracts import (
    DEEPSTACK_EMBEDS,
    PIXEL_VALUES,
    PLUGIN,
    PORTABLE,
    VISION_GRAPH_INPUTS,
    VISION_ONNX_DATA_FILE,
    VISION_ONNX_FILE,
    VISION_OUTPUTS,
)
from ..common.fsutil import atomic_output_dir
from ..common.torch_dtypes import TORCH_DTYPES
from ..errors import Qwen3VLTrtError
from ..hf.checkpoint import Checkpoint, VisionConfig, tensors_sha256
from ..plugins import PLUGIN_NAME, PLUGIN_NAMESPACE
from .metadata import graph_feeds, num_patches, vision_metadata
from .model import PluginVisionTower, VisionTower
from .plugin_op import ONNX_TRANSLATION, PLUGIN_DOMAIN_VERSION, PLUGIN_NODE_ATTRIBUTES
from .sidecar import VisionSidecar

# The tower module of each graph variant.
TOWERS: dict[str, type[VisionTower]] = {PORTABLE: VisionTower, PLUGIN: PluginVisionTower}

# Opset 20: native Gelu (one kernel instead of a tanh formula) and LayerNormalization, and
# inside the range TensorRT parses (opset 9 to 20 since 10.0).
ONNX_OPSET = 20
# Parity tolerance of the fp32 export against transformers (max |a-b| / max |b|).
FP32_REL_TOLERANCE = 1e-4
# Grids used by --verify: square, non-square, the smallest, and a two-frame video.
VERIFY_GRIDS = ((1, 8, 8), (1, 6, 10), (1, 2, 2), (2, 4, 6))


@dataclass
class Parity:
    grids: list[list[int]]
    image_embeds_max_abs: float
    image_embeds_max_rel: float
    deepstack_max_abs: float
    deepstack_max_rel: float

    @property
    def max_rel(self) -> float:
        return max(self.image_embeds_max_rel, self.deepstack_max_rel)


@dataclass
class VisionExport:
    output_dir: Path
    dtype: str
    sidecar: VisionSidecar
    parity: list[Parity] = field(default_factory=list)


def parity_errors(actual: np.ndarray, expected: np.ndarray) -> tuple[float, float]:
    """(max abs error, max abs error relative to the largest expected magnitude)."""
    if actual.shape != expected.shape:
        raise Qwen3VLTrtError(f"shape mismatch: {actual.shape} vs expected {expected.shape}")
    err = float(np.max(np.abs(actual.astype(np.float64) - expected.astype(np.float64))))
    scale = float(np.max(np.abs(expected))) or 1.0
    return err, err / scale


def _sample_inputs(cfg: VisionConfig, variant: str) -> tuple[torch.Tensor, ...]:
    """Two images, so the traced graph sees more than one attention segment."""
    grid = np.array([[1, 4, 4], [1, 2, 4]])
    per_patch = {PIXEL_VALUES.name: np.zeros((num_patches(grid), cfg.patch_dim), np.float32)}
    per_patch.update(vision_metadata(grid, cfg.spatial_merge_size, cfg.num_grid_per_side))
    feeds = graph_feeds(per_patch, variant)
    return tuple(torch.from_numpy(feeds[spec.name]) for spec in VISION_GRAPH_INPUTS[variant])


def _export_graph(tower: VisionTower, path: Path, variant: str) -> None:
    cfg = tower.cfg
    merged = torch.export.Dim("merged_tokens", min=1)
    patches = cfg.merge_unit * merged  # the patch count is a whole number of merge blocks
    # The plugin variant's segment inputs have their own dims: segments + 1, and the longest segment.
    segment_dims = {"S+1": torch.export.Dim("segments_plus_one", min=2), "L": torch.export.Dim("max_seqlen", min=1)}
    dynamic_shapes = {
        spec.name: {0: patches if spec.shape[0] == "N" else segment_dims[str(spec.shape[0])]}
        for spec in VISION_GRAPH_INPUTS[variant]
    }
    onnx_logger = logging.getLogger("torch.onnx")
    level = onnx_logger.level
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        onnx_logger.setLevel(logging.ERROR)
        try:
            program = torch.onnx.export(
                tower,
                _sample_inputs(cfg, variant),
                dynamo=True,
                opset_version=ONNX_OPSET,
                input_names=[spec.name for spec in VISION_GRAPH_INPUTS[variant]],
                output_names=[spec.name for spec in VISION_OUTPUTS],
                dynamic_shapes=dynamic_shapes,
                custom_translation_table=ONNX_TRANSLATION if variant == PLUGIN else None,
                verbose=False,
            )
        finally:
            onnx_logger.setLevel(level)
    assert program is not None
    model = program.model_proto
    _name_dynamic_dims(model, variant)
    onnx.save_model(
        model,
        str(path),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location=VISION_ONNX_DATA_FILE,
        size_threshold=1024,
    )


def _name_dynamic_dims(model: onnx.ModelProto, variant: str) -> None:
    """Gives the graph's dynamic dims the contract's names (N patches, M merged tokens; S+1, L)."""
    for value, spec in zip(model.graph.input, VISION_GRAPH_INPUTS[variant], strict=True):
        value.type.tensor_type.shape.dim[0].dim_param = str(spec.shape[0])
    for value in model.graph.output:
        dims = value.type.tensor_type.shape.dim
        dim = dims[1] if value.name == DEEPSTACK_EMBEDS.name else dims[0]
        dim.dim_param = "M"


def check_onnx(path: Path) -> onnx.ModelProto:
    """onnx.checker plus strict full shape inference; returns the inferred model (no weights)."""
    onnx.checker.check_model(str(path), full_check=True)
    model = onnx.load(str(path), load_external_data=False)
    return onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True, data_prop=True)


def verify_against_transformers(
    onnx_dir: Path, ckpt: Checkpoint, tensors: dict[str, torch.Tensor] | None = None, seed: int = 0
) -> list[Parity]:
    """Random pixels on several grids through ONNX Runtime and the transformers tower."""
    from ..hf.reference import load_hf_vision_tower, run_hf_vision_tower
    from .onnx_runner import OnnxVisionRunner

    encoder = OnnxVisionRunner(onnx_dir)
    reference = load_hf_vision_tower(ckpt, tensors)
    rng = np.random.default_rng(seed)
    cases = [[list(g)] for g in VERIFY_GRIDS] + [[list(g) for g in VERIFY_GRIDS]]
    results = []
    for grids in tqdm(cases, desc="verify vision (ORT vs transformers)", unit="case", leave=False, disable=None):
        grid = np.array(grids)
        pixels = rng.uniform(-1, 1, size=(num_patches(grid), ckpt.info.vision.patch_dim)).astype(np.float32)
        ours = encoder.encode(pixels, grid)
        theirs = run_hf_vision_tower(reference, pixels, grid)
        img_abs, img_rel = parity_errors(ours[0], theirs[0])
        ds_abs, ds_rel = parity_errors(ours[1], theirs[1])
        results.append(Parity(grids, img_abs, img_rel, ds_abs, ds_rel))
    return results


def export_vision(
    model: Checkpoint | str | os.PathLike[str],
    output_dir: str | os.PathLike[str],
    dtype: str = "fp32",
    verify: bool = False,
    force: bool = False,
    variant: str = PORTABLE,
    log=print,
) -> VisionExport:
    """Exports the vision encoder of a Qwen3-VL checkpoint to `output_dir` (see module doc)."""
    if dtype not in TORCH_DTYPES:
        raise Qwen3VLTrtError(f"unsupported dtype {dtype!r}; choose one of {', '.join(TORCH_DTYPES)}")
    if variant not in TOWERS:
        raise Qwen3VLTrtError(f"unknown graph variant {variant!r}; choose one of {', '.join(TOWERS)}")
    if verify and dtype != "fp32":
        raise Qwen3VLTrtError(
            "--verify compares against transformers in fp32 on ONNX Runtime; export with --dtype fp32 to verify"
        )
    ckpt = model if isinstance(model, Checkpoint) else Checkpoint(model)
    cfg = ckpt.info.vision
    with atomic_output_dir(output_dir, force=force, inputs=[ckpt.path]) as tmp:
        names = VisionTower.checkpoint_names(cfg)
        size_mb = ckpt.tensor_bytes(names) / 2**20
        log(f"reading {len(names)} visual tensors ({size_mb:.0f} MiB) from {ckpt.path}")
        tensors = dict(
            tqdm(ckpt.iter_tensors(names), total=len(names), desc="read vision weights", unit="tensor", disable=None)
        )
        weights_sha256 = tensors_sha256(tensors)
        tower = TOWERS[variant].from_checkpoint_tensors(cfg, tensors, TORCH_DTYPES[dtype])

        start = time.perf_counter()
        log(
            f"exporting the {variant} vision encoder ({cfg.depth} blocks, hidden {cfg.hidden_size}, {dtype}), "
            f"opset {ONNX_OPSET}"
        )
        _export_graph(tower, tmp / VISION_ONNX_FILE, variant)
        del tower
        check_onnx(tmp / VISION_ONNX_FILE)
        log(f"exported and checked in {time.perf_counter() - start:.1f}s")

        attention_plugin = {
            "op_type": PLUGIN_NAME,
            "domain": PLUGIN_NAMESPACE,
            "domain_version": PLUGIN_DOMAIN_VERSION,
            "attributes": PLUGIN_NODE_ATTRIBUTES,
        }
        sidecar = VisionSidecar.of_export(
            ckpt,
            dtype,
            variant,
            weights_sha256,
            opset=ONNX_OPSET,
            attention_plugin=attention_plugin if variant == PLUGIN else None,
            exported_with={"torch": torch.__version__, "onnx": onnx.__version__},
        )
        parity: list[Parity] = []
        if verify:
            sidecar.write(tmp)  # the runner that checks the export reads it
            parity = verify_against_transformers(tmp, ckpt, tensors)
            for p in parity:
                log(
                    f"  grids {p.grids}: image_embeds max abs {p.image_embeds_max_abs:.2e} "
                    f"rel {p.image_embeds_max_rel:.2e}; deepstack max abs {p.deepstack_max_abs:.2e} "
                    f"rel {p.deepstack_max_rel:.2e}"
                )
            worst = max(p.max_rel for p in parity)
            log(f"verified against transformers: max relative error {worst:.2e} (tolerance {FP32_REL_TOLERANCE:.0e})")
            sidecar = sidecar.with_verification(
                {
                    "reference": "transformers vision tower, fp32, CPU",
                    "max_rel_error": worst,
                    "tolerance": FP32_REL_TOLERANCE,
                    "cases": [p.__dict__ for p in parity],
                }
            )
            if worst > FP32_REL_TOLERANCE:
                raise Qwen3VLTrtError(
                    f"vision export does not match transformers: max relative error {worst:.2e} > "
                    f"{FP32_REL_TOLERANCE:.0e}; nothing was written"
                )
        sidecar.write(tmp)
    return VisionExport(Path(output_dir), dtype, sidecar, parity)
