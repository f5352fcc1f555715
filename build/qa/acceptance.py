"""GPU-host acceptance: the one run a user makes first on a GPU host, and sends back.

From tiny random-weight Qwen3-VL checkpoints made on the spot (dense and MoE; nothing is downloaded) it runs every
stage of `qwen3vl-trt build` (plugin vision engine, trtllm-build LLM engine, GPU repository), serves the repository,
and checks numbers, one row each:

- the varlen attention kernel against per-segment SDPA (error and time) and flash-attn's varlen kernel (time);
- nvImageCodec decoding and GPU resizing against Pillow and the CPU path;
- the vision engine against the transformers tower;
- tokens of the served deployment (nvImageCodec decoding, vision engine, tensorrtllm backend), text only and with an
  image, against transformers: every served token must be transformers' greedy choice at its position, up to a
  small logit gap (teacher-forced: transformers scores the served sequence), so near-ties of a random model cannot
  fail the row and a wrong token always does;
- the same for builds with other options (`variants`): every --llm-quant and quantized KV cache from a block-FP8
  checkpoint (scored on its bf16 twin), an fp32 engine, chunked context, tp 2.

A row whose needs are missing is SKIPPED with the reason (a GPU machine without TensorRT runs the kernel and decoding
rows; a CPU machine runs none). The table and a JSON file say PASS, FAIL or SKIPPED with each row's figure.
Exit code: 0 every row passed; 1 a row failed; 3 none failed but some were skipped (the GPU stack is incomplete).
"""

from __future__ import annotations

import contextlib
import json
import platform
import re
import shutil
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import __version__
from ..common.limits import EngineLimits

if TYPE_CHECKING:
    from ..preprocess.preprocessor import VideoDecoderName
    from ..preprocess.videos import VideoFrameDecoder
    from ..serving.repository.gpu_memory import LLMEngineBuild

PASS, FAIL, SKIPPED = "PASS", "FAIL", "SKIPPED"
EXIT_PASSED, EXIT_FAILED, EXIT_SKIPPED = 0, 1, 3
RESULT_FILE = "acceptance.json"
DEVICE_CHECK_FILE = "device_check.json"  # scripts/device_check.sh's

# The kernel rows: Qwen3-VL 8B-and-up tower shapes (16 heads, head_dim 72), images of 1024-4096 patches.
KERNEL_HEADS, KERNEL_HEAD_DIM = 16, 72
KERNEL_SEGMENTS = (1024, 4096, 2304, 1024, 3136, 1600, 4096, 2048)
KERNEL_TOLERANCE = 1.6e-2  # bf16: two bf16 steps of the largest output (tests/test_varlen_attention.py)
FLASH_ATTN_RATIO = 0.7  # the kernel's speed at least 0.7x flash-attn's varlen kernel
# Pixels: nvJPEG rounds its IDCT differently from libjpeg-turbo, and GPU resizing is float32 where the CPU's is
# fixed-point; a fraction of a level on average, far below nearest-neighbour chroma (tests/test_preprocess_cuda.py).
LEVEL = 2 / 255
PIXEL_MEAN_LEVELS, PIXEL_MAX_LEVELS = 1.0, 24.0
# NVDEC converts YUV to RGB with its own kernel, not FFmpeg's swscale: a few levels apart on average on these SD clips
# (tests/test_video_cuda.py), and each frame nearest FFmpeg's frame of the same number.
NVDEC_MEAN_LEVELS = 3.0
VISION_TOLERANCE = 4e-2  # a bf16 engine against the fp32 tower (scripts/vision_engine_check.py)
# A served token is transformers' greedy choice when its logit is within this share of the step's logit spread
# (max - median) of the maximum: bf16 engines round differently from transformers' fp32.
LOGIT_GAP = 0.05
# The same gap for engines built from a block-FP8 checkpoint (--llm-quant, --kv-cache-dtype), scored by transformers
# on its dequantized twin. Measured on a CPU machine with the reference runtime in bf16 on the converted checkpoints
# (the acceptance's tiny configurations, seeds 2 and 3, three requests of 8 tokens each; the worst token's gap):
#   dense: none 0.003, int8-wo 0.003, int4-wo 0.13-0.21, fp8 0.026-0.037, fp8 + FP8 KV cache 0.024-0.028,
#          none + INT8 KV cache 0.006;
#   MoE:   none 0.069-0.085 (already in fp32: the twin's bf16-rounded experts flip near-tied routings of the random
#          router), int8-wo 0.069-0.085, fp8 0.066-0.085.
# int4-wo read in a wrong layout (adjacent output or input channels swapped, input channels interleaved by 8) gave
# 0.71-1.46 per request, 0.86 and up on the JPEG request the rows send: each limit keeps 2-4x its measurement and
# stays below that.
QUANT_LOGIT_GAPS = {"none": LOGIT_GAP, "int8-wo": 0.1, "int4-wo": 0.4, "fp8": 0.15}
KV_CACHE_LOGIT_GAP = 0.1  # none + INT8 KV cache (fp8 + FP8 KV cache takes fp8's)
MOE_QUANT_LOGIT_GAP = 0.3  # int8-wo and fp8 of the MoE checkpoint: routing near-ties dominate
NEW_TOKENS = 8
# The served builds answer top_logprobs: the engine gathers its generation logits (limits.max_top_logprobs).
TOP_LOGPROBS = 5
TOP_LOGPROB_GAP = 0.1  # largest |log prob - transformers' fp32 log-softmax|, in nats, of a bf16 engine's
SERVED_LIMITS = EngineLimits(max_top_logprobs=TOP_LOGPROBS)
# The quantized rows' tiny text model: dims the weight-only GEMMs and the 128x128 FP8 blocks take, with grouped-query
# attention as every released Qwen3-VL has (4 query heads per key/value head, head_dim 128). With equal head counts
# TensorRT-LLM's attention with q/k norms views the fused qkv interleaved per head (`layers/attention.py`,
# Attention.forward, its `if self.qk_layernorm:` block), which our checkpoint (three blocks [Q; K; V]) does not write.
QUANT_TEXT = {
    "hidden_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 128,
    "intermediate_size": 256,
    "mrope_section": [24, 20, 20],
}
QUANT_MOE_TEXT = {**QUANT_TEXT, "moe_intermediate_size": 128}
# The chunked-context row: an engine step of 128 tokens, a JPEG request of 314 (300 visual): three chunks,
# the visual tokens across their boundaries.
CHUNK_TOKENS = 128
# The first request after serve's warm-up against the median of the next ten (a cold first request took 2.0x on a
# full-size 2B layout).
FIRST_REQUEST_RATIO = 1.5
# A stream long enough to be generating when the server is stopped (min_tokens holds it to this length; a tiny model
# on a GPU takes a few seconds, well within serve's --stop-grace of 30 s).
DRAIN_TOKENS = 2000


@dataclass
class Row:
    check: str
    status: str
    figure: str = ""
    limit: str = ""
    detail: str = ""
    seconds: float = 0.0


@dataclass
class Report:
    rows: list[Row] = field(default_factory=list)
    environment: dict[str, str] = field(default_factory=dict)

    @property
    def exit_code(self) -> int:
        statuses = {row.status for row in self.rows}
        if FAIL in statuses:
            return EXIT_FAILED
        return EXIT_SKIPPED if SKIPPED in statuses else EXIT_PASSED

    def table(self) -> str:
        header = ("check", "status", "figure", "limit")
        cells = [header, *[(r.check, r.status, r.figure, r.limit) for r in self.rows]]
        widths = [max(len(c[i]) for c in cells) for i in range(len(header))]
        lines = [" | ".join(c[i].ljust(widths[i]) for i in range(len(header))).rstrip() for c in cells]
        lines.insert(1, "-+-".join("-" * w for w in widths))
        notes = [f"  {r.check}: {r.detail}" for r in self.rows if r.detail]
        return "\n".join([*lines, *(["", "notes:", *notes] if notes else [])])

    def to_json(self) -> str:
        counts = {status: sum(r.status == status for r in self.rows) for status in (PASS, FAIL, SKIPPED)}
        body = {"exit_code": self.exit_code, "counts": counts, "environment": self.environment}
        return json.dumps({**body, "rows": [asdict(r) for r in self.rows]}, indent=2) + "\n"


# -- what each row needs: None when present, else why not ------------------------------------------------------


def _cuda() -> str | None:
    import torch

    return None if torch.cuda.is_available() else "no CUDA device is visible to torch"


def _importable(module: str, what: str) -> Callable[[], str | None]:
    def need() -> str | None:
        try:
            __import__(module)
        except Exception as e:  # noqa: BLE001 (a broken install says why, whatever it raises)
            return f"{what} is not importable ({type(e).__name__}: {e})"
        return None

    return need


def _tensorrt() -> str | None:
    from ..vision.engine import tensorrt_problem

    return tensorrt_problem()


def _tensorrt_llm() -> str | None:
    from ..llm.engine_build import gpu_stack_problem

    return gpu_stack_problem()


