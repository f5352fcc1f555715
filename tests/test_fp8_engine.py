"""FP8 engines (--llm-quant fp8) and quantized KV caches (--kv-cache-dtype fp8 / int8): the rank files against the
stand-in's loader, the stored weight scales and e4m3 values against a quantizer written out here, the activation and
KV scales against a whole-model calibration run, the reference runtime's arithmetic against an independent
emulation, its cache against rounding applied by hand, teacher-forced agreement with transformers' fp32 model, and
the choice of mode and the refusals (library and command line)."""

from __future__ import annotations

import json
import warnings
from collections import defaultdict

import numpy as np
import pytest
import torch
from PIL import Image
from qwen3vl_trt.cli import main as cli_main
from qwen3vl_trt.errors import CheckpointError, UnsupportedModelError
from qwen3vl_trt.hf.checkpoint import Checkpoint
from qwen3vl_trt.llm.checkpoint_format import load_llm_weights, read_trtllm_config
from qwen3vl_trt.llm.convert import check_llm_options
from qwen3vl_trt.llm.fp8 import FP8Weight, linear
from qwen3vl_trt.llm.kv_cache import KV_CACHE_DTYPES
from qwen3vl_trt.llm.precision import choose_llm_quant, parse_gpu_arch
from qwen3vl_trt.pipeline.calibration import builtin_prompts, calibrate, convert_calibrated, read_prompts
from qwen3vl_trt.preprocess import Preprocessor
from qwen3vl_trt.qa.quantized import quantize_block_fp8
from qwen3vl_trt.runtime.reference_llm import KVCache, LLMRequest, ReferenceLLM
from qwen3vl_trt.runtime.sampling import SamplingParams
from qwen3vl_trt.vision.model import VisionTower
from safetensors import safe_open
from safetensors.torch import load_file, save_file

E4M3 = 448.0
PROMPT = np.array([151644, 872, 198, 9707, 11, 1879, 0, 42, 1234, 77], dtype=np.int32)
# The quantized linears of a layer (TensorRT-LLM names under transformer.layers.N.) and the calibrated input each
# reads (reference_llm.Observer's names), per kind of model.
LINEAR_INPUTS = {
    "dense": {
        "attention.qkv": "qkv",
        "attention.dense": "dense",
        "mlp.fc": "mlp",
        "mlp.gate": "mlp",
        "mlp.proj": "down",
    },
    "moe": {"attention.qkv": "qkv", "attention.dense": "dense", "mlp.fc": "experts", "mlp.proj": "experts_down"},
}


# -- an independent quantizer ----------------------------------------------------------------------------------


