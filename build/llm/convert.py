"""convert-llm: the Qwen3-VL language model as a TensorRT-LLM 1.2.1 checkpoint, streamed.

Every output tensor is produced in row chunks read straight from the source shards (one positioned
read per chunk, see safetensors_io), cast, cut for its tensor-parallel rank and appended to that
rank's file, whose header was written first. Peak memory is a few chunks, whatever the model size:
a 235B-A22B checkpoint converts on a machine with a few GB of RAM. Names, splits and config.json
come from trtllm_checkpoint, which the reference runtime reads back with.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from tqdm import tqdm

from ..common.dtypes import DTYPE_CHOICES, KV_CACHE_DTYPE_CHOICES
from ..common.fsutil import atomic_output_dir
from ..common.torch_dtypes import TORCH_DTYPES
from ..decoding.guides import write_tokenizer_info
from ..errors import CheckpointError, UnsupportedModelError
from ..hf.checkpoint import Checkpoint, ModelInfo, generation_end_ids
from ..hf.safetensors_io import RowReader, StackedLocation, StreamingWriter, TensorPlan
from .checkpoint_format import (
    CONFIG_FILE,
    TOKENIZER_INFO_FILE,
    LLMConfig,
    ParallelLayout,
    Param,
    parse_trtllm_config,
    rank_file,
    stage_params,
    trtllm_config,
)
from .fp8 import ACTIVATION_SCALE, E4M3_MAX, FP8_ALGO, WEIGHT_SCALE, FP8PerTensor, scale_of, to_fp8
from .kv_cache import KV_CACHE_DTYPES, KVCacheQuant
from .precision import check_kv_cache, choose_llm_quant, visible_gpu_arch
from .ranges import Ranges
from .weight_only import WEIGHT_ONLY_MODES, WeightOnly

TEXT_PREFIX = "model.language_model."
LM_HEAD = "lm_head.weight"
CHUNK_BYTES = 32 * 2**20  # source bytes per read
WEIGHT_ONLY_MULTIPLE = 64  # what the weight-only layers round features up to, per rank (quantization/layers.py)


@dataclass(frozen=True)
class Source:
    """Rows of one split group of an output parameter, read from a source tensor. `transform` maps a
    chunk of source rows to the same rows in the output layout; rows past the source are zeros
    (lm_head vocab padding)."""

    location: RowReader
    rows: int
    transform: Callable[[torch.Tensor], torch.Tensor] | None = None

    def read(
        self, start: int, stop: int, dtype: torch.dtype, reads: dict[int, torch.Tensor] | None = None
    ) -> torch.Tensor:
        """Rows [start, stop) in the output layout and dtype; `reads` shares raw reads of the same
        rows among sources cut from one tensor."""
        available = self.location.shape[0] if self.location.shape else 1
        key = id(self.location)
        if reads is not None and key in reads:
            chunk = reads[key]
        else:
            chunk = self.location.read_rows(min(start, available), min(stop, available))
            if reads is not None:
                reads[key] = chunk
        if self.transform is not None:
            chunk = self.transform(chunk)
        chunk = chunk.to(dtype)
        if stop > available:
            pad = chunk.new_zeros((stop - max(start, available), *chunk.shape[1:]))
            chunk = torch.cat([chunk, pad])
        return chunk

    @property
    def chunk_rows(self) -> int:
        return max(1, CHUNK_BYTES // max(1, self.location.row_bytes))


def source_dtype(config: dict) -> str:
    """The checkpoint's own dtype as a --dtype choice (bf16 when it does not say)."""
    text = config.get("text_config", {})
    name = text.get("dtype") or text.get("torch_dtype") or config.get("dtype") or config.get("torch_dtype")
    return DTYPE_CHOICES.get(str(name), "bf16")