def _gpu_takes(llm_quant: str, kv_cache_dtype: str = "auto") -> Callable[[], str | None]:
    """A need: the visible GPU runs bf16 engines of `llm_quant` with a KV cache of `kv_cache_dtype`, as the build
    decides it (llm.precision: fp8 needs sm89+; TensorRT-LLM builds no INT8/INT4 weights nor INT8 cache for
    sm100-sm119)."""

    def need() -> str | None:
        from ..errors import UnsupportedModelError
        from ..llm.precision import check_kv_cache, choose_llm_quant, visible_gpu_arch

        arch = visible_gpu_arch()
        if arch is None:
            return "no CUDA device is visible"
        try:
            choose_llm_quant(llm_quant, True, arch)
            check_kv_cache(kv_cache_dtype, arch, "bf16")
        except UnsupportedModelError as e:
            return str(e)
        return None

    return need


def _gpus(count: int) -> Callable[[], str | None]:
    """A need: `count` visible GPUs (a tp engine's ranks, one each)."""

    def need() -> str | None:
        import torch

        visible = torch.cuda.device_count()
        if visible == 0:
            return f"no CUDA device is visible (it needs {count})"
        return None if visible >= count else f"it needs {count} GPUs, {visible} visible"

    return need


def _tritonserver() -> str | None:
    from ..errors import ServingError
    from ..serving.server.tritonserver_install import find_tritonserver

    try:
        find_tritonserver()
    except ServingError as e:
        return str(e)
    return None


# Server log lines of tensors that missed Triton's CUDA memory pool: python_backend's CUDA IPC fallback
# (r26.04 src/infer_response.cc, src/python_be.cc: "... will use CUDA IPC ...") and core's fallback of a GPU buffer
# to pinned system memory (r26.04 src/memory.cc, AllocatedMemory). Not core's warnings of a server without a pinned
# pool ("Unable to allocate pinned system memory", "falling back to non-pinned system memory": every CPU machine).
_POOL_MISS = re.compile(r"use CUDA IPC|falling back to pinned system memory", re.IGNORECASE)
_TRITON_LANGUAGE = _importable("triton", "the Triton language (triton)")
_NVIMGCODEC = _importable("nvidia.nvimgcodec", "nvImageCodec (nvidia-nvimgcodec-cu13)")
_PYNVVIDEOCODEC = _importable("PyNvVideoCodec", "PyNvVideoCodec (NVDEC)")
_HOST_DECODED = "decoded on the host"  # preprocess.videos and preprocessor warn so when NVDEC is not used
_FLASH_ATTN = _importable("flash_attn", "flash-attn")
_TRANSFORMERS = _importable("transformers", "transformers")


Request = tuple[str, list[bytes]]  # a prompt and its JPEGs


@dataclass(frozen=True)
class Variant:
    """A build of `model` with build()'s `options`, served: the tokens for `requests` scored teacher-forced by
    transformers on `reference` (the model itself, or the bf16 twin a block-FP8 checkpoint stands for) within `gap`.
    `check` looks at the build first (its figure joins the row's); `served` says what the served row checks."""

    name: str
    model: Path
    reference: Path
    gap: float
    served: str
    requests: tuple[Request, ...]
    options: dict[str, Any] = field(default_factory=dict)
    needs: tuple[Callable[[], str | None], ...] = ()
    check: Callable[[Path, Variant], tuple[bool, str]] | None = None