def e4m3_of(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """w / scale as e4m3, saturated (scale broadcasts against w)."""
    return (w.float() / scale).clamp(-E4M3, E4M3).to(torch.float8_e4m3fn)


def tensor_scale(*weights: torch.Tensor) -> torch.Tensor:
    """(1,): the largest magnitude over all the given tensors, / 448."""
    return (torch.stack([w.float().abs().max() for w in weights]).max() / E4M3).reshape(1)


def expert_scales(*weights: torch.Tensor) -> torch.Tensor:
    """(E, 1): each expert's largest magnitude over the given [E, ...] tensors, / 448."""
    per_expert = torch.stack([w.float().abs().reshape(w.shape[0], -1).max(dim=1).values for w in weights])
    return (per_expert.max(dim=0).values / E4M3).reshape(-1, 1)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def cache_round(x: torch.Tensor, scale: torch.Tensor, kv_dtype: str) -> torch.Tensor:
    """What a quantized cache gives back, written out independently: int8 with numpy's rint (half to even) and a
    clip to [-128, 127]; fp8 through the e4m3 cast after saturating at 448."""
    s = float(scale.reshape(-1)[0])
    y = x.float() / s
    if kv_dtype == "int8":
        q = torch.from_numpy(np.clip(np.rint(y.numpy()), -128, 127))
    else:
        q = torch.where(y.abs() > E4M3, y.sign() * E4M3, y).to(torch.float8_e4m3fn).float()
    return (q * s).to(x.dtype)


# -- fixtures --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def calibration_file(tmp_path_factory):
    """A small JSON-lines calibration set: one text-only prompt and one with a JPEG beside the file."""
    root = tmp_path_factory.mktemp("fp8-calibration")
    rng = np.random.default_rng(7)
    y, x = np.mgrid[0:96, 0:128]
    pixels = np.stack([(x * 2) % 256, (y * 3) % 256, (x + y) % 256], axis=-1) + rng.integers(0, 30, (96, 128, 3))
    Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(root / "field.jpg", quality=85)
    lines = [{"text": "Name three rivers in Europe."}, {"text": "What is in the picture?", "image": "field.jpg"}]
    path = root / "prompts.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


@pytest.fixture(scope="module")
def fp8_converted(checkpoints, calibration_file, tmp_path_factory):
    """convert_llm outputs by (kind, quant, kv_cache_dtype, tp, prompts), each written once. "file" calibrates on
    calibration_file (fast), "builtin" on the built-in set."""
    root = tmp_path_factory.mktemp("fp8-converted")
    done: dict[tuple, object] = {}

    def convert(kind: str, quant: str = "fp8", kv: str = "auto", tp: int = 1, prompts: str = "file"):
        key = (kind, quant, kv, tp, prompts)
        if key not in done:
            calibrated = quant == "fp8" or kv != "auto"
            data = calibration_file if prompts == "file" and calibrated else None
            out = root / "_".join(map(str, key))
            done[key] = convert_calibrated(
                checkpoints[kind], out, quant=quant, kv_cache_dtype=kv, tp=tp, gpu_arch=90, calibration_data=data
            )
        return done[key]

    return convert


def rank_tensors(ckpt, rank: int = 0) -> dict[str, torch.Tensor]:
    return load_file(str(ckpt / f"rank{rank}.safetensors"))


def whole_model_amax(checkpoint_dir, model_dir, prompts) -> list[dict[str, float]]:
    """Per layer and observed input, the largest magnitude over `prompts`, from the whole bf16 model loaded at once,
    each prompt run on its own (calibrate runs them as one ragged batch, one layer loaded at a time)."""
    llm = ReferenceLLM.from_checkpoint(checkpoint_dir)
    info = Checkpoint(model_dir).info
    pre = Preprocessor.from_pretrained(model_dir)
    names = VisionTower.checkpoint_names(info.vision)
    tower = VisionTower.from_checkpoint_tensors(info.vision, Checkpoint(model_dir).load_tensors(names), torch.float32)
    seen: list[dict[str, float]] = [defaultdict(float) for _ in llm.w.layers]
    with torch.inference_mode():
        for prompt in prompts:
            request = pre(prompt.messages())
            outputs = (None, None)
            if request.num_visual_tokens:
                grid = {k: torch.as_tensor(v) for k, v in request.vision_inputs.items()}
                outputs = tower(torch.as_tensor(request.pixel_values, dtype=torch.float32), **grid)
            checked = llm._check(LLMRequest.from_preprocessed(request, *outputs))
            h = llm._embed(checked)
            for layer, w in enumerate(llm.w.layers):

                def record(name, x, into=seen[layer]):
                    into[name] = max(into[name], x.abs().max().item())

                h, _, _ = llm.prefill_layer(w, h, checked.cos, checked.sin, [(0, h.shape[0])], record)
                llm._deepstack(h, checked, layer)
    return [dict(d) for d in seen]


# -- 1. layout against the stand-in's loader ---------------------------------------------------------------------


@pytest.mark.once
@pytest.mark.parametrize("kind", ["dense", "moe"])
@pytest.mark.parametrize("kv,kv_algo", [("auto", None), ("fp8", "FP8"), ("int8", "INT8")])
@pytest.mark.parametrize("tp", [1, 2])
def test_every_fp8_rank_loads_into_the_standins_layers(fp8_converted, standin_engine_model, kind, kv, kv_algo, tp):
    """config.json's quantization as QuantConfig reads it; every rank file through upstream's from_checkpoint with
    warnings as errors (a dtype the FP8 layers do not declare, or a tensor they do not have); the loader derives
    each kv_cache_rcp_scaling_factor as 1 / the stored scale."""
    ckpt = fp8_converted(kind, kv=kv, tp=tp)
    cfg, _ = read_trtllm_config(ckpt)
    quantization = cfg["quantization"]
    assert (quantization["quant_algo"], quantization["kv_cache_quant_algo"]) == ("FP8", kv_algo)
    assert {"*lm_head", "*router", "*vocab_embedding"} <= set(quantization["exclude_modules"])
    layers = cfg["num_hidden_layers"]
    model_cls = standin_engine_model.Qwen3VLForCausalLM
    for rank in range(tp):
        config = model_cls.config_class(**cfg)
        config.set_rank(rank)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            loaded = model_cls.from_checkpoint(str(ckpt), config=config).loaded_weights
        e4m3 = sorted(n for n, t in loaded.items() if t.dtype == torch.float8_e4m3fn)
        expected = sorted(f"transformer.layers.{i}.{n}.weight" for i in range(layers) for n in LINEAR_INPUTS[kind])
        assert e4m3 == expected
        for name in e4m3:
            prefix = name.removesuffix("weight")
            assert loaded[prefix + "weights_scaling_factor"].dtype == torch.float32
            assert loaded[prefix + "activation_scaling_factor"].shape == (1,)
        assert loaded["lm_head.weight"].dtype == torch.bfloat16
        stored = rank_tensors(ckpt, rank)
        kv_names = [n for n in loaded if "kv_cache" in n]
        if kv_algo is None:
            assert kv_names == []
            continue
        assert len(kv_names) == 2 * layers
        for i in range(layers):
            p = f"transformer.layers.{i}.attention."
            assert p + "kv_cache_rcp_scaling_factor" not in stored  # derived by the loader, not written
            scale = loaded[p + "kv_cache_scaling_factor"]
            assert scale.dtype == torch.float32 and float(scale) > 0
            torch.testing.assert_close(loaded[p + "kv_cache_rcp_scaling_factor"], 1 / scale, rtol=1e-7, atol=0)


# -- 2. weight scales and values ---------------------------------------------------------------------------------


@pytest.mark.once
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_weight_scales_are_whole_tensor_amax_and_values_are_their_e4m3(fp8_converted, kind):
    """Against the bf16 conversion: each quantized weight's scale is its whole (unsplit) tensor's amax / 448 on
    every rank (the dense MLP's fc and gate share the larger; experts one per expert), and each rank's e4m3 values
    are that rank's bf16 slice quantized with it."""
    whole = rank_tensors(fp8_converted(kind, "none"))
    bf16_ranks = [rank_tensors(fp8_converted(kind, "none", tp=2), r) for r in range(2)]
    fp8_ranks = [rank_tensors(fp8_converted(kind, tp=2), r) for r in range(2)]
    layers = read_trtllm_config(fp8_converted(kind, tp=2))[0]["num_hidden_layers"]
    for layer in range(layers):
        p = f"transformer.layers.{layer}."
        for linear_name in LINEAR_INPUTS[kind]:
            w = whole[p + linear_name + ".weight"]
            if kind == "moe" and linear_name.startswith("mlp."):
                expected = expert_scales(w)
                assert expected.shape == (w.shape[0], 1)
            elif linear_name in ("mlp.fc", "mlp.gate"):
                expected = tensor_scale(whole[p + "mlp.fc.weight"], whole[p + "mlp.gate.weight"])
            else:
                expected = tensor_scale(w)
            for bf16, fp8 in zip(bf16_ranks, fp8_ranks, strict=True):
                name = p + linear_name
                assert torch.equal(fp8[name + ".weights_scaling_factor"], expected), name
                broadcast = expected.reshape(-1, 1, 1) if expected.shape[0] > 1 else expected
                assert fp8[name + ".weight"].dtype == torch.float8_e4m3fn
                assert torch.equal(bits(fp8[name + ".weight"]), bits(e4m3_of(bf16[name + ".weight"], broadcast))), name
        if kind == "dense":  # the shared scale is the larger of the two, so one of them saturates its range
            fc, gate = whole[p + "mlp.fc.weight"].float().abs().max(), whole[p + "mlp.gate.weight"].float().abs().max()
            assert fp8_ranks[0][p + "mlp.fc.weights_scaling_factor"].item() == pytest.approx(max(fc, gate) / E4M3)


# -- 3. activation and KV scales from calibration ----------------------------------------------------------------


@pytest.fixture(scope="module")
def file_ranges(checkpoints, fp8_converted, calibration_file):
    """Whole-model ranges over the calibration file's prompts, per kind."""
    prompts = read_prompts(calibration_file)
    return {
        kind: whole_model_amax(fp8_converted(kind, "none"), checkpoints[kind], prompts) for kind in ("dense", "moe")
    }


def assert_same_ranges(got: list[dict[str, float]], want: list[dict[str, float]]) -> None:
    assert len(got) == len(want)
    for layer, (g, w) in enumerate(zip(got, want, strict=True)):
        assert set(g) == set(w), layer
        for name in w:
            assert w[name] > 0
            assert g[name] == pytest.approx(w[name], rel=1e-2), (layer, name)


@pytest.mark.once
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_layer_at_a_time_calibration_matches_a_whole_model_run(checkpoints, calibration_file, file_ranges, kind):
    ckpt = Checkpoint(checkpoints[kind])
    ranges = calibrate(ckpt, torch.bfloat16, read_prompts(calibration_file))
    want = file_ranges[kind]
    expected_names = {"qkv", "kv", "q", "dense", *{v for v in LINEAR_INPUTS[kind].values()}}
    assert all(set(layer) == expected_names for layer in want)
    assert_same_ranges(ranges.amax, want)


@pytest.mark.once
@pytest.mark.parametrize("kind", ["dense", "moe"])
@pytest.mark.parametrize("kv", ["fp8", "int8"])
def test_stored_activation_and_kv_scales_are_calibrated_amax_over_levels(fp8_converted, file_ranges, kind, kv):
    """Each activation scale is its input's amax / 448; the KV-cache scale is the keys' and values' amax over the
    cache's levels, and the queries' where they are larger under an FP8 cache (FP8 context FMHA)."""
    tensors = rank_tensors(fp8_converted(kind, kv=kv))
    levels = {"fp8": 448.0, "int8": 127.0}[kv]
    for layer, amax in enumerate(file_ranges[kind]):
        p = f"transformer.layers.{layer}."
        for linear_name, observed in LINEAR_INPUTS[kind].items():
            stored = tensors[p + linear_name + ".activation_scaling_factor"]
            assert stored.dtype == torch.float32 and stored.shape == (1,)
            assert stored.item() == pytest.approx(amax[observed] / E4M3, rel=1e-2), (layer, linear_name)
        # Beside FP8 weights an FP8 cache runs FP8 context FMHA, which quantizes the queries with its scale too.
        covered = max(amax["kv"], amax["q"]) if kv == "fp8" else amax["kv"]
        kv_scale = tensors[p + "attention.kv_cache_scaling_factor"].item()
        assert kv_scale == pytest.approx(covered / levels, rel=1e-2), layer


@pytest.mark.once
def test_calibration_data_replaces_the_builtin_prompts(checkpoints, fp8_converted):
    """The built-in set's conversion holds that set's ranges (checked against a whole-model run over it), and they
    differ from those of the user's file."""
    builtin = rank_tensors(fp8_converted("dense", kv="fp8", prompts="builtin"))
    own = rank_tensors(fp8_converted("dense", kv="fp8"))
    amax = whole_model_amax(fp8_converted("dense", "none"), checkpoints["dense"], builtin_prompts())
    scales = [n for n in builtin if n.endswith(("activation_scaling_factor", "kv_cache_scaling_factor"))]
    assert len(scales) == 6 * len(amax)
    assert any(not torch.equal(builtin[n], own[n]) for n in scales)
    for layer, ranges in enumerate(amax):
        p = f"transformer.layers.{layer}."
        assert builtin[p + "attention.qkv.activation_scaling_factor"].item() == pytest.approx(
            ranges["qkv"] / E4M3, rel=1e-2
        )
        assert builtin[p + "mlp.proj.activation_scaling_factor"].item() == pytest.approx(
            ranges["down"] / E4M3, rel=1e-2
        )
        assert builtin[p + "attention.kv_cache_scaling_factor"].item() == pytest.approx(
            max(ranges["kv"], ranges["q"]) / E4M3, rel=1e-2
        )
    for name in builtin:  # the weights do not depend on the prompts
        if not name.endswith(("activation_scaling_factor", "kv_cache_scaling_factor")):
            assert torch.equal(bits(builtin[name]), bits(own[name])), name


# -- 4. the reference runtime's arithmetic -----------------------------------------------------------------------


@pytest.mark.once
def test_fp8_linear_is_fp8_gemm_rescaled():
    """linear() on an FP8Weight against the recipe computed in float64: fp8(x / a) @ fp8(w / s)^T * a * s, with a
    and s cast to the engine dtype first as FP8Linear.forward casts them. The e4m3 products are exact and K = 96 terms
    sum with float32 rounding of ~1e-7 relative, so the bf16 outputs agree to within one bf16 ulp (2^-8 relative)."""
    torch.manual_seed(3)
    x = (torch.randn(7, 96) * 3).to(torch.bfloat16)
    w = (torch.randn(40, 96) * 0.02).to(torch.bfloat16)
    s, a = tensor_scale(w), tensor_scale(x) * 0.8  # some inputs saturate
    wq = e4m3_of(w, s)
    got = linear(x, FP8Weight(wq, s, a))
    a16, s16 = a.to(torch.bfloat16).double(), s.to(torch.bfloat16).double()
    want = (e4m3_of(x, a16.float()).double() @ wq.double().T * (a16 * s16)).to(torch.bfloat16)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-8, atol=1e-6)
    plain = torch.nn.functional.linear(x.float(), w.float())
    assert (got.float() - plain).abs().max() > 0  # quantization is not a no-op here


