"""The plugin graph variant of the vision encoder: its attention nodes as TensorRT's ONNX parser reads them, no
N x N tensor anywhere, cu_seqlens metadata for concatenated requests, and ONNX Runtime parity (the nodes through a
Python custom op over the plugin's torch reference) with the portable variant."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from conftest import _quiet, random_pixels
from qwen3vl_trt.cli import main as cli_main
from qwen3vl_trt.common.contracts import (
    CU_SEQLENS,
    MAX_SEQLEN_CARRIER,
    SEGMENT_START,
    VISION_GRAPH_INPUTS,
    VISION_ONNX_FILE,
    VISION_OUTPUTS,
    VISION_SIDECAR_FILE,
    contract_sha256,
)
from qwen3vl_trt.errors import InputError, Qwen3VLTrtError
from qwen3vl_trt.plugins import PLUGIN_NAME, PLUGIN_NAMESPACE, PLUGIN_VERSION
from qwen3vl_trt.vision import OnnxVisionRunner, VisionSidecar
from qwen3vl_trt.vision.export import FP32_REL_TOLERANCE, check_onnx, export_vision, parity_errors
from qwen3vl_trt.vision.metadata import attention_segments, graph_feeds, vision_metadata
from qwen3vl_trt.vision.plugin_op import PLUGIN_DOMAIN_VERSION
from test_export_vision import ELEM_TYPES, elem_types, trt_supported_ops

TOWERS = ("dense", "dense-hd72")
# Mixed batches: sizes, a non-square grid, the smallest grid and a two-frame-pair video (two segments).
MIXED_GRIDS = {
    "mixed images": [[1, 4, 6], [1, 2, 2], [1, 8, 4]],
    "images and a video": [[1, 6, 4], [2, 4, 4], [1, 2, 6]],
}


@pytest.fixture(scope="module")
def plugin_exports(checkpoints, tmp_path_factory):
    """fp32 plugin exports of the dense (through the command line) and head_dim 72 towers."""
    root = tmp_path_factory.mktemp("plugin")
    args = ["export-vision", "--model", str(checkpoints["dense"]), "--output", str(root / "dense")]
    assert cli_main([*args, "--variant", "plugin"]) == 0
    export_vision(checkpoints["dense-hd72"], root / "dense-hd72", variant="plugin", log=_quiet)
    return {name: root / name for name in TOWERS}


def _plugin_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.op_type == PLUGIN_NAME]


@pytest.mark.parametrize("tower", TOWERS)
def test_attention_nodes_are_what_tensorrts_parser_resolves_to_the_plugin(tower, plugin_exports):
    from qwen3vl_trt.plugins.registration import INPUT_NAMES, PLUGIN_ID

    model = check_onnx(plugin_exports[tower] / VISION_ONNX_FILE)
    sidecar = json.loads((plugin_exports[tower] / VISION_SIDECAR_FILE).read_text())
    nodes = _plugin_nodes(model)
    assert len(nodes) == sidecar["depth"]  # one per block
    assert {o.domain: o.version for o in model.opset_import}[PLUGIN_NAMESPACE] == PLUGIN_DOMAIN_VERSION
    graph_inputs = [i.name for i in model.graph.input]
    assert graph_inputs == [s.name for s in VISION_GRAPH_INPUTS["plugin"]]
    types = elem_types(model)
    for node in nodes:
        assert f"{node.domain}::{node.op_type}" == PLUGIN_ID == f"{PLUGIN_NAMESPACE}::{PLUGIN_NAME}"
        attributes = {a.name: a for a in node.attribute}
        assert set(attributes) == {"plugin_namespace", "plugin_version", "aot"}
        assert attributes["plugin_namespace"].type == onnx.AttributeProto.STRING
        assert attributes["plugin_namespace"].s.decode() == PLUGIN_NAMESPACE
        assert attributes["plugin_version"].type == onnx.AttributeProto.STRING
        assert attributes["plugin_version"].s.decode() == PLUGIN_VERSION == "1"
        assert attributes["aot"].type == onnx.AttributeProto.INT and attributes["aot"].i == 1
        assert len(node.input) == len(INPUT_NAMES) and len(node.output) == 1
        # q, k, v in the compute dtype; the segment inputs straight from the graph's inputs.
        assert [types[i] for i in node.input[:3]] == [onnx.TensorProto.FLOAT] * 3
        assert list(node.input[3:]) == [CU_SEQLENS.name, MAX_SEQLEN_CARRIER.name]
    assert sidecar["graph_variant"] == "plugin"
    assert sidecar["attention_plugin"]["attributes"] == {
        "plugin_namespace": PLUGIN_NAMESPACE,
        "plugin_version": "1",
        "aot": 1,
    }
    assert [i["name"] for i in sidecar["inputs"]] == graph_inputs
    assert sidecar["inputs"][4]["shape"] == ["S+1"] and sidecar["inputs"][5]["shape"] == ["L"]
    assert (
        contract_sha256(sidecar["inputs"] + sidecar["outputs"])
        == VisionSidecar.load(plugin_exports[tower]).contract_sha256()
    )


def _has_n_by_n_tensor(model: onnx.ModelProto) -> bool:
    """Any tensor with one symbolic dim twice after shape inference: the portable graph's [N, N] mask and
    [heads, N, N] scores (the only dynamic dims are patches, tokens, segments and the longest segment)."""
    for value in [*model.graph.value_info, *model.graph.output]:
        symbolic = [d.dim_param for d in value.type.tensor_type.shape.dim if d.dim_param]
        if len(set(symbolic)) < len(symbolic):
            return True
    return False


def test_no_n_by_n_tensor_in_the_plugin_graph(plugin_exports, vision_exports):
    plugin = check_onnx(plugin_exports["dense"] / VISION_ONNX_FILE)
    portable = check_onnx(vision_exports["dense"] / VISION_ONNX_FILE)
    assert _has_n_by_n_tensor(portable), "the check must see the portable variant's mask"
    assert not _has_n_by_n_tensor(plugin)
    ops = {n.op_type for n in plugin.graph.node}
    assert not ops & {"Softmax", "CumSum", "Equal", "Where", "MatMul"}, "attention outside the plugin"
    assert SEGMENT_START.name not in {name for node in plugin.graph.node for name in node.input}


def test_every_other_op_is_parsed_by_tensorrt_10_14(plugin_exports):
    supported, _ = trt_supported_ops()
    model = check_onnx(plugin_exports["dense-hd72"] / VISION_ONNX_FILE)
    types = elem_types(model)
    for node in model.graph.node:
        if node.domain == PLUGIN_NAMESPACE:
            continue
        assert node.domain == "" and node.op_type in supported, f"{node.domain}::{node.op_type} is not parsed"
        if node.op_type not in ("Constant", "Shape"):
            assert ELEM_TYPES[types[node.input[0]]] in supported[node.op_type], f"{node.op_type} {node.name}"


@pytest.mark.parametrize("tower", TOWERS)
@pytest.mark.parametrize("case", list(MIXED_GRIDS))
def test_ort_custom_op_matches_the_portable_variant(tower, case, plugin_exports, vision_exports):
    grid = np.array(MIXED_GRIDS[case])
    pixels = random_pixels(grid, seed=len(case))
    plugin = OnnxVisionRunner(plugin_exports[tower]).encode(pixels, grid)
    portable = OnnxVisionRunner(vision_exports[tower]).encode(pixels, grid)
    for ours, theirs in zip(plugin, portable, strict=True):
        assert ours.shape == theirs.shape and ours.dtype == np.float32
        assert parity_errors(ours, theirs)[1] <= FP32_REL_TOLERANCE


def test_concatenated_requests_equal_separate_runs(plugin_exports):
    encoder = OnnxVisionRunner(plugin_exports["dense"])
    grids = [np.array([[1, 4, 6]]), np.array([[2, 2, 2], [1, 8, 4]])]
    pixels = [random_pixels(g, seed=i) for i, g in enumerate(grids)]
    separate = [encoder.encode(p, g) for p, g in zip(pixels, grids, strict=True)]
    feeds = [encoder.inputs_for(p, g) for p, g in zip(pixels, grids, strict=True)]
    batched = encoder.run({name: np.concatenate([f[name] for f in feeds]) for name in feeds[0]})
    np.testing.assert_allclose(batched[0], np.concatenate([s[0] for s in separate]), rtol=0, atol=1e-5)
    np.testing.assert_allclose(batched[1], np.concatenate([s[1] for s in separate], axis=1), rtol=0, atol=1e-5)


def test_cu_seqlens_of_concatenated_requests():
    """Each request's segment_start flags concatenate; cu_seqlens follow every (image, temporal patch)."""
    requests = [[[1, 4, 6]], [[3, 2, 2], [1, 8, 4]], [[1, 2, 2]]]
    flags = [vision_metadata(np.array(g), 2, 48)[SEGMENT_START.name] for g in requests]
    segments = attention_segments(np.concatenate(flags))
    lengths = [h * w for grid in requests for t, h, w in grid for _ in range(t)]
    assert segments[CU_SEQLENS.name].dtype == np.int32 and segments[MAX_SEQLEN_CARRIER.name].dtype == np.int32
    assert segments[CU_SEQLENS.name].tolist() == np.concatenate([[0], np.cumsum(lengths)]).tolist()
    assert segments[MAX_SEQLEN_CARRIER.name].shape == (32,)  # the 8 x 4 image
    # The plugin feed drops the flags for the segments; the portable feed keeps them.
    per_patch = {SEGMENT_START.name: np.concatenate(flags), "pixel_values": np.zeros((len(np.concatenate(flags)), 3))}
    assert set(graph_feeds(per_patch, "plugin")) == {"pixel_values", CU_SEQLENS.name, MAX_SEQLEN_CARRIER.name}
    assert graph_feeds(per_patch, "portable").keys() == per_patch.keys()


