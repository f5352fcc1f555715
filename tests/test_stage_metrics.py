"""The python models' metrics on a real tritonserver's metrics port (the CPU target): a known set of
requests over gRPC, then the scrape must count exactly what was sent and answered."""

from __future__ import annotations

import urllib.request

import pytest
from deployment import build_cpu_repository
from images import jpeg
from qwen3vl_trt.preprocess import Preprocessor
from qwen3vl_trt.serving import interface
from qwen3vl_trt.serving.client import Answer, Client, RequestRejectedError
from qwen3vl_trt.serving.ports import free_ports
from qwen3vl_trt.serving.server.tritonserver import TritonServer
from qwen3vl_trt.serving.stages import metrics as stage_metrics
from videos import clip

pytestmark = [pytest.mark.slow, pytest.mark.server]

MODELS = (interface.PREPROCESSING, interface.VISION_ENCODER, interface.LLM, interface.POSTPROCESSING)


@pytest.fixture(scope="module")
def served(checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-metrics")
    server = TritonServer(build_cpu_repository(checkpoints["dense"], root), free_ports(), log_path=root / "server.log")
    server.start()
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def _patches(model_dir, images: list[bytes]) -> int:
    """The patches preprocessing makes of a request's images."""
    content = [{"type": "image", "image": image} for image in images] + [{"type": "text", "text": "?"}]
    return int(Preprocessor.from_pretrained(model_dir)([{"role": "user", "content": content}]).pixel_values.shape[0])


def test_each_model_counts_what_it_was_sent(served, checkpoints):
    before = stage_metrics.read(served.metrics_url)
    assert before, "no qwen3vl_ metrics on the metrics port"
    with urllib.request.urlopen(served.metrics_url, timeout=10) as reply:
        published = [line for line in reply.read().decode().splitlines() if line.startswith("qwen3vl_")]
    assert all(f'{stage_metrics.STUB_LABEL}="' in line for line in published), published  # each stub's own series
    for metric in (stage_metrics.REQUESTS, stage_metrics.REQUEST_ERRORS):
        for model in MODELS:
            assert before[(metric.name, model)] == 0, (metric.name, model)  # published from load, still zero

    requests = [
        ("Describe this picture.", [jpeg(64, 96, seed=1)]),
        ("What is in this one?", [jpeg(96, 64, seed=2)]),
        ("Compare the two images.", [jpeg(32, 32, seed=3), jpeg(128, 64, seed=4)]),
        ("What is the capital of France?", []),
    ]
    client = Client(served.url, timeout_s=120)
    answers = [client.generate(prompt, images, max_tokens=8) for prompt, images in requests[:3]]
    # The text-only request streams: each of its responses is a postprocessing request of its own.
    pieces = list(client.stream(requests[3][0], requests[3][1], max_tokens=8, stream=True))
    answers.append(Answer("".join(p.text for p in pieces), [t for p in pieces for t in p.token_ids]))
    with pytest.raises(RequestRejectedError):
        client.generate("What is this?", [b"not an image"], max_tokens=8)  # refused by preprocessing
    client.close()

    after = stage_metrics.read(served.metrics_url)

    def sent(metric: stage_metrics.Metric, model: str, sample: str = "") -> float:
        return after[(metric.name + sample, model)] - before.get((metric.name + sample, model), 0.0)

    images = sum(len(i) for _, i in requests)
    patches = sum(_patches(checkpoints["dense"], i) for _, i in requests if i)
    tokens = sum(len(a.token_ids) for a in answers)
    assert images == 4 and tokens > 0 and len(pieces) > 1

    assert sent(stage_metrics.REQUESTS, interface.PREPROCESSING) == 5
    assert sent(stage_metrics.REQUEST_ERRORS, interface.PREPROCESSING) == 1
    assert sent(stage_metrics.IMAGES_DECODED, interface.PREPROCESSING) == images
    # One vision request per preprocessing batch with images to encode: the three with images came one by one.
    assert sent(stage_metrics.REQUESTS, interface.VISION_ENCODER) == 3
    assert sent(stage_metrics.PATCHES_ENCODED, interface.VISION_ENCODER) == patches
    runs = sent(stage_metrics.VISION_RUN_PATCHES, interface.VISION_ENCODER, "_count")
    assert 3 <= runs <= images  # the requests came one by one: at least one run each
    assert sent(stage_metrics.VISION_RUN_PATCHES, interface.VISION_ENCODER, "_sum") == patches
    assert sent(stage_metrics.VISION_RUN_IMAGES, interface.VISION_ENCODER, "_count") == runs
    assert sent(stage_metrics.VISION_RUN_IMAGES, interface.VISION_ENCODER, "_sum") == images
    assert sent(stage_metrics.VISION_RUN_SECONDS, interface.VISION_ENCODER, "_count") == runs
    assert sent(stage_metrics.VISION_RUN_SECONDS, interface.VISION_ENCODER, "_sum") > 0
    assert sent(stage_metrics.REQUESTS, interface.LLM) == 4
    assert sent(stage_metrics.TOKENS_GENERATED, interface.LLM) == tokens
    assert sent(stage_metrics.REQUESTS, interface.POSTPROCESSING) == 3 + len(pieces)
    for model in (interface.VISION_ENCODER, interface.LLM, interface.POSTPROCESSING):
        assert sent(stage_metrics.REQUEST_ERRORS, model) == 0, model


def test_preprocessing_counts_videos_and_times_its_batches(served):
    before = stage_metrics.read(served.metrics_url)
    client = Client(served.url, timeout_s=120)
    client.generate("What happens?", max_tokens=4, videos=[clip("h264 3 s 10 fps", seed=9)])
    client.close()
    after = stage_metrics.read(served.metrics_url)

    def sent(metric: stage_metrics.Metric, sample: str = "") -> float:
        key = (metric.name + sample, interface.PREPROCESSING)
        return after[key] - before.get(key, 0.0)

    assert sent(stage_metrics.VIDEOS_DECODED) == 1 and sent(stage_metrics.IMAGES_DECODED) == 0
    assert sent(stage_metrics.PREPROCESS_SECONDS, "_count") == 1 and sent(stage_metrics.PREPROCESS_SECONDS, "_sum") > 0
