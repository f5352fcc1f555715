"""The GPU acceptance's served rows (build/qa/acceptance.py) run against the CPU target's deployment: every check they
make of a served repository (warm-up, tokens against transformers, the batch lines' priority, the tokens ensemble,
the visual cache, guided decoding, sampling options, healing, draining) and the rows and report around them, on
tritonserver 2.51 with the reference runtime where a GPU host runs them on the tensorrtllm backend. As on a GPU host,
the vision models read a vision engine (the GPU target's graph in fp32, built through the TensorRT stand-in) and
tritonserver's python stub runs it with the engine runner (`VisionBatching(engine_dir=...)`, its warm-up at load
included), with the stand-in and CUDA on the host (tests/tensorrt_standin/stub_gpu.py, imported first by that model's
model.py). Only what needs CUDA or TensorRT is taken as present. What this deployment cannot do fails here as the
check says it must: tritonserver 2.51 cuts a stream in flight when it stops (docs/gpu-hosts.md)."""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import shutil
from dataclasses import dataclass, replace

import pytest
import torch
from deployment import LIMITS, user
from qwen3vl_trt.qa import acceptance
from qwen3vl_trt.qa.acceptance import (
    FAIL,
    FIRST_REQUEST_RATIO,
    NEW_TOKENS,
    PASS,
    RESULT_FILE,
    Acceptance,
    Variant,
    write_report,
)
from qwen3vl_trt.qa.tiny import synthetic_jpeg
from qwen3vl_trt.runtime.local import LocalPipeline
from qwen3vl_trt.runtime.sampling import SamplingParams
from qwen3vl_trt.serving import interface
from qwen3vl_trt.serving.client import Client
from qwen3vl_trt.serving.parameters import CACHE_MEMORY, PreprocessingParameters, VisionEncoderParameters
from qwen3vl_trt.serving.repository import model_config
from qwen3vl_trt.serving.request import GenerationRequest
from qwen3vl_trt.serving.server import tritonserver
from qwen3vl_trt.serving.stages import metrics as stage_metrics
from qwen3vl_trt.serving.stages.preprocessing import Preprocessing
from qwen3vl_trt.vision.engine import build_vision_engine
from qwen3vl_trt.vision.export import export_vision
from qwen3vl_trt.vision.sidecar import VisionEngineProfile
from tensorrt_standin.activation import gpu_in_stub, gpu_stack

pytestmark = [pytest.mark.slow, pytest.mark.server]

# What a GPU host has and this machine has not: the rows' needs that stand for CUDA, TensorRT, TensorRT-LLM and the
# GPU decoders.
GPU_NEEDS = ("_cuda", "_tensorrt", "_tensorrt_llm", "_NVIMGCODEC", "_PYNVVIDEOCODEC")
ENDING_PROMPT = "Say nothing."  # the tokens ensemble's case that ends on the end id at once
JPEG = ("Describe this picture.", [synthetic_jpeg(480, 640, seed=5)])  # served_rows' "one JPEG", the variant's
TEXT = ("Describe a sunset in three words.", [])


def _present() -> None:
    return None


class Recorded:
    """Every Client.generate call of the run: its prompt, images, options and answer's token ids."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[bytes, ...], dict, list[int]]] = []

    def wrap(self, generate):
        @functools.wraps(generate)
        def recording(client, prompt, images=(), max_tokens=64, **options):
            answer = generate(client, prompt, images, max_tokens, **options)
            self.calls.append((prompt, tuple(images), dict(options), answer.token_ids))
            return answer

        return recording


@pytest.fixture(scope="module")
def engine_build(tiny_dense, cpu_repository, tmp_path_factory):
    """The CPU deployment's build with its vision models reading a vision engine built through the TensorRT stand-in
    for the deployment's limits (the other build files linked)."""
    work = tmp_path_factory.mktemp("engine-build")
    plugin = export_vision(tiny_dense, work / "vision_plugin", variant="plugin", log=lambda *_: None).output_dir
    parameters = VisionEncoderParameters.from_model_config(model_config.read(cpu_repository / interface.VISION_ENCODER))
    profile = VisionEngineProfile.for_visual_tokens(parameters.limits.max_visual_tokens, merge_unit=4)
    with gpu_stack():
        engine = build_vision_engine(plugin, work / "vision_engine", profile, log=lambda *_: None)
    build = work / "build"
    build.mkdir()
    for path in cpu_repository.parent.iterdir():
        if path != cpu_repository:
            (build / path.name).symlink_to(path)
    repo = shutil.copytree(cpu_repository, build / cpu_repository.name)
    for model, declaration in (
        (interface.VISION_ENCODER, VisionEncoderParameters),
        (interface.PREPROCESSING, PreprocessingParameters),
    ):
        config = model_config.read(repo / model)
        dataclasses.replace(declaration.from_model_config(config), vision_engine_dir=engine).apply(config)
        model_config.write(repo / model, config)
    gpu_in_stub(repo / interface.VISION_ENCODER)
    return build


