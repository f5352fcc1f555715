"""No data lost, no untyped failure: outputs never overlap inputs, --force replaces only what this
tool wrote, publishing is durable, reads survive short transfers, no handle outlives an error, and
bad build directories, limits and oversized images are typed errors the CLI reports with exit 2."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from qwen3vl_trt.cli import main as cli
from qwen3vl_trt.common.contracts import VISION_SIDECAR_FILE, BuildLayout
from qwen3vl_trt.common.fsutil import OUTPUT_MARKER, atomic_output_dir
from qwen3vl_trt.common.limits import RequestLimits
from qwen3vl_trt.errors import CheckpointError, ImageTooLargeError
from qwen3vl_trt.hf.checkpoint import Checkpoint
from qwen3vl_trt.llm.checkpoint_format import CONFIG_FILE, load_llm_weights, rank_file
from qwen3vl_trt.llm.convert import convert_llm
from qwen3vl_trt.pipeline.build import build
from qwen3vl_trt.preprocess import Preprocessor
from qwen3vl_trt.preprocess.prompts import normalize_messages
from qwen3vl_trt.qa.tiny import synthetic_jpeg
from safetensors import safe_open
from safetensors.torch import load_file, save_file


def _quiet(*_args, **_kwargs) -> None:
    pass


def _tree_digest(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in root.rglob("*") if p.is_file()
    }


def _open_paths() -> list[str]:
    """What this process's file descriptors point at."""
    paths = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            paths.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:  # the descriptor listdir itself used
            pass
    return paths


def _mapped_paths() -> str:
    return Path("/proc/self/maps").read_text()


@pytest.fixture
def own_checkpoint(tiny_dense, tmp_path):
    """A private copy: a failing guard must not cost the session's shared checkpoint."""
    return Path(shutil.copytree(tiny_dense, tmp_path / "model"))


@pytest.fixture(scope="module")
def build_dir(tiny_dense, tmp_path_factory):
    output = tmp_path_factory.mktemp("safety") / "build"
    build(tiny_dense, output, log=_quiet)
    return output


# -- outputs and inputs ----------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["same", "inside", "around"])
def test_output_overlapping_the_input_is_refused(own_checkpoint, where, capsys):
    model, output = {
        "same": (own_checkpoint, own_checkpoint),
        "inside": (own_checkpoint, own_checkpoint / "trtllm"),
        "around": (own_checkpoint, own_checkpoint.parent),
    }[where]
    before = _tree_digest(own_checkpoint)
    assert cli(["convert-llm", "--model", str(model), "--output", str(output), "--force"]) == 2
    assert f"output {output} overlaps the input {model}" in capsys.readouterr().err
    assert _tree_digest(own_checkpoint) == before


def test_force_replaces_only_what_qwen3vl_trt_wrote(own_checkpoint, tmp_path, capsys):
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep")
    assert cli(["convert-llm", "--model", str(own_checkpoint), "--output", str(foreign), "--force"]) == 2
    err = capsys.readouterr().err
    assert f"{foreign} was not written by qwen3vl-trt" in err and "delete it yourself" in err
    assert (foreign / "notes.txt").read_text() == "keep"

    ours = tmp_path / "ours"
    assert cli(["convert-llm", "--model", str(own_checkpoint), "--output", str(ours)]) == 0
    assert json.loads((ours / OUTPUT_MARKER).read_text())["written_by"] == "qwen3vl-trt"
    assert cli(["convert-llm", "--model", str(own_checkpoint), "--output", str(ours), "--tp", "2", "--force"]) == 0
    assert (ours / rank_file(1)).is_file() and (ours / OUTPUT_MARKER).is_file()