class CheckpointSources:
    """Locates and shape-checks the Hugging Face tensors behind each output parameter."""

    def __init__(self, ckpt: Checkpoint, info: ModelInfo):
        self.ckpt, self.info = ckpt, info

    def tensor(self, name: str, shape: tuple[int, ...]) -> RowReader:
        location = self.ckpt.locate(name)
        if location.shape != shape:
            raise CheckpointError(f"tensor '{name}' has shape {list(location.shape)}, expected {list(shape)}")
        return location

    def plain(self, name: str, shape: tuple[int, ...], rows: int | None = None) -> list[Source]:
        return [Source(self.tensor(name, shape), rows if rows is not None else shape[0])]

    def whole(self, role: str, config: LLMConfig, param: Param, dtype: torch.dtype) -> torch.Tensor:
        """Parameter `role` of a one-rank `config`, whole, in `dtype` (float32 where the parameter stays so), read
        chunk by chunk into place (a block-FP8 tensor is never whole in float32). Its sources are consecutive
        groups along the split dimension; their rows (experts, for expert stacks) run along dim 0."""
        out = torch.empty(param.shape, dtype=torch.float32 if param.float32 else dtype)
        dim, offset = param.split.dim or 0, 0
        for src in self.for_role(role, config):
            width = src.rows
            for start in range(0, src.rows, src.chunk_rows):
                chunk = src.read(start, min(start + src.chunk_rows, src.rows), out.dtype)
                if dim == 0:
                    out[offset + start : offset + start + len(chunk)] = chunk
                else:
                    width = chunk.shape[dim]
                    out.narrow(dim, offset, width)[start : start + len(chunk)] = chunk
            offset += width
        return out

    def per_expert(self, prefix: str, projection: str, experts: int, shape: tuple[int, int]) -> RowReader | None:
        """The experts' `projection` weights stored one nn.Linear per expert (`{prefix}{e}.{projection}.weight`,
        [out, in]), as an [E, out, in] stack; None when the checkpoint fuses them."""
        names = [f"{prefix}{e}.{projection}.weight" for e in range(experts)]
        if not self.ckpt.tensor_names(names[0]):
            return None
        return StackedLocation(tuple(self.tensor(n, shape) for n in names))

    def experts(
        self, name: str, experts: int, in_features: int, out_features: int
    ) -> tuple[RowReader, Callable[[torch.Tensor], torch.Tensor]]:
        """A fused expert tensor in either layout transformers writes, and the map of a chunk of it to
        F.linear's [E, out, in]: the released [E, in, out] (x @ W; transformers 4.x) or 5.x's own
        [E, out, in] (its save_pretrained keeps it). A square shape fits both: then the layout is that of
        the version that saved the checkpoint, as each version's loader assumes for its own files."""
        location = self.ckpt.locate(name)
        released, linear = (experts, in_features, out_features), (experts, out_features, in_features)
        if location.shape not in (released, linear):
            raise CheckpointError(
                f"tensor '{name}' has shape {list(location.shape)}, expected {list(released)} or {list(linear)}"
            )
        if released == linear:
            saved_by = self.info.saved_by_transformers_major
            is_linear = saved_by is not None and saved_by >= 5
        else:
            is_linear = location.shape == linear
        return location, (lambda w: w) if is_linear else (lambda w: w.transpose(1, 2))

    def for_role(self, role: str, config: LLMConfig) -> list[Source]:
        c, t = config, self.info.text
        d, hd = c.hidden_size, c.head_size
        if role == "vocab_embedding":
            return self.plain(TEXT_PREFIX + "embed_tokens.weight", (c.vocab_size, d))
        if role == "ln_f":
            return self.plain(TEXT_PREFIX + "norm.weight", (d,))
        if role == "lm_head":
            if self.info.tie_word_embeddings:
                return self.plain(TEXT_PREFIX + "embed_tokens.weight", (c.vocab_size, d), rows=c.vocab_size_padded)
            if LM_HEAD not in self.ckpt.tensor_names(LM_HEAD):
                raise CheckpointError(
                    f"the checkpoint has no {LM_HEAD} although config.json unties the output head from the "
                    "embedding (tie_word_embeddings false): restore the tensor, or set the flag if the model was tied"
                )
            return self.plain(LM_HEAD, (c.vocab_size, d), rows=c.vocab_size_padded)
        _, layer, what = role.split(".", 2)
        p = f"{TEXT_PREFIX}layers.{layer}."
        q, kv = c.num_attention_heads * hd, c.num_key_value_heads * hd
        simple = {
            "input_layernorm": ("input_layernorm.weight", (d,)),
            "q_norm": ("self_attn.q_norm.weight", (hd,)),
            "k_norm": ("self_attn.k_norm.weight", (hd,)),
            "dense": ("self_attn.o_proj.weight", (d, q)),
            "post_layernorm": ("post_attention_layernorm.weight", (d,)),
            "mlp_gate": ("mlp.gate_proj.weight", (t.intermediate_size, d)),
            "mlp_up": ("mlp.up_proj.weight", (t.intermediate_size, d)),
            "mlp_down": ("mlp.down_proj.weight", (d, t.intermediate_size)),
        }
        if what in simple:
            return self.plain(p + simple[what][0], simple[what][1])
        if what == "kv_scale":
            return []  # from calibration
        if what == "qkv":
            return [
                *self.plain(p + "self_attn.q_proj.weight", (q, d)),
                *self.plain(p + "self_attn.k_proj.weight", (kv, d)),
                *self.plain(p + "self_attn.v_proj.weight", (kv, d)),
            ]
        assert c.moe is not None
        e, i = c.moe.num_experts, c.moe.intermediate_size
        if what == "router":
            return self.plain(p + "mlp.gate.weight", (e, d))
        experts = p + "mlp.experts."
        if what == "experts_up_gate":
            gate = self.per_expert(experts, "gate_proj", e, (i, d))
            if gate is not None:  # TensorRT-LLM wants [E, up; gate, H]
                up = self.per_expert(experts, "up_proj", e, (i, d))
                if up is None:
                    raise CheckpointError(f"the checkpoint has {experts}0.gate_proj.weight but no up_proj")
                return [Source(up, e), Source(gate, e)]
            # As F.linear weights gate_up_proj is [E, 2I, H] (gate rows, then up); TensorRT-LLM wants [E, up; gate, H].
            fused, as_linear = self.experts(p + "mlp.experts.gate_up_proj", e, d, 2 * i)
            return [
                Source(fused, e, lambda w: as_linear(w)[:, i:]),
                Source(fused, e, lambda w: as_linear(w)[:, :i]),
            ]
        if what == "experts_down":
            stacked = self.per_expert(experts, "down_proj", e, (d, i))
            if stacked is not None:
                return [Source(stacked, e)]
            down, as_linear = self.experts(p + "mlp.experts.down_proj", e, i, d)
            return [Source(down, e, as_linear)]
        raise AssertionError(f"no source for {role}")


