"""The vision export reads the tower's tensors only, even from a shard dominated by the language model."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys

import torch
from qwen3vl_trt.common.contracts import VISUAL_PREFIX
from qwen3vl_trt.hf.checkpoint import Checkpoint
from safetensors import safe_open

LM_TENSOR_BYTES = 6 * 2**30  # a sparse 6 GiB language-model tensor: free on disk, 6 GiB of RSS if read


def _write_mixed_shard(path, small_name: str, small: bytes, small_meta: dict) -> None:
    """A safetensors shard with one real visual tensor and one huge LM tensor left as a file hole."""
    header = {
        small_name: {**small_meta, "data_offsets": [0, len(small)]},
        "model.language_model.layers.99.mlp.huge.weight": {
            "dtype": "BF16",
            "shape": [LM_TENSOR_BYTES // 2],
            "data_offsets": [len(small), len(small) + LM_TENSOR_BYTES],
        },
    }
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + small)
        f.truncate(8 + len(raw) + len(small) + LM_TENSOR_BYTES)


def _peak_rss_mib(args: list[str]) -> float:
    code = (
        "import resource, sys\n"
        "from qwen3vl_trt.cli import main\n"
        "rc = main(sys.argv[1:])\n"
        "print('PEAK', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)\n"
        "sys.exit(rc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, check=True)
    return float(out.stdout.rsplit("PEAK", 1)[1])


def test_export_peak_rss_is_bounded_by_the_tower(tiny_dense, tmp_path):
    ckpt_dir = tmp_path / "ckpt"
    shutil.copytree(tiny_dense, ckpt_dir)
    ckpt = Checkpoint(ckpt_dir)
    name = VISUAL_PREFIX + "merger.linear_fc1.weight"
    with safe_open(str(ckpt_dir / ckpt._weight_map[name]), "pt") as f:
        tensor = f.get_tensor(name)
    meta = {"dtype": "BF16", "shape": list(tensor.shape)}
    raw = tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    _write_mixed_shard(ckpt_dir / "model-lm-huge.safetensors", name, raw, meta)
    index_path = ckpt_dir / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"][name] = "model-lm-huge.safetensors"
    index["weight_map"]["model.language_model.layers.99.mlp.huge.weight"] = "model-lm-huge.safetensors"
    index_path.write_text(json.dumps(index))

    baseline = _peak_rss_mib(["export-vision", "--model", str(tiny_dense), "--output", str(tmp_path / "a")])
    with_huge_lm = _peak_rss_mib(["export-vision", "--model", str(ckpt_dir), "--output", str(tmp_path / "b")])
    print(f"peak RSS: {baseline:.0f} MiB plain, {with_huge_lm:.0f} MiB beside a {LM_TENSOR_BYTES >> 30} GiB LM tensor")
    assert with_huge_lm < baseline + 256, (baseline, with_huge_lm)
    assert (tmp_path / "b" / "vision_encoder.onnx").is_file()
