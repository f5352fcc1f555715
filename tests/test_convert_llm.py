"""convert-llm: the TensorRT-LLM checkpoint's config, its tensor layout per rank, and its failures.

The layout checks slice the Hugging Face tensors directly, the way TensorRT-LLM 1.2.1's Qwen
converter does (tensorrt_llm/models/qwen/convert.py), independently of the Split tables the
converter and the reference runtime share.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from qwen3vl_trt.cli import main as cli
from qwen3vl_trt.common.fsutil import OUTPUT_MARKER
from qwen3vl_trt.errors import CheckpointError, OutputExistsError, UnsupportedModelError
from qwen3vl_trt.hf.checkpoint import Checkpoint
from qwen3vl_trt.hf.safetensors_io import StreamingWriter
from qwen3vl_trt.llm import convert as convert_module
from qwen3vl_trt.llm.checkpoint_format import LLMConfig, ParallelLayout, Split, layer_params, merge, read_trtllm_config
from qwen3vl_trt.llm.convert import Source, convert_llm
from qwen3vl_trt.qa.tiny import make_tiny_checkpoint
from qwen3vl_trt.runtime import LLMRequest, ReferenceLLM
from safetensors import safe_open
from transformers import AutoModelForImageTextToText

# What TensorRT-LLM 1.2.1 reads from a qwen3 / qwen3_moe checkpoint's config.json:
# PretrainedConfig.__init__ and from_dict (tensorrt_llm/models/modeling_utils.py),
PRETRAINED_FIELDS = [
    "architecture",
    "dtype",
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_size",
    "hidden_act",
    "intermediate_size",
    "norm_epsilon",
    "position_embedding_type",
    "max_position_embeddings",
    "rotary_embedding_dim",
    "logits_dtype",
    "mapping",
    "quantization",
    "use_parallel_embedding",
    "embedding_sharding_dim",
]
# QWenConfig.__init__ (models/qwen/config.py) and the attributes models/qwen/model.py reads,
QWEN_FIELDS = [
    "qwen_type",
    "mlp_bias",
    "attn_bias",
    "rotary_base",
    "rotary_scaling",
    "disable_weight_only_quant_plugin",
    "use_logn_attn",
    "moe",
    "moe_intermediate_size",
    "moe_shared_expert_intermediate_size",
    "tie_word_embeddings",
    "seq_length",
]
# Mapping.__init__ (mapping.py) and MoeConfig (layers/moe.py).
MAPPING_FIELDS = ["world_size", "tp_size", "pp_size", "cp_size", "moe_tp_size", "moe_ep_size"]
MOE_FIELDS = ["num_experts", "top_k", "normalization_mode", "shared_expert_intermediate_size"]


def _rank(path, rank):
    with safe_open(str(path / f"rank{rank}.safetensors"), framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


def _hf(model_dir, layer=None):
    ckpt = Checkpoint(model_dir)
    prefix = "model.language_model." + ("" if layer is None else f"layers.{layer}.")
    return {name[len(prefix) :]: t.float() for name, t in ckpt.load_tensors(ckpt.tensor_names(prefix)).items()}


@pytest.mark.parametrize("name", ["dense", "moe"])
def test_config_has_the_fields_tensorrt_llm_reads(name, checkpoints, tmp_path):
    out = convert_llm(checkpoints[name], tmp_path / "c", tp=2, pp=1, progress=False)
    cfg, _ = read_trtllm_config(out)
    missing = [f for f in PRETRAINED_FIELDS + QWEN_FIELDS if f not in cfg]
    missing += [f"mapping.{f}" for f in MAPPING_FIELDS if f not in cfg["mapping"]]
    missing += [f"moe.{f}" for f in MOE_FIELDS if f not in cfg["moe"]]
    assert not missing
    hf_text = json.loads((checkpoints[name] / "config.json").read_text())["text_config"]
    moe = name == "moe"
    assert cfg["architecture"] == "Qwen3VLForCausalLM"
    assert cfg["dtype"] == "bfloat16"  # the checkpoint's own dtype by default
    assert cfg["qwen_type"] == ("qwen3_moe" if moe else "qwen3")  # q/k RMSNorm comes with these two
    assert cfg["hidden_act"] == ("swiglu" if moe else "silu")
    assert cfg["head_size"] == cfg["rotary_embedding_dim"] == hf_text["head_dim"] != hf_text["hidden_size"] // 4
    assert cfg["rotary_base"] == 5e6 and cfg["position_embedding_type"] == "mrope"
    assert cfg["attn_bias"] is False and cfg["mlp_bias"] is False
    assert cfg["mapping"]["world_size"] == 2
    assert cfg["mapping"]["tp_size"] == cfg["mapping"]["moe_tp_size"] == 2
    assert cfg["qwen3_vl"] == {
        "deepstack_count": 3,
        "mrope_section": [8, 4, 4],
        "mrope_interleaved": True,
        "image_token_id": 151655,
    }
    if moe:
        assert cfg["moe"]["num_experts"] == 4 and cfg["moe"]["top_k"] == 2
        assert cfg["moe"]["normalization_mode"] == 1  # RENORMALIZE, as transformers' Qwen3-VL-MoE routing
        assert cfg["moe_intermediate_size"] == 48
    else:
        assert cfg["moe"]["num_experts"] == 0


def test_dense_tp2_layout(checkpoints, tmp_path):
    out = convert_llm(checkpoints["dense"], tmp_path / "c", dtype="fp32", tp=2, progress=False)
    hf = _hf(checkpoints["dense"], layer=1)
    hd = 32
    for r in range(2):
        w = _rank(out, r)
        p = "transformer.layers.1."
        q, k, v = (hf[f"self_attn.{n}_proj.weight"] for n in "qkv")
        expected_qkv = torch.cat([q[r * 2 * hd : (r + 1) * 2 * hd], k[r * hd : (r + 1) * hd], v[r * hd : (r + 1) * hd]])
        assert torch.equal(w[p + "attention.qkv.weight"], expected_qkv)
        assert torch.equal(w[p + "attention.dense.weight"], hf["self_attn.o_proj.weight"][:, r * 64 : (r + 1) * 64])
        assert torch.equal(w[p + "attention.q_layernorm.weight"], hf["self_attn.q_norm.weight"])
        assert torch.equal(w[p + "attention.k_layernorm.weight"], hf["self_attn.k_norm.weight"])
        assert torch.equal(w[p + "mlp.fc.weight"], hf["mlp.gate_proj.weight"][r * 64 : (r + 1) * 64])
        assert torch.equal(w[p + "mlp.gate.weight"], hf["mlp.up_proj.weight"][r * 64 : (r + 1) * 64])
        assert torch.equal(w[p + "mlp.proj.weight"], hf["mlp.down_proj.weight"][:, r * 64 : (r + 1) * 64])
        assert torch.equal(w[p + "post_layernorm.weight"], hf["post_attention_layernorm.weight"])
        assert w["transformer.vocab_embedding.weight"].shape == (151936, 64)  # not split
        assert w["lm_head.weight"].shape == (151936 // 2, 64)


def test_moe_tp2_layout_and_router_dtype(checkpoints, tmp_path):
    out = convert_llm(checkpoints["moe"], tmp_path / "c", dtype="bf16", tp=2, progress=False)
    hf = _hf(checkpoints["moe"], layer=0)
    inter, half = 48, 24
    gate_up, down = hf["mlp.experts.gate_up_proj"], hf["mlp.experts.down_proj"]  # [E, H, 2I], [E, I, H]
    for r in range(2):
        w = _rank(out, r)
        p = "transformer.layers.0.mlp."
        assert w[p + "router.weight"].dtype == torch.float32  # TensorRT-LLM never casts the router
        assert torch.equal(w[p + "router.weight"], hf["mlp.gate.weight"])
        part = slice(r * half, (r + 1) * half)
        up = gate_up[:, :, inter:].transpose(1, 2)[:, part]
        gate = gate_up[:, :, :inter].transpose(1, 2)[:, part]
        assert w[p + "fc.weight"].dtype == torch.bfloat16
        assert torch.equal(w[p + "fc.weight"].float(), torch.cat([up, gate], dim=1))  # [E, up_r; gate_r, H]
        assert torch.equal(w[p + "proj.weight"].float(), down.transpose(1, 2)[:, :, part])


def test_kv_heads_repeat_when_tp_exceeds_them(checkpoints, tmp_path):
    out = convert_llm(checkpoints["dense"], tmp_path / "c", dtype="fp32", tp=4, progress=False)
    hf = _hf(checkpoints["dense"], layer=0)
    k = hf["self_attn.k_proj.weight"]
    for r in range(4):
        qkv = _rank(out, r)["transformer.layers.0.attention.qkv.weight"]
        assert qkv.shape == (32 + 32 + 32, 64)  # one q head, one (repeated) k head, one v head
        assert torch.equal(qkv[32:64], k[(r // 2) * 32 : (r // 2 + 1) * 32])


def test_pipeline_stages_hold_local_layers(checkpoints, tmp_path):
    out = convert_llm(checkpoints["dense"], tmp_path / "c", dtype="fp32", pp=2, progress=False)
    first, last = _rank(out, 0), _rank(out, 1)
    layers = lambda w: sorted({int(n.split(".")[2]) for n in w if n.startswith("transformer.layers.")})  # noqa: E731
    assert layers(first) == [0, 1, 2] and layers(last) == [0, 1]  # 5 layers: the first stage takes the extra one
    assert "transformer.vocab_embedding.weight" in first and "transformer.vocab_embedding.weight" not in last
    assert {"transformer.ln_f.weight", "lm_head.weight"} <= set(last) and "lm_head.weight" not in first
    hf = _hf(checkpoints["dense"], layer=3)
    assert torch.equal(last["transformer.layers.0.post_layernorm.weight"], hf["post_attention_layernorm.weight"])


def test_tied_embeddings_write_the_head_and_match_transformers(tmp_path):
    src = make_tiny_checkpoint(tmp_path / "tied", tie_word_embeddings=True, seed=5)
    assert not Checkpoint(src).tensor_names("lm_head")
    out = convert_llm(src, tmp_path / "c", dtype="fp32", progress=False)
    w = _rank(out, 0)
    assert torch.equal(w["lm_head.weight"], w["transformer.vocab_embedding.weight"])
    ids = torch.tensor([[151644, 872, 198, 9707, 11, 1879, 0, 151645]])
    hf = AutoModelForImageTextToText.from_pretrained(src, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = hf(input_ids=ids).logits[0]
    ours = ReferenceLLM.from_checkpoint(out).prompt_logits(LLMRequest(ids[0].int().numpy()))
    assert float(((ours - expected).abs().amax(-1) / expected.abs().amax(-1)).max()) <= 1e-4


def test_lm_head_rows_are_padded_for_tp():
    """Vocabularies that tp does not divide get zero rows (TensorRT-LLM's pad_vocab_size)."""
    split = Split(0, (12,))  # vocab 10 padded to 12 for tp=4
    assert [split.ranges(r, 4) for r in range(4)] == [[(0, 3)], [(3, 6)], [(6, 9)], [(9, 12)]]

    class Location:
        shape = (10, 2)
        row_bytes = 8

        def read_rows(self, a, b):
            return torch.arange(a, b, dtype=torch.float32)[:, None].repeat(1, 2)

    rows = Source(Location(), rows=12).read(9, 12, torch.float32)  # type: ignore[arg-type]
    assert rows[:, 0].tolist() == [9.0, 0.0, 0.0]


def _layout(heads: int, kv_heads: int, tp: int) -> LLMConfig:
    return LLMConfig(
        dtype="bfloat16",
        vocab_size=16,
        hidden_size=8,
        num_hidden_layers=1,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_size=2,
        intermediate_size=8,
        norm_epsilon=1e-6,
        rotary_base=1e4,
        rotary_dim=2,
        max_position_embeddings=8,
        deepstack_count=0,
        mapping=ParallelLayout(tp),
    )


@pytest.mark.parametrize(
    "heads,kv_heads,tp,rank0",
    [
        (4, 2, 2, [(0, 4), (8, 10), (12, 14)]),  # 2 query heads, 1 key/value head: [Q; K; V]
        (
            4,
            4,
            1,
            [(0, 2), (8, 10), (16, 18), (2, 4), (10, 12), (18, 20), (4, 6), (12, 14), (20, 22), (6, 8)]
            + [(14, 16), (22, 24)],
        ),  # as many of each: head by head
        (4, 4, 2, [(0, 2), (8, 10), (16, 18), (2, 4), (10, 12), (18, 20)]),
        (4, 2, 4, [(0, 2), (8, 10), (12, 14)]),  # one of each: the two layouts are the same
    ],
)
def test_qkv_rows_per_rank_are_in_the_order_tensorrt_llms_attention_reads(heads, kv_heads, tp, rank0):
    """TensorRT-LLM's Attention (layers/attention.py, `if self.qk_layernorm:`) cuts a rank's fused qkv as [Q; K; V]
    when its query and key/value head counts differ and as [heads, 3, head_size] when they are equal; merge() puts
    any rank order back."""
    param = layer_params(_layout(heads, kv_heads, tp), 0)["qkv"]
    assert param.split.ranges(0, tp) == rank0
    whole = torch.arange(param.shape[0]).float()[:, None].expand(param.shape)
    parts = [torch.cat([whole[a:b] for a, b in param.split.ranges(r, tp)]) for r in range(tp)]
    assert torch.equal(merge(param, parts, tp), whole)


def test_unsupported_splits_are_refused_before_writing(checkpoints, tmp_path):
    with pytest.raises(UnsupportedModelError, match="tp=3"):
        convert_llm(checkpoints["dense"], tmp_path / "c", tp=3, progress=False)
    with pytest.raises(UnsupportedModelError, match="pp=6"):
        convert_llm(checkpoints["dense"], tmp_path / "c", pp=6, progress=False)
    assert not (tmp_path / "c").exists()


def test_pipeline_splits_keep_the_deepstack_layers_on_the_first_stage(checkpoints, tmp_path):
    """Only TensorRT-LLM's first pipeline rank has input_ids, which mark the visual tokens: the 5-layer
    model's 3 DeepStack layers fit on the first of 2 stages (layers 0-2), not of 3 (layers 0-1)."""
    with pytest.raises(UnsupportedModelError, match=r"pp=3 puts DeepStack layer\(s\) \[2\] .*use pp <= 2"):
        convert_llm(checkpoints["moe"], tmp_path / "c", pp=3, progress=False)
    assert not (tmp_path / "c").exists()
    assert cli(["convert-llm", "--model", str(checkpoints["dense"]), "--output", str(tmp_path / "c"), "--pp", "3"]) == 2
    assert not (tmp_path / "c").exists()


def test_unsupported_models_are_refused(checkpoints, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(checkpoints["moe"], src)
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps(cfg | {"model_type": "qwen2_5_vl"}))
    with pytest.raises(UnsupportedModelError, match="Qwen2.5-VL"):
        convert_llm(src, tmp_path / "c", progress=False)
    cfg["text_config"]["mlp_only_layers"] = [1]
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="mlp_only_layers"):
        convert_llm(src, tmp_path / "c", progress=False)
    assert not (tmp_path / "c").exists()


