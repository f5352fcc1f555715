"""Checkpoint reader: both config styles, size identification, and a clear error for each bad input."""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import transformers
from qwen3vl_trt.cli import main as cli_main
from qwen3vl_trt.common.contracts import VISUAL_PREFIX
from qwen3vl_trt.errors import CheckpointError, UnsupportedModelError
from qwen3vl_trt.hf.checkpoint import CONFIG_ALIASES, Checkpoint, parse_config
from qwen3vl_trt.llm.convert import convert_llm
from qwen3vl_trt.qa.tiny import PRESETS, build_config
from transformers.models.qwen3_vl import configuration_qwen3_vl as dense_configs
from transformers.models.qwen3_vl_moe import configuration_qwen3_vl_moe as moe_configs

TRANSFORMERS_MAJOR = int(transformers.__version__.split(".")[0])


def _v5_style(cfg: dict) -> dict:
    """The same config as transformers 5.x writes it: rope_parameters instead of rope_scaling."""
    cfg = copy.deepcopy(cfg)
    text = cfg["text_config"]
    scaling = text.pop("rope_scaling")
    text["rope_parameters"] = {**scaling, "rope_theta": text.pop("rope_theta")}
    return cfg


@pytest.mark.parametrize("moe", [False, True])
def test_both_config_styles_parse_identically(moe):
    cfg = build_config(PRESETS["tiny"], moe=moe)
    old, new = parse_config(cfg), parse_config(_v5_style(cfg))
    assert old == new
    assert old.is_moe is moe and old.text.mrope_section == (8, 4, 4) and old.text.mrope_interleaved
    assert old.text.rope_theta == 5e6 and old.vision.head_dim == 64 and old.deepstack_count == 3


# Every config class of Qwen3-VL in the installed transformers, by the config.json object it reads.
CONFIG_CLASSES = [
    dense_configs.Qwen3VLConfig,
    dense_configs.Qwen3VLVisionConfig,
    dense_configs.Qwen3VLTextConfig,
    moe_configs.Qwen3VLMoeConfig,
    moe_configs.Qwen3VLMoeVisionConfig,
    moe_configs.Qwen3VLMoeTextConfig,
]


def test_alias_table_is_what_transformers_declares():
    """CONFIG_ALIASES holds the installed classes' attribute_map entries (5.x declares them, 4.57 none)."""
    installed = {
        (cls.base_config_key or "config", standard, stored)
        for cls in CONFIG_CLASSES
        for standard, stored in cls.attribute_map.items()
    }
    declared = {
        (section, standard, stored) for section, names in CONFIG_ALIASES.items() for standard, stored in names.items()
    }
    assert installed <= declared
    if TRANSFORMERS_MAJOR >= 5:
        assert installed == declared


def _renamed_to_aliases(cfg: dict) -> dict:
    """The config with every field that has an alias written under that alias instead."""
    cfg = copy.deepcopy(cfg)
    for section, names in CONFIG_ALIASES.items():
        values = cfg[section]
        for standard, stored in names.items():
            if stored in values:
                values[standard] = values.pop(stored)
            elif standard in values:
                values[stored] = values.pop(standard)
    return cfg


@pytest.mark.parametrize("moe", [False, True])
def test_fields_are_read_under_their_aliases(moe):
    cfg = build_config(PRESETS["tiny"], moe=moe)
    renamed = _renamed_to_aliases(cfg)
    assert renamed["vision_config"]["num_hidden_layers"] == 4 and "depth" not in renamed["vision_config"]
    assert ("num_local_experts" in renamed["text_config"]) is moe
    assert parse_config(renamed) == parse_config(cfg)


@pytest.mark.parametrize("style", ["4.57", "5.x"])
def test_absent_mrope_interleaved_means_interleaved(style):
    """transformers' Qwen3-VL rotary embedding interleaves whatever the config says."""
    cfg = build_config(PRESETS["tiny"], moe=False)
    del cfg["text_config"]["rope_scaling"]["mrope_interleaved"]
    cfg = _v5_style(cfg) if style == "5.x" else cfg
    assert parse_config(cfg).text.mrope_interleaved is True