def emulated_fp8_weights(none_ckpt, fp8_ckpt):
    """The bf16 engine's weights with each quantized linear replaced by an FP8Weight quantized here, per tensor (or
    per expert), with the activation scales the fp8 rank file holds."""
    weights = load_llm_weights(none_ckpt)
    stored = rank_tensors(fp8_ckpt)
    moe = weights.config.moe is not None
    for i, layer in enumerate(weights.layers):

        def act(name: str, i: int = i) -> torch.Tensor:
            return stored[f"transformer.layers.{i}.{name}.activation_scaling_factor"]

        def quantized(w: torch.Tensor, scale: torch.Tensor, name: str) -> FP8Weight:
            return FP8Weight(e4m3_of(w, scale.reshape(-1, 1, 1) if w.ndim == 3 else scale), scale, act(name))

        layer.qkv = quantized(layer.qkv, tensor_scale(layer.qkv), "attention.qkv")
        layer.dense = quantized(layer.dense, tensor_scale(layer.dense), "attention.dense")
        mlp = layer.mlp
        if moe:
            fc = expert_scales(mlp.up, mlp.gate)
            mlp.up, mlp.gate = quantized(mlp.up, fc, "mlp.fc"), quantized(mlp.gate, fc, "mlp.fc")
            mlp.down = quantized(mlp.down, expert_scales(mlp.down), "mlp.proj")
        else:
            fc = tensor_scale(mlp.gate, mlp.up)
            mlp.gate, mlp.up = quantized(mlp.gate, fc, "mlp.fc"), quantized(mlp.up, fc, "mlp.gate")
            mlp.down = quantized(mlp.down, tensor_scale(mlp.down), "mlp.proj")
    return weights