@dataclass
class Served:
    report: acceptance.Report
    recorded: Recorded
    built: list[dict]  # the stood-in builds' target, tp and other flags
    metrics: dict  # the first metrics read (before the vision_encoder's stub is killed)


@pytest.fixture(scope="module")
def run(checkpoints, engine_build, tmp_path_factory):
    """served_rows of the dense checkpoint over the CPU deployment reading the vision engine (served with its
    in-process visual cache, and a short stop grace: tritonserver 2.51 does not drain, so the stop waits the grace
    out), then one variant whose build and serving are stood in for (its requests answered as served_rows' server
    answered them)."""
    work = tmp_path_factory.mktemp("acceptance")
    recorded = Recorded()
    built: list[dict] = []
    metrics: list[dict] = []
    with pytest.MonkeyPatch.context() as patch:
        for need in GPU_NEEDS:
            patch.setattr(acceptance, need, _present)
        patch.setattr(
            tritonserver,
            "TritonServer",
            functools.partial(tritonserver.TritonServer, visual_cache=CACHE_MEMORY, stop_grace=2),
        )
        patch.setattr(Client, "generate", recorded.wrap(Client.generate))
        patch.setattr(stage_metrics, "read", functools.partial(_recorded_read, stage_metrics.read, metrics))
        run = Acceptance(work, log=lambda _line: None)
        run._builds["dense"] = engine_build
        run.served_rows("dense", checkpoints["dense"])

        def build(model, output, options, **flags):
            built.append({**flags, "tp": options.tp})
            output.mkdir(parents=True)
            return type("Manifest", (), {"done_stages": lambda self: ["llm_checkpoint"]})()

        def served_once(_build_dir, requests, _log_path):
            plain = [call for call in recorded.calls if not any(call[2].values())]  # no options but videos=[]
            answers = {(prompt, images): tokens for prompt, images, _, tokens in plain}
            return [answers[(prompt, tuple(images))] for prompt, images in requests]

        patch.setattr("qwen3vl_trt.pipeline.build.build", build)
        patch.setattr(acceptance, "_served_once", served_once)
        dense = checkpoints["dense"]
        variant = Variant(
            "dense, tp 2", dense, dense, acceptance.LOGIT_GAP, "served", (TEXT, JPEG), {"tp": 2}, check=_checked
        )
        run.variant_rows(variant)
        run.variant_rows(replace(variant, name="wrong tokens", reference=checkpoints["moe"]))  # another model's scores
        run.variant_rows(replace(variant, name="refused", check=_refused))
    return Served(run.report, recorded, built, metrics[0])


def _recorded_read(read, into: list[dict], url: str) -> dict:
    samples = read(url)
    into.append(samples)
    return samples


def _checked(build_dir, variant) -> tuple[bool, str]:
    return True, f"checked {build_dir.name} for {variant.name}"


def _refused(_build_dir, _variant) -> tuple[bool, str]:
    return False, "the build is not what the row needs"


def _rows(report, name: str = "dense") -> dict[str, acceptance.Row]:
    """The rows of the served model `name`, by their check without the name."""
    tail = f" ({name})"
    return {row.check.removesuffix(tail): row for row in report.rows if row.check.endswith(tail)}


def test_every_served_check_passes_on_the_cpu_deployment(run):
    rows = _rows(run.report)
    for check in (
        "serve the GPU repository",
        "served tokens vs transformers greedy, text only",
        "served tokens vs transformers greedy, one JPEG",
        "served tokens vs transformers greedy, an H.264 video",  # the host decodes it here, without a warning
        "the same requests at the batch lines' priority get the same tokens",
        "the tokens ensemble streams the engine's ids, decoded by the client as the text ensemble",
        "top_logprobs from the engine's generation logits vs transformers' log-softmax",
        "a repeated image: a visual cache hit, no decode, no vision encoder",
        "guided decoding on the engine: a json_schema answer and a required tool call",
        "logit bias, presence penalty and log probs on the engine",
        "metrics published; a killed vision_encoder stub comes back",
    ):
        assert rows[check].status == PASS, rows[check]
    assert "0 server log lines on tensors missing the CUDA memory pool" in rows["serve the GPU repository"].figure
    assert rows["the same requests at the batch lines' priority get the same tokens"].figure == "3/3 answers the same"
    tops = rows["top_logprobs from the engine's generation logits vs transformers' log-softmax"].figure
    pattern = r"alternatives; the served token the likeliest (\d+)/\1; largest \|log prob - transformers'\| 0\.0000$"
    assert re.search(pattern, tops), tops
    for kind in ("text only", "one JPEG", "an H.264 video"):
        assert re.match(
            r"(\d+)/\1 tokens equal, largest gap 0\.000", rows[f"served tokens vs transformers greedy, {kind}"].figure
        )
    assert rows["a repeated image: a visual cache hit, no decode, no vision encoder"].figure == (
        "same tokens, 1 hit(s), 0 decoded, 0 runs"
    )
    assert "back after" in rows["metrics published; a killed vision_encoder stub comes back"].figure
    split = rows["the vision pool: a member and a language replica (--role language) answer as the colocated"]
    assert split.status == PASS and split.figure == (
        "3/3 requests' tokens as the colocated; 2 of 2 encoded by the pool, 0 decoded here; vision encoder not loaded"
    ), split

    # The warm-up's verdict is its figure's (a CPU's first request may or may not be slower).
    warm = rows["serve's warm-up through every model, then the first request against the next ten"]
    ratio = float(re.search(r"\(x([\d.]+)\)$", warm.figure).group(1))
    assert warm.figure.startswith("4 warm-up requests")
    if ratio != FIRST_REQUEST_RATIO:  # the figure's two decimals cannot tell a ratio at the limit (seen: x1.50, FAIL)
        assert warm.status == (PASS if ratio < FIRST_REQUEST_RATIO else FAIL)


