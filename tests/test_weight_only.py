"""Weight-only INT8/INT4 engines (--llm-quant int8-wo / int4-wo): the stored arithmetic against an independent
emulation of TensorRT-LLM's quantizer, the checkpoint against the stand-in's loader (names, dtypes, shapes per rank,
what upstream's layers declare), refusals, and the reference runtime's logits (the CPU deployment's LLM) against the
emulation and, teacher-forced, against transformers' full-precision model."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import torch
from qwen3vl_trt.errors import UnsupportedModelError
from qwen3vl_trt.llm import convert as convert_module
from qwen3vl_trt.llm.checkpoint_format import load_llm_weights, read_trtllm_config
from qwen3vl_trt.llm.convert import convert_llm
from qwen3vl_trt.llm.weight_only import WeightOnly
from qwen3vl_trt.qa.tiny import make_tiny_checkpoint
from qwen3vl_trt.runtime.reference_llm import LLMRequest, ReferenceLLM
from qwen3vl_trt.runtime.sampling import SamplingParams
from safetensors.torch import load_file, save_file

# Text dims the weight-only layers take unpadded at tp 1 and 2 (split features multiples of 64 per rank, the hidden
# size of 64 * tp).
TEXT = dict(hidden_size=128, num_key_value_heads=4, intermediate_size=256)
MOE_TEXT = dict(TEXT, moe_intermediate_size=128)


def emulate(weight: torch.Tensor, bits: int) -> torch.Tensor:
    """TensorRT-LLM's symmetric per-channel quantizer (cutlass_preprocessors.cpp, symmetric_quantize) written out
    in numpy: scale = amax / 2^(bits-1) in float32, C round (ties away from zero), clip, the scale kept in the
    weight's dtype; the dequantized weight [N, K] in that dtype."""
    w = weight.float().numpy()
    levels = np.float32(1 << (bits - 1))
    scale = (np.abs(w).max(axis=-1) / levels).astype(np.float32)
    x = w / np.where(scale > 0, scale, 1)[..., None]
    q = np.clip(np.sign(x) * np.floor(np.abs(x) + 0.5), -levels, levels - 1)
    stored_scale = torch.from_numpy(scale).to(weight.dtype).float().numpy()
    return torch.from_numpy(q * stored_scale[..., None]).to(weight.dtype)


@pytest.mark.once
@pytest.mark.parametrize("bits", [8, 4])
def test_quantizer_matches_the_emulation_and_round_trips_the_stored_layout(bits):
    torch.manual_seed(0)
    w = (torch.randn(3, 64, 96) * 0.05).to(torch.bfloat16)
    w[0, 0, :4] = torch.tensor([0.5, -0.5, 1.5, -1.0]).to(torch.bfloat16)  # a tie at the channel's scale
    scheme = WeightOnly(bits)
    q, scale = scheme.quantize(w)
    assert torch.equal(WeightOnly.dequantize(q, scale.to(w.dtype), w.dtype), emulate(w, bits))
    stored = scheme.to_stored(q)
    assert stored.dtype == torch.int8 and tuple(stored.shape) == scheme.stored_shape(tuple(w.shape))
    assert torch.equal(scheme.from_stored(stored), q)
    if bits == 4:  # two per byte along N, the even column in the low nibble
        k0 = stored[0, 0, 0].item() & 0xFF
        assert (k0 & 0x0F) == (q[0, 0, 0].item() & 0x0F) and (k0 >> 4) == (q[0, 1, 0].item() & 0x0F)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("weight-only")
    return {
        "dense": make_tiny_checkpoint(root / "dense", text_overrides=TEXT),
        "moe": make_tiny_checkpoint(root / "moe", moe=True, text_overrides=MOE_TEXT),
    }


@pytest.fixture(scope="module")
def converted(models, tmp_path_factory):
    root = tmp_path_factory.mktemp("weight-only-converted")
    cache: dict[tuple, object] = {}

    def get(kind: str, quant: str, tp: int = 1):
        key = (kind, quant, tp)
        if key not in cache:
            cache[key] = convert_llm(models[kind], root / "-".join(map(str, key)), tp=tp, quant=quant, progress=False)
        return cache[key]

    return get


