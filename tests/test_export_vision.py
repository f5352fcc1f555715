"""Structure of the exported graphs: dtypes, fp32 islands, TensorRT op support, sidecar, atomic writes."""

from __future__ import annotations

import json
from importlib import resources

import numpy as np
import onnx
import pytest
from conftest import _quiet
from qwen3vl_trt.checkpoint import Checkpoint
from qwen3vl_trt.contracts import (
    VISION_INPUTS,
    VISION_ONNX_DATA_FILE,
    VISION_ONNX_FILE,
    VISION_OUTPUTS,
    VISION_SIDECAR_FILE,
)
from qwen3vl_trt.errors import CheckpointError, InputError, OutputExistsError, Qwen3VLTrtError
from qwen3vl_trt.export_vision import ONNX_OPSET, check_onnx, export_vision
from qwen3vl_trt.vision import VisionEncoder

ELEM_TYPES = {
    onnx.TensorProto.FLOAT: "FP32",
    onnx.TensorProto.FLOAT16: "FP16",
    onnx.TensorProto.BFLOAT16: "BF16",
    onnx.TensorProto.INT32: "INT32",
    onnx.TensorProto.INT64: "INT64",
    onnx.TensorProto.BOOL: "BOOL",
    onnx.TensorProto.UINT8: "UINT8",
    onnx.TensorProto.INT8: "INT8",
}


def trt_supported_ops() -> tuple[dict[str, set[str]], tuple[int, int]]:
    """TensorRT 10.14 ONNX parser support: {op: types}, (min opset, max opset)."""
    text = (resources.files("qwen3vl_trt") / "data" / "trt_10_14_onnx_ops.txt").read_text()
    ops, opsets = {}, None
    for line in text.splitlines():
        if line.startswith("# opset-range:"):
            lo, hi = line.split(":")[1].split()
            opsets = (int(lo), int(hi))
        elif line and not line.startswith("#"):
            name, types = line.split("\t")[:2]
            ops[name] = set(types.split(","))
    assert opsets is not None and "# Source:" in text
    return ops, opsets


def elem_types(model: onnx.ModelProto) -> dict[str, int]:
    graph = model.graph
    types = {v.name: v.type.tensor_type.elem_type for v in [*graph.input, *graph.output, *graph.value_info]}
    types.update({t.name: t.data_type for t in graph.initializer})
    for node in graph.node:
        if node.op_type == "Constant":
            types[node.output[0]] = node.attribute[0].t.data_type
    return types


@pytest.fixture(scope="module")
def exports(tiny_dense, vision_exports, tmp_path_factory):
    root = tmp_path_factory.mktemp("dtypes")
    out = {"fp32": vision_exports["dense"]}
    for dtype in ("fp16", "bf16"):
        out[dtype] = export_vision(tiny_dense, root / dtype, dtype=dtype, log=_quiet).output_dir
    return out


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
def test_graph_checks_and_keeps_fp32_islands(exports, dtype):
    inferred = check_onnx(exports[dtype] / VISION_ONNX_FILE)  # checker + strict full shape inference
    types = elem_types(inferred)
    compute = {"fp32": onnx.TensorProto.FLOAT, "fp16": onnx.TensorProto.FLOAT16, "bf16": onnx.TensorProto.BFLOAT16}[
        dtype
    ]
    ops = {n.op_type for n in inferred.graph.node}
    assert {"LayerNormalization", "Softmax", "Cos", "Sin"} <= ops
    for node in inferred.graph.node:
        if node.op_type in ("LayerNormalization", "Softmax", "Cos", "Sin"):
            assert types[node.input[0]] == onnx.TensorProto.FLOAT, f"{node.op_type} {node.name} is not fp32"
    matmul_types = {types[n.input[0]] for n in inferred.graph.node if n.op_type == "MatMul"}
    assert compute in matmul_types, "the linear layers should run in the export dtype"
    outputs = {o.name: o.type.tensor_type for o in inferred.graph.output}
    assert [o.name for o in inferred.graph.output] == [s.name for s in VISION_OUTPUTS]
    assert all(t.elem_type == compute for t in outputs.values())
    assert [i.name for i in inferred.graph.input] == [s.name for s in VISION_INPUTS]
    assert all(i.type.tensor_type.shape.dim[0].dim_param == "N" for i in inferred.graph.input)
    assert outputs["deepstack_embeds"].shape.dim[1].dim_param == "M"


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
def test_every_op_is_parsed_by_tensorrt_10_14(exports, dtype):
    supported, (lo, hi) = trt_supported_ops()
    model = check_onnx(exports[dtype] / VISION_ONNX_FILE)
    opset = {o.domain: o.version for o in model.opset_import}
    assert opset.get("", opset.get("ai.onnx")) == ONNX_OPSET and lo <= ONNX_OPSET <= hi
    assert set(opset) <= {"", "ai.onnx"}, f"non-standard domains: {opset}"
    types = elem_types(model)
    for node in model.graph.node:
        assert node.op_type in supported, f"{node.op_type} is not in TensorRT 10.14's ONNX parser support list"
        if node.op_type not in ("Constant", "Shape") and node.input and node.input[0] in types:
            data_type = ELEM_TYPES[types[node.input[0]]]
            assert data_type in supported[node.op_type], f"{node.op_type} on {data_type} is not supported by TensorRT"


