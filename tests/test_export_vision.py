"""Structure of the exported graphs: dtypes, fp32 islands, TensorRT op support, sidecar, atomic writes."""

from __future__ import annotations

import json
from importlib import resources

import numpy as np
import onnx
import pytest
from conftest import _quiet
from qwen3vl_trt.common.contracts import (
    VISION_INPUTS,
    VISION_ONNX_DATA_FILE,
    VISION_ONNX_FILE,
    VISION_OUTPUTS,
    VISION_SIDECAR_FILE,
)
from qwen3vl_trt.errors import CheckpointError, InputError, OutputExistsError, Qwen3VLTrtError
from qwen3vl_trt.hf.checkpoint import Checkpoint
from qwen3vl_trt.vision import OnnxVisionRunner, VisionSidecar
from qwen3vl_trt.vision.export import ONNX_OPSET, check_onnx, export_vision

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
    # The rotary frequencies are fp32 constants with their exact values, not rounded ones cast back.
    head_dim = 64
    inv_freq = 1.0 / 10000 ** (np.arange(0, head_dim // 2, 2, dtype=np.float32) / (head_dim // 2))
    inline = [t for t in inferred.graph.initializer if t.data_location != onnx.TensorProto.EXTERNAL]
    constants = [onnx.numpy_helper.to_array(t) for t in inline]
    constants += [onnx.numpy_helper.to_array(n.attribute[0].t) for n in inferred.graph.node if n.op_type == "Constant"]
    assert any(
        c.dtype == np.float32 and c.size == inv_freq.size and np.allclose(c.ravel(), inv_freq, rtol=1e-7, atol=0)
        for c in constants
    ), "fp32 rotary frequencies not found"
    # The learned position grid is gathered and interpolated in fp32.
    pos_gather = [n for n in inferred.graph.node if n.op_type == "Gather" and "pos_embed_idx" in n.input]
    assert len(pos_gather) == 1 and types[pos_gather[0].input[0]] == onnx.TensorProto.FLOAT
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
    # 20: the highest opset every TensorRT 10.x parser documents (10.0: "opset 9 to opset 20").
    assert opset.get("", opset.get("ai.onnx")) == ONNX_OPSET and lo <= ONNX_OPSET <= min(hi, 20)
    assert set(opset) <= {"", "ai.onnx"}, f"non-standard domains: {opset}"
    types = elem_types(model)
    constants = {t.name for t in model.graph.initializer} | {
        n.output[0] for n in model.graph.node if n.op_type == "Constant"
    }
    for node in model.graph.node:
        assert node.op_type in supported, f"{node.op_type} is not in TensorRT 10.14's ONNX parser support list"
        if node.op_type in ("Constant", "Shape"):
            continue
        data_type = ELEM_TYPES[types[node.input[0]]]  # every data input has an inferred type
        assert data_type in supported[node.op_type], f"{node.op_type} on {data_type} is not supported by TensorRT"
        # Parser restrictions: axes (and the CumSum axis, Reshape shape) must be build-time constants.
        if node.op_type in ("CumSum", "Unsqueeze", "Squeeze", "ReduceSum", "Split", "Reshape") and len(node.input) > 1:
            assert all(i in constants for i in node.input[1:] if i), f"{node.op_type} {node.name} has runtime axes"


def test_fp16_export_runs_close_to_fp32(exports):
    grid = np.array([[1, 48, 64]])  # large positions: rounded rotary frequencies would show here
    pixels = np.random.default_rng(0).uniform(-1, 1, (48 * 64, 1536)).astype(np.float32)
    ref = OnnxVisionRunner(exports["fp32"]).encode(pixels, grid)
    half = OnnxVisionRunner(exports["fp16"]).encode(pixels, grid)
    for r, h in zip(ref, half, strict=True):
        assert h.dtype == np.float16
        assert np.abs(h.astype(np.float32) - r).max() / np.abs(r).max() < 1e-2


def test_bf16_export_refuses_ort_clearly(exports):
    with pytest.raises(Qwen3VLTrtError, match="bf16"):
        OnnxVisionRunner(exports["bf16"])


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
    assert result.sidecar.raw["verification"]["max_rel_error"] <= 1e-4
    assert VisionSidecar.load(tmp_path / "v") == result.sidecar
    assert {tuple(map(tuple, p.grids)) for p in result.parity} >= {((1, 2, 2),), ((2, 4, 6),)}


def test_refuses_to_overwrite_without_force(tiny_dense, tmp_path):
    out = tmp_path / "out"
    export_vision(tiny_dense, out, log=_quiet)
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


def test_published_files_are_readable_by_others(exports):
    for path in [exports["fp32"], *exports["fp32"].iterdir()]:
        assert path.stat().st_mode & 0o044 == 0o044, f"{path} is not readable by group and others"


def test_failed_replace_keeps_the_previous_output(tiny_dense, tmp_path, monkeypatch):
    from pathlib import Path

    out = tmp_path / "out"
    export_vision(tiny_dense, out, log=_quiet)
    before = (out / VISION_SIDECAR_FILE).read_text()
    real_rename = Path.rename

    def failing_rename(self, target):
        if self.name.startswith(".out.tmp-"):
            raise OSError("simulated failure while publishing")
        return real_rename(self, target)

    monkeypatch.setattr(Path, "rename", failing_rename)
    with pytest.raises(OSError, match="simulated"):
        export_vision(tiny_dense, out, force=True, log=_quiet)
    monkeypatch.undo()
    assert (out / VISION_SIDECAR_FILE).read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_index_pointing_at_the_wrong_shard(tiny_dense, tmp_path):
    import shutil

    ckpt_dir = tmp_path / "ckpt"
    shutil.copytree(tiny_dense, ckpt_dir)
    index_path = ckpt_dir / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    name = "model.visual.blocks.1.mlp.linear_fc1.weight"
    index["weight_map"][name] = next(s for s in set(index["weight_map"].values()) if s != index["weight_map"][name])
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=f"lacks tensor '{name}'"):
        export_vision(ckpt_dir, tmp_path / "out", log=_quiet)
    assert not (tmp_path / "out").exists()


def test_verify_needs_fp32(tiny_dense, tmp_path):
    with pytest.raises(Qwen3VLTrtError, match="fp32"):
        export_vision(tiny_dense, tmp_path / "v", dtype="fp16", verify=True, log=_quiet)
    assert not (tmp_path / "v").exists()


def test_encoder_rejects_inputs_off_contract(vision_exports):
    encoder = OnnxVisionRunner(vision_exports["dense"])
    pixels = np.zeros((16, 1536), np.float32)
    with pytest.raises(InputError, match="1536"):
        encoder.encode(np.zeros((16, 1000), np.float32), [[1, 4, 4]])
    with pytest.raises(InputError, match="describes 32"):
        encoder.encode(pixels, [[2, 4, 4]])
    with pytest.raises(InputError, match="multiples of spatial_merge_size"):
        encoder.encode(np.zeros((15, 1536), np.float32), [[1, 3, 5]])
    with pytest.raises(InputError, match=r"\[num_images, 3\]"):
        encoder.encode(pixels, [4, 4])