def _param_chunks(
    param: Param, sources: list[Source], tp_size: int, dtype: torch.dtype
) -> Iterator[tuple[int, torch.Tensor]]:
    """(tp_rank, chunk) pairs covering every rank's part of a parameter, each rank's chunks in row
    order. Rows split across ranks are read once each; parameters every rank needs whole rows of
    (replicated, or split on an inner dim) are read once per chunk and cut for all ranks."""
    split = param.split
    offsets = [sum(split.groups[:g]) for g in range(len(split.groups))]
    if split.dim == 0:
        for tp_rank in range(tp_size):
            for a, b in split.ranges(tp_rank, tp_size):
                g = max(k for k, off in enumerate(offsets) if off <= a)
                src = sources[g]
                for start in range(a - offsets[g], b - offsets[g], src.chunk_rows):
                    yield tp_rank, src.read(start, min(start + src.chunk_rows, b - offsets[g]), dtype)
        return
    rows, step = sources[0].rows, min(s.chunk_rows for s in sources)
    for start in range(0, rows, step):
        stop = min(start + step, rows)
        reads: dict[int, torch.Tensor] = {}  # groups cut from one source tensor share its read
        parts = [src.read(start, stop, dtype, reads) for src in sources]
        for tp_rank in range(tp_size):
            if split.dim is None:
                yield tp_rank, parts[0]
                continue
            ranges = split.ranges(tp_rank, tp_size)
            pieces = [
                p.narrow(split.dim, a - off, b - a) for p, off, (a, b) in zip(parts, offsets, ranges, strict=True)
            ]
            yield tp_rank, torch.cat(pieces, dim=split.dim)