class Acceptance:
    """Runs the rows in order; a row's exception is its FAIL, never the end of the run."""

    def __init__(self, work: Path, log: Callable[[str], None] = print):
        self.work, self.log = work, log
        self.report = Report(environment=_environment())
        self._builds: dict[str, Path] = {}

    def row(
        self, check: str, limit: str, needs: Sequence[Callable[[], str | None]], run: Callable[[], tuple[bool, str]]
    ) -> Row:
        missing = [reason for need in needs if (reason := need()) is not None]
        if missing:
            row = Row(check, SKIPPED, limit=limit, detail="; ".join(dict.fromkeys(missing)))
        else:
            self.log(f"== {check}")
            start = time.perf_counter()
            try:
                ok, figure = run()
                row = Row(check, PASS if ok else FAIL, figure, limit)
            except Exception as e:  # noqa: BLE001 (reported as the row's failure)
                row = Row(check, FAIL, limit=limit, detail=f"{type(e).__name__}: {e}")
            row.seconds = round(time.perf_counter() - start, 1)
        self.report.rows.append(row)
        self.log(f"   {row.status} {row.figure} {row.detail}".rstrip())
        return row

    # -- rows ---------------------------------------------------------------------------------------------------

    def kernel_rows(self) -> None:
        timings: dict[str, float] = {}

        def against_sdpa() -> tuple[bool, str]:
            error, timings["kernel"], timings["sdpa"] = _kernel_against_sdpa()
            ratio = timings["kernel"] / timings["sdpa"]
            figure = f"error {error:.1e}; {timings['kernel']:.3f} ms vs SDPA {timings['sdpa']:.3f} ms ({ratio:.2f}x)"
            return error <= KERNEL_TOLERANCE and ratio < 1.0, figure

        shape = f"bf16, {KERNEL_HEADS} heads, head_dim {KERNEL_HEAD_DIM}, {len(KERNEL_SEGMENTS)} images"
        self.row(
            f"varlen kernel vs per-segment SDPA ({shape})",
            f"error <= {KERNEL_TOLERANCE:g}, faster than SDPA",
            [_cuda, _TRITON_LANGUAGE],
            against_sdpa,
        )

        def against_flash() -> tuple[bool, str]:
            if "kernel" not in timings:
                raise RuntimeError("the SDPA row did not time the kernel")
            flash = _flash_attn_ms()
            speed = flash / timings["kernel"]
            return speed >= FLASH_ATTN_RATIO, f"{timings['kernel']:.3f} ms vs flash-attn {flash:.3f} ms ({speed:.2f}x)"

        self.row(
            "varlen kernel vs flash-attn varlen (same shapes)",
            f"speed >= {FLASH_ATTN_RATIO}x flash-attn",
            [_cuda, _TRITON_LANGUAGE, _FLASH_ATTN],
            against_flash,
        )

    def decode_row(self, model: Path) -> None:
        def run() -> tuple[bool, str]:
            mean, peak = _pixels_against_pillow(model, "cuda")
            figure = f"mean {mean / LEVEL:.3f} levels, max {peak / LEVEL:.1f} levels"
            return mean <= PIXEL_MEAN_LEVELS * LEVEL and peak <= PIXEL_MAX_LEVELS * LEVEL, figure

        self.row(
            "nvImageCodec decode + GPU resize vs Pillow + CPU resize (4:2:0 JPEG)",
            f"mean <= {PIXEL_MEAN_LEVELS:g} level, max <= {PIXEL_MAX_LEVELS:g}",
            [_cuda, _NVIMGCODEC, _TRANSFORMERS],
            run,
        )

    def device_decode_rows(self) -> None:
        """nvImageCodec and NVDEC decoding into device memory against the host's decoders."""

        def image() -> tuple[bool, str]:
            device, mean, peak = _nvimgcodec_against_pillow("cuda")
            figure = f"on {device}: mean {mean:.3f} levels, max {peak:.0f} levels"
            return device.startswith("cuda") and mean <= PIXEL_MEAN_LEVELS and peak <= PIXEL_MAX_LEVELS, figure

        self.row(
            "nvImageCodec decode into device memory vs Pillow (4:2:0 JPEG)",
            f"on cuda, mean <= {PIXEL_MEAN_LEVELS:g} level, max <= {PIXEL_MAX_LEVELS:g}",
            [_cuda, _NVIMGCODEC],
            image,
        )

        def video() -> tuple[bool, str]:
            import torch

            from ..preprocess.nvdec_decoder import NvdecVideoDecoder

            devices, frames, worst, aligned = _frames_against_ffmpeg(NvdecVideoDecoder(torch.device("cuda")))
            figure = f"{frames} frames on {', '.join(devices)}: worst frame's mean {worst:.2f} levels"
            figure += "" if aligned else "; a frame nearer another frame of FFmpeg's than its own"
            on_device = all(d.startswith("cuda") for d in devices)
            return on_device and worst <= NVDEC_MEAN_LEVELS and aligned, figure

        self.row(
            "NVDEC (PyNvVideoCodec) decode into device memory vs FFmpeg (H.264, 640x360)",
            f"on cuda, each frame's mean <= {NVDEC_MEAN_LEVELS:g} levels and nearest its own",
            [_cuda, _PYNVVIDEOCODEC],
            video,
        )

    def video_preprocess_row(self, model: Path) -> None:
        def run() -> tuple[bool, str]:
            same, mean, on_host = _video_pixels_against_host(model, "cuda", "nvdec")
            figure = f"{'same' if same else 'different'} tokens, mean {mean / LEVEL:.2f} levels"
            figure += "; NVDEC did not decode it (decoded on the host)" if on_host else ""
            return same and mean <= NVDEC_MEAN_LEVELS * LEVEL and not on_host, figure

        self.row(
            "NVDEC + GPU resize vs FFmpeg + CPU resize (an H.264 request)",
            f"same tokens, mean <= {NVDEC_MEAN_LEVELS:g} levels",
            [_cuda, _PYNVVIDEOCODEC, _TRANSFORMERS],
            run,
        )

    def vision_engine_build_row(self, name: str, model: Path) -> None:
        """The vision stages of a build alone (the fp32 export whose host metadata the engine reads, the plugin
        export, its bf16 engine), for vision_engine_row on a machine without TensorRT-LLM."""

        def run() -> tuple[bool, str]:
            from ..common.contracts import PLUGIN, BuildLayout
            from ..vision.engine import VisionEngineProfile, build_vision_engine
            from ..vision.export import export_vision

            layout = BuildLayout(self.work / f"build-{_slug(name)}-vision")
            export_vision(model, layout.vision, dtype="fp32", force=True, log=self.log)
            export_vision(model, layout.vision_plugin, dtype="bf16", variant=PLUGIN, force=True, log=self.log)
            start = time.perf_counter()
            # The sizes _vision_engine_against_transformers sends, with room (scripts/vision_engine_check.py's profile).
            profile = VisionEngineProfile(opt_patches=1024, max_patches=8192, max_images=16)
            build_vision_engine(layout.vision_plugin, layout.vision_engine, profile, force=True, log=self.log)
            self._builds[name] = layout.root
            return True, f"engine built in {time.perf_counter() - start:.1f} s"

        self.row(f"build-vision-engine (plugin, bf16) ({name})", "built", [_cuda, _tensorrt, _TRANSFORMERS], run)

    def weight_only_layout_row(self) -> None:
        self.row(
            "weight-only checkpoint layout + the build's hook vs TensorRT-LLM's quantizer (int8, int4; 2-D, experts)",
            "equal values and scales",
            [_cuda, _tensorrt_llm],
            _weight_only_layout_against_upstream,
        )

    def build_row(self, name: str, model: Path, needs: Sequence[Callable[[], str | None]] = (), **options: Any) -> None:
        """`qwen3vl-trt build` of `model` for the GPU target with build()'s `options`."""

        def run() -> tuple[bool, str]:
            from ..pipeline.build import BuildOptions, build

            output = self.work / f"build-{_slug(name)}"
            manifest = build(model, output, BuildOptions(**options), target="gpu", force=True, log=self.log)
            self._builds[name] = output
            stages = manifest.done_stages()
            return True, f"{len(stages)} stages: {', '.join(stages)}"

        self.row(
            f"qwen3vl-trt build, every stage ({name})",
            "all stages done",
            needs or [_cuda, _tensorrt, _tensorrt_llm],
            run,
        )

    def build_cache_row(self, name: str, model: Path) -> None:
        """build --cache twice in a fresh cache: a miss that builds the engines, then a hit that links them; the
        served rows then serve the hit's repository (its engines read through the links)."""

        def run() -> tuple[bool, str]:
            from ..build_cache.key import NO_GPU
            from ..build_cache.store import CacheSettings
            from ..common.contracts import BuildLayout
            from ..pipeline.build import BuildOptions, build

            cache = self.work / "build-cache"
            shutil.rmtree(cache, ignore_errors=True)
            seconds, records = [], []
            for run_name in ("miss", "hit"):
                output = self.work / f"build-{name.replace(' ', '-')}-cache-{run_name}"
                start = time.perf_counter()
                manifest = build(
                    model,
                    output,
                    BuildOptions(limits=SERVED_LIMITS),
                    target="gpu",
                    force=True,
                    cache=CacheSettings(cache),
                    log=self.log,
                )
                seconds.append(time.perf_counter() - start)
                records.append(manifest.cache)
            miss, hit = records
            assert miss is not None and hit is not None
            parts = hit.parts
            stack = [parts[p] for p in ("gpu", "compute_capability", "tensorrt", "tensorrt_llm")]
            engines = [output / d for d in (BuildLayout.VISION_ENGINE, BuildLayout.LLM_ENGINE)]
            linked = all(d.is_symlink() and d.is_dir() for d in engines)
            ok = (miss.source, hit.source) == ("built", "pulled") and NO_GPU not in stack and linked
            if ok:
                self._builds[name] = output
            versions = f"TensorRT {parts['tensorrt']}, TensorRT-LLM {parts['tensorrt_llm']}"
            key = f"key for {parts['gpu']} (sm {parts['compute_capability']}), {versions}"
            return ok, f"hit {seconds[1]:.1f} s vs miss {seconds[0]:.1f} s; {key}"

        self.row(
            f"build --cache: a miss builds the engines, a hit links them and is served ({name})",
            "miss then hit, GPU in the key",
            [_cuda, _tensorrt, _tensorrt_llm],
            run,
        )

    def vision_engine_row(self, name: str, model: Path) -> None:
        def run() -> tuple[bool, str]:
            error = _vision_engine_against_transformers(model, self._built(name))
            return error <= VISION_TOLERANCE, f"max rel error {error:.1e}"

        self.row(
            f"vision engine (plugin, bf16) vs transformers tower fp32 ({name})",
            f"<= {VISION_TOLERANCE:g}",
            [_cuda, _tensorrt],
            run,
        )

    def served_rows(self, name: str, model: Path) -> None:
        from .tiny import synthetic_jpeg, synthetic_video

        requests: dict[str, tuple[str, list[bytes], list[bytes]]] = {
            "text only": ("Describe a sunset in three words.", [], []),
            "one JPEG": ("Describe this picture.", [synthetic_jpeg(480, 640, seed=5)], []),
            # 4 s of 640x360 H.264 at 30 fps, keyframe every second: NVDEC decodes it into device memory.
            "an H.264 video": ("What happens?", [], [synthetic_video(120, 360, 640, 30, options={"g": "30"})]),
        }
        needs = [_cuda, _tensorrt, _tensorrt_llm, _tritonserver, _NVIMGCODEC]
        served: dict[str, list[int]] = {}
        healed: list[tuple[bool, str]] = []
        cached: list[tuple[bool, str]] = []
        guided: list[tuple[bool, str]] = []
        sampled: list[tuple[bool, str]] = []
        drained: list[tuple[bool, str]] = []
        warmed: list[tuple[bool, str]] = []
        prioritized: list[tuple[bool, str]] = []
        decoded: list[tuple[bool, str]] = []
        alternatives: list[tuple[bool, str]] = []

        log_path = self.work / f"server-{name}.log"

        def serve_and_send() -> tuple[bool, str]:
            tokens, warm, lowest, ids, tops, hits, guides, options, heals, drains = _served_tokens(
                self._built(name), requests, log_path
            )
            served.update(tokens)
            warmed.append(warm)
            prioritized.append(lowest)
            decoded.append(ids)
            alternatives.append(tops)
            cached.append(hits)
            guided.append(guides)
            sampled.append(options)
            healed.append(heals)
            drained.append(drains)
            answers = ", ".join(f"{k}: {len(v)} tokens" for k, v in served.items())
            # Tensors between models that miss the CUDA memory pool go by CUDA IPC or through pinned host memory
            # (serving.repository.gpu_memory): the pool is sized so that none does.
            fallbacks = [line for line in log_path.read_text(errors="replace").splitlines() if _POOL_MISS.search(line)]
            figure = f"{answers}; {len(fallbacks)} server log lines on tensors missing the CUDA memory pool"
            return not fallbacks, figure + (f" (first: {fallbacks[0].strip()[:160]})" if fallbacks else "")

        limit = f"gap <= {LOGIT_GAP:g}"
        serving = f"serve the GPU repository ({name})"
        healing = f"metrics published; a killed vision_encoder stub comes back ({name})"
        caching = f"a repeated image: a visual cache hit, no decode, no vision encoder ({name})"
        draining = f"a stop lets a stream in flight finish ({name})"
        guiding = f"guided decoding on the engine: a json_schema answer and a required tool call ({name})"
        sampling = f"logit bias, presence penalty and log probs on the engine ({name})"
        warming = f"serve's warm-up through every model, then the first request against the next ten ({name})"
        decoding = f"the tokens ensemble streams the engine's ids, decoded by the client as the text ensemble ({name})"
        lowering = f"the same requests at the batch lines' priority get the same tokens ({name})"
        topping = f"top_logprobs from the engine's generation logits vs transformers' log-softmax ({name})"
        splitting = (
            f"the vision pool: a member and a language replica (--role language) answer as the colocated ({name})"
        )
        split_limit = "same tokens, the replica decoding nothing"
        top_limit = f"{TOP_LOGPROBS} each, the likeliest served, gap <= {TOP_LOGPROB_GAP:g}"
        if self.row(serving, "ready, answers, no CUDA pool misses", needs, serve_and_send).status != PASS:
            for kind in requests:
                check = f"served tokens vs transformers greedy, {kind} ({name})"
                self.report.rows.append(Row(check, SKIPPED, limit=limit, detail="the repository was not served"))
            for check, check_limit in (
                (warming, f"first / median <= {FIRST_REQUEST_RATIO:g}"),
                (lowering, "same tokens"),
                (decoding, "same text and ids"),
                (topping, top_limit),
                (caching, "same tokens, 0 runs"),
                (guiding, "both validate"),
                (sampling, "biased, distinct, log probs <= 0"),
                (healing, "back, answers"),
                (draining, "all tokens, exit 0, shm named and gone"),
                (splitting, split_limit),
            ):
                self.report.rows.append(Row(check, SKIPPED, limit=check_limit, detail="the repository was not served"))
            return
        reference = _TransformersGreedy(model)
        for kind, (prompt, images, videos) in requests.items():

            def compare(
                prompt: str = prompt, images: list[bytes] = images, videos: list[bytes] = videos, kind: str = kind
            ) -> tuple[bool, str]:
                equal, gaps = reference.score(prompt, images, videos, served[kind])
                worst = max(gaps, default=0.0)
                figure = f"{equal}/{len(served[kind])} tokens equal, largest gap {worst:.3f} of the logit spread"
                # Preprocessing falls back to host decoding (with a warning) where NVDEC cannot load or decode.
                on_host = [line for line in log_path.read_text(errors="replace").splitlines() if _HOST_DECODED in line]
                if videos and on_host:
                    return False, f"{figure}; NVDEC did not decode it: {on_host[0].strip()[:200]}"
                return bool(served[kind]) and worst <= LOGIT_GAP, figure

            video_needs = [_PYNVVIDEOCODEC] if videos else []
            self.row(f"served tokens vs transformers greedy, {kind} ({name})", limit, needs + video_needs, compare)
        self.row(warming, f"first / median <= {FIRST_REQUEST_RATIO:g}", needs, lambda: warmed[0])
        self.row(lowering, "same tokens", needs, lambda: prioritized[0])
        self.row(decoding, "same text and ids", needs, lambda: decoded[0])
        self.row(topping, top_limit, needs, lambda: alternatives[0])
        self.row(caching, "same tokens, 0 runs", needs, lambda: cached[0])
        self.row(guiding, "both validate", needs, lambda: guided[0])
        self.row(sampling, "biased, distinct, log probs <= 0", needs, lambda: sampled[0])
        self.row(healing, "back, answers", needs, lambda: healed[0])
        self.row(draining, "all tokens, exit 0, shm named and gone", needs, lambda: drained[0])
        split_log = self.work / f"server-{name}-split.log"
        self.row(splitting, split_limit, needs, lambda: _split_answers(self._built(name), requests, served, split_log))

    def variant_rows(self, variant: Variant) -> None:
        """The variant's build, then its repository served: its requests' tokens scored by transformers on its
        reference, after its check of the build."""
        stack = [_cuda, _tensorrt, _tensorrt_llm, *variant.needs]
        self.build_row(variant.name, variant.model, stack, **variant.options)

        def run() -> tuple[bool, str]:
            build_dir = self._built(variant.name)
            figures = []
            if variant.check is not None:
                checked, figure = variant.check(build_dir, variant)
                if not checked:
                    return False, figure
                figures.append(figure)
            served = _served_once(build_dir, variant.requests, self.work / f"server-{_slug(variant.name)}.log")
            scorer = _TransformersGreedy(variant.reference)
            worst = 0.0
            for (prompt, images), tokens in zip(variant.requests, served, strict=True):
                equal, gaps = scorer.score(prompt, images, [], tokens)
                worst = max([worst, *gaps])
                figures.append(f"{equal}/{len(tokens)} tokens equal")
            figures.append(f"largest gap {worst:.3f}")
            return all(served) and worst <= variant.gap, "; ".join(figures)

        self.row(
            f"{variant.served} ({variant.name})",
            f"gap <= {variant.gap:g}",
            [*stack, _tritonserver, _NVIMGCODEC],
            run,
        )

    def _built(self, name: str) -> Path:
        if name not in self._builds:
            raise RuntimeError(f"the {name} build did not finish (see its row)")
        return self._builds[name]