@pytest.mark.parametrize(
    "flags, message",
    [([0, 1, 0, 0], "starting with 1"), ([1, 2, 0, 0], "0/1 flags"), ([], "non-empty"), ([[1, 0]], "shape")],
)
def test_malformed_segment_flags_are_refused(flags, message):
    with pytest.raises(InputError, match=message):
        attention_segments(np.array(flags, dtype=np.int32))


def test_a_reduced_precision_plugin_export_carries_its_dtype_and_refuses_ort(tiny_dense, tmp_path):
    out = export_vision(tiny_dense, tmp_path / "bf16", dtype="bf16", variant="plugin", log=_quiet).output_dir
    model = check_onnx(out / VISION_ONNX_FILE)
    types = elem_types(model)
    for node in _plugin_nodes(model):
        assert [types[i] for i in node.input] == [onnx.TensorProto.BFLOAT16] * 3 + [onnx.TensorProto.INT32] * 2
        assert types[node.output[0]] == onnx.TensorProto.BFLOAT16
    outputs = [o.type.tensor_type.elem_type for o in model.graph.output]
    assert outputs == [onnx.TensorProto.BFLOAT16] * len(VISION_OUTPUTS)
    with pytest.raises(Qwen3VLTrtError, match="bf16"):
        OnnxVisionRunner(out)


def test_unknown_variant_is_refused(tiny_dense, tmp_path):
    with pytest.raises(Qwen3VLTrtError, match="unknown graph variant"):
        export_vision(tiny_dense, tmp_path / "x", variant="dense-mask", log=_quiet)
    assert not (tmp_path / "x").exists()