def _weight_only_multiples(param: Param, tp: int) -> tuple[int, int]:
    """What a quantized parameter's per-rank [out, in] features must be multiples of for the weight-only layers to
    declare exactly its stored shapes. WeightOnlyQuant{Column,Row}Linear (quantization/layers.py) round a linear's
    whole in and out features up to a multiple of 64 * tp before splitting one of them: 64 per rank on the split
    side, 64 * tp on the side every rank holds whole (the hidden size). The MoE experts' weights are not padded
    (layers/moe.py, MOEWeightWrapper); each rank's are held to 64 on both sides, the alignment the dense layers give
    their GEMM."""
    multiples = [WEIGHT_ONLY_MULTIPLE, WEIGHT_ONLY_MULTIPLE]
    if len(param.shape) == 2 and param.split.dim is not None:
        multiples[1 - param.split.dim] *= tp
    return multiples[0], multiples[1]


def check_weight_only(config: LLMConfig, scheme: WeightOnly, mode: str) -> None:
    """Refuses a tensor-parallel split whose quantized weights the weight-only layers would pad
    (_weight_only_multiples): the stored shapes would not load. The message names the --tp values that work."""

    def misfits(tp: int) -> list[str]:
        layout = replace(config.mapping, tp_size=tp)
        trial = replace(config, mapping=layout)
        bad = []
        for param in stage_params(trial, 0).values():
            if not param.quantizable:
                continue
            out_multiple, in_multiple = _weight_only_multiples(param, tp)
            for tp_rank in range(tp):
                *_, n, k = param.rank_shape(tp_rank, tp)
                if n % out_multiple or k % in_multiple:
                    bad.append(f"{param.name.split('.', 3)[-1]} [{n}, {k}]")
                    break
        return sorted(set(bad))

    tp = config.mapping.tp_size
    bad = misfits(tp)
    if bad:
        works = [n for n in (1, 2, 4, 8) if _tp_divides(config, n) and not misfits(n)]
        hint = f"use --tp {' or '.join(map(str, works))}" if works else "no tp fits this model: use --llm-quant none"
        raise UnsupportedModelError(
            f"--llm-quant {mode} at tp={tp}: TensorRT-LLM's weight-only layers pad a linear's features to multiples "
            f"of {WEIGHT_ONLY_MULTIPLE} per rank and {WEIGHT_ONLY_MULTIPLE}*tp={WEIGHT_ONLY_MULTIPLE * tp} where "
            f"every rank holds them whole (the hidden size), and {', '.join(bad[:4])} (per rank, [out, in]) do not "
            f"fit; {hint}"
        )


def _tp_divides(config: LLMConfig, tp: int) -> bool:
    c = config
    sizes = [c.num_attention_heads, c.intermediate_size] + ([c.moe.intermediate_size] if c.moe else [])
    kv = c.num_key_value_heads
    return all(n % tp == 0 for n in sizes) and (kv % tp == 0 or tp % kv == 0)


# The calibrated input (reference_llm.Observer's name) of each FP8 linear, by role.
_ACTIVATIONS = {
    "qkv": "qkv",
    "dense": "dense",
    "mlp_gate": "mlp",
    "mlp_up": "mlp",
    "mlp_down": "down",
    "experts_up_gate": "experts",
    "experts_down": "experts_down",
}
# Parameters whose FP8 weight scales are one: the dense MLP's fc and gate, which the build fuses (fuse_gate_mlp).
_SHARED_WEIGHT_SCALE = {"mlp_gate": "mlp_up", "mlp_up": "mlp_gate"}