@pytest.mark.parametrize("style", ["4.57", "5.x"])
def test_chunked_mrope_is_refused(style):
    cfg = build_config(PRESETS["tiny"], moe=False)
    cfg["text_config"]["rope_scaling"]["mrope_interleaved"] = False
    cfg = _v5_style(cfg) if style == "5.x" else cfg
    with pytest.raises(UnsupportedModelError, match="mrope_interleaved is false"):
        parse_config(cfg)


@pytest.mark.parametrize(("saved_by", "tied"), [("5.1.0", True), ("4.57.3", False)])
def test_tie_flag_is_read_where_the_saving_version_reads_it(saved_by, tied):
    """transformers 5.x ties by the top-level flag, 4.x by text_config's (tests/test_saved_checkpoints.py
    checks this against both versions' save_pretrained)."""
    cfg = build_config(PRESETS["tiny"], moe=False) | {"tie_word_embeddings": True, "transformers_version": saved_by}
    cfg["text_config"]["tie_word_embeddings"] = False
    assert parse_config(cfg).tie_word_embeddings is tied


def test_disagreeing_tie_flags_without_a_version_are_refused():
    cfg = build_config(PRESETS["tiny"], moe=False) | {"tie_word_embeddings": True}
    cfg["text_config"]["tie_word_embeddings"] = False
    with pytest.raises(CheckpointError, match="tie_word_embeddings"):
        parse_config(cfg)


def _released(moe: bool, hidden: int, layers: int) -> dict:
    cfg = build_config(PRESETS["tiny"], moe=moe)
    cfg["text_config"].update(hidden_size=hidden, num_hidden_layers=layers)
    cfg["vision_config"]["out_hidden_size"] = hidden
    return cfg


@pytest.mark.parametrize(
    ("moe", "hidden", "layers", "name"),
    [
        (False, 2048, 28, "2B"),
        (False, 2560, 36, "4B"),
        (False, 4096, 36, "8B"),
        (False, 5120, 64, "32B"),
        (True, 2048, 48, "30B-A3B"),
        (True, 4096, 94, "235B-A22B"),
        (False, 64, 3, "custom"),
    ],
)
def test_identifies_released_sizes(moe, hidden, layers, name):
    assert parse_config(_released(moe, hidden, layers)).size_name == name


@pytest.mark.parametrize(("model_type", "name"), [("qwen2_vl", "Qwen2-VL"), ("qwen2_5_vl", "Qwen2.5-VL")])
def test_predecessors_are_named(model_type, name):
    cfg = build_config(PRESETS["tiny"], moe=False) | {"model_type": model_type}
    with pytest.raises(UnsupportedModelError, match=f"{name}.*Qwen3-VL only"):
        parse_config(cfg)


def test_deepstack_indexes_are_checked():
    cfg = build_config(PRESETS["tiny"], moe=False)
    for bad in ([], [0, 4]):
        cfg["vision_config"]["deepstack_visual_indexes"] = bad
        with pytest.raises(CheckpointError, match="deepstack_visual_indexes"):
            parse_config(cfg)


@pytest.mark.parametrize("section", [[8, 4, 2], [8, 8], [8, 4, 4, 0]])
def test_mrope_sections_that_are_not_the_heads_rotary_pairs_are_refused(section, tiny_dense, tmp_path):
    """Refused when the checkpoint is read (inspect, build: before any work), not when serve loads preprocessing."""
    cfg = build_config(PRESETS["tiny"], moe=False)
    cfg["text_config"]["rope_scaling"]["mrope_section"] = section
    with pytest.raises(CheckpointError, match=r"mrope_section .* must be 3 sections \(t, h, w\) that sum to"):
        parse_config(cfg)
    model = shutil.copytree(tiny_dense, tmp_path / "model")
    config = json.loads((model / "config.json").read_text())
    config["text_config"]["rope_scaling"]["mrope_section"] = section
    (model / "config.json").write_text(json.dumps(config))
    assert cli_main(["build", "--model", str(model), "--output", str(tmp_path / "build"), "--target", "cpu"]) == 2
    assert not (tmp_path / "build").exists()


