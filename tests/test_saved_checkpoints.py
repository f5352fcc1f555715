"""Checkpoints as transformers' own save_pretrained writes them, through every stage.

The installed transformers (5.x, or 4.57.3 with the overlay) instantiates Qwen3-VL and Qwen3-VL-MoE
with random weights and saves them: its config.json (5.x: `rope_parameters`, `num_local_experts`,
`qwen3_vl_vision` model types; 4.57: `rope_scaling`, `num_experts`) and its weight layout (5.x
writes fused experts as [E, out, in], 4.57 as the released [E, in, out]). Every command must accept
them, and the converted language model must give transformers' logits on the saved model.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from images import jpeg
from qwen3vl_trt.cli import main as cli
from qwen3vl_trt.hf.checkpoint import Checkpoint
from qwen3vl_trt.llm.checkpoint_format import load_llm_weights
from qwen3vl_trt.llm.convert import convert_llm
from qwen3vl_trt.qa.tiny import PRESETS, build_config
from qwen3vl_trt.runtime import LLMRequest, ReferenceLLM
from test_reference_llm import CASES, LOGIT_TOLERANCE, Chain, position_errors
from transformers import (
    AutoModelForImageTextToText,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
    Qwen3VLMoeConfig,
    Qwen3VLMoeForConditionalGeneration,
)


def _config(moe: bool, **text: object) -> dict:
    """build_config's tiny model, with text_config changes, as arguments of transformers' config classes."""
    cfg = build_config(PRESETS["tiny"], moe=moe)
    cfg["text_config"].update(text)
    return {k: v for k, v in cfg.items() if k not in ("architectures", "model_type")}


# What the saved checkpoints are made from: (MoE, text_config changes).
SAVED = {
    # A config without mrope_interleaved: transformers interleaves anyway.
    "dense": (False, {"rope_scaling": {"mrope_section": [8, 4, 4], "rope_type": "default"}}),
    "moe": (True, {}),
    # gate_up_proj is [E, 64, 64] in both layouts: the saving version says which one it is.
    "moe-square-experts": (True, {"moe_intermediate_size": 32}),
}


def save_pretrained(fields: dict, moe: bool, output: Path, seed: int = 0) -> Path:
    """A random-weight model of the installed transformers, saved by its save_pretrained."""
    config_class, model_class = (
        (Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration)
        if moe
        else (Qwen3VLConfig, Qwen3VLForConditionalGeneration)
    )
    torch.manual_seed(seed)
    model_class(config_class(**fields)).save_pretrained(output)
    return output


@pytest.fixture(scope="module")
def saved(tiny_dense, tmp_path_factory):
    """Saved checkpoints by SAVED key, with the processor and tokenizer files of a make-tiny checkpoint."""
    root = tmp_path_factory.mktemp("saved")
    cache: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in cache:
            moe, text = SAVED[kind]
            path = save_pretrained(_config(moe, **text), moe, root / kind, seed=len(cache))
            for file in tiny_dense.iterdir():
                if not (path / file.name).exists() and not file.name.startswith("model"):
                    shutil.copy(file, path / file.name)
            cache[kind] = path
        return cache[kind]

    return get


@dataclass
class Run:
    code: int
    stdout: str
    stderr: str


def run_cli(*args: str | Path) -> Run:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli([str(a) for a in args])
    return Run(code, out.getvalue(), err.getvalue())


@dataclass
class Stages:
    model: Path
    vision: Path  # export-vision --verify, fp32
    llm: Path  # convert-llm, fp32
    runs: dict[str, Run]


@pytest.fixture(scope="module")
def stages(saved, tmp_path_factory):
    """Every command run once on each saved checkpoint."""
    cache: dict[str, Stages] = {}

    def get(kind: str) -> Stages:
        if kind not in cache:
            model, out = saved(kind), tmp_path_factory.mktemp(kind)
            (out / "photo.jpg").write_bytes(jpeg(64, 96, seed=1))
            image = ["--image", out / "photo.jpg"]
            commands = {
                "inspect": ["--model", model],
                "export-vision": ["--model", model, "--output", out / "vision", "--verify"],
                "convert-llm": ["--model", model, "--output", out / "llm", "--dtype", "fp32"],
                "preprocess": ["--model", model, *image],
                # fp16 skips a second parity run of the same tower; export-vision --verify did it.
                "build": ["--model", model, "--output", out / "build", "--dtype", "fp16"],
                "generate": ["--model", model, "--build", out / "build", *image, "--max-new-tokens", "4"],
            }
            runs = {name: run_cli(name, *args) for name, args in commands.items()}
            cache[kind] = Stages(model, out / "vision", out / "llm", runs)
        return cache[kind]

    return get


@pytest.mark.slow  # two vision exports per checkpoint (export-vision, build)
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_every_command_accepts_it(kind, stages):
    run = stages(kind)
    for name, result in run.runs.items():
        assert result.code == 0, f"{name}: {result.stderr}"
    info = json.loads(run.runs["inspect"].stdout)
    saved = json.loads((run.model / "config.json").read_text())
    text = saved["text_config"]
    assert info["moe"] is (kind == "moe") and info["vision"]["depth"] == saved["vision_config"]["depth"]
    if kind == "moe":
        assert info["text"]["moe"]["num_experts"] == text.get("num_experts", text.get("num_local_experts")) == 4
    assert info["text"]["mrope_interleaved"] is True
    assert "verified against transformers" in run.runs["export-vision"].stdout
    request = json.loads(run.runs["preprocess"].stdout)
    assert request["visual_tokens"] == math.prod(request["images"][0]["grid_thw"]) // 4 > 0
    assert run.runs["generate"].stdout.strip()


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_converted_logits_match_transformers(kind, stages):
    """A prompt with an image: MRoPE's interleaved layout and DeepStack both reach the logits."""
    run = stages(kind)
    chain, llm = Chain(run.model, run.vision), ReferenceLLM.from_checkpoint(run.llm)
    messages = CASES["one image"]
    ours = llm.prompt_logits(chain.engine_request(messages))
    with torch.no_grad():
        theirs = chain.hf(**chain.hf_inputs(messages)).logits[0]
    errors = position_errors(ours, theirs)
    assert float(errors.max()) <= LOGIT_TOLERANCE, f"worst position {int(errors.argmax())}: {float(errors.max()):.2e}"