def test_broken_checkpoints_are_reported(checkpoints, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(checkpoints["dense"], src)
    cfg = json.loads((src / "config.json").read_text())
    cfg["text_config"]["intermediate_size"] = 256
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="gate_proj.weight' has shape"):
        convert_llm(src, tmp_path / "c", progress=False)
    shard = sorted(src.glob("model-*.safetensors"))[-1]
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match="truncated"):
        convert_llm(src, tmp_path / "c", progress=False)
    shard.unlink()
    with pytest.raises(CheckpointError, match="missing"):
        convert_llm(src, tmp_path / "c", progress=False)
    assert not (tmp_path / "c").exists()


def test_failure_midway_publishes_nothing(checkpoints, tmp_path, monkeypatch):
    out = tmp_path / "c"
    convert_llm(checkpoints["dense"], out, progress=False)
    before = sorted(p.name for p in tmp_path.iterdir())
    writes = 0
    real_write = StreamingWriter.write

    def failing_write(self, name, chunk):
        nonlocal writes
        writes += 1
        if writes == 20:
            raise OSError(28, "No space left on device")
        real_write(self, name, chunk)

    monkeypatch.setattr(StreamingWriter, "write", failing_write)
    with pytest.raises(OSError):
        convert_llm(checkpoints["dense"], out, tp=2, force=True, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no temp dir left
    assert read_trtllm_config(out)[1].mapping.tp_size == 1  # the previous output is intact
    with pytest.raises(OutputExistsError):
        convert_llm(checkpoints["dense"], out, progress=False)


def test_chunked_reads_give_the_same_checkpoint(checkpoints, tmp_path, monkeypatch):
    """Tiny chunks (many partial writes per tensor) produce the same bytes as whole-tensor ones."""
    whole = convert_llm(checkpoints["moe"], tmp_path / "whole", tp=2, progress=False)
    monkeypatch.setattr(convert_module, "CHUNK_BYTES", 256)
    chunked = convert_llm(checkpoints["moe"], tmp_path / "chunked", tp=2, progress=False)
    for rank in range(2):
        name = f"rank{rank}.safetensors"
        assert (whole / name).read_bytes() == (chunked / name).read_bytes()


def test_cli(checkpoints, tmp_path, capsys):
    assert cli(["convert-llm", "--model", str(checkpoints["moe"]), "--output", str(tmp_path / "c"), "--tp", "2"]) == 0
    assert "2 rank files" in capsys.readouterr().out
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == [
        OUTPUT_MARKER,
        "config.json",
        "rank0.safetensors",
        "rank1.safetensors",
        "xgrammar_tokenizer_info.json",  # guided decoding's (guided_decoding.write_tokenizer_info)
    ]
    assert cli(["convert-llm", "--model", str(tmp_path / "nope"), "--output", str(tmp_path / "d")]) == 2
    assert "does not exist" in capsys.readouterr().err