@pytest.mark.once
@pytest.mark.parametrize("kind", ["dense", "moe"])
@pytest.mark.parametrize("quant,algo", [("int8-wo", "W8A16"), ("int4-wo", "W4A16")])
@pytest.mark.parametrize("tp", [1, 2])
def test_every_rank_loads_into_the_standins_quantized_layers(converted, standin_engine_model, kind, quant, algo, tp):
    """config.json's quantization as QuantConfig reads it; each rank file through upstream's from_checkpoint:
    our hook gives each stored int8 weight the GPU layout, preprocess_weights leaves it, and load() finds every
    parameter the quantized layers declare, in its shape and dtype."""
    from tensorrt_llm.quantization import functional

    ckpt = converted(kind, quant, tp)
    cfg, _ = read_trtllm_config(ckpt)
    assert cfg["quantization"]["quant_algo"] == algo
    assert {"*lm_head", "*router", "*vocab_embedding"} <= set(cfg["quantization"]["exclude_modules"])
    for rank in range(tp):
        config = standin_engine_model.Qwen3VLForCausalLM.config_class(**cfg)
        config.set_rank(rank)
        functional.CALLS.clear()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a dtype the layers do not declare, or a tensor they do not have
            model = standin_engine_model.Qwen3VLForCausalLM.from_checkpoint(str(ckpt), config=config)
        quantized = [n for n, t in model.loaded_weights.items() if t.dtype == torch.int8]
        per_layer = 4 if kind == "moe" else 5  # qkv, dense and the MLP's fc, gate, proj (MoE: fc, proj)
        assert len(quantized) == len(functional.CALLS) == per_layer * cfg["num_hidden_layers"]
        kinds = {call[1] for call in functional.CALLS}
        assert kinds == {torch.int8 if quant == "int8-wo" else torch.quint4x2}
        assert model.loaded_weights["lm_head.weight"].dtype == torch.bfloat16


@pytest.mark.once
def test_a_given_preprocess_weights_hook_runs_before_the_gpu_layout(converted, standin_engine_model):
    """from_checkpoint's hook argument (as trtllm-build's callers pass one) still runs, first, on the rank's
    weights; the GPU layout is applied after it."""
    from tensorrt_llm.quantization import functional

    seen = []

    def hook(weights):
        seen.append((len(functional.CALLS), weights["transformer.layers.0.attention.qkv.weight"].dtype))
        return weights

    functional.CALLS.clear()
    standin_engine_model.Qwen3VLForCausalLM.from_checkpoint(
        str(converted("dense", "int8-wo")), rank=0, preprocess_weights_hook=hook
    )
    assert seen == [(0, torch.int8)] and functional.CALLS


@pytest.mark.once
def test_float_weights_would_need_cuda_in_the_standin(converted, standin_engine_model, tmp_path):
    """The stand-in models what upstream does with a float weight under W8A16 (quantize it with CUDA ops): our
    checkpoints never rely on it."""
    ckpt = converted("dense", "none")
    cfg, _ = read_trtllm_config(ckpt)
    cfg["quantization"] = {"quant_algo": "W8A16"}
    config = standin_engine_model.Qwen3VLForCausalLM.config_class(**cfg)
    with pytest.raises(RuntimeError, match="needs CUDA"):
        standin_engine_model.Qwen3VLForCausalLM.from_checkpoint(str(ckpt), config=config)


@pytest.mark.once
def test_splits_the_weight_only_gemm_would_pad_are_refused_with_the_tp_that_works(checkpoints, tmp_path):
    out = tmp_path / "never"
    with pytest.raises(UnsupportedModelError, match=r"multiples of 64.*no tp fits") as e:
        convert_llm(checkpoints["moe"], out, quant="int8-wo", progress=False)  # experts of 48
    assert "--llm-quant none" in str(e.value)
    assert not out.exists()


@pytest.mark.once
def test_a_hidden_size_the_layers_would_pad_for_tp_is_refused(checkpoints, standin_engine_model, tmp_path, monkeypatch):
    """WeightOnlyQuant{Column,Row}Linear pad the features every rank holds whole (the hidden size, 64 here) to a
    multiple of 64 * tp, though each rank's split ones (64) would fit: tp 2 is refused, and a checkpoint written past
    the check does not load into the stand-in's quantized layers."""
    with pytest.raises(
        UnsupportedModelError, match=r"at tp=2.*64\*tp=128.*attention.dense.weight \[64, 64\].*use --tp 1$"
    ):
        convert_llm(checkpoints["dense"], tmp_path / "never", quant="int8-wo", tp=2, progress=False)
    assert not (tmp_path / "never").exists()
    monkeypatch.setattr(convert_module, "check_weight_only", lambda *_: None)
    ckpt = convert_llm(checkpoints["dense"], tmp_path / "unchecked", quant="int8-wo", tp=2, progress=False)
    cfg, _ = read_trtllm_config(ckpt)
    config = standin_engine_model.Qwen3VLForCausalLM.config_class(**cfg)
    with pytest.raises(RuntimeError, match=r"qkv.weight: shape \[64, 128\] is not the declared \[128, 128\]"):
        standin_engine_model.Qwen3VLForCausalLM.from_checkpoint(str(ckpt), config=config)