def run_acceptance(work: Path, log: Callable[[str], None] = print) -> Report:
    """Every row, in a working directory that keeps the checkpoints, builds and server logs."""
    from .tiny import make_tiny_checkpoint

    work.mkdir(parents=True, exist_ok=True)
    acceptance = Acceptance(work, log)
    acceptance.kernel_rows()
    models = {"dense": make_tiny_checkpoint(work / "tiny-dense", seed=0, force=True)}
    models["moe"] = make_tiny_checkpoint(work / "tiny-moe", moe=True, seed=1, force=True)
    acceptance.decode_row(models["dense"])
    acceptance.weight_only_layout_row()
    for name, model in models.items():
        acceptance.build_row(name, model, limits=SERVED_LIMITS)
        acceptance.vision_engine_row(name, model)
        if name == "dense":
            acceptance.build_cache_row(name, model)
        acceptance.served_rows(name, model)
    for variant in variants(work, models["dense"]):
        acceptance.variant_rows(variant)
    return acceptance.report


def run_device_check(work: Path, log: Callable[[str], None] = print) -> Report:
    """scripts/device_check.sh's rows: what a GPU machine with or without TensorRT runs in a few minutes (the kernel,
    decoding into device memory, the GPU preprocessing against the CPU's pixels; the vision engine where TensorRT
    is)."""
    from .tiny import make_tiny_checkpoint

    work.mkdir(parents=True, exist_ok=True)
    check = Acceptance(work, log)
    # The rows that read it need transformers, which makes it.
    model = work / "tiny-dense"
    if _TRANSFORMERS() is None:
        make_tiny_checkpoint(model, seed=0, force=True)
    check.kernel_rows()
    check.device_decode_rows()
    check.decode_row(model)
    check.video_preprocess_row(model)
    check.vision_engine_build_row("dense", model)
    check.vision_engine_row("dense", model)
    return check.report


def variants(work: Path, dense: Path) -> list[Variant]:
    """The builds with other options than the served rows': every --llm-quant and quantized KV cache from a block-FP8
    checkpoint (dense; MoE int8-wo and fp8), an fp32 engine, chunked context, tp 2."""
    from .tiny import synthetic_jpeg

    fp8, twin = _block_fp8_checkpoint(work, moe=False)
    moe_fp8, moe_twin = _block_fp8_checkpoint(work, moe=True)
    jpeg: Request = ("Describe this picture.", [synthetic_jpeg(480, 640, seed=5)])
    text: Request = ("Describe a sunset in three words.", [])
    on_twin, served = "served tokens vs transformers greedy on the bf16 twin", "served tokens vs transformers greedy"

    def quantized(name: str, model: Path, reference: Path, gap: float, quant: str, kv: str = "auto") -> Variant:
        options = {"llm_quant": quant, "kv_cache_dtype": kv}
        return Variant(name, model, reference, gap, on_twin, (jpeg,), options, (_gpu_takes(quant, kv),))

    return [
        *[
            quantized(f"block-FP8 dense, --llm-quant {quant}", fp8, twin, gap, quant)
            for quant, gap in QUANT_LOGIT_GAPS.items()
        ],
        quantized(
            "block-FP8 dense, --llm-quant fp8 --kv-cache-dtype fp8", fp8, twin, QUANT_LOGIT_GAPS["fp8"], "fp8", "fp8"
        ),
        quantized(
            "block-FP8 dense, --llm-quant none --kv-cache-dtype int8", fp8, twin, KV_CACHE_LOGIT_GAP, "none", "int8"
        ),
        *[
            quantized(f"block-FP8 MoE, --llm-quant {quant}", moe_fp8, moe_twin, MOE_QUANT_LOGIT_GAP, quant)
            for quant in ("int8-wo", "fp8")
        ],
        Variant(
            "dense, --llm-dtype fp32",
            dense,
            dense,
            LOGIT_GAP,
            f"KV-cache reuse and chunked context off; {served}",
            (text, jpeg),
            dict(llm_dtype="fp32"),
            check=_no_reuse_no_chunks,
        ),
        Variant(
            f"dense, max_num_tokens {CHUNK_TOKENS}",
            dense,
            dense,
            LOGIT_GAP,
            f"a prompt longer than max_num_tokens, prefilled in chunks; {served}",
            (jpeg,),
            dict(limits=EngineLimits(max_num_tokens=CHUNK_TOKENS)),
            check=_chunked_prompts,
        ),
        Variant("dense, tp 2", dense, dense, LOGIT_GAP, served, (text, jpeg), dict(tp=2), (_gpus(2),)),
    ]


def _block_fp8_checkpoint(work: Path, moe: bool) -> tuple[Path, Path]:
    """A tiny checkpoint stored as Qwen's -FP8 releases are (QUANT_TEXT), and its dequantized bf16 twin."""
    from .quantized import dequantized_twin, quantize_block_fp8
    from .tiny import make_tiny_checkpoint

    kind = "moe" if moe else "dense"
    text = QUANT_MOE_TEXT if moe else QUANT_TEXT
    bf16 = make_tiny_checkpoint(work / f"tiny-{kind}-128", moe=moe, seed=2, text_overrides=text, force=True)
    fp8 = quantize_block_fp8(bf16, work / f"tiny-{kind}-fp8", force=True)
    return fp8, dequantized_twin(fp8, work / f"tiny-{kind}-fp8-twin", force=True)


def _slug(name: str) -> str:
    """A row's name as a file name: builds and server logs are named after it."""
    return re.sub(r"[^A-Za-z0-9.]+", "-", name).strip("-")


# -- the measurements (GPU hosts) --------------------------------------------------------------------------------


# The packages the rows use, by distribution: versions are read from their metadata, not by importing them.
_DISTRIBUTIONS = ("triton", "tensorrt", "tensorrt_llm", "nvidia-nvimgcodec-cu13", "flash-attn", "tritonclient")