@pytest.mark.once
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_reference_runtime_fp8_logits_equal_the_emulation(fp8_converted, kind):
    """The fp8 checkpoint's prompt logits (tp 1, and tp 2 reassembled) against ReferenceLLM over LLMWeights built
    from FP8Weight objects quantized here from the bf16 weights. Both run the same operations on the same e4m3 values,
    so they agree to float32 summation order; the tolerance, 1e-3 of the logits' spread, is far below the effect of
    quantization itself (checked: the bf16 model's logits are further away than that)."""
    request = LLMRequest(PROMPT)
    ours = ReferenceLLM.from_checkpoint(fp8_converted(kind)).prompt_logits(request)
    split = ReferenceLLM.from_checkpoint(fp8_converted(kind, tp=2)).prompt_logits(request)
    emulated = ReferenceLLM(emulated_fp8_weights(fp8_converted(kind, "none"), fp8_converted(kind))).prompt_logits(
        request
    )
    bf16 = ReferenceLLM.from_checkpoint(fp8_converted(kind, "none")).prompt_logits(request)
    atol = 1e-3 * emulated.std().item()
    torch.testing.assert_close(ours, emulated, rtol=0, atol=atol)
    torch.testing.assert_close(split, ours, rtol=0, atol=atol)
    assert (bf16 - emulated).abs().max().item() > 10 * atol