@pytest.mark.once
def test_refusal_names_the_tp_values_that_fit(models, tmp_path):
    with pytest.raises(UnsupportedModelError, match=r"at tp=4.*use --tp 1 or 2"):
        convert_llm(models["dense"], tmp_path / "never", quant="int4-wo", tp=4, progress=False)


def _emulated_weights(none_ckpt, bits: int):
    """The bf16 engine's weights with each quantized linear replaced by the emulation of what the engine computes
    with (tp 1: one scale per output channel over the whole input)."""
    weights = load_llm_weights(none_ckpt)
    for layer in weights.layers:
        layer.qkv, layer.dense = emulate(layer.qkv, bits), emulate(layer.dense, bits)
        mlp = layer.mlp
        for name in ("gate", "up", "down"):
            setattr(mlp, name, emulate(getattr(mlp, name), bits))
    return weights


@pytest.mark.once
@pytest.mark.parametrize("kind", ["dense", "moe"])
@pytest.mark.parametrize("quant,bits", [("int8-wo", 8), ("int4-wo", 4)])
def test_reference_runtime_logits_equal_the_emulated_arithmetic(converted, kind, quant, bits):
    ids = np.array([151644, 872, 198, 9707, 11, 1879, 0, 42, 1234, 77], dtype=np.int32)
    ours = ReferenceLLM.from_checkpoint(converted(kind, quant)).prompt_logits(LLMRequest(ids))
    emulated = ReferenceLLM(_emulated_weights(converted(kind, "none"), bits)).prompt_logits(LLMRequest(ids))
    torch.testing.assert_close(ours, emulated, rtol=0, atol=1e-3)


def _scaled_up(model_dir, out):
    """The checkpoint with its output head scaled up, so that random weights give logits that are not flat."""
    import shutil

    shutil.copytree(model_dir, out)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    for shard in set(index["weight_map"].values()):
        tensors = load_file(str(out / shard))
        for name in tensors:
            if name == "lm_head.weight":
                tensors[name] = (tensors[name].float() * 40).to(torch.bfloat16)
        save_file(tensors, str(out / shard), metadata={"format": "pt"})
    return out


def test_int8_wo_agrees_with_transformers_full_precision_teacher_forced(models, tmp_path, capsys):
    """Greedy tokens of the int8-wo engine, scored by transformers' fp32 model on the same sequence: the fraction
    of steps where our token is its argmax, and the largest logit gap."""
    from transformers import AutoModelForImageTextToText

    model_dir = _scaled_up(models["dense"], tmp_path / "scaled")
    prompt = np.array([151644, 872, 198, 9707, 11, 1879, 0, 42], dtype=np.int32)
    steps = 16
    agreement = {}
    hf = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    for quant in ("int8-wo", "int4-wo"):
        llm = ReferenceLLM.from_checkpoint(convert_llm(model_dir, tmp_path / quant, quant=quant, progress=False))
        result = llm.generate([LLMRequest(prompt, sampling=SamplingParams(max_new_tokens=steps))])[0]
        sequence = torch.as_tensor(np.concatenate([prompt, result.output_ids[:-1]]), dtype=torch.long)[None]
        with torch.no_grad():
            theirs = hf(input_ids=sequence).logits[0, len(prompt) - 1 :]
        ours = llm.prompt_logits(LLMRequest(sequence[0].int().numpy()))[len(prompt) - 1 :]
        hits = (theirs.argmax(-1) == torch.as_tensor(result.output_ids)).float().mean().item()
        gap = (ours - theirs).abs().max().item()
        spread = theirs.std(dim=-1).mean().item()
        agreement[quant] = hits
        print(
            f"{quant}: served token is transformers' fp32 argmax at {hits:.2f} of {steps} steps; largest logit gap "
            f"{gap:.3f} (logit spread {spread:.2f})"
        )
    with capsys.disabled():
        print(capsys.readouterr().out, end="")
    assert agreement["int8-wo"] >= 0.8