def _weight_amax(param: Param, sources: list[Source], dtype: torch.dtype) -> torch.Tensor:
    """The absolute maximum of a parameter in `dtype`: over the whole tensor ([1]), or per expert ([E])."""
    experts = len(param.shape) == 3
    totals = []
    for src in sources:
        parts = []
        for start in range(0, src.rows, src.chunk_rows):
            chunk = src.read(start, min(start + src.chunk_rows, src.rows), dtype).abs()
            parts.append(chunk.flatten(1).amax(1) if experts else chunk.amax().reshape(1))
        per_source = torch.cat(parts)
        totals.append(per_source if experts else per_source.amax().reshape(1))
    return torch.stack(totals).amax(0).float()


def _layer_role(role: str) -> tuple[int, str]:
    """(layer, role within it) of a stage parameter's role; (-1, role) outside the layers."""
    if not role.startswith("layers."):
        return -1, role
    _, layer, what = role.split(".", 2)
    return int(layer), what


def _fp8_weight_scale(
    role: str,
    params: dict[str, Param],
    plan: dict[str, list[Source]],
    amax: dict[str, torch.Tensor],
    dtype: torch.dtype,
) -> torch.Tensor:
    """A parameter's FP8 weight scale: its amax / 448, the max with its partner's where two share one (amax keeps
    each parameter's absolute maximum once read)."""
    layer, what = _layer_role(role)
    names = [role] + ([f"layers.{layer}.{_SHARED_WEIGHT_SCALE[what]}"] if what in _SHARED_WEIGHT_SCALE else [])
    for name in names:
        if name not in amax:
            amax[name] = _weight_amax(params[name], plan[name], dtype)
    return scale_of(torch.stack([amax[name] for name in names]).amax(0))


@dataclass
class _Writing:
    """What writing one stage's parameters needs besides their chunks."""

    writers: list[StreamingWriter]
    dtype: torch.dtype
    bar: tqdm


def _write_plain(param: Param, chunks: Iterator[tuple[int, torch.Tensor]], w: _Writing) -> None:
    for tp_rank, chunk in chunks:
        w.writers[tp_rank].write(param.name, chunk)
        w.bar.update(chunk.numel() * chunk.element_size())


def _write_weight_only(
    param: Param, chunks: Iterator[tuple[int, torch.Tensor]], w: _Writing, scheme: WeightOnly
) -> None:
    """Each chunk's rows quantized (per output channel: a chunk holds whole rows) and written in the stored
    layout, then the scales."""
    rows: dict[int, list[torch.Tensor]] = defaultdict(list)
    scales: dict[int, list[torch.Tensor]] = defaultdict(list)
    for tp_rank, chunk in chunks:
        q, scale = scheme.quantize(chunk)
        scales[tp_rank].append(scale.to(w.dtype))
        if chunk.ndim == 3:  # chunks of whole experts: their stored layout is the chunk's own
            w.writers[tp_rank].write(param.name, scheme.to_stored(q))
        else:  # the stored layout is transposed: the rank's rows are gathered first (1 byte each)
            rows[tp_rank].append(q)
        w.bar.update(chunk.numel() * chunk.element_size())
    for tp_rank in sorted(scales):
        if rows[tp_rank]:
            w.writers[tp_rank].write(param.name, scheme.to_stored(torch.cat(rows[tp_rank])))
        w.writers[tp_rank].write(param.scale_name, torch.cat(scales[tp_rank]))


def _write_fp8(
    param: Param,
    chunks: Iterator[tuple[int, torch.Tensor]],
    w: _Writing,
    weight_scale: torch.Tensor,
    activation_scale: float,
) -> None:
    """Each chunk as e4m3 with the tensor's (or its experts') scale, then the scales, on every rank."""
    cursor: dict[int, int] = defaultdict(int)  # experts written per rank
    for tp_rank, chunk in chunks:
        scale = weight_scale
        if chunk.ndim == 3:
            first = cursor[tp_rank]
            scale = weight_scale[first : first + chunk.shape[0]].reshape(-1, 1, 1)
            cursor[tp_rank] += chunk.shape[0]
        w.writers[tp_rank].write(param.name, to_fp8(chunk, scale))
        w.bar.update(chunk.numel() * chunk.element_size())
    prefix = param.name.removesuffix("weight")
    stored_scale = weight_scale.reshape(-1, 1) if len(param.shape) == 3 else weight_scale.reshape(1)
    for writer in w.writers:
        writer.write(prefix + WEIGHT_SCALE, stored_scale.float())
        writer.write(prefix + ACTIVATION_SCALE, torch.tensor([activation_scale], dtype=torch.float32))