def _environment() -> dict[str, str]:
    from importlib import metadata

    import torch

    env = {"qwen3vl_trt": __version__, "python": platform.python_version(), "torch": torch.__version__}
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        env |= {"gpu": torch.cuda.get_device_name(), "compute_capability": f"{major}.{minor}"}
    for distribution in _DISTRIBUTIONS:
        try:
            env[distribution] = metadata.version(distribution)
        except metadata.PackageNotFoundError:
            env[distribution] = "absent"
    return env


def _median_ms(fn: Callable[[], object], repeats: int = 20) -> float:
    import torch

    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(1e3 * (time.perf_counter() - start))
    return sorted(times)[len(times) // 2]


def _kernel_inputs() -> tuple[Any, Any, Any, Any, int]:
    import torch

    total = sum(KERNEL_SEGMENTS)
    generator = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (
        torch.randn(total, KERNEL_HEADS, KERNEL_HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=generator)
        for _ in range(3)
    )
    cu_seqlens = torch.tensor([0, *KERNEL_SEGMENTS], device="cuda").cumsum(0).to(torch.int32)
    return q, k, v, cu_seqlens, max(KERNEL_SEGMENTS)


def _kernel_against_sdpa() -> tuple[float, float, float]:
    """(relative error, kernel ms, per-segment SDPA ms)."""
    from ..plugins import varlen_attention
    from ..plugins.reference import varlen_attention_reference

    q, k, v, cu_seqlens, longest = _kernel_inputs()
    ours = varlen_attention(q, k, v, cu_seqlens, longest)
    reference = varlen_attention_reference(q.float(), k.float(), v.float(), cu_seqlens)
    error = float((ours.float() - reference).abs().max() / reference.abs().max())
    kernel_ms = _median_ms(lambda: varlen_attention(q, k, v, cu_seqlens, longest))
    sdpa_ms = _median_ms(lambda: varlen_attention_reference(q, k, v, cu_seqlens))
    return error, kernel_ms, sdpa_ms


def _flash_attn_ms() -> float:
    from flash_attn import flash_attn_varlen_func

    q, k, v, cu_seqlens, longest = _kernel_inputs()
    return _median_ms(lambda: flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, longest, longest))


def _pixels_against_pillow(model: Path, device: str) -> tuple[float, float]:
    """(mean, max) |pixels - CPU pixels| of one 4:2:0 JPEG request, nvImageCodec decoding and resizing on `device`
    against Pillow and the CPU's resize."""
    from ..preprocess import Preprocessor
    from .tiny import synthetic_jpeg

    image = synthetic_jpeg(720, 1280, seed=3, subsampling=2)
    messages = [_user_message("?", [image])]
    ours = Preprocessor.from_pretrained(model, device=device, decoder="nvimgcodec")(messages).pixel_values
    cpu = Preprocessor.from_pretrained(model, device="cpu", decoder="pillow")(messages).pixel_values
    diff = (ours.cpu() - cpu).abs()
    return float(diff.mean()), float(diff.max())


def _nvimgcodec_against_pillow(device: str) -> tuple[str, float, float]:
    """(the device the frame is on, mean, max) |nvImageCodec's RGB - Pillow's| in levels of one 4:2:0 JPEG decoded by
    nvImageCodec on `device`."""
    import io

    import numpy as np
    from PIL import Image

    from ..common.limits import RequestLimits
    from ..preprocess.images import open_image
    from ..preprocess.nvimgcodec_decoder import NvImageCodecDecoder
    from .tiny import synthetic_jpeg

    data = synthetic_jpeg(720, 1280, seed=3, subsampling=2)
    (frame,) = NvImageCodecDecoder(device).decode([data], [open_image(data, 0, RequestLimits())[1]])
    pillow = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"), dtype=np.int16)
    diff = np.abs(frame.cpu().numpy().astype(np.int16) - pillow)
    return str(frame.device), float(diff.mean()), float(diff.max())


def _frames_against_ffmpeg(decoder: VideoFrameDecoder) -> tuple[list[str], int, float, bool]:
    """Every frame of a 640x360 H.264 clip by `decoder` against FFmpeg's (PyAV): (the devices its chunks are on, the
    frames, the worst frame's mean |difference| in levels, whether each frame is nearest FFmpeg's of its number)."""
    import numpy as np

    from ..common.limits import RequestLimits
    from ..preprocess.videos import decode_frames, probe_video
    from .tiny import synthetic_video

    data = synthetic_video(40, 360, 640, 30000 / 1001, options={"g": "15"})
    header = probe_video(data, 0, RequestLimits())
    every = list(range(header.total_frames))
    ffmpeg = [frame.astype(np.int16) for _, frame in sorted(decode_frames(data, header, every))]
    chunks = list(decoder.decode(data, every))
    frames = np.concatenate([chunk.cpu().numpy() for chunk in chunks]).astype(np.int16)
    if frames.shape != (len(ffmpeg), header.height, header.width, 3):
        raise RuntimeError(f"{frames.shape[0]} frames of {frames.shape[1:]} decoded; FFmpeg: {len(ffmpeg)}")

    def mean(n: int, m: int) -> float:
        return float(np.abs(frames[n] - ffmpeg[m]).mean())

    means = [mean(n, n) for n in every]
    aligned = all(means[n] < mean(n, m) for n in every for m in (n - 1, n + 1) if 0 <= m < len(ffmpeg))
    return sorted({str(chunk.device) for chunk in chunks}), len(means), max(means), aligned


def _video_pixels_against_host(model: Path, device: str, video_decoder: VideoDecoderName) -> tuple[bool, float, bool]:
    """An H.264 request preprocessed on `device` with `video_decoder` against the host's (PyAV, CPU resize): (the same
    input ids, the mean |pixel difference|, whether preprocessing warned that it decoded the video on the host)."""
    import warnings

    import numpy as np

    from ..preprocess import Preprocessor
    from .tiny import synthetic_video

    data = synthetic_video(40, 360, 640, 30000 / 1001, options={"g": "15"})
    messages = [_user_message("?", [], [data])]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = Preprocessor.from_pretrained(model, device=device, video_decoder=video_decoder)(messages)
    host = Preprocessor.from_pretrained(model, device="cpu")(messages)
    same = np.array_equal(ours.input_ids, host.input_ids)
    mean = float((ours.pixel_values.cpu() - host.pixel_values).abs().mean()) if same else float("inf")
    return same, mean, any(_HOST_DECODED in str(warning.message) for warning in caught)


def _vision_engine_against_transformers(model: Path, build_dir: Path) -> float:
    """Largest relative error of the build's vision engine against the transformers tower over mixed batches."""
    import numpy as np
    import torch

    from ..common.contracts import BuildLayout
    from ..hf.checkpoint import Checkpoint
    from ..hf.reference import load_hf_vision_tower, run_hf_vision_tower
    from ..vision import OnnxVisionRunner
    from ..vision.export import parity_errors
    from ..vision.trt_runner import VisionEngine

    layout = BuildLayout(build_dir)
    inputs_from = OnnxVisionRunner(layout.vision)  # the host metadata of the export (grid-dependent inputs)
    engine = VisionEngine(layout.vision_engine)
    tower = load_hf_vision_tower(Checkpoint(model))
    rng = np.random.default_rng(0)
    errors = []
    for grids in ([[1, 16, 24]], [[1, 2, 2], [1, 32, 16]], [[2, 8, 8], [1, 12, 6]]):
        grid = np.array(grids)
        pixels = rng.uniform(-1, 1, (int(np.prod(grid, axis=1).sum()), 1536)).astype(np.float32)
        feeds = {name: torch.from_numpy(value) for name, value in inputs_from.inputs_for(pixels, grid).items()}
        stream = torch.cuda.Stream()
        image, deepstack = engine.run(feeds, stream)
        stream.synchronize()
        ref_image, ref_deepstack = run_hf_vision_tower(tower, pixels, grid)
        errors.append(parity_errors(image.float().cpu().numpy(), ref_image)[1])
        errors.append(parity_errors(deepstack.float().cpu().numpy(), ref_deepstack)[1])
    return max(errors)


def _weight_only_layout_against_upstream() -> tuple[bool, str]:
    """What the engine build loads for a weight-only linear (our stored layout through engine_model's hook, i.e.
    preprocess_weights_for_mixed_gemm for this GPU) against what TensorRT-LLM's own converters store
    (symmetric_quantize_last_axis_of_batched_matrix on the [K, N] weight), for dense weights and expert stacks."""
    import tensorrt_llm  # noqa: F401  (registers torch.ops.trtllm)
    import torch
    from tensorrt_llm.quantization.functional import preprocess_weights_for_mixed_gemm

    from ..llm.weight_only import WeightOnly

    torch.manual_seed(0)
    weights = {"2-D": torch.randn(384, 256) * 0.02, "experts": torch.randn(4, 256, 128) * 0.02}
    mismatches = []
    for bits, kind in ((8, torch.int8), (4, torch.quint4x2)):
        scheme = WeightOnly(bits)
        for name, weight in weights.items():
            w = weight.to(torch.bfloat16)
            q, scale = scheme.quantize(w)
            ours = preprocess_weights_for_mixed_gemm(scheme.to_stored(q), kind, torch.bfloat16)
            upstream = torch.ops.trtllm.symmetric_quantize_last_axis_of_batched_matrix(
                w.transpose(-1, -2).contiguous(), kind
            )
            theirs, their_scale = upstream[0], upstream[1]
            if not torch.equal(ours, theirs) or not torch.equal(scale.to(torch.bfloat16), their_scale):
                mismatches.append(f"int{bits} {name}")
    return not mismatches, "all equal" if not mismatches else f"differ: {', '.join(mismatches)}"