KNOWN_ROUND_TRIPS = {
    # scale 0.5: x / 0.5 -> stored -> times 0.5
    "fp8": (
        [0.0, 3.3, 0.26, 7.75, 7.25, -1000.0, 500.0, -0.001],
        # 6.6 -> 6.5 (step 0.5 in [4, 8)); 0.52 -> 0.5; 15.5 -> 16 (tie to even mantissa); 14.5 -> 14 (tie to
        # even); -2000 and 1000 saturate at 448; -0.002 is subnormal territory: nearest multiple of 2^-9 is -2^-9
        [0.0, 3.25, 0.25, 8.0, 7.0, -224.0, 224.0, -(2**-10)],
    ),
    "int8": (
        [0.25, 0.75, 1.25, -0.25, -0.75, 100.0, -100.0, 63.6],
        # 0.5 -> 0, 1.5 -> 2, 2.5 -> 2, -0.5 -> -0, -1.5 -> -2 (half to even); 200 -> 127, -200 -> -128; 127.2 -> 127
        [0.0, 1.0, 1.0, 0.0, -1.0, 63.5, -64.0, 63.5],
    ),
}


@pytest.mark.once
@pytest.mark.parametrize("kv", ["fp8", "int8"])
def test_kv_cache_round_trip_on_known_values(kv):
    x, want = (torch.tensor(v, dtype=torch.float32) for v in KNOWN_ROUND_TRIPS[kv])
    scale = torch.tensor([0.5])
    got = KV_CACHE_DTYPES[kv].round_trip(x, scale)
    assert torch.equal(got, want), got
    assert torch.equal(cache_round(x, scale, kv), want)  # the test's own rounding agrees
    half = KV_CACHE_DTYPES[kv].round_trip(x.to(torch.bfloat16), scale)
    assert half.dtype == torch.bfloat16


class RoundsTheCacheByHand(ReferenceLLM):
    """The runtime with no KV-cache quantization configured, whose cache holds keys and values rounded by the test's
    own cache_round with the given per-layer scales (where the engine stores them: after the context phase attended,
    and each decoded token's before it is attended); with an fp8 cache beside the FP8 weights, its context phase
    also attends with the rotated queries, keys and values rounded so (FP8 context FMHA)."""

    def __init__(self, weights, scales: list[torch.Tensor], kv_dtype: str):
        super().__init__(weights)
        self.scales, self.kv_dtype = scales, kv_dtype

    def _layer(self, w) -> int:
        return next(i for i, layer in enumerate(self.w.layers) if layer is w)

    def _round_kv(self, w, k, v):
        scale = self.scales[self._layer(w)]
        k.copy_(cache_round(k, scale, self.kv_dtype))
        v.copy_(cache_round(v, scale, self.kv_dtype))

    def _context_qkv(self, w, q, k, v):
        if self.kv_dtype != "fp8":
            return q, k, v
        scale = self.scales[self._layer(w)]
        return tuple(cache_round(t, scale, "fp8") for t in (q, k, v))


def greedy_decode(llm: ReferenceLLM, ids: np.ndarray, steps: int):
    """Float32 logits of the prompt's last position and of `steps - 1` greedy decode steps, and the cache."""
    logits, keys, values = llm._prefill([llm._check(LLMRequest(ids))], all_logits=False)
    cache = KVCache(llm)
    cache.reserve(1, len(ids) + steps)
    cache.write(0, keys, values)
    out = [logits[0]]
    for t in range(steps - 1):
        token = out[-1].argmax().reshape(1)
        out.append(llm._decode_step(token, torch.tensor([len(ids) + t]), torch.zeros(1, dtype=torch.long), cache)[0])
    return torch.stack(out), cache


@pytest.mark.once
@pytest.mark.parametrize("kind", ["dense", "moe"])
@pytest.mark.parametrize("kv", ["fp8", "int8"])
def test_quantized_kv_cache_changes_the_cache_and_fp8_context_attention(fp8_converted, kind, kv):
    """The kv-quantized checkpoint is the unquantized-KV one plus the layers' KV scales (the same calibration, so
    the same weights). Its prompt logits and 8 greedy decode steps equal, logits included, those of the
    unquantized-KV model whose cache (and, beside these FP8 weights an fp8 cache, whose context attention's q, k and
    v: FP8 context FMHA) is rounded here by hand; with an int8 cache the prompt logits are the unquantized-KV
    model's, with an fp8 one they are not; its cache holds the rounded prompt keys and values."""
    steps = 8
    quantized_ckpt, plain_ckpt = fp8_converted(kind, kv=kv), fp8_converted(kind)
    with_scales, without = rank_tensors(quantized_ckpt), rank_tensors(plain_ckpt)
    assert set(with_scales) - set(without) == {n for n in with_scales if n.endswith("kv_cache_scaling_factor")}
    assert all(torch.equal(bits(without[n]), bits(with_scales[n])) for n in without)
    layers = read_trtllm_config(quantized_ckpt)[0]["num_hidden_layers"]
    scales = [with_scales[f"transformer.layers.{i}.attention.kv_cache_scaling_factor"] for i in range(layers)]

    served = ReferenceLLM.from_checkpoint(quantized_ckpt)
    plain = ReferenceLLM.from_checkpoint(plain_ckpt)
    by_hand = RoundsTheCacheByHand(load_llm_weights(plain_ckpt), scales, kv)
    assert served.fp8_context_fmha == (kv == "fp8")
    served_prompt = served.prompt_logits(LLMRequest(PROMPT))
    assert torch.equal(served_prompt, by_hand.prompt_logits(LLMRequest(PROMPT)))
    assert torch.equal(served_prompt, plain.prompt_logits(LLMRequest(PROMPT))) == (kv == "int8")

    tokens = served.generate([LLMRequest(PROMPT, sampling=SamplingParams(max_new_tokens=steps))])[0].output_ids
    served_logits, served_cache = greedy_decode(served, PROMPT, steps)
    hand_logits, _ = greedy_decode(by_hand, PROMPT, steps)
    plain_logits, _ = greedy_decode(plain, PROMPT, steps)
    assert len(tokens) == steps and served_logits.argmax(-1).tolist() == tokens
    torch.testing.assert_close(served_logits, hand_logits, rtol=0, atol=0)
    assert (served_logits[1:] - plain_logits[1:]).abs().max() > 0  # decoding reads the rounded cache

    # by_hand's prefill returns its keys and values as its cache holds them: rounded by cache_round.
    _, keys, values = by_hand._prefill([by_hand._check(LLMRequest(PROMPT))], all_logits=False)
    n = len(PROMPT)
    for layer in range(layers):
        want_k, want_v = keys[layer].transpose(0, 1), values[layer].transpose(0, 1)
        assert torch.equal(want_k, cache_round(want_k, scales[layer], kv)), layer  # on the cache's grid
        assert torch.equal(served_cache.keys[layer, 0, :, :n], want_k), layer
        assert torch.equal(served_cache.values[layer, 0, :, :n], want_v), layer


