"""Block-FP8 checkpoints (Qwen's -FP8 releases): their dequantization against transformers and against a naive
reference, what `inspect` reports, refusal of the other quantization methods, broken scales, and every stage
(convert-llm, export-vision, the reference runtime, one served deployment) against the dequantized twin or
transformers.

transformers rounds each dequantized weight (e4m3 times its scale, in float32) to bf16; the stages keep the float32
product when they convert to fp32. The fp32 parity checks (tokens, fp32 conversions, the fp32 vision export) use
checkpoints whose scales are powers of two ("pow2", stored as bf16): their products are e4m3 values scaled, exact in
bf16, so the stages read the very weights transformers holds. Arbitrary float32 and bf16 scales are checked bit for
bit at the weights and through bf16 conversions.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from images import jpeg
from qwen3vl_trt.cli import main as cli
from qwen3vl_trt.common.contracts import VISUAL_PREFIX
from qwen3vl_trt.common.torch_dtypes import SAFETENSORS_DTYPES
from qwen3vl_trt.errors import CheckpointError
from qwen3vl_trt.hf.checkpoint import Checkpoint, read_shard_header
from qwen3vl_trt.hf.quantization import BlockFP8Location, dequantize_block_fp8
from qwen3vl_trt.hf.safetensors_io import TensorLocation
from qwen3vl_trt.llm.convert import convert_llm
from qwen3vl_trt.qa.quantized import dequantized_twin, quantize_block_fp8
from qwen3vl_trt.qa.tiny import ENDOFTEXT_ID, IM_END_ID, make_tiny_checkpoint
from safetensors import safe_open
from safetensors.torch import load_file, save_file

# Every text dimension a multiple of the 128x128 block: what transformers' FP8 loading accepts.
ALIGNED = dict(hidden_size=128, num_key_value_heads=4, intermediate_size=256)
END_IDS = (IM_END_ID, ENDOFTEXT_ID)
NEW_TOKENS = 8
PHOTO = jpeg(64, 96, seed=1)
MESSAGES = [{"role": "user", "content": [{"type": "image", "image": PHOTO}, {"type": "text", "text": "Describe."}]}]


def _quiet(*_args, **_kwargs) -> None:
    pass


def _transformers_major() -> int:
    import transformers

    return int(transformers.__version__.split(".")[0])


def needs_transformers_fp8() -> None:
    if _transformers_major() < 5:
        pytest.skip("transformers < 5 refuses FP8 checkpoints on CPU (it needs a GPU to load them)")


def load_hf_fp8(model_dir: Path, dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    """The FP8 checkpoint as transformers 5.x loads it on a CPU (dequantized to bf16), then in `dtype`."""
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.bfloat16).to(dtype).eval()


def _pow2_scales(model_dir: Path) -> Path:
    """Rounds every block scale of an FP8 checkpoint to a power of two (stored as bf16), in place."""
    for shard in Checkpoint(model_dir).shard_files:
        path = model_dir / shard
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata()
        tensors = load_file(str(path))
        for name in [n for n in tensors if n.endswith("weight_scale_inv")]:
            tensors[name] = torch.exp2(torch.log2(tensors[name].float()).round()).to(torch.bfloat16)
        save_file(tensors, str(path), metadata=metadata)
    return model_dir


BASES = {
    "aligned": dict(seed=11, text_overrides=ALIGNED),
    "ragged": dict(seed=12),
    "moe": dict(moe=True, seed=13),
}
SCALES = {"f32": torch.float32, "bf16": torch.bfloat16, "pow2": torch.float32, "pow2-vision": torch.float32}


class Made:
    """Checkpoints by name, each made on first use: a bf16 tiny one ("aligned", "ragged", "moe"), its block-FP8
    version ("NAME-fp8-SCALES": float32, bf16 or power-of-two scales; "pow2-vision" quantizes the tower too) and
    that one's dequantized twin ("NAME-fp8-SCALES-twin")."""

    def __init__(self, root: Path):
        self.root, self.paths = root, {}

    def __getitem__(self, name: str) -> Path:
        if name not in self.paths:
            self.paths[name] = self._make(name)
        return self.paths[name]

    def _make(self, name: str) -> Path:
        out = self.root / name
        if name in BASES:
            return make_tiny_checkpoint(out, **BASES[name])
        if name.endswith("-twin"):
            return dequantized_twin(self[name[: -len("-twin")]], out)
        base, tag = name.split("-fp8-")
        fp8 = quantize_block_fp8(self[base], out, SCALES[tag], vision=tag.endswith("vision"))
        return _pow2_scales(fp8) if tag.startswith("pow2") else fp8


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    return Made(tmp_path_factory.mktemp("fp8"))