def _served_once(build_dir: Path, requests: Sequence[Request], log_path: Path) -> list[list[int]]:
    """Greedy token ids of each request through the build's repository on a real tritonserver."""
    from ..common.contracts import BuildLayout
    from ..serving.client import Client
    from ..serving.ports import free_ports
    from ..serving.server.tritonserver import TritonServer

    server = TritonServer(BuildLayout(build_dir).triton_repo, free_ports(), log_path=log_path)
    server.start()
    try:
        server.wait_ready()
        with contextlib.closing(Client(server.url, timeout_s=120)) as client:
            return [client.generate(prompt, images, max_tokens=NEW_TOKENS).token_ids for prompt, images in requests]
    finally:
        server.stop()


def _llm_scheduling(build_dir: Path) -> tuple[LLMEngineBuild, bool, bool]:
    """The LLM engine's build (paged context FMHA, max_num_tokens), and whether the repository's llm reuses KV-cache
    blocks and chunks prompts (the tensorrtllm backend's enable_kv_cache_reuse and enable_chunked_context)."""
    from ..common.contracts import BuildLayout
    from ..serving import interface
    from ..serving.repository import model_config
    from ..serving.repository.gpu_memory import LLMEngineBuild

    layout = BuildLayout(build_dir)
    parameters = model_config.read(layout.triton_repo / interface.LLM).parameters
    reuse, chunked = (
        key in parameters and parameters[key].string_value == "true"
        for key in ("enable_kv_cache_reuse", "enable_chunked_context")
    )
    return LLMEngineBuild.read(layout.llm_engine), reuse, chunked


def _on(flag: bool) -> str:
    return "on" if flag else "off"


def _no_reuse_no_chunks(build_dir: Path, _variant: Variant) -> tuple[bool, str]:
    """An fp32 engine has no paged context FMHA (no fused context kernel in fp32: llm.engine_build), which KV-cache
    reuse and chunked context need: the repository turns both off."""
    engine, reuse, chunked = _llm_scheduling(build_dir)
    figure = (
        f"paged context FMHA {_on(engine.paged_context_fmha)}, KV-cache reuse {_on(reuse)}, "
        f"chunked context {_on(chunked)}"
    )
    return not (engine.paged_context_fmha or reuse or chunked), figure


def _chunked_prompts(build_dir: Path, variant: Variant) -> tuple[bool, str]:
    """Chunked context on, and every request's prompt longer than the engine's step (max_num_tokens)."""
    from ..preprocess import Preprocessor

    engine, _, chunked = _llm_scheduling(build_dir)
    pre = Preprocessor.from_pretrained(variant.model)
    lengths = [pre([_user_message(prompt, images)]).num_tokens for prompt, images in variant.requests]
    figure = f"prompts of {lengths} tokens, max_num_tokens {engine.max_num_tokens}, chunked context {_on(chunked)}"
    return chunked and min(lengths) > engine.max_num_tokens, figure


def _user_message(prompt: str, images: Sequence[bytes], videos: Sequence[bytes] = ()) -> dict[str, Any]:
    """The chat message the client's generate() sends for a prompt with images and videos."""
    parts = [{"type": "image", "image": image} for image in images]
    parts += [{"type": "video", "video": video} for video in videos] + [{"type": "text", "text": prompt}]
    return {"role": "user", "content": parts}


def _served_tokens(
    build_dir: Path, requests: dict[str, tuple[str, list[bytes], list[bytes]]], log_path: Path
) -> tuple[
    dict[str, list[int]],
    tuple[bool, str],
    tuple[bool, str],
    tuple[bool, str],
    tuple[bool, str],
    tuple[bool, str],
    tuple[bool, str],
    tuple[bool, str],
    tuple[bool, str],
    tuple[bool, str],
]:
    """serve's warm-up (see _warm_up), then greedy token ids of each request through the build's GPU repository on a
    real tritonserver, the same requests at the batch lines' priority (see _batch_priority), whether the tokens
    ensemble gives the same answers decoded by the client (see _tokens_ensemble) and top_logprobs as transformers
    (see _top_logprobs), then whether
    a request's image sent again is answered from the visual cache (see _cache_hit), whether the engine's guided
    decoding holds (see _guided_answers) and its sampling options apply (see _sampling_options), whether the
    deployment heals (see _heals), and whether its stop lets a stream in flight finish (see _drains), each with its
    figure."""
    from ..common.contracts import BuildLayout
    from ..serving.client import Client
    from ..serving.ports import free_ports
    from ..serving.server.tritonserver import TritonServer

    # Verbose logging: the memory pool's fallbacks are logged at verbose levels too.
    server = TritonServer(BuildLayout(build_dir).triton_repo, free_ports(), log_path=log_path, log_verbose=1)
    server.start()
    try:
        server.wait_ready()
        warmed = _warm_up(server)
        client = Client(server.url, timeout_s=120)
        try:
            tokens = {
                kind: client.generate(prompt, images, max_tokens=NEW_TOKENS, videos=videos).token_ids
                for kind, (prompt, images, videos) in requests.items()
            }
            lowest = _checked(lambda c: _batch_priority(c, requests, tokens), client)
            ids = _checked(lambda c: _tokens_ensemble(c, build_dir, requests), client)
            tops = _checked(lambda c: _top_logprobs(c, build_dir), client)
            hits = _cache_hit(server, client, next((r[:2], tokens[k]) for k, r in requests.items() if r[1]))
            guided = _checked(_guided_answers, client)
            options = _checked(_sampling_options, client)
        finally:
            client.close()
        heals = _heals(server)
        return tokens, warmed, lowest, ids, tops, hits, guided, options, heals, _drains(server)
    finally:
        server.stop()


def _split_answers(
    build_dir: Path,
    requests: dict[str, tuple[str, list[bytes], list[bytes]]],
    served: dict[str, list[int]],
    log_path: Path,
) -> tuple[bool, str]:
    """The build's repository split on this host (docs/vision-pool.md): a vision pool member (serve --role vision's
    models: preprocessing decoding on the GPU, the vision engine) and a language replica (serve --role language's
    models and configs: no vision encoder, the KV cache share of its own plan) that sends it what its visual cache
    does not hold (the cache off): each request's tokens against the colocated deployment's (`served`), the replica's
    metrics, which say the pool encoded the images and videos and the replica decoded none, and what it loaded."""
    from tritonclient.grpc import InferenceServerClient

    from ..common.contracts import BuildLayout
    from ..serving import interface
    from ..serving.client import Client
    from ..serving.ports import free_ports
    from ..serving.repository import model_config as serving_config
    from ..serving.server.serve import LANGUAGE_ROLE, VISION_MODELS, role_config, role_models
    from ..serving.server.tritonserver import TritonServer
    from ..serving.stages import metrics as stage_metrics

    repo = BuildLayout(build_dir).triton_repo
    member = TritonServer(repo, free_ports(), log_path=log_path.with_suffix(".pool.log"), models=VISION_MODELS)
    with member:
        replica = TritonServer(
            repo, free_ports(), log_path=log_path, vision_pool=member.url, visual_cache="off",
            models=role_models(repo, LANGUAGE_ROLE), config_name=role_config(LANGUAGE_ROLE),
        )  # fmt: skip
        with replica, contextlib.closing(Client(replica.url, timeout_s=300)) as client:
            tokens = {
                kind: client.generate(prompt, images, max_tokens=NEW_TOKENS, videos=videos).token_ids
                for kind, (prompt, images, videos) in requests.items()
            }
            counts = {
                name: value
                for (name, model), value in stage_metrics.read(replica.metrics_url).items()
                if model == interface.PREPROCESSING
            }
            with contextlib.closing(InferenceServerClient(replica.url)) as triton:
                encoder = triton.is_model_ready(interface.VISION_ENCODER)
                llm = triton.get_model_config(interface.LLM).config
    media = sum(len(images) + len(videos) for _, images, videos in requests.values())
    pooled = int(counts.get(stage_metrics.VISION_POOL_ENCODES.name, 0))
    decoded = int(counts.get(stage_metrics.IMAGES_DECODED.name, 0) + counts.get(stage_metrics.VIDEOS_DECODED.name, 0))
    same = [kind for kind in requests if tokens[kind] == served[kind]]
    figure = f"{len(same)}/{len(requests)} requests' tokens as the colocated; {pooled} of {media} encoded by the pool"
    figure += f", {decoded} decoded here; vision encoder {'loaded' if encoder else 'not loaded'}"
    fraction = "kv_cache_free_gpu_mem_fraction"  # the tensorrtllm backend's (none on the CPU target's llm)
    planned = serving_config.read(repo / interface.LLM, serving_config.LANGUAGE_CONFIG).parameters
    share = fraction not in planned or llm.parameters[fraction].string_value == planned[fraction].string_value
    if fraction in planned:
        colocated = serving_config.read(repo / interface.LLM).parameters[fraction].string_value
        figure += f", KV cache share {llm.parameters[fraction].string_value} (colocated {colocated})"
    return len(same) == len(requests) and pooled == media and decoded == 0 and not encoder and share, figure