@dataclass(frozen=True)
class LLMOptions:
    """What convert-llm writes for a checkpoint and its options, checked."""

    cfg: dict  # config.json
    config: LLMConfig
    dtype: str
    quant: str
    why: str  # how the mode was chosen
    kv_cache: KVCacheQuant | None

    @property
    def needs_calibration(self) -> bool:
        return self.quant == "fp8" or self.kv_cache is not None


def check_llm_options(
    ckpt: Checkpoint,
    dtype: str | None,
    quant: str | None,
    tp: int,
    pp: int,
    kv_cache_dtype: str = "auto",
    gpu_arch: int | None = None,
) -> LLMOptions:
    """Checks the language model's options against the checkpoint and the target GPU (`gpu_arch`, else the
    visible one) before any work (build runs it first), and chooses the default --llm-quant."""
    dtype = dtype or source_dtype(ckpt.config)
    if dtype not in TORCH_DTYPES:
        raise CheckpointError(f"dtype must be one of {', '.join(TORCH_DTYPES)}, got {dtype!r}")
    if kv_cache_dtype not in KV_CACHE_DTYPE_CHOICES:
        choices = ", ".join(KV_CACHE_DTYPE_CHOICES)
        raise UnsupportedModelError(f"--kv-cache-dtype must be one of {choices}, got {kv_cache_dtype!r}")
    arch = gpu_arch if gpu_arch is not None else visible_gpu_arch()
    quant, why = choose_llm_quant(quant, ckpt.info.quantization is not None, arch)
    check_kv_cache(kv_cache_dtype, arch, dtype)
    kv_cache = KV_CACHE_DTYPES.get(kv_cache_dtype)
    quant_algo = FP8_ALGO if quant == "fp8" else WEIGHT_ONLY_MODES[quant][0] if quant in WEIGHT_ONLY_MODES else None
    if quant != "none" and dtype == "fp32":
        raise UnsupportedModelError(f"--llm-quant {quant} quantizes from a bf16 or fp16 engine dtype, not fp32")
    cfg = trtllm_config(
        ckpt.info, dtype, ParallelLayout(tp, pp), quant_algo, kv_cache.algo if kv_cache is not None else None
    )
    config = parse_trtllm_config(cfg)
    if isinstance(config.scheme, WeightOnly):
        check_weight_only(config, config.scheme, quant)
    return LLMOptions(cfg, config, dtype, quant, why, kv_cache)