def scaled_copy(model_dir, out, suffix: str, factor: float):
    """A copy of the checkpoint whose tensors named *suffix are `factor` times larger."""
    import shutil

    shutil.copytree(model_dir, out)
    shards = set(json.loads((out / "model.safetensors.index.json").read_text())["weight_map"].values())
    for shard in sorted(shards):
        with safe_open(str(out / shard), framework="pt") as f:
            tensors = {name: f.get_tensor(name) for name in f.keys()}
        scaled = [name for name in tensors if name.endswith(suffix)]
        for name in scaled:
            tensors[name] = (tensors[name].float() * factor).to(tensors[name].dtype)
        if scaled:
            save_file(tensors, str(out / shard), metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def loud_queries(checkpoints, calibration_file, tmp_path_factory):
    """The dense checkpoint with its q_norm weights 4 times larger (queries beyond keys and values), and its
    conversions with FP8 weights over an FP8 cache ("fp8") and over an unquantized one ("auto")."""
    root = tmp_path_factory.mktemp("loud-queries")
    model = scaled_copy(checkpoints["dense"], root / "model", "self_attn.q_norm.weight", 4.0)
    converted = {
        kv: convert_calibrated(
            model, root / kv, quant="fp8", kv_cache_dtype=kv, gpu_arch=90, calibration_data=calibration_file
        )
        for kv in ("fp8", "auto")
    }
    return model, converted


def rotated_queries(llm: ReferenceLLM, ids: np.ndarray) -> list[torch.Tensor]:
    """Each layer's rotated queries over a prompt (what the context phase quantizes under FP8 context FMHA)."""
    prompt = llm._check(LLMRequest(ids))
    h = llm._embed(prompt)
    out: list[torch.Tensor] = []
    with torch.inference_mode():
        for w in llm.w.layers:

            def record(name, x):
                if name == "q":
                    out.append(x.clone())

            h, _, _ = llm.prefill_layer(w, h, prompt.cos, prompt.sin, [(0, h.shape[0])], record)
    return out


def saturated_queries(llm: ReferenceLLM) -> list[float]:
    """Per layer, the fraction of PROMPT's rotated queries that e4m3 saturates under the layer's KV-cache scale."""
    return [
        float((q.float().abs() >= E4M3 * w.kv_scale).float().mean())
        for q, w in zip(rotated_queries(llm, PROMPT), llm.w.layers, strict=True)
    ]


@pytest.mark.once
def test_fp8_context_fmha_kv_scale_covers_the_queries(loud_queries, calibration_file):
    """FP8 weights with an FP8 cache: the builder turns FP8 context FMHA on, and the context phase quantizes the
    rotated queries with the KV-cache scale (attentionOp.cpp, enqueueContext). On a model whose queries are about 4
    times larger than its keys and values, the stored scale is the queries' amax / 448. With the keys' and values'
    scale alone (what calibration stored before), the queries saturate at 448 times it, and the prompt logits move
    from those of the same FP8 weights over an unquantized cache several times further than with the stored scale
    (mean absolute differences: measured 0.019 and 0.059, the logits' spread 0.16)."""
    model, converted = loud_queries
    plain = calibrate(Checkpoint(model), torch.bfloat16, read_prompts(calibration_file))  # "kv": keys and values
    stored = rank_tensors(converted["fp8"])
    kv_only = []
    for layer, amax in enumerate(plain.amax):
        assert amax["q"] > 2 * amax["kv"], layer
        scale = stored[f"transformer.layers.{layer}.attention.kv_cache_scaling_factor"]
        assert scale.item() == pytest.approx(amax["q"] / E4M3, rel=1e-2), layer
        kv_only.append(torch.tensor([amax["kv"] / E4M3]))

    served = ReferenceLLM.from_checkpoint(converted["fp8"])
    old_weights = load_llm_weights(converted["fp8"])
    for w, scale in zip(old_weights.layers, kv_only, strict=True):
        w.kv_scale = scale
    old = ReferenceLLM(old_weights)
    # PROMPT's queries: hardly any saturates under the stored scale, a good part of every layer's under the old one.
    stored_saturated, old_saturated = saturated_queries(served), saturated_queries(old)
    assert max(stored_saturated) < 0.01 and min(old_saturated) > 0.2, (stored_saturated, old_saturated)

    unquantized_cache = ReferenceLLM.from_checkpoint(converted["auto"]).prompt_logits(LLMRequest(PROMPT))
    spread = unquantized_cache.std().item()
    close = (served.prompt_logits(LLMRequest(PROMPT)) - unquantized_cache).abs().mean().item()
    far = (old.prompt_logits(LLMRequest(PROMPT)) - unquantized_cache).abs().mean().item()
    assert close < 0.2 * spread and far > 2.5 * close, (close, far, spread)


# -- 5. agreement with transformers --------------------------------------------------------------------------------


def louder_head(model_dir, out):
    """A copy of the checkpoint whose lm_head is 40 times larger, so random weights give logits that are not flat."""
    return scaled_copy(model_dir, out, "lm_head.weight", 40.0)


def test_fp8_agrees_with_transformers_full_precision_teacher_forced(checkpoints, calibration_file, tmp_path, capsys):
    """Greedy tokens of the fp8 engine (and, for scale, of the bf16 one), scored by transformers' fp32 model on the
    same sequence: the fraction of steps where the served token is its argmax, and the largest logit gap."""
    from transformers import AutoModelForImageTextToText

    model_dir = louder_head(checkpoints["dense"], tmp_path / "louder")
    prompt, steps = PROMPT[:8], 16
    hf = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    fractions = {}
    for quant in ("fp8", "none"):
        data = calibration_file if quant == "fp8" else None
        out = convert_calibrated(model_dir, tmp_path / quant, quant=quant, gpu_arch=90, calibration_data=data)
        llm = ReferenceLLM.from_checkpoint(out)
        served = llm.generate([LLMRequest(prompt, sampling=SamplingParams(max_new_tokens=steps))])[0].output_ids
        sequence = torch.as_tensor(np.concatenate([prompt, served[:-1]]), dtype=torch.long)
        with torch.no_grad():
            theirs = hf(input_ids=sequence[None]).logits[0, len(prompt) - 1 :]
        ours = llm.prompt_logits(LLMRequest(sequence.int().numpy()))[len(prompt) - 1 :]
        fractions[quant] = (theirs.argmax(-1) == torch.as_tensor(served)).float().mean().item()
        print(
            f"{quant}: served token is transformers' fp32 argmax at {fractions[quant]:.2f} of {steps} steps; largest "
            f"logit gap {(ours - theirs).abs().max().item():.3f} (logit spread {theirs.std(-1).mean().item():.2f})"
        )
    with capsys.disabled():
        print(capsys.readouterr().out, end="")
    assert all(0.0 <= f <= 1.0 for f in fractions.values())
    assert fractions["fp8"] >= 0.5


# -- 6. choice and refusals ----------------------------------------------------------------------------------------


def convert_cli(model, out, *options: str) -> int:
    """The command line's convert-llm, in-process: its exit status."""
    return cli_main(["convert-llm", "--model", str(model), "--output", str(out), *options])


@pytest.fixture(scope="module")
def block_fp8(checkpoints, tmp_path_factory):
    return quantize_block_fp8(checkpoints["dense"], tmp_path_factory.mktemp("block-fp8") / "model")


@pytest.mark.once
def test_default_mode_follows_the_checkpoint_and_the_gpu(checkpoints, block_fp8):
    fp8_ckpt, bf16_ckpt = Checkpoint(block_fp8), Checkpoint(checkpoints["dense"])
    assert check_llm_options(fp8_ckpt, None, None, 1, 1, gpu_arch=90).quant == "fp8"
    assert check_llm_options(fp8_ckpt, None, None, 1, 1, gpu_arch=89).quant == "fp8"
    assert check_llm_options(fp8_ckpt, None, None, 1, 1, gpu_arch=80).quant == "none"
    assert choose_llm_quant(None, True, None)[0] == "none"  # no GPU visible, no --gpu-arch
    if not torch.cuda.is_available():  # gpu_arch None: the visible GPU, here none
        assert check_llm_options(fp8_ckpt, None, None, 1, 1, gpu_arch=None).quant == "none"
    assert check_llm_options(bf16_ckpt, None, None, 1, 1, gpu_arch=90).quant == "none"
    assert choose_llm_quant(None, False, None)[0] == "none"
    for quant in ("int8-wo", "int4-wo", "fp8"):
        assert choose_llm_quant(quant, False, 90)[0] == quant
    assert choose_llm_quant("int8-wo", False, 80)[0] == "int8-wo"


@pytest.mark.once
def test_block_fp8_checkpoint_converts_to_fp8_by_default_on_hopper(block_fp8, calibration_file, tmp_path):
    out = convert_calibrated(block_fp8, tmp_path / "out", gpu_arch=90, calibration_data=calibration_file)
    cfg, _ = read_trtllm_config(out)
    assert cfg["quantization"]["quant_algo"] == "FP8"
    logits = ReferenceLLM.from_checkpoint(out).prompt_logits(LLMRequest(PROMPT))
    assert torch.isfinite(logits).all()


@pytest.mark.once
def test_gpu_arch_spellings():
    assert [parse_gpu_arch(v) for v in ("sm90", "90", "9.0", "sm_89", "SM80", " sm86 ")] == [90, 90, 90, 89, 80, 86]
    assert [parse_gpu_arch(v) for v in ("sm100", "100", "10.0", "sm_120")] == [100, 100, 100, 120]
    for bad in ("h100", "", "sm", "ampere"):
        with pytest.raises(ValueError, match="not a GPU architecture"):
            parse_gpu_arch(bad)


@pytest.mark.once
def test_fp8_on_ampere_is_refused_naming_what_works(checkpoints, tmp_path, capsys):
    out = tmp_path / "never"
    code = convert_cli(checkpoints["dense"], out, "--llm-quant", "fp8", "--gpu-arch", "sm80")
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and "sm89" in err and "sm80" in err
    assert "none" in err and "int8-wo" in err and "int4-wo" in err
    assert not out.exists()
    with pytest.raises(UnsupportedModelError, match="use --llm-quant none or int8-wo or int4-wo"):
        check_llm_options(Checkpoint(checkpoints["dense"]), None, "fp8", 1, 1, gpu_arch=86)


@pytest.mark.once
def test_unknown_gpu_arch_is_a_usage_error(checkpoints, tmp_path, capsys):
    with pytest.raises(SystemExit) as exited:
        convert_cli(checkpoints["dense"], tmp_path / "x", "--gpu-arch", "h100")
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "'h100' is not a GPU architecture" in err and "Traceback" not in err


@pytest.mark.once
def test_fp8_from_fp32_is_refused(checkpoints, tmp_path, capsys):
    out = tmp_path / "never"
    code = convert_cli(checkpoints["dense"], out, "--llm-quant", "fp8", "--dtype", "fp32", "--gpu-arch", "sm90")
    err = capsys.readouterr().err
    assert code == 2 and "fp32" in err and "Traceback" not in err, err
    assert not out.exists()


@pytest.mark.once
def test_calibration_file_reading(calibration_file, tmp_path):
    prompts = read_prompts(calibration_file)
    assert [p.text for p in prompts] == ["Name three rivers in Europe.", "What is in the picture?"]
    assert prompts[0].image is None
    assert prompts[1].image == (calibration_file.parent / "field.jpg").read_bytes()
    assert prompts[1].messages()[0]["content"][0] == {"type": "image", "image": prompts[1].image}

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n\n{"image": "no text.jpg"}\n')
    with pytest.raises(CheckpointError, match=r"bad\.jsonl:3: expected"):
        read_prompts(bad)
    bad.write_text('{"text": "fine"}\n{"text": oops}\n')
    with pytest.raises(CheckpointError, match=r"bad\.jsonl:2: expected"):
        read_prompts(bad)
    bad.write_text('{"text": "fine", "image": "missing.jpg"}\n')
    with pytest.raises(CheckpointError, match=r"bad\.jsonl:1: cannot read image missing\.jpg"):
        read_prompts(bad)
    bad.write_text("\n\n")
    with pytest.raises(CheckpointError, match="no calibration prompts"):
        read_prompts(bad)


@pytest.mark.once
def test_malformed_calibration_data_is_refused_before_any_output(checkpoints, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    out = tmp_path / "never"
    code = convert_cli(
        checkpoints["dense"], out, "--llm-quant", "fp8", "--gpu-arch", "sm90", "--calibration-data", str(bad)
    )
    err = capsys.readouterr().err
    assert code == 2 and "bad.jsonl:1:" in err and "Traceback" not in err, err
    assert not out.exists()
    with pytest.raises(UnsupportedModelError, match="--calibration-data"):  # nothing to calibrate
        convert_calibrated(checkpoints["dense"], out, quant="none", calibration_data=bad)
    assert not out.exists()


@pytest.mark.once
@pytest.mark.parametrize("quant", ["int8-wo", "int4-wo"])
@pytest.mark.parametrize("arch", ["sm100", "sm103", "sm110"])
def test_weight_only_on_sm100_to_sm119_is_refused_before_any_output(checkpoints, tmp_path, capsys, quant, arch):
    """TensorRT-LLM 1.2.1's builder refuses INT8/INT4 weight-only on sm100-sm119 once the weights are loaded
    (builder.py, build); convert-llm refuses it first, naming the option to change. sm120 and sm90 build it."""
    out = tmp_path / "never"
    code = convert_cli(checkpoints["dense"], out, "--llm-quant", quant, "--gpu-arch", arch)
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    assert f"no INT8/INT4 weight-only engine for {arch}" in err and "use --llm-quant fp8 or none" in err
    assert len(err.strip().splitlines()) == 1 and not out.exists()
    for fine in (90, 120):
        assert choose_llm_quant(quant, False, fine)[0] == quant


@pytest.mark.once
@pytest.mark.parametrize("kv", ["fp8", "int8"])
def test_quantized_kv_cache_of_an_fp32_engine_is_refused_before_any_output(checkpoints, tmp_path, capsys, kv):
    out = tmp_path / "never"
    code = convert_cli(checkpoints["dense"], out, "--dtype", "fp32", "--kv-cache-dtype", kv, "--gpu-arch", "sm90")
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    assert f"--kv-cache-dtype {kv} quantizes the KV cache of a bf16 or fp16 engine, not fp32" in err
    assert "--kv-cache-dtype auto" in err and len(err.strip().splitlines()) == 1 and not out.exists()
    with pytest.raises(UnsupportedModelError, match="not fp32"):  # with no target GPU either
        check_llm_options(Checkpoint(checkpoints["dense"]), "fp32", None, 1, 1, kv, gpu_arch=None)
    assert check_llm_options(Checkpoint(checkpoints["dense"]), "bf16", None, 1, 1, kv, gpu_arch=90).kv_cache