def _warm_up(server: Any) -> tuple[bool, str]:
    """serve's warm-up requests (serving.server.warmup) through the engines: the llm on the tensorrtllm backend with
    their prefixed request ids, the vision engine after its model_warmup samples ran at load; then an image request
    (8 tokens) and ten more, each a fresh image (no visual-cache hit): the first's latency against their median."""
    from ..serving.client import Client
    from ..serving.server.warmup import plan, warm_up
    from .tiny import synthetic_jpeg

    try:
        steps: list[str] = []
        seconds = warm_up(server.url, plan(server.repo), steps.append, timeout_s=300)
        client = Client(server.url, timeout_s=120)
        try:
            latencies = []
            for i in range(11):
                image = synthetic_jpeg(448, 448, seed=100 + i)
                start = time.perf_counter()
                client.generate("Describe this picture.", [image], max_tokens=8)
                latencies.append(time.perf_counter() - start)
        finally:
            client.close()
    except Exception as e:  # noqa: BLE001 (reported as the row's failure)
        return False, f"{type(e).__name__}: {e}"
    median = statistics.median(latencies[1:])
    ratio = latencies[0] / median
    figure = f"{len(steps)} warm-up requests in {seconds:.1f} s; first request {latencies[0] * 1000:.0f} ms"
    return ratio <= FIRST_REQUEST_RATIO, f"{figure}, median of the next ten {median * 1000:.0f} ms (x{ratio:.2f})"


GUIDED_SCHEMA = {
    "type": "object",
    "properties": {
        "colour": {"enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 9},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
    },
    "required": ["colour", "count", "tags"],
    "additionalProperties": False,
}
WEATHER_TOOL: dict[str, Any] = {
    "name": "get_weather",
    "description": "Current weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 12},
            "days": {"type": "integer", "minimum": 1, "maximum": 9},
        },
        "required": ["city"],
        "additionalProperties": False,
    },
}


def _tokens_ensemble(
    client: Any, build_dir: Path, requests: dict[str, tuple[str, list[bytes], list[bytes]]]
) -> tuple[bool, str]:
    """The ensemble that answers the engine's token ids (the gateway's and decoding clients': no python step per
    streamed token), decoded by the client, against the one that answers text: the same text and ids for each
    request, streamed (the tensorrtllm backend's responses, each with its new ids) and not."""
    from ..common.manifest import BuildManifest
    from ..decoding.detokenize import Detokenizer
    from ..hf.checkpoint import generation_end_ids
    from ..serving.client import Client

    model = BuildManifest.read(build_dir).model
    decoding = Client(client.url, timeout_s=client.timeout_s, detokenizer=Detokenizer.from_model_dir(model))
    # And one that ends on the end id at once (a +100 bias): the engine's last streamed response then carries no
    # token ([1, 1, 0]), which both ensembles' decoding must take. The engine's end id is the one preprocessing sends:
    # generation_config's first eos id (its others go as stop words, which end otherwise).
    Case = tuple[str, list[bytes], list[bytes], dict[str, Any]]
    ends: dict[str, Case] = {
        "ends on the end id": ("Say nothing.", [], [], {"logit_bias": {generation_end_ids(model)[0]: 100.0}})
    }
    cases: dict[str, Case] = {kind: (*request, {}) for kind, request in requests.items()} | ends
    try:
        for kind, (prompt, images, videos, options) in cases.items():
            for stream in (False, True):
                sent = dict(max_tokens=NEW_TOKENS, videos=videos, stream=stream, **options)
                expected = client.generate(prompt, images, **sent)
                got = decoding.generate(prompt, images, **sent)
                if (got.text, got.token_ids) != (expected.text, expected.token_ids):
                    return False, f"{kind}, stream {stream}: {got.text[:80]!r} against {expected.text[:80]!r}"
    finally:
        decoding.close()
    return True, f"{len(cases)} requests, streamed and not: the same text and ids"


def _top_logprobs(client: Any, build_dir: Path) -> tuple[bool, str]:
    """top_logprobs from the engine's generation logits (the tensorrtllm backend's return_generation_logits), decoded
    by the client: TOP_LOGPROBS alternatives per token, the served (greedy) token the likeliest, and every reported
    log probability, the token's own among them, against transformers' log-softmax of its logits at that step
    (teacher-forced on the served tokens), by token id."""
    from ..common.manifest import BuildManifest
    from ..decoding.detokenize import Detokenizer
    from ..serving.client import Client

    model = BuildManifest.read(build_dir).model
    prompt = "Describe a sunset in three words."
    decoding = Client(client.url, timeout_s=client.timeout_s, detokenizer=Detokenizer.from_model_dir(model))
    try:
        answer = decoding.generate(prompt, [], max_tokens=NEW_TOKENS, top_logprobs=TOP_LOGPROBS)
    finally:
        decoding.close()
    rows = _TransformersGreedy(model).log_softmax(prompt, [], [], answer.token_ids)
    counted = all(len(top) == TOP_LOGPROBS for top in answer.top) and len(answer.top) == len(answer.token_ids)
    likeliest = sum(top[0][0] == token for top, token in zip(answer.top, answer.token_ids, strict=False))
    gaps = [
        abs(p - float(row[t]))
        for row, token, own, top in zip(rows, answer.token_ids, answer.log_probs, answer.top, strict=False)
        for t, p in [(token, own), *top]
    ]
    worst = max(gaps, default=float("inf"))
    figure = (
        f"{len(answer.top)} tokens x {TOP_LOGPROBS} alternatives; the served token the likeliest "
        f"{likeliest}/{len(answer.token_ids)}; largest |log prob - transformers'| {worst:.4f}"
    )
    return counted and likeliest == len(answer.token_ids) > 0 and worst <= TOP_LOGPROB_GAP, figure


def _batch_priority(
    client: Any, requests: dict[str, tuple[str, list[bytes], list[bytes]]], tokens: dict[str, list[int]]
) -> tuple[bool, str]:
    """The requests sent again at the batch lines' Triton priority (the python models' lower level, which the
    tensorrtllm model takes as its default) are answered with the same tokens."""
    from ..serving.request import BATCH_PRIORITY

    again = {
        kind: client.generate(prompt, images, max_tokens=NEW_TOKENS, videos=videos, priority=BATCH_PRIORITY).token_ids
        for kind, (prompt, images, videos) in requests.items()
    }
    differ = [kind for kind in requests if again[kind] != tokens[kind]]
    return not differ, f"{len(requests) - len(differ)}/{len(requests)} answers the same" + (
        f"; differ: {', '.join(differ)}" if differ else ""
    )


def _checked(check: Callable[[Any], tuple[bool, str]], client: Any) -> tuple[bool, str]:
    try:
        return check(client)
    except Exception as e:  # an answer that does not parse or validate, or a request the server refused
        return False, f"{type(e).__name__}: {str(e)[:300]}"


def _guided_answers(client: Any) -> tuple[bool, str]:
    """The engine's guided decoding (the tensorrtllm backend's xgrammar over the build's tokenizer info) on the
    grammars the gateway sends: a json_schema answer that parses and validates, and a required tool call whose
    arguments validate against the function's parameters (the tiny model's weights are random: only the grammar
    makes either valid)."""
    import jsonschema

    from ..decoding.guides import json_schema_guide, tool_call_guide
    from ..serving.gateway.tool_calls import parse_tool_calls

    messages = [{"role": "user", "content": "Answer in JSON."}]
    schema = json_schema_guide(GUIDED_SCHEMA)
    answer = client.generate("", [], max_tokens=96, messages=messages, guide=schema).text
    jsonschema.validate(json.loads(answer), GUIDED_SCHEMA)
    tools = [{"type": "function", "function": WEATHER_TOOL}]
    call = tool_call_guide([WEATHER_TOOL], named=None, parallel=False)
    weather = [{"role": "user", "content": "Weather in Bern?"}]
    text = client.generate("", [], max_tokens=96, messages=weather, tools=tools, guide=call).text
    content, calls = parse_tool_calls(text, ["get_weather"])
    if len(calls) != 1 or content:
        return False, f"the required call is not one valid call: {text[:200]!r}"
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER_TOOL["parameters"])
    return True, f"json_schema answer {answer[:80]!r} validates; call {calls[0].name}({calls[0].arguments[:60]})"


BIASED_TOKEN = 1234  # any id of the vocabulary