def test_publishing_flushes_every_file_and_directory_before_the_rename(tmp_path, monkeypatch):
    events: list[tuple[str, str]] = []
    real_fsync, real_rename = os.fsync, os.rename

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def rename(src, dst):
        events.append(("rename", os.fspath(dst)))
        real_rename(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    output = tmp_path / "out"
    with atomic_output_dir(output) as tmp:
        (tmp / "a.bin").write_bytes(b"a")
        (tmp / "sub").mkdir()
        (tmp / "sub" / "b.bin").write_bytes(b"b")
        tmp_name = tmp.name
    published = events.index(("rename", str(output)))
    synced_before = {path.replace(tmp_name, "out") for kind, path in events[:published] if kind == "fsync"}
    expected = {str(output), str(output / "sub"), str(output / "a.bin"), str(output / "sub" / "b.bin")}
    assert expected | {str(output / OUTPUT_MARKER)} <= synced_before
    assert ("fsync", str(tmp_path)) in events[published:]  # the rename itself


# -- reads, writers and handles --------------------------------------------------------------------------


def test_reads_survive_short_transfers(tiny_dense, monkeypatch):
    ckpt = Checkpoint(tiny_dense)
    name = "model.language_model.embed_tokens.weight"
    location = ckpt.locate(name)
    with safe_open(str(location.path), framework="pt") as f:
        expected = f.get_tensor(name)
    real_preadv = os.preadv

    def short_preadv(fd, buffers, offset):  # as a network file system may answer
        return real_preadv(fd, [memoryview(buffers[0])[:1000]], offset)

    monkeypatch.setattr(os, "preadv", short_preadv)
    assert torch.equal(location.read_rows(0, location.shape[0]), expected)
    assert torch.equal(location.read_rows(3, 5), expected[3:5])


# The exception keeps its frames alive (a server logging it would too): handles must be closed anyway.


def test_failed_conversion_leaves_no_handle_open(own_checkpoint, tmp_path):
    ckpt = Checkpoint(own_checkpoint)
    ckpt.verify_shards()
    norm = ckpt.locate("model.language_model.norm.weight")
    with norm.path.open("r+b") as f:  # the shard shrinks after its header was read: a premature end
        f.truncate(norm.offset + 1)
    with pytest.raises(CheckpointError, match="ended early") as failure:
        convert_llm(ckpt, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
    assert not [p for p in _open_paths() if p.startswith(str(tmp_path))], failure


def test_failed_load_leaves_no_rank_file_mapped(tiny_dense, tmp_path):
    out = convert_llm(tiny_dense, tmp_path / "c", tp=2, progress=False)
    rank0 = out / rank_file(0)
    tensors = {name: t.clone() for name, t in load_file(rank0).items()}  # clones: rank0 is not left mapped
    del tensors["transformer.vocab_embedding.weight"]  # the first tensor read: nothing is loaded yet
    save_file(tensors, rank0, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="rank0.safetensors lacks") as failure:
        load_llm_weights(out)
    mapped = _mapped_paths()
    assert str(rank0) not in mapped and str(out / rank_file(1)) not in mapped, failure


# -- typed errors through the CLI ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--max-batch-size", "0"], "EngineLimits.max_batch_size must be a positive integer, got 0"),
        (["--max-seq-len", "100"], "max_seq_len (100) must exceed max_input_len (8192)"),
    ],
)
def test_bad_limits_exit_2(tiny_dense, tmp_path, flags, message, capsys):
    for command in (["build", "--model", str(tiny_dense)], ["build-llm-engine", "--checkpoint", str(tmp_path)]):
        assert cli([*command, "--output", str(tmp_path / "out"), *flags]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"qwen3vl-trt {command[0]}: error: ") and message in err


def _generate(model: Path, build: Path, *extra: str) -> int:
    return cli(["generate", "--model", str(model), "--build", str(build), "--max-new-tokens", "3", *extra])


@pytest.mark.parametrize(
    ("file", "content", "message"),
    [
        (f"vision/{VISION_SIDECAR_FILE}", "{not json", "vision_config.json is not valid JSON"),
        (f"vision/{VISION_SIDECAR_FILE}", '{"format_version": 1}', "is not a vision export sidecar this version reads"),
        (f"vision/{VISION_SIDECAR_FILE}", "[1, 2]", "holds a JSON list, not an object"),
        (BuildLayout.MANIFEST, "", "manifest.json is not valid JSON"),
        (BuildLayout.MANIFEST, '{"stages": "all"}', "is not a qwen3vl-trt build manifest"),
        (BuildLayout.MANIFEST, '{"stages": []}', "lacks the stage(s) vision-onnx, llm-checkpoint"),
        (f"llm_checkpoint/{CONFIG_FILE}", "\x00\x01", "config.json is not valid JSON"),
        (f"llm_checkpoint/{CONFIG_FILE}", '{"architecture": "LlamaForCausalLM"}', "architecture is 'LlamaForCausalLM'"),
    ],
)
def test_corrupt_or_foreign_build_files_exit_2(tiny_dense, build_dir, tmp_path, file, content, message, capsys):
    broken = Path(shutil.copytree(build_dir, tmp_path / "build"))
    (broken / file).write_text(content)
    assert _generate(tiny_dense, broken) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_truncated_rank_file_exit_2(tiny_dense, build_dir, tmp_path, capsys):
    broken = Path(shutil.copytree(build_dir, tmp_path / "build"))
    rank0 = broken / "llm_checkpoint" / "rank0.safetensors"
    rank0.write_bytes(rank0.read_bytes()[:-100])
    assert _generate(tiny_dense, broken) == 2
    err = capsys.readouterr().err
    assert "rank0.safetensors is not a readable safetensors file" in err and err.count("\n") == 1, err


