"""Activation ranges for engines with static scales: FP8 (per-tensor activation scales) and a quantized KV cache,
and convert-llm with them (`convert_calibrated`, what `convert-llm` and `build` run). It sits above the stages it
uses (preprocessing, the vision tower, the reference runtime's layers, the converter's sources).

The prompts (a built-in set of chat turns, each with or without an image; or the user's) are preprocessed as
requests are, their images encoded by the checkpoint's vision tower (PyTorch, float32), and the language model runs
them one decoder layer at a time: a layer's weights are read from the checkpoint (dequantized if stored in FP8),
its inputs' and its queries', keys' and values' absolute maxima are recorded (runtime.reference_llm.Observer), and
the layer is freed before the next is read, so memory holds one layer and the prompts' hidden states whatever the model
size (a 235B-A22B layer is 3 GB in bf16). The built-in set is small and synthetic (images of smooth colour fields
and edges, short English prompts): it bounds ranges well enough for the weights' own scales to dominate, but a
user's own images and prompts (`--calibration-data`) give the ranges their traffic has; docs/model.md says when
that matters.

The KV-cache scale covers the layer's keys and values, and its queries too where the engine runs FP8 context FMHA
(FP8 weights with an FP8 cache: llm.kv_cache.fp8_context_fmha), whose context phase quantizes the queries with it.
"""

from __future__ import annotations

import io
import json
import os
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..common.torch_dtypes import TORCH_DTYPES
from ..errors import CheckpointError, UnsupportedModelError
from ..hf.checkpoint import Checkpoint
from ..llm.checkpoint_format import LLMWeights, ParallelLayout, layer_params, layer_weights, parse_trtllm_config
from ..llm.checkpoint_format import trtllm_config as make_trtllm_config
from ..llm.convert import CheckpointSources, check_llm_options, convert_llm
from ..llm.kv_cache import fp8_context_fmha
from ..llm.ranges import Ranges

PROMPTS = (
    "Describe this picture in detail.",
    "What colours and shapes do you see? Answer in two sentences.",
    "Write a short story about a lighthouse keeper and a storm.",
    "List three facts about the Pacific Ocean.",
    "Explain how a bicycle gear works to a child.",
    "Translate 'good morning, how are you?' into French and German.",
)
IMAGE_SIZES = ((448, 448), (336, 672), (672, 336))