def test_fp16_export_runs_close_to_fp32(exports):
    grid = np.array([[1, 4, 4]])
    pixels = np.random.default_rng(0).uniform(-1, 1, (16, 1536)).astype(np.float32)
    ref = VisionEncoder(exports["fp32"]).encode(pixels, grid)
    half = VisionEncoder(exports["fp16"]).encode(pixels, grid)
    assert half[0].dtype == np.float16
    scale = np.abs(ref[0]).max()
    assert np.abs(half[0].astype(np.float32) - ref[0]).max() / scale < 1e-2


def test_bf16_export_refuses_ort_clearly(exports):
    with pytest.raises(Qwen3VLTrtError, match="bf16"):
        VisionEncoder(exports["bf16"])


def test_sidecar_describes_the_graph(tiny_dense, exports):
    sidecar = json.loads((exports["fp32"] / VISION_SIDECAR_FILE).read_text())
    info = Checkpoint(tiny_dense).info
    assert [i["name"] for i in sidecar["inputs"]] == [s.name for s in VISION_INPUTS]
    assert [o["name"] for o in sidecar["outputs"]] == [s.name for s in VISION_OUTPUTS]
    assert sidecar["inputs"][0]["shape"] == ["N", 1536]
    assert sidecar["outputs"][1]["shape"] == [3, "M", info.text.hidden_size]
    assert sidecar["head_dim"] == 64 and sidecar["spatial_merge_size"] == 2
    assert sidecar["deepstack_count"] == 3 and sidecar["opset"] == ONNX_OPSET
    assert len(sidecar["source_checkpoint"]["visual_weights_sha256"]) == 64
    assert (exports["fp32"] / VISION_ONNX_DATA_FILE).stat().st_size > 1_000_000  # weights live outside the proto


def test_verify_records_parity(tiny_dense, tmp_path):
    result = export_vision(tiny_dense, tmp_path / "v", verify=True, log=_quiet)
    assert result.sidecar["verification"]["max_rel_error"] <= 1e-4
    assert {tuple(map(tuple, p.grids)) for p in result.parity} >= {((1, 2, 2),), ((2, 4, 6),)}


def test_refuses_to_overwrite_without_force(tiny_dense, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(OutputExistsError, match="--force"):
        export_vision(tiny_dense, out, log=_quiet)
    assert (out / "keep.txt").read_text() == "mine"
    export_vision(tiny_dense, out, force=True, log=_quiet)
    assert not (out / "keep.txt").exists() and (out / VISION_ONNX_FILE).is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temp or backup dirs left


def test_failure_leaves_nothing_behind(tiny_dense, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in tiny_dense.iterdir():
        (broken / f.name).symlink_to(f)
    shard = Checkpoint(tiny_dense)._weight_map["model.visual.blocks.0.attn.qkv.weight"]
    (broken / shard).unlink()
    (broken / shard).write_bytes((tiny_dense / shard).read_bytes()[:1000])
    with pytest.raises(CheckpointError, match="truncated"):
        export_vision(broken, tmp_path / "out", log=_quiet)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken"]


def test_verify_needs_fp32(tiny_dense, tmp_path):
    with pytest.raises(Qwen3VLTrtError, match="fp32"):
        export_vision(tiny_dense, tmp_path / "v", dtype="fp16", verify=True, log=_quiet)
    assert not (tmp_path / "v").exists()


def test_encoder_rejects_inputs_off_contract(vision_exports):
    encoder = VisionEncoder(vision_exports["dense"])
    pixels = np.zeros((16, 1536), np.float32)
    with pytest.raises(InputError, match="1536"):
        encoder.encode(np.zeros((16, 1000), np.float32), [[1, 4, 4]])
    with pytest.raises(InputError, match="describes 32"):
        encoder.encode(pixels, [[2, 4, 4]])
    with pytest.raises(InputError, match="multiples of spatial_merge_size"):
        encoder.encode(np.zeros((15, 1536), np.float32), [[1, 3, 5]])
    with pytest.raises(InputError, match=r"\[num_images, 3\]"):
        encoder.encode(pixels, [4, 4])
