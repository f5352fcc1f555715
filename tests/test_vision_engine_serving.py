"""The CPU target's deployment serving through the vision engine runner: the repository's vision_encoder (and
preprocessing) read a vision engine built through the TensorRT stand-in, and tritonserver's python stub runs it
(`VisionBatching(engine_dir=...)`: the GPU target's vision_encoder, its warm-up at load included) with the stand-in
and CUDA on the host (tests/tensorrt_standin/stub_gpu.py, imported first by that model's model.py). A request's tokens
equal those of the chain with ONNX Runtime's encoder."""

from __future__ import annotations

import dataclasses
import shutil

import pytest
from deployment import user
from images import jpeg
from qwen3vl_trt.runtime.local import LocalPipeline
from qwen3vl_trt.runtime.sampling import SamplingParams
from qwen3vl_trt.serving import interface
from qwen3vl_trt.serving.client import Client
from qwen3vl_trt.serving.parameters import PreprocessingParameters, VisionEncoderParameters
from qwen3vl_trt.serving.ports import free_ports
from qwen3vl_trt.serving.repository import model_config
from qwen3vl_trt.serving.server.serve import TritonServer
from qwen3vl_trt.serving.stages import metrics as stage_metrics
from qwen3vl_trt.vision.engine import build_vision_engine
from qwen3vl_trt.vision.export import export_vision
from qwen3vl_trt.vision.sidecar import VisionEngineProfile
from tensorrt_standin.activation import gpu_in_stub, gpu_stack

pytestmark = [pytest.mark.slow, pytest.mark.server]


def test_the_cpu_deployment_serves_through_the_engine_runner_with_onnx_runtimes_tokens(
    tiny_dense, cpu_repository, tmp_path
):
    build_dir = cpu_repository.parent
    # The GPU target's graph (fp32: ONNX Runtime runs the stand-in's engine), built for the deployment's limits.
    plugin = export_vision(tiny_dense, tmp_path / "vision_plugin", variant="plugin", log=lambda *_: None).output_dir
    parameters = VisionEncoderParameters.from_model_config(model_config.read(cpu_repository / interface.VISION_ENCODER))
    profile = VisionEngineProfile.for_visual_tokens(parameters.limits.max_visual_tokens, merge_unit=4)
    with gpu_stack():
        engine = build_vision_engine(plugin, tmp_path / "vision_engine", profile, log=lambda *_: None)

    # The repository, its vision models reading the engine as the GPU target's do.
    repo = shutil.copytree(cpu_repository, tmp_path / "triton_repo")
    for model, declaration in (
        (interface.VISION_ENCODER, VisionEncoderParameters),
        (interface.PREPROCESSING, PreprocessingParameters),
    ):
        config = model_config.read(repo / model)
        dataclasses.replace(declaration.from_model_config(config), vision_engine_dir=engine).apply(config)
        model_config.write(repo / model, config)
    gpu_in_stub(repo / interface.VISION_ENCODER)
    server = TritonServer(repo, free_ports(), log_path=tmp_path / "server.log")
    server.start()
    try:
        server.wait_ready()  # the vision_encoder loaded the engine and ran it once (its warm-up)
        photo = jpeg(64, 96, seed=1)
        answer = Client(server.url, timeout_s=120).generate("Describe this picture.", [photo], max_tokens=12)
        samples = stage_metrics.read(server.metrics_url)
    finally:
        server.stop()
    local = LocalPipeline(tiny_dense, build_dir).generate(
        user("Describe this picture.", photo), SamplingParams(max_new_tokens=12)
    )
    assert answer.token_ids == local.token_ids and len(answer.token_ids) == 12
    # The engine encoded the image: patches counted, no run timed on the host (engine runs end on a CUDA stream).
    encoder = interface.VISION_ENCODER
    assert samples[(stage_metrics.PATCHES_ENCODED.name, encoder)] > 0
    assert samples[(f"{stage_metrics.VISION_RUN_PATCHES.name}_count", encoder)] > 0
    assert samples.get((f"{stage_metrics.VISION_RUN_SECONDS.name}_count", encoder), 0) == 0