def naive_dequantize(weight: torch.Tensor, scale: torch.Tensor, block=(128, 128)) -> torch.Tensor:
    """Block by block: each block's e4m3 values in float32 times its scale (the last row/column of blocks partial)."""
    n, k = weight.shape
    out = torch.empty(n, k, dtype=torch.float32)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            rows, cols = slice(i * block[0], (i + 1) * block[0]), slice(j * block[1], (j + 1) * block[1])
            out[rows, cols] = weight[rows, cols].to(torch.float32) * scale[i, j].to(torch.float32)
    return out


def raw_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for shard in Checkpoint(model_dir).shard_files:
        state.update(load_file(str(model_dir / shard)))
    return state


# -- 1. bit for bit against transformers' FP8 loading ------------------------------------------------------------


@pytest.mark.parametrize("scales", ["f32", "bf16", "pow2"])
def test_dequantized_weights_equal_transformers_bit_for_bit(made, scales):
    needs_transformers_fp8()
    fp8 = made[f"aligned-fp8-{scales}"]
    ckpt = Checkpoint(fp8)
    quantized = ckpt.quantized_tensor_names()
    assert len(quantized) == 5 * 7  # every projection of the five layers
    theirs = load_hf_fp8(fp8).state_dict()
    ours = ckpt.load_tensors(ckpt.tensor_names())
    for name in quantized:
        assert ours[name].dtype == torch.float32
        assert torch.equal(ours[name].to(torch.bfloat16), theirs[name]), name
        if scales == "pow2":  # bf16 values already: the fp32 stages read transformers' weights
            assert torch.equal(ours[name], theirs[name].float()), name
    for name in set(ours) - set(quantized):  # the unquantized tensors are the stored ones
        if name in theirs:
            assert torch.equal(ours[name], theirs[name]), name


# -- 2. ragged shapes against a naive reference -----------------------------------------------------------------


@pytest.mark.once
def test_ragged_checkpoint_dequantizes_as_the_naive_reference(made):
    ckpt = Checkpoint(made["ragged-fp8-f32"])
    raw = raw_tensors(ckpt.path)
    quantized = ckpt.quantized_tensor_names()
    shapes = {tuple(raw[n].shape) for n in quantized}
    assert any(n % 128 or k % 128 for n, k in shapes)  # hidden 64: partial blocks
    for name, tensor in ckpt.iter_tensors(quantized):
        expected = naive_dequantize(raw[name], raw[name + "_scale_inv"])
        assert torch.equal(tensor, expected), name
        location = ckpt.locate(name)
        assert isinstance(location, BlockFP8Location)
        assert torch.equal(location.read_rows(1, location.shape[0] - 1), expected[1:-1]), name
    assert not any(n.endswith("weight_scale_inv") for n in ckpt.tensor_names())


def _fp8_file(path: Path, tensors: dict[str, torch.Tensor]) -> dict[str, TensorLocation]:
    save_file(tensors, str(path))
    header = read_shard_header(path)
    return {
        name: TensorLocation(
            path,
            header.data_start + int(meta["data_offsets"][0]),
            SAFETENSORS_DTYPES[meta["dtype"]],
            tuple(meta["shape"]),
        )
        for name, meta in header.tensors.items()
    }


RANGES = [(0, 300), (100, 300), (0, 1), (127, 129), (128, 256), (255, 256), (299, 300), (3, 140)]