def test_square_experts_are_read_in_the_saving_versions_layout(saved, tmp_path):
    model = saved("moe-square-experts")
    gate_up = Checkpoint(model).locate("model.language_model.layers.0.mlp.experts.gate_up_proj")
    assert gate_up.shape == (4, 64, 64)
    ids = torch.tensor([[151644, 872, 198, 9707, 11, 1879, 0, 151645]])
    hf = AutoModelForImageTextToText.from_pretrained(model, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf(input_ids=ids).logits[0]
    ours = ReferenceLLM.from_checkpoint(convert_llm(model, tmp_path / "llm", dtype="fp32", progress=False))
    assert float(position_errors(ours.prompt_logits(LLMRequest(ids[0].int().numpy())), theirs).max()) <= LOGIT_TOLERANCE


@pytest.mark.parametrize(("top_level", "text_level"), [(True, False), (False, True)])
def test_output_head_is_the_one_transformers_uses(top_level, text_level, tmp_path):
    """The tie flag at the level the saving version obeys (5.x: top level, 4.x: text_config) picks the head."""
    fields = _config(False, vocab_size=512, tie_word_embeddings=text_level) | {"tie_word_embeddings": top_level}
    model = save_pretrained(fields, moe=False, output=tmp_path / "saved")
    hf = AutoModelForImageTextToText.from_pretrained(model, dtype=torch.float32)
    head, embedding = hf.lm_head.weight, hf.get_input_embeddings().weight
    assert Checkpoint(model).info.tie_word_embeddings is (head.data_ptr() == embedding.data_ptr())
    converted = load_llm_weights(convert_llm(model, tmp_path / "llm", dtype="fp32", progress=False))
    assert torch.equal(converted.lm_head, head.detach())