@pytest.mark.parametrize("style", ["4.57", "5.x"])
def test_scaled_rope_is_rejected(style):
    cfg = build_config(PRESETS["tiny"], moe=False)
    cfg["text_config"]["rope_scaling"].update(rope_type="yarn", factor=4.0)
    if style == "5.x":
        cfg = _v5_style(cfg)
    with pytest.raises(UnsupportedModelError, match="rope_type 'yarn' is not supported"):
        parse_config(cfg)


def test_other_architectures_are_rejected():
    with pytest.raises(UnsupportedModelError, match="'llama'"):
        parse_config({"model_type": "llama"})


@pytest.fixture
def copy_of(tiny_dense, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(tiny_dense, dst)
    return dst


def test_not_a_directory(tiny_dense, tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        Checkpoint(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="not a directory"):
        Checkpoint(tiny_dense / "config.json")


def test_missing_config(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        Checkpoint(tmp_path)


def test_missing_shard(copy_of):
    ckpt = Checkpoint(copy_of)
    shard = ckpt._weight_map[VISUAL_PREFIX + "blocks.0.attn.qkv.weight"]
    (copy_of / shard).unlink()
    with pytest.raises(CheckpointError, match=f"shard {shard} is missing"):
        ckpt.load_tensors([VISUAL_PREFIX + "blocks.0.attn.qkv.weight"])
    with pytest.raises(CheckpointError, match="missing"):
        Checkpoint(copy_of).verify_shards()


def test_truncated_shard(copy_of):
    shard = Checkpoint(copy_of).shard_files[0]
    data = (copy_of / shard).read_bytes()
    (copy_of / shard).write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=f"shard {shard} is truncated"):
        Checkpoint(copy_of).verify_shards()


def test_tensor_missing_from_index(copy_of):
    index_path = copy_of / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    name = VISUAL_PREFIX + "merger.linear_fc2.weight"
    del index["weight_map"][name]
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=f"no tensor '{name}'.*index"):
        Checkpoint(copy_of).load_tensors([name])


def test_untied_checkpoint_without_lm_head_is_refused(copy_of, tmp_path):
    """The head of an untied model is its own tensor: the embedding is no substitute for it."""
    assert not Checkpoint(copy_of).info.tie_word_embeddings
    index_path = copy_of / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    del index["weight_map"]["lm_head.weight"]
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="no lm_head.weight"):
        convert_llm(copy_of, tmp_path / "converted", progress=False)
    assert not (tmp_path / "converted").exists()


def test_no_weights_and_bin_weights(copy_of):
    for f in copy_of.glob("model*"):
        f.unlink()
    with pytest.raises(CheckpointError, match="has no weights"):
        Checkpoint(copy_of)
    (copy_of / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="safetensors checkpoints only"):
        Checkpoint(copy_of)


def test_loads_only_requested_tensors(tiny_dense):
    ckpt = Checkpoint(tiny_dense)
    names = ckpt.tensor_names(VISUAL_PREFIX)
    assert names and all(n.startswith(VISUAL_PREFIX) for n in names)
    tensors = ckpt.load_tensors(names[:3])
    assert list(tensors) == names[:3]


def test_single_file_checkpoint(tiny_dense, tmp_path):
    """Small checkpoints ship one model.safetensors and no index."""
    from safetensors.torch import save_file

    dst = tmp_path / "single"
    shutil.copytree(tiny_dense, dst)
    sharded = Checkpoint(dst)
    tensors = sharded.load_tensors(sharded.tensor_names())
    for shard in sharded.shard_files:
        (dst / shard).unlink()
    (dst / "model.safetensors.index.json").unlink()
    save_file(tensors, str(dst / "model.safetensors"))
    single = Checkpoint(dst)
    name = VISUAL_PREFIX + "patch_embed.proj.weight"
    assert single.tensor_names() == sorted(tensors)
    assert single.load_tensors([name])[name].equal(tensors[name])