def _synthetic_image(height: int, width: int, seed: int) -> bytes:
    """A JPEG of smooth colour fields with edges and noise: the statistics of a photo, none of its content."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    fields = [128 + 100 * np.sin(x / (19 + 9 * c) + seed) * np.cos(y / (13 + 7 * c) - c) for c in range(3)]
    image = np.stack(fields, axis=-1) + rng.normal(0, 10, (height, width, 3))
    image[(x // 64 + y // 64) % 5 == 0] *= 0.3  # edges
    out = io.BytesIO()
    Image.fromarray(np.clip(image, 0, 255).astype(np.uint8)).save(out, "JPEG", quality=90)
    return out.getvalue()


@dataclass(frozen=True)
class CalibrationPrompt:
    text: str
    image: bytes | None = None

    def messages(self) -> list[dict]:
        parts: list[dict] = [{"type": "image", "image": self.image}] if self.image is not None else []
        return [{"role": "user", "content": [*parts, {"type": "text", "text": self.text}]}]


def builtin_prompts() -> list[CalibrationPrompt]:
    """Half the prompts with an image (of three aspect ratios), half text only."""
    out = []
    for i, text in enumerate(PROMPTS):
        image = _synthetic_image(*IMAGE_SIZES[i % len(IMAGE_SIZES)], seed=i) if i % 2 == 0 else None
        out.append(CalibrationPrompt(text, image))
    return out


def read_prompts(path: str | os.PathLike[str]) -> list[CalibrationPrompt]:
    """A JSON-lines file of {"text": ..., "image": optional path relative to the file}."""
    path = Path(path)
    prompts = []
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise CheckpointError(f"cannot read the calibration data {path}: {e.strerror}") from None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            text, image = str(item["text"]), item.get("image")
        except (json.JSONDecodeError, KeyError, TypeError):
            raise CheckpointError(f'{path}:{number}: expected {{"text": ..., "image": optional path}}') from None
        data = None
        if image is not None:
            try:
                data = (path.parent / image).read_bytes()
            except OSError as e:
                raise CheckpointError(f"{path}:{number}: cannot read image {image}: {e.strerror}") from None
        prompts.append(CalibrationPrompt(text, data))
    if not prompts:
        raise CheckpointError(f"{path} holds no calibration prompts")
    return prompts


def calibrate(
    ckpt: Checkpoint, dtype: torch.dtype, prompts: list[CalibrationPrompt], kv_covers_queries: bool = False
) -> Ranges:
    """The ranges of the language model's activations over `prompts`, one decoder layer in memory at a time; with
    `kv_covers_queries` (FP8 context FMHA), the "kv" range of a layer is that of its queries, keys and values."""
    from ..llm.inputs import prompt_table_row
    from ..preprocess import Preprocessor
    from ..runtime.reference_llm import LLMRequest, ReferenceLLM
    from ..vision.model import VisionTower

    sources = CheckpointSources(ckpt, ckpt.info)
    info = ckpt.info
    config = parse_trtllm_config(make_trtllm_config(info, "fp32", ParallelLayout()))  # one rank, unsplit
    pre = Preprocessor.from_pretrained(ckpt.path)
    tower = None
    requests = []
    for prompt in prompts:
        request = pre(prompt.messages())
        embeds = (None, None)
        if request.num_visual_tokens:
            if tower is None:
                names = VisionTower.checkpoint_names(info.vision)
                tower = VisionTower.from_checkpoint_tensors(info.vision, ckpt.load_tensors(names), torch.float32)
            with torch.inference_mode():
                inputs = {k: torch.as_tensor(v) for k, v in request.vision_inputs.items()}
                embeds = tower(torch.as_tensor(request.pixel_values).float(), **inputs)
        requests.append(LLMRequest.from_preprocessed(request, *embeds))
    del tower

    # Only the embedding rows the prompts use are read (the table is 1.2 GB at 8B), and a skeleton model holds them.
    llm = ReferenceLLM(LLMWeights(config, torch.empty(0, config.hidden_size, dtype=dtype), [], *[torch.empty(0)] * 2))
    checked = [llm._check(request) for request in requests]
    ids = torch.cat([p.ids for p in checked]).clamp(max=config.vocab_size - 1)
    used, where = torch.unique(ids, return_inverse=True)
    (table,) = sources.for_role("vocab_embedding", config)
    rows = torch.cat([table.read(i, i + 1, dtype) for i in used.tolist()])
    lengths = [p.ids.numel() for p in checked]
    ends = np.cumsum(lengths).tolist()
    spans = list(zip([0, *ends[:-1]], ends, strict=True))
    cos, sin = torch.cat([p.cos for p in checked]), torch.cat([p.sin for p in checked])
    ranges = Ranges()
    with torch.inference_mode():
        h = rows[where]
        for (a, b), item in zip(spans, checked, strict=True):  # visual tokens take their prompt-table rows
            if item.table is not None:
                h[a:b][item.visual] = item.table[prompt_table_row(item.visual_ids, config.vocab_size)]
        for layer in range(config.num_hidden_layers):
            roles = layer_params(config, 0).items()
            w = layer_weights(
                {role: sources.whole(f"layers.{layer}.{role}", config, param, dtype) for role, param in roles}, config
            )
            seen: dict[str, float] = defaultdict(float)

            def observe(name: str, x: torch.Tensor, seen: dict[str, float] = seen) -> None:
                seen[name] = max(seen[name], float(x.abs().max()) if x.numel() else 0.0)

            h, _, _ = llm.prefill_layer(w, h, cos, sin, spans, observe)
            for (a, b), item in zip(spans, checked, strict=True):
                llm._deepstack(h[a:b], item, layer)
            if kv_covers_queries:
                seen["kv"] = max(seen["kv"], seen["q"])
            ranges.amax.append(dict(seen))
            del w
    return ranges


def convert_calibrated(
    model: str | os.PathLike[str] | Checkpoint,
    output: str | os.PathLike[str],
    dtype: str | None = None,
    tp: int = 1,
    pp: int = 1,
    quant: str | None = None,
    kv_cache_dtype: str = "auto",
    gpu_arch: int | None = None,
    calibration_data: str | os.PathLike[str] | None = None,
    force: bool = False,
    progress: bool | None = None,
    log: Callable[[str], object] | None = None,
) -> Path:
    """llm.convert.convert_llm with the options' calibration pass run first where they need one (fp8, a quantized
    KV cache), over `calibration_data` (read_prompts) or the built-in prompts; refused with calibration data that
    nothing would use."""
    ckpt = model if isinstance(model, Checkpoint) else Checkpoint(model)
    options = check_llm_options(ckpt, dtype, quant, tp, pp, kv_cache_dtype, gpu_arch)
    if calibration_data is not None and not options.needs_calibration:
        raise UnsupportedModelError(
            "--calibration-data sets the scales of --llm-quant fp8 and --kv-cache-dtype fp8/int8; this build has none"
        )
    ranges = None
    if options.needs_calibration:
        prompts = read_prompts(calibration_data) if calibration_data is not None else builtin_prompts()
        if log is not None:
            log(f"convert-llm: calibrating activation ranges over {len(prompts)} prompts, one decoder layer at a time")
        queries = fp8_context_fmha(options.config.quant_algo, options.config.kv_cache_quant_algo)
        ranges = calibrate(ckpt, TORCH_DTYPES[options.dtype], prompts, kv_covers_queries=queries)
    return convert_llm(
        ckpt,
        output,
        dtype=dtype,
        tp=tp,
        pp=pp,
        quant=quant,
        kv_cache_dtype=kv_cache_dtype,
        gpu_arch=gpu_arch,
        ranges=ranges,
        force=force,
        progress=progress,
        log=log,
    )