@pytest.mark.once
def test_block_fp8_rows_of_a_ragged_weight_equal_the_naive_reference(tmp_path):
    g = torch.Generator().manual_seed(0)
    weight = (torch.randn(300, 200, generator=g) * 100).to(torch.float8_e4m3fn)
    scale = torch.rand(3, 2, generator=g) + 0.01
    expected = naive_dequantize(weight, scale)
    assert torch.equal(dequantize_block_fp8(weight, scale, (128, 128)), expected)
    at = _fp8_file(tmp_path / "w.safetensors", {"w": weight, "s": scale})
    location = BlockFP8Location(at["w"], at["s"], (128, 128))
    assert location.shape == (300, 200) and location.row_bytes == 200 * 4
    for start, stop in RANGES:
        rows = location.read_rows(start, stop)
        assert rows.dtype == torch.float32 and torch.equal(rows, expected[start:stop]), (start, stop)
        # the function itself, given the rows and the scales of the blocks they lie in
        scales = scale[start // 128 : -(-stop // 128)]
        assert torch.equal(dequantize_block_fp8(weight[start:stop], scales, (128, 128), start), expected[start:stop])
    # other block shapes, bf16 scales
    scale_bf16 = (torch.rand(5, 4, generator=g) + 0.01).to(torch.bfloat16)
    expected = naive_dequantize(weight, scale_bf16, (64, 64))
    assert torch.equal(dequantize_block_fp8(weight, scale_bf16, (64, 64)), expected)
    assert torch.equal(dequantize_block_fp8(weight[100:300], scale_bf16[1:5], (64, 64), 100), expected[100:300])


@pytest.mark.once
def test_block_fp8_expert_stacks_read_by_expert(tmp_path):
    g = torch.Generator().manual_seed(1)
    weight = (torch.randn(3, 130, 70, generator=g) * 50).to(torch.float8_e4m3fn)
    scale = torch.rand(3, 2, 1, generator=g) + 0.01
    expected = torch.stack([naive_dequantize(w, s) for w, s in zip(weight, scale, strict=True)])
    assert torch.equal(dequantize_block_fp8(weight, scale, (128, 128)), expected)
    at = _fp8_file(tmp_path / "e.safetensors", {"w": weight, "s": scale})
    location = BlockFP8Location(at["w"], at["s"], (128, 128))
    for start, stop in [(0, 3), (1, 2), (2, 3)]:
        assert torch.equal(location.read_rows(start, stop), expected[start:stop])


# -- 3. inspect --------------------------------------------------------------------------------------------------


def inspect(model_dir: Path, capsys) -> dict:
    capsys.readouterr()
    assert cli(["inspect", "--model", str(model_dir)]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.once
@pytest.mark.parametrize(
    "name, quantized",
    [("aligned-fp8-f32", 5 * 7), ("moe-fp8-bf16", 5 * (4 + 4 * 3)), ("aligned-fp8-pow2-vision", None)],
)
def test_inspect_reports_the_quantization(made, capsys, name, quantized):
    info = inspect(made[name], capsys)
    q = info["quantization"]
    raw = raw_tensors(made[name])
    fp8 = [n for n, t in raw.items() if t.dtype == torch.float8_e4m3fn]
    assert q["method"].startswith("fp8") and q["block_size"] == [128, 128]
    assert q["activation_scheme"] == "dynamic"
    config = json.loads((made[name] / "config.json").read_text())
    assert q["modules_to_not_convert"] == config["quantization_config"]["modules_to_not_convert"]
    assert "model.language_model.embed_tokens" in q["modules_to_not_convert"]
    assert q["quantized_tensors"] == len(fp8) and (quantized is None or len(fp8) == quantized)
    assert q["quantized_bytes"] == sum(raw[n].numel() for n in fp8)
    assert q["vision_quantized"] == (name == "aligned-fp8-pow2-vision")
    by_dtype = info["bytes_by_dtype"]
    assert by_dtype["F8_E4M3"] == q["quantized_bytes"]
    scale_tag = "F32" if name.endswith("f32") else "BF16"
    scales = sum(t.numel() * t.element_size() for n, t in raw.items() if n.endswith("weight_scale_inv"))
    assert by_dtype[scale_tag] >= scales > 0
    assert sum(by_dtype.values()) == sum(t.numel() * t.element_size() for t in raw.values())
    if name.startswith("moe"):
        assert info["moe"] and any(".mlp.gate" in m for m in q["modules_to_not_convert"])


@pytest.mark.once
def test_inspect_of_an_unquantized_checkpoint_says_null(made, capsys):
    info = inspect(made["aligned"], capsys)
    assert info["quantization"] is None and "F8_E4M3" not in info["bytes_by_dtype"]


# -- 4. other methods refused by name, before any stage ----------------------------------------------------------

BLOCKED = {
    "awq": ({"quant_method": "awq", "bits": 4, "group_size": 128}, ["'awq'", "AWQ"]),
    "gptq": ({"quant_method": "gptq", "bits": 4, "group_size": 128}, ["'gptq'", "GPTQ"]),
    "bitsandbytes": ({"quant_method": "bitsandbytes", "load_in_4bit": True}, ["'bitsandbytes'"]),
    "compressed-tensors": ({"quant_method": "compressed-tensors"}, ["'compressed-tensors'"]),
    "fp8 per-tensor": ({"quant_method": "fp8", "activation_scheme": "dynamic"}, ["fp8", "weight_block_size"]),
    "fp8 static": (
        {"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]},
        ["fp8", "static"],
    ),
    "fp8 e5m2": ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}, ["fp8", "e5m2"]),
}


def _with_config(src: Path, dst: Path, edit) -> Path:
    """A checkpoint that is `src` with config.json edited (the other files linked)."""
    dst.mkdir()
    for path in src.iterdir():
        if path.name != "config.json":
            (dst / path.name).symlink_to(path)
    config = json.loads((src / "config.json").read_text())
    edit(config)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


@pytest.mark.once
@pytest.mark.parametrize("method", list(BLOCKED))
def test_other_quantizations_are_refused_by_name_before_any_stage(made, tmp_path, capsys, method):
    declared, words = BLOCKED[method]
    model = _with_config(made["ragged"], tmp_path / "model", lambda c: c.__setitem__("quantization_config", declared))
    capsys.readouterr()
    for command in (
        ["inspect", "--model", str(model)],
        ["build", "--model", str(model), "--output", str(tmp_path / "b")],
    ):
        assert cli(command) == 2, command
        captured = capsys.readouterr()
        assert captured.err.startswith(f"qwen3vl-trt {command[0]}: error: "), captured.err
        assert len(captured.err.strip().splitlines()) == 1 and "Traceback" not in captured.err
        for word in words:
            assert word in captured.err, (word, captured.err)
        assert not captured.out.strip(), captured.out  # no stage ran
    assert not (tmp_path / "b").exists()


# -- 5. broken scales, FP8 without its config --------------------------------------------------------------------

VICTIM = "model.language_model.layers.1.self_attn.q_proj.weight"


def _rewrite(src: Path, dst: Path, edit_tensors=None, edit_config=None) -> Path:
    """A copy of an FP8 checkpoint with its tensors (the shard holding VICTIM) and/or config edited."""
    shutil.copytree(src, dst)
    index_path = dst / "model.safetensors.index.json"
    if edit_tensors:
        index = json.loads(index_path.read_text())
        shard = dst / index["weight_map"][VICTIM]
        tensors = load_file(str(shard))
        edit_tensors(tensors)
        save_file(tensors, str(shard))
        index["weight_map"] = {n: s for n, s in index["weight_map"].items() if s != shard.name or n in tensors}
        index_path.write_text(json.dumps(index))
    if edit_config:
        config = json.loads((dst / "config.json").read_text())
        edit_config(config)
        (dst / "config.json").write_text(json.dumps(config))
    return dst


BROKEN = {
    "missing scale": (
        dict(edit_tensors=lambda t: t.pop(VICTIM + "_scale_inv")),
        [f"'{VICTIM}'", f"'{VICTIM}_scale_inv'"],
    ),
    "wrong scale shape": (
        dict(edit_tensors=lambda t: t.__setitem__(VICTIM + "_scale_inv", torch.ones(2, 1))),
        [f"'{VICTIM}_scale_inv'", "[2, 1]", "[1, 1]"],
    ),
    "no quantization_config": (
        dict(edit_config=lambda c: c.pop("quantization_config")),
        [f"'{VICTIM}'", "F8_E4M3", "quantization_config"],
    ),
}


@pytest.mark.once
@pytest.mark.parametrize("case", list(BROKEN))
def test_broken_fp8_checkpoints_name_the_tensor(made, tmp_path, case):
    edits, words = BROKEN[case]
    model = _rewrite(made["ragged-fp8-f32"], tmp_path / "model", **edits)
    ckpt = Checkpoint(model)
    with pytest.raises(CheckpointError) as raised:
        ckpt.load_tensors([VICTIM])
    for word in words:
        assert word in str(raised.value), (word, str(raised.value))
    with pytest.raises(CheckpointError) as raised:
        convert_llm(model, tmp_path / "llm", progress=False)
    if case == "no quantization_config":  # the first FP8 tensor the conversion reads
        assert re.search(
            r"tensor 'model\.language_model\.layers\.\d+\.[\w.]+\.weight' is stored as F8_E4M3", str(raised.value)
        )
    else:
        assert f"'{VICTIM}" in str(raised.value)
    assert not (tmp_path / "llm").exists()


# -- 6. convert-llm: the FP8 checkpoint converts as its dequantized twin -----------------------------------------


def _converted(path: Path) -> dict[str, bytes | dict]:
    """Every tensor of every rank (raw bytes, dtype and shape) and config.json."""
    out: dict[str, bytes | dict] = {"config.json": json.loads((path / "config.json").read_text())}
    for shard in sorted(path.glob("rank*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                t = f.get_tensor(name)
                out[f"{shard.name}/{name}"] = (
                    f"{t.dtype}{tuple(t.shape)}".encode() + t.view(torch.uint8).numpy().tobytes()
                )
    return out


# (checkpoint, converted dtype): the twin holds bf16-rounded weights, so bf16 output, and fp32 where the
# dequantized weights are bf16 values (power-of-two scales).
CONVERSIONS = [
    ("aligned-fp8-f32", "bf16"),
    ("aligned-fp8-bf16", "bf16"),
    ("aligned-fp8-pow2", "fp32"),
    ("ragged-fp8-f32", "bf16"),
    ("moe-fp8-f32", "bf16"),
    ("moe-fp8-bf16", "bf16"),
    ("moe-fp8-pow2", "fp32"),
]


@pytest.mark.once
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("name, dtype", CONVERSIONS)
def test_convert_llm_of_fp8_equals_its_dequantized_twin(made, tmp_path, name, dtype, tp):
    ours = convert_llm(made[name], tmp_path / "fp8", dtype=dtype, tp=tp, progress=False)
    twin = convert_llm(made[f"{name}-twin"], tmp_path / "twin", dtype=dtype, tp=tp, progress=False)
    a, b = _converted(ours), _converted(twin)
    assert len(list(ours.glob("rank*.safetensors"))) == tp
    assert a.keys() == b.keys()
    for key in a:
        assert a[key] == b[key], key


# -- 7. the vision tower quantized -------------------------------------------------------------------------------


@pytest.mark.once
def test_export_vision_of_a_quantized_tower_equals_its_twins(made, tmp_path):
    import onnx
    from onnx import numpy_helper
    from qwen3vl_trt.vision.export import export_vision

    fp8 = Checkpoint(made["aligned-fp8-pow2-vision"])
    assert any(n.startswith(VISUAL_PREFIX) for n in fp8.quantized_tensor_names())
    twin = Checkpoint(made["aligned-fp8-pow2-vision-twin"])
    names = fp8.tensor_names(VISUAL_PREFIX)
    assert names == twin.tensor_names(VISUAL_PREFIX)
    ours, theirs = fp8.load_tensors(names), twin.load_tensors(names)
    for name in names:
        assert torch.equal(ours[name].to(theirs[name].dtype), theirs[name]), name

    def initializers(model_dir: Path, out: Path) -> dict[str, np.ndarray]:
        result = export_vision(model_dir, out, dtype="fp32", log=_quiet)
        graph = onnx.load(str(result.output_dir / "vision_encoder.onnx")).graph
        return {i.name: numpy_helper.to_array(i) for i in graph.initializer}

    a = initializers(fp8.path, tmp_path / "fp8")
    b = initializers(twin.path, tmp_path / "twin")
    assert a.keys() == b.keys() and len(a) > 10
    for name in a:
        assert a[name].dtype == b[name].dtype and np.array_equal(a[name], b[name]), name


# -- 8. greedy tokens: the reference runtime on the converted FP8 checkpoint against transformers ----------------


@pytest.fixture(scope="module")
def vision_dirs(made, tmp_path_factory):
    from qwen3vl_trt.vision.export import export_vision

    root = tmp_path_factory.mktemp("fp8-vision")
    cache: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in cache:
            cache[name] = export_vision(made[name], root / name, dtype="fp32", log=_quiet).output_dir
        return cache[name]

    return get


def greedy_pair(fp8: Path, vision_dir: Path, hf: torch.nn.Module, out: Path) -> tuple[list[int], list[int]]:
    """(the reference runtime's tokens on the converted FP8 checkpoint, transformers' generate) for MESSAGES."""
    from qwen3vl_trt.hf.reference import hf_model_inputs
    from qwen3vl_trt.preprocess import Preprocessor
    from qwen3vl_trt.runtime import ReferenceLLM, SamplingParams
    from qwen3vl_trt.runtime.local import engine_request
    from qwen3vl_trt.vision import OnnxVisionRunner

    pre, encoder = Preprocessor.from_pretrained(fp8), OnnxVisionRunner(vision_dir)
    llm = ReferenceLLM.from_checkpoint(convert_llm(fp8, out / "llm", dtype="fp32", progress=False))
    sampling = SamplingParams(max_new_tokens=NEW_TOKENS, end_ids=END_IDS)
    (result,) = llm.generate([engine_request(pre, encoder, MESSAGES, sampling)])
    r = pre(MESSAGES)
    inputs = hf_model_inputs(hf, r.input_ids, pre.info.image_token_id, r.pixel_values, r.image_grid_thw)
    with torch.no_grad():
        tokens = hf.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=list(END_IDS))
    return result.output_ids, tokens[0, inputs["input_ids"].shape[1] :].tolist()


@pytest.mark.slow
def test_greedy_tokens_of_moe_fp8_equal_transformers_on_the_dequantized_twin(made, vision_dirs, tmp_path):
    """transformers skips per-expert FP8 keys (its fused experts stay random), so its reference is the twin."""
    from transformers import AutoModelForImageTextToText

    twin = AutoModelForImageTextToText.from_pretrained(made["moe-fp8-pow2-twin"], dtype=torch.float32).eval()
    ours, theirs = greedy_pair(made["moe-fp8-pow2"], vision_dirs("moe-fp8-pow2"), twin, tmp_path)
    assert len(theirs) > 1 and ours == theirs


# -- served: the CPU deployment built from the FP8 checkpoint ----------------------------------------------------


def _served_tokens(model: Path, root: Path, **options: object) -> list[int]:
    """Greedy tokens for MESSAGES from the CPU deployment built (build --target cpu) from `model` with `options`."""
    from deployment import LIMITS, SETTINGS
    from qwen3vl_trt.pipeline.build import BuildOptions, build
    from qwen3vl_trt.serving.client import Client
    from qwen3vl_trt.serving.ports import free_ports
    from qwen3vl_trt.serving.server.tritonserver import TritonServer

    build(model, root / "build", BuildOptions(limits=LIMITS, **options), target="cpu", settings=SETTINGS, log=_quiet)
    server = TritonServer(root / "build" / "triton_repo", free_ports(), log_path=root / "server.log")
    server.start()
    try:
        server.wait_ready()
        return Client(server.url, timeout_s=120).generate("Describe.", [PHOTO], max_tokens=NEW_TOKENS).token_ids
    finally:
        server.stop()


@pytest.mark.slow
@pytest.mark.server
@pytest.mark.parametrize("name", ["aligned-fp8-pow2", "moe-fp8-pow2"])
def test_served_greedy_tokens_of_fp8_checkpoints_equal_transformers(made, tmp_path, name):
    """Dense: transformers on the FP8 checkpoint as it loads it; MoE: on the dequantized twin (transformers leaves
    per-expert FP8 keys unloaded)."""
    from qwen3vl_trt.hf.reference import hf_request_inputs
    from qwen3vl_trt.preprocess import Preprocessor
    from transformers import AutoModelForImageTextToText

    fp8 = made[name]
    served = _served_tokens(fp8, tmp_path, llm_dtype="fp32")
    if name.startswith("moe"):
        hf = AutoModelForImageTextToText.from_pretrained(made[name + "-twin"], dtype=torch.float32).eval()
    else:
        needs_transformers_fp8()
        hf = load_hf_fp8(fp8, torch.float32)
    pre = Preprocessor.from_pretrained(fp8)
    inputs = hf_request_inputs(hf, pre(MESSAGES), pre.info.image_token_id, pre.info.video_token_id)
    with torch.no_grad():
        out = hf.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=list(END_IDS))
    expected = [t for t in out[0, inputs["input_ids"].shape[1] :].tolist() if t not in END_IDS]
    assert expected and served == expected