@pytest.mark.parametrize("content", ["{not json", '{"eos_token_id": "<|im_end|>"}'])
def test_corrupt_generation_config_exit_2(tiny_dense, build_dir, tmp_path, content, capsys):
    model = Path(shutil.copytree(tiny_dense, tmp_path / "model"))
    (model / "generation_config.json").write_text(content)
    assert _generate(model, build_dir) == 2
    err = capsys.readouterr().err
    assert "generation_config.json" in err and err.count("\n") == 1, err


@pytest.mark.parametrize(
    ("entry", "value", "message"),
    [
        ("mapping", "tp2", "lacks 'mapping.tp_size'"),
        ("qwen3_vl", None, "lacks 'qwen3_vl.deepstack_count'"),
        ("num_hidden_layers", "3", "'num_hidden_layers' must be a positive integer, got '3'"),
        ("norm_epsilon", True, "'norm_epsilon' must be a number, got True"),
        ("dtype", "int4", "dtype 'int4' is not one of float32, float16, bfloat16"),
    ],
)
def test_malformed_trtllm_config_exit_2(build_dir, tmp_path, entry, value, message, capsys):
    checkpoint = Path(shutil.copytree(build_dir / "llm_checkpoint", tmp_path / "c"))
    config = json.loads((checkpoint / CONFIG_FILE).read_text())
    config[entry] = value
    (checkpoint / CONFIG_FILE).write_text(json.dumps(config))
    args = ["build-llm-engine", "--checkpoint", str(checkpoint), "--output", str(tmp_path / "e"), "--print-command"]
    assert cli(args) == 2
    err = capsys.readouterr().err
    assert f"{checkpoint / CONFIG_FILE}" in err and message in err and "qwen3vl-trt convert-llm" in err


def test_build_of_another_checkpoint_is_refused(checkpoints, build_dir, capsys):
    other = checkpoints["moe"]
    assert _generate(other, build_dir) == 2
    err = capsys.readouterr().err
    assert f"made from the checkpoint {checkpoints['dense']}" in err and f"but {other} has" in err
    assert f"qwen3vl-trt build --model {other} --output {build_dir} --force" in err


def test_generate_json_prints_text_and_token_ids(tiny_dense, build_dir, tmp_path, capsys):
    photo = tmp_path / "photo.jpg"
    photo.write_bytes(synthetic_jpeg(64, 96))
    assert _generate(tiny_dense, build_dir, "--image", str(photo)) == 0
    streamed = capsys.readouterr().out
    assert _generate(tiny_dense, build_dir, "--image", str(photo), "--json") == 0
    answer = json.loads(capsys.readouterr().out)  # one object, nothing else
    assert set(answer) == {"text", "token_ids"} and answer["text"] + "\n" == streamed
    assert 1 <= len(answer["token_ids"]) <= 3 and all(isinstance(t, int) for t in answer["token_ids"])


# -- data: URLs ------------------------------------------------------------------------------------------


def _data_url(data: bytes, line_length: int = 76) -> str:
    encoded = base64.b64encode(data).decode()
    lines = [encoded[i : i + line_length] for i in range(0, len(encoded), line_length)]
    return "data:image/jpeg;base64," + "\r\n".join(lines)


def _image_url_message(url: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]


@pytest.mark.parametrize("size", [1000, 1001, 1002])  # every base64 padding length
def test_data_url_cap_is_exact(size):
    data = os.urandom(size)
    _, images, _ = normalize_messages(_image_url_message(_data_url(data)), max_image_bytes=size)
    assert images == [data]
    with pytest.raises(ImageTooLargeError, match="message 0 part 0: the image is"):
        normalize_messages(_image_url_message(_data_url(data)), max_image_bytes=size - 1)


def test_data_url_is_capped_before_decoding():
    # Not even base64: the size alone refuses it, before any decoding is attempted.
    url = "data:image/png;base64," + "!" * (4 * 2**20)
    with pytest.raises(ImageTooLargeError, match="is 3,145,728 bytes, over the limit of 1,048,576 bytes"):
        normalize_messages(_image_url_message(url), max_image_bytes=2**20)


def test_preprocessor_applies_its_image_byte_limit(tiny_dense):
    jpeg = synthetic_jpeg(64, 64)
    messages = _image_url_message(_data_url(jpeg))
    fits = Preprocessor.from_pretrained(tiny_dense, limits=RequestLimits(max_image_bytes=len(jpeg)))
    assert fits(messages).image_grid_thw.tolist() == [[1, 16, 16]]
    tight = Preprocessor.from_pretrained(tiny_dense, limits=RequestLimits(max_image_bytes=len(jpeg) - 1))
    with pytest.raises(ImageTooLargeError):
        tight(messages)
    with pytest.raises(ImageTooLargeError, match="image 0"):
        tight(prompt="<|vision_start|><|image_pad|><|vision_end|>Describe.", images=[jpeg])