def convert_llm(
    model: str | os.PathLike[str] | Checkpoint,
    output: str | os.PathLike[str],
    dtype: str | None = None,
    tp: int = 1,
    pp: int = 1,
    quant: str | None = None,
    kv_cache_dtype: str = "auto",
    gpu_arch: int | None = None,
    ranges: Ranges | None = None,
    force: bool = False,
    progress: bool | None = None,
    log: Callable[[str], object] | None = None,
) -> Path:
    """Writes the TensorRT-LLM checkpoint of the model's language half and returns its directory. `quant` (None:
    the default for the checkpoint and the GPU, precision.choose_llm_quant) stores its linear weights quantized;
    fp8 and a quantized KV cache (`kv_cache_dtype`) take their static scales from `ranges`, a calibration pass's
    (qwen3vl_trt.pipeline.calibration.convert_calibrated runs one first)."""
    ckpt = model if isinstance(model, Checkpoint) else Checkpoint(model)
    ckpt.verify_shards()
    options = check_llm_options(ckpt, dtype, quant, tp, pp, kv_cache_dtype, gpu_arch)
    if options.needs_calibration and ranges is None:
        raise UnsupportedModelError(
            f"--llm-quant {options.quant} with --kv-cache-dtype {kv_cache_dtype} needs activation ranges from a "
            "calibration pass: convert with qwen3vl_trt.pipeline.calibration.convert_calibrated (what convert-llm runs)"
        )
    config, scheme = options.config, options.config.scheme
    out_dtype = TORCH_DTYPES[options.dtype]
    sources = CheckpointSources(ckpt, ckpt.info)
    stages = [stage_params(config, pp_rank) for pp_rank in range(pp)]
    plan = {role: sources.for_role(role, config) for params in stages for role in params}  # all checked first

    def chunk_dtype(param: Param) -> torch.dtype:
        return torch.float32 if param.float32 else out_dtype

    def tensors(param: Param, tp_rank: int) -> list[TensorPlan]:
        return [TensorPlan(t.name, t.dtype, t.shape) for t in param.stored(tp_rank, tp, out_dtype, scheme)]

    total = sum(
        TensorPlan(p.name, chunk_dtype(p), p.rank_shape(r, tp)).nbytes
        for params in stages
        for p in params.values()
        for r in range(tp)
    )
    if log is not None:
        stored = sum(t.nbytes for params in stages for p in params.values() for r in range(tp) for t in tensors(p, r))
        what = config.quant_algo or options.dtype
        saved = f", {(total - stored) / 2**30:.2f} GiB less than {options.dtype}" if scheme is not None else ""
        log(
            f"convert-llm: --llm-quant {options.quant} ({what}; {options.why}): "
            f"{stored / 2**30:.2f} GiB of weights{saved}"
        )
    with atomic_output_dir(output, force=force, inputs=[ckpt.path]) as tmp:
        (tmp / CONFIG_FILE).write_text(json.dumps(options.cfg, indent=4) + "\n")
        # Serving reads it for guided decoding (write-repo refuses a checkpoint without it); the engine does not.
        end_ids = generation_end_ids(ckpt.path)
        if (ckpt.path / "tokenizer.json").is_file() and end_ids:
            write_tokenizer_info(ckpt.path, config.vocab_size, end_ids, tmp / TOKENIZER_INFO_FILE)
        elif log is not None:
            log(
                f"convert-llm: {ckpt.path} has no tokenizer.json or no eos_token_id in generation_config.json: "
                f"{TOKENIZER_INFO_FILE}, which serving needs, is not written"
            )
        with tqdm(
            total=total, unit="B", unit_scale=True, desc="convert-llm", disable=True if progress is False else None
        ) as bar:
            for pp_rank, params in enumerate(stages):
                writing = _Writing(
                    [
                        StreamingWriter(
                            tmp / rank_file(config.mapping.rank(tp_rank, pp_rank)),
                            [t for p in params.values() for t in tensors(p, tp_rank)],
                            metadata={"format": "pt"},
                        )
                        for tp_rank in range(tp)
                    ],
                    out_dtype,
                    bar,
                )
                amax: dict[str, torch.Tensor] = {}
                for role, param in params.items():
                    chunks = _param_chunks(param, plan[role], tp, chunk_dtype(param))
                    layer, what = _layer_role(role)
                    if what == "kv_scale":
                        assert ranges is not None and options.kv_cache is not None
                        scale = ranges.scale(layer, "kv", options.kv_cache.levels)
                        for writer in writing.writers:
                            writer.write(param.name, torch.tensor([scale], dtype=torch.float32))
                    elif isinstance(scheme, WeightOnly) and param.quantizable:
                        _write_weight_only(param, chunks, writing, scheme)
                    elif isinstance(scheme, FP8PerTensor) and param.quantizable:
                        assert ranges is not None
                        weight_scale = _fp8_weight_scale(role, params, plan, amax, out_dtype)
                        activation = ranges.scale(layer, _ACTIVATIONS[what], E4M3_MAX)
                        _write_fp8(param, chunks, writing, weight_scale, activation)
                    else:
                        _write_plain(param, chunks, writing)
                for writer in writing.writers:
                    writer.close()
    return Path(output)