def _sampling_options(client: Any) -> tuple[bool, str]:
    """The sampling and output inputs the gateway passes on reach the engine as the reference runtime defines them:
    a +100 logit bias makes every greedy token that one (the llm's embedding_bias), a huge presence penalty
    keeps greedy tokens from repeating (prompt and output tokens count), and the log probs come one per token,
    none above 0 and not all 0 (normalize_log_probs off: the backend's default gives 0 for every greedy token)."""
    messages = [{"role": "user", "content": "Count slowly."}]
    biased = client.generate("", [], max_tokens=8, messages=messages, logit_bias={BIASED_TOKEN: 100.0}).token_ids
    if set(biased) != {BIASED_TOKEN}:
        return False, f"a +100 logit bias on {BIASED_TOKEN} gave {biased}"
    shy = client.generate("", [], max_tokens=16, messages=messages, presence_penalty=1e4).token_ids
    if len(set(shy)) != len(shy):
        return False, f"a presence penalty of 1e4 still repeated tokens: {shy}"
    answer = client.generate("", [], max_tokens=16, messages=messages, return_log_probs=True)
    log_probs = answer.log_probs
    if len(log_probs) != len(answer.token_ids) or max(log_probs, default=1.0) > 0 or not any(log_probs):
        return False, f"log probs {log_probs} for {len(answer.token_ids)} tokens"
    return (
        True,
        f"bias {len(biased)}/8 tokens, {len(shy)} distinct, log probs {min(log_probs):.2f}..{max(log_probs):.2f}",
    )


def _drains(server: Any) -> tuple[bool, str]:
    """A stop (SIGTERM, as a pod's termination sends) while a stream is generating: the stream runs to its end and
    the server exits cleanly. serve passes --stop-grace to tritonserver as --exit-timeout-secs, and the image's
    server (r26.04) finishes the gRPC streams in flight before it stops the models. Its python stubs' shared memory
    carries the server's own prefix (--backend-config=python,shm-region-prefix-name), and none is left after."""
    import threading

    from ..serving.client import Client, InferenceError
    from ..serving.server.tritonserver import SHM_DIR

    def regions() -> int:
        return len(list(SHM_DIR.glob(f"{server.shm_prefix}*")))

    named = regions()

    client = Client(server.url, timeout_s=120)
    stopped: list[float | int | None] = []
    try:
        generation = client.stream("Count slowly.", [], DRAIN_TOKENS, stream=True, min_tokens=DRAIN_TOKENS)
        pieces = iter(generation)
        tokens = len(next(pieces).token_ids)
        stop_at = time.monotonic()
        stopper = threading.Thread(target=lambda: stopped.append(server.stop()))
        stopper.start()
        after_stop = 0
        try:
            for piece in pieces:
                tokens += len(piece.token_ids)
                after_stop += len(piece.token_ids)
            ended = "ended"
        except InferenceError as e:
            ended = f"cut ({e})"
        finished_s = time.monotonic() - stop_at
        stopper.join()
    finally:
        client.close()
    status = stopped[0] if stopped else None
    left = regions()
    figure = (
        f"stop sent after the first piece; the stream {ended} with {tokens}/{DRAIN_TOKENS} tokens ({after_stop} after "
        f"the stop, {finished_s:.1f} s); server exit status {status}; shared-memory regions with the server's prefix: "
        f"{named} while serving, {left} after"
    )
    drained = ended == "ended" and tokens == DRAIN_TOKENS and after_stop > 0 and status == 0
    return drained and named > 0 and left == 0, figure


def _cache_hit(server: Any, client: Any, sent: tuple[tuple[str, list[bytes]], list[int]]) -> tuple[bool, str]:
    """The request with images sent again: the same tokens, the visual cache's hit, no image decoded and no
    vision encoder execution (Triton's statistics)."""
    from ..serving import interface
    from ..serving.stages import metrics as stage_metrics

    def runs() -> int:
        stats = client.grpc.get_inference_statistics(model_name=interface.VISION_ENCODER, as_json=True)
        return int(stats["model_stats"][0].get("execution_count", 0))

    def counted(metric: stage_metrics.Metric) -> float:
        return stage_metrics.read(server.metrics_url).get((metric.name, interface.PREPROCESSING), 0.0)

    (prompt, images), first = sent
    before = (runs(), counted(stage_metrics.VISUAL_CACHE_HITS), counted(stage_metrics.IMAGES_DECODED))
    again = client.generate(prompt, images, max_tokens=NEW_TOKENS).token_ids
    after = (runs(), counted(stage_metrics.VISUAL_CACHE_HITS), counted(stage_metrics.IMAGES_DECODED))
    vision_runs, hits, decoded = (int(b - a) for a, b in zip(before, after, strict=True))
    figure = f"{'same' if again == first else 'different'} tokens, {hits} hit(s), {decoded} decoded, {vision_runs} runs"
    return again == first and hits == len(images) and decoded == 0 and vision_runs == 0, figure


def _heals(server: Any) -> tuple[bool, str]:
    """On the image's own tritonserver (python_backend r26.04, whose model readiness follows stub health): the
    python models publish their qwen3vl_ metrics, and the vision encoder's stub killed (as an OOM kill would) is
    seen, reloaded by the supervisor, and serves again."""
    import os
    import signal
    import urllib.request

    from tritonclient.grpc import InferenceServerClient

    from ..serving import interface
    from ..serving.client import Client
    from ..serving.server.supervisor import group_stubs
    from ..serving.stages import metrics as stage_metrics

    with urllib.request.urlopen(f"http://127.0.0.1:{server.ports.metrics}/metrics", timeout=10) as reply:
        published = stage_metrics.REQUESTS.name in reply.read().decode()
    (stub,) = [s for s in group_stubs(server.pid).live.values() if s.model == interface.VISION_ENCODER]
    os.kill(stub.pid, signal.SIGKILL)
    killed = time.monotonic()
    probe = InferenceServerClient(server.url)
    broken_at = back_at = None
    try:
        while back_at is None and time.monotonic() - killed < 300:
            try:
                ready = probe.is_model_ready(interface.VISION_ENCODER) and probe.is_model_ready(interface.ENSEMBLE)
            except Exception:  # tritonclient's own errors: the server is being started again
                ready = False
            if not ready and broken_at is None:
                broken_at = time.monotonic() - killed
            elif ready and broken_at is not None:
                back_at = time.monotonic() - killed
            time.sleep(0.2)
    finally:
        probe.close()
    answered = False
    if back_at is not None:
        client = Client(server.url, timeout_s=120)
        try:
            answered = bool(client.generate("Still there?", max_tokens=2).token_ids)
        finally:
            client.close()
    figure = (
        f"qwen3vl_ metrics {'published' if published else 'missing'}; vision_encoder stub killed: "
        + (f"not ready after {broken_at:.1f} s, " if broken_at is not None else "never seen not ready, ")
        + (f"back after {back_at:.1f} s, " if back_at is not None else "not back in 300 s, ")
        + f"then {'answered' if answered else 'no answer'}"
    )
    return published and answered, figure


class _TransformersGreedy:
    """transformers (fp32) scoring a served sequence, teacher-forced: how many served tokens equal its greedy
    choices from the start, and how far each is from the step's best logit (a share of max - median)."""

    def __init__(self, model: Path):
        import torch
        from transformers import AutoModelForImageTextToText

        from ..preprocess import Preprocessor

        self.model = AutoModelForImageTextToText.from_pretrained(model, dtype=torch.float32).eval()
        self.pre = Preprocessor.from_pretrained(model)

    def steps(self, prompt: str, images: list[bytes], videos: list[bytes], served: list[int]) -> Any:
        """The logits that score each served token, float32 [len(served), vocab]."""
        import numpy as np
        import torch

        from ..hf.reference import hf_request_inputs

        request = self.pre([_user_message(prompt, images, videos)])  # on the CPU: FFmpeg's frames, as transformers
        ids = np.concatenate([request.input_ids, np.asarray(served, dtype=request.input_ids.dtype)])
        info = self.pre.info
        inputs = hf_request_inputs(self.model, request, info.image_token_id, info.video_token_id, ids)
        with torch.no_grad():
            logits = self.model(**inputs).logits[0].float()
        # Row i scores the token after position i: the served tokens are scored by the rows from the prompt's last.
        start = len(request.input_ids) - 1
        return logits[start : start + len(served)]

    def log_softmax(self, prompt: str, images: list[bytes], videos: list[bytes], served: list[int]) -> Any:
        """The log-softmax of those logits, numpy float32 [len(served), vocab]."""
        return self.steps(prompt, images, videos, served).log_softmax(-1).numpy()

    def score(
        self, prompt: str, images: list[bytes], videos: list[bytes], served: list[int]
    ) -> tuple[int, list[float]]:
        steps = self.steps(prompt, images, videos, served)
        greedy = steps.argmax(-1).tolist()
        equal = next((i for i, (a, b) in enumerate(zip(served, greedy, strict=True)) if a != b), len(served))
        return equal, logit_gaps(steps, served)


def logit_gaps(steps: Any, served: Sequence[int]) -> list[float]:
    """How far each served token's logit is from its step's best, as a share of the step's max - median (steps: the
    logits [len(served), vocab] that score them)."""
    return [
        float(row.max() - row[token]) / (float(row.max() - row.median()) or 1.0)
        for row, token in zip(steps, served, strict=True)
    ]


def write_report(report: Report, output: Path, name: str = RESULT_FILE) -> Path:
    output.mkdir(parents=True, exist_ok=True)
    path = output / name
    path.write_text(report.to_json())
    return path