def test_a_stop_cuts_the_stream_on_tritonserver_2_51_and_leaves_no_shared_memory(run):
    drain = _rows(run.report)["a stop lets a stream in flight finish"]
    assert drain.status == FAIL and "the stream cut" in drain.figure, drain
    named, left = map(int, re.search(r"prefix: (\d+) while serving, (\d+) after$", drain.figure).groups())
    assert named > 0 and left == 0, drain


def test_the_engine_runner_serves_onnx_runtimes_tokens(run, tiny_dense, cpu_repository):
    """The vision encoder ran the engine (through the stand-in: ONNX Runtime on the plan's ONNX) and the deployment
    answered what the chain with ONNX Runtime's encoder answers."""
    prompt, images = JPEG
    served = next(
        tokens
        for p, i, options, tokens in run.recorded.calls
        if (p, list(i)) == (prompt, images) and not any(options.values())  # no options but videos=[]
    )
    local = LocalPipeline(tiny_dense, cpu_repository.parent).generate(
        user(prompt, *images), SamplingParams(max_new_tokens=NEW_TOKENS)
    )
    assert served == local.token_ids and len(served) == NEW_TOKENS
    # The engine encoded the images: patches counted, no run timed on the host (engine runs end on a CUDA stream).
    encoder = interface.VISION_ENCODER
    assert run.metrics[(stage_metrics.PATCHES_ENCODED.name, encoder)] > 0
    assert run.metrics[(f"{stage_metrics.VISION_RUN_PATCHES.name}_count", encoder)] > 0
    assert run.metrics.get((f"{stage_metrics.VISION_RUN_SECONDS.name}_count", encoder), 0) == 0


def test_the_ending_case_biases_the_end_id_preprocessing_sends_and_ends_at_once(run, checkpoints):
    """On the GPU the engine stops on its end id only (the other eos ids are stop words): the case that must end
    on it biases the id preprocessing gives the llm as end_id."""
    ending = [(options, tokens) for prompt, _, options, tokens in run.recorded.calls if prompt == ENDING_PROMPT]
    assert len(ending) == 4  # both ensembles, streamed and not
    (biased,) = {tuple(options["logit_bias"]) for options, _ in ending}
    assert all(tokens == [] for _, tokens in ending)
    request = GenerationRequest(prompt=ENDING_PROMPT, max_tokens=8).named_inputs()
    prepared = Preprocessing(checkpoints["dense"], LIMITS, torch.float32, 64).execute([request])[0]
    assert biased == (int(prepared.outputs[interface.END_ID.name][0]),)


def test_variant_rows_build_with_their_options_and_score_the_served_tokens(run):
    rows = {row.check: row for row in run.report.rows}
    assert [(options["target"], options["tp"]) for options in run.built] == [("gpu", 2)] * 3
    assert rows["qwen3vl-trt build, every stage (dense, tp 2)"].status == PASS
    served = rows["served (dense, tp 2)"]
    assert served.status == PASS and re.fullmatch(
        r"checked build-dense-tp-2 for dense, tp 2; (\d+)/\1 tokens equal; (\d+)/\2 tokens equal; largest gap 0\.000",
        served.figure,
    )
    wrong = rows["served (wrong tokens)"]
    assert wrong.status == FAIL and float(wrong.figure.rsplit(" ", 1)[1]) > acceptance.LOGIT_GAP, wrong
    refused = rows["served (refused)"]
    assert (refused.status, refused.figure) == (FAIL, "the build is not what the row needs")


def test_the_report_says_each_rows_verdict(run, tmp_path):
    report = run.report
    path = write_report(report, tmp_path)
    assert path.name == RESULT_FILE
    body = json.loads(path.read_text())
    statuses = [row["status"] for row in body["rows"]]
    assert body["exit_code"] == acceptance.EXIT_FAILED
    assert body["counts"] == {status: statuses.count(status) for status in (PASS, FAIL, acceptance.SKIPPED)}
    table = report.table().splitlines()
    assert len(table) >= len(report.rows) + 2
    assert all(f" | {row.status} " in table[i + 2] for i, row in enumerate(report.rows))
