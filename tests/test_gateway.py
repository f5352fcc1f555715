"""The OpenAI-compatible gateway started by `qwen3vl-trt serve --openai-port` on the CPU deployment,
called with the official `openai` client: the same answers as `qwen3vl-trt infer`, usage counted as
transformers' processor counts the prompt, OpenAI error bodies, and cancellation on the server."""

from __future__ import annotations

import io
import json
import re
import subprocess
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import openai
import pytest
from deployment import LIMITS, Gateway, cli, error_body, http_status, port_flags, user
from images import jpeg
from PIL import Image
from qwen3vl_trt.hf.reference import load_hf_processor
from qwen3vl_trt.qa.ports import free_port
from qwen3vl_trt.serving.ports import free_ports
from qwen3vl_trt.serving.server.serve import CPU_TARGET_NOTE
from videos import audio_only, clip, corrupt_middle, ffv1_mkv

# gpu_image: the gateway's asyncio client runs again on the GPU image's tritonclient 2.68 and grpcio 1.67.
pytestmark = [pytest.mark.slow, pytest.mark.server, pytest.mark.gpu_image]

PHOTO = jpeg(64, 96, seed=1)
PROMPT = "Describe this picture."


@pytest.fixture(scope="module")
def served(checkpoints, cpu_repository, tmp_path_factory):
    root = tmp_path_factory.mktemp("gateway")
    repo = cpu_repository
    ports = free_ports()
    port = free_port()
    args = ["serve", "--repo", str(repo), "--openai-port", str(port), *port_flags(ports)]
    gateway = Gateway(args, port, root / "serve.log")
    gateway.model_dir = checkpoints["dense"]
    gateway.repo = repo
    gateway.grpc_url = f"127.0.0.1:{ports.grpc}"
    gateway.ready_port = ports.ready  # `openai` in front of it asks serve's readiness there
    gateway.triton_metrics_url = f"http://127.0.0.1:{ports.metrics}"
    yield gateway
    gateway.stop()


def _infer_json(served, tmp_path, prompt: str, images: list[bytes], max_tokens: int, videos=()) -> dict:
    args = ["infer", "--url", served.grpc_url, "--prompt", prompt, "--max-tokens", str(max_tokens), "--json"]
    for k, image in enumerate(images):
        path = tmp_path / f"image{k}.jpg"
        path.write_bytes(image)
        args += ["--image", str(path)]
    for k, video in enumerate(videos):
        path = tmp_path / f"video{k}.mp4"
        path.write_bytes(video)
        args += ["--video", str(path)]
    process = cli(*args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = process.communicate(timeout=300)
    assert process.returncode == 0, err
    return json.loads(out)


def _hf_prompt_tokens(model_dir: Path, prompt: str, images: list[bytes]) -> int:
    """The prompt's length as transformers' processor tokenizes the same chat."""
    parts = [{"type": "image", "image": Image.open(io.BytesIO(i))} for i in images]
    chat = [{"role": "user", "content": [*parts, {"type": "text", "text": prompt}]}]
    hf = load_hf_processor(model_dir).apply_chat_template(
        chat, tokenize=True, add_generation_prompt=True, return_dict=True
    )
    return int(np.asarray(hf["input_ids"]).size)


def test_openai_client_gets_what_infer_returns_and_usage_counts_the_tokens(served, tmp_path):
    expected = _infer_json(served, tmp_path, PROMPT, [PHOTO], 16)
    client = served.client()
    reply = client.chat.completions.create(model="dense", messages=user(PROMPT, PHOTO), max_tokens=16)
    assert reply.choices[0].message.content == expected["text"] and expected["text"]
    assert reply.choices[0].message.role == "assistant"
    assert reply.usage.prompt_tokens == _hf_prompt_tokens(served.model_dir, PROMPT, [PHOTO])
    assert reply.usage.completion_tokens == len(expected["token_ids"])
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    assert reply.choices[0].finish_reason == ("length" if len(expected["token_ids"]) == 16 else "stop")

    chunks = list(
        client.chat.completions.create(
            model="dense",
            messages=user(PROMPT, PHOTO),
            max_completion_tokens=16,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    deltas = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(deltas) > 1 and "".join(deltas) == expected["text"]
    assert chunks[-1].choices == [] and chunks[-1].usage == reply.usage
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == reply.choices[0].finish_reason
    assert len({c.id for c in chunks}) == 1


def test_a_video_streamed_through_the_gateway_equals_infer(served, tmp_path):
    video = clip("h264 3 s 10 fps")
    expected = _infer_json(served, tmp_path, PROMPT, [PHOTO], 16, videos=[video])
    client = served.client()
    chunks = list(
        client.chat.completions.create(
            model="dense",
            messages=user(PROMPT, PHOTO, videos=(video,)),
            max_tokens=16,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    deltas = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(deltas) > 1 and "".join(deltas) == expected["text"]
    assert chunks[-1].usage.completion_tokens == len(expected["token_ids"])
    whole = client.chat.completions.create(model="dense", messages=user(PROMPT, PHOTO, videos=(video,)), max_tokens=16)
    assert whole.choices[0].message.content == expected["text"]
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens > 36  # the video's 36 visual tokens included


def test_text_only_and_sampling_options(served, tmp_path):
    expected = _infer_json(served, tmp_path, "Hello!", [], 12)
    client = served.client()
    reply = client.chat.completions.create(model="dense", messages=user("Hello!"), max_tokens=12, temperature=0)
    assert reply.choices[0].message.content == expected["text"]

    def sample(seed):
        return (
            client.chat.completions.create(
                model="dense", messages=user("Hello!"), max_tokens=12, temperature=1.0, top_p=0.9, seed=seed
            )
            .choices[0]
            .message.content
        )

    assert sample(7) == sample(7) != sample(8)


def test_stop_strings_end_the_text_before_them(served):
    client = served.client()
    whole = client.chat.completions.create(model="dense", messages=user(PROMPT, PHOTO), max_tokens=16)
    text = whole.choices[0].message.content
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), f"pick another stop string from {text!r}"
    cut = text[: text.index(stop)]
    stopped = client.chat.completions.create(model="dense", messages=user(PROMPT, PHOTO), max_tokens=16, stop=[stop])
    assert stopped.choices[0].message.content == cut and stopped.choices[0].finish_reason == "stop"
    streamed = client.chat.completions.create(
        model="dense", messages=user(PROMPT, PHOTO), max_tokens=16, stop=stop, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == cut

    short = client.chat.completions.create(model="dense", messages=user(PROMPT, PHOTO), max_tokens=3)
    assert short.choices[0].finish_reason == "length" and short.usage.completion_tokens == 3


BAD_REQUESTS = {
    # Cut mid-file: found by preprocessing (a bad header is found by the gateway), the same code either way.
    "broken image": (dict(messages=user("Look.", PHOTO[: len(PHOTO) // 3])), 400, "image", "invalid_image"),
    "too many images": (
        dict(messages=user("Many.", *[jpeg(32, 32, seed=s) for s in range(17)])),
        400,
        "17 images",
        "too_many_images",
    ),
    "prompt over the limit": (
        dict(messages=user("word " * 1500)),
        400,
        f"limit is {LIMITS.max_input_len}",
        "context_length_exceeded",
    ),
    "completion over the context": (
        dict(messages=user("Hi."), max_tokens=LIMITS.max_seq_len),
        400,
        f"maximum context length is {LIMITS.max_seq_len}",
        "context_length_exceeded",
    ),
    "remote image URL": (
        dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/a.jpg"}}]}]),
        400,
        "--allow-remote-media",
        None,
    ),
    "n over 16": (dict(messages=user("Hi."), n=17), 400, "n", None),
    "audio-only video": (
        dict(messages=user("Watch.", videos=(audio_only(),))),
        400,
        "no video stream",
        "invalid_video",
    ),
    "truncated video": (
        dict(messages=user("Watch.", videos=(clip("h264 3 s 10 fps")[:5000],))),
        400,
        "not a readable video container",
        "invalid_video",
    ),
    "unsupported video codec": (dict(messages=user("Watch.", videos=(ffv1_mkv(),))), 400, "'ffv1'", "invalid_video"),
    "corrupt video frames": (
        dict(
            messages=user("Watch.", videos=(corrupt_middle(clip("h264 portrait 30 fps, keyframe every 12, B-frames")),))
        ),
        400,
        "video 0",
        "invalid_video",
    ),
    "zero-length video": (dict(messages=user("Watch.", videos=(b"",))), 400, "empty", "invalid_video"),
    "remote video URL": (
        dict(messages=[{"role": "user", "content": [{"type": "video_url", "video_url": {"url": "http://x/a.mp4"}}]}]),
        400,
        "--allow-remote-media",
        None,
    ),
    "top_logprobs over the deployment's": (
        dict(messages=user("Hi."), logprobs=True, top_logprobs=LIMITS.max_top_logprobs + 1),
        400,
        f"serves top_logprobs up to {LIMITS.max_top_logprobs}",
        None,
    ),
    "top_logprobs without logprobs": (dict(messages=user("Hi."), top_logprobs=2), 400, "needs logprobs true", None),
    "top_logprobs without max_tokens": (
        dict(messages=user("Hi."), logprobs=True, top_logprobs=2, max_tokens=None),
        400,
        "top_logprobs needs max_completion_tokens",
        None,
    ),
    "tool_choice without tools": (dict(messages=user("Hi."), tool_choice="required"), 400, "needs tools", None),
    "a tool result without its call id": (
        dict(messages=[*user("Hi."), {"role": "tool", "content": "21"}]),
        400,
        "tool_call_id",
        None,
    ),
    "functions": (
        dict(messages=user("Hi."), extra_body={"functions": [{"name": "f"}]}),
        400,
        "functions",
        "unsupported_parameter",
    ),
    "temperature out of range": (dict(messages=user("Hi."), temperature=5.0), 400, "temperature", None),
    "top_p 0": (dict(messages=user("Hi."), top_p=0.0), 400, "top_p must be in (0, 1]", None),
    "max_completion_tokens 0": (
        dict(messages=user("Hi."), max_completion_tokens=0),
        400,
        "max_tokens must be at least 1",
        None,
    ),
    "no messages": (dict(messages=[]), 400, "messages", None),
    "unknown model": (dict(messages=user("Hi."), model="gpt-4o"), 404, "'gpt-4o' does not exist", "model_not_found"),
}


@pytest.mark.parametrize("case", BAD_REQUESTS, ids=list(BAD_REQUESTS))
def test_bad_requests_get_openai_errors_and_the_server_stays_ready(served, case):
    request, status, fragment, code = BAD_REQUESTS[case]
    client = served.client()
    for stream in (False, True):
        with pytest.raises(openai.APIStatusError) as raised:
            client.chat.completions.create(**{"model": "dense", "max_tokens": 8, "stream": stream, **request})
        assert raised.value.status_code == status
        error = error_body(raised.value)
        assert fragment in error["message"] and error["type"] == "invalid_request_error"
        assert error["code"] == code
        assert not re.search(r"\d+\.\d+\.\d+\.\d+|ensemble|qwen3vl", error["message"]), error  # nothing internal
    assert http_status(f"{served.url}/health") == 200
    assert client.chat.completions.create(model="dense", messages=user("Still here?"), max_tokens=4).choices


def test_models_and_health(served):
    (model,) = served.client().models.list()
    assert model.id == "dense" and 0 < time.time() - model.created < 3600  # when it was served
    assert http_status(f"{served.url}/health") == 200


def test_the_log_says_before_triton_that_its_gpu_errors_are_harmless_on_the_cpu_target(served):
    lines = served.log.read_text(errors="replace").splitlines()
    note = next(i for i, line in enumerate(lines) if CPU_TARGET_NOTE in line)
    assert all("CUDA driver" not in line and "NVML" not in line for line in lines[:note])


def test_routes_methods_and_bodies_it_does_not_take_get_openai_error_objects(served):
    def sent(method: str, path: str, body: bytes | None = None, content_type: str = "application/json"):
        request = urllib.request.Request(f"{served.url}{path}", body, {"Content-Type": content_type}, method=method)
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return response.status, response.headers, json.loads(response.read())
        except urllib.error.HTTPError as e:
            return e.code, e.headers, json.loads(e.read())

    status, _, body = sent("GET", "/v1/no-such-thing")
    assert (status, body["error"]["message"]) == (404, "Invalid URL (GET /v1/no-such-thing)")
    status, headers, body = sent("GET", "/v1/chat/completions")
    assert status == 405 and headers["Allow"] == "POST" and body["error"]["type"] == "invalid_request_error"
    chat = json.dumps({"model": "dense", "messages": user("Hi."), "max_tokens": 2}).encode()
    status, _, body = sent("POST", "/v1/chat/completions", chat, content_type="text/plain")
    assert status == 400 and "Content-Type: application/json" in body["error"]["message"], body
    status, _, body = sent("POST", "/v1/chat/completions", chat)
    assert status == 200 and "tool_calls" not in body["choices"][0]["message"]  # no call: absent, as OpenAI's


def test_a_client_leaving_mid_stream_cancels_its_request_on_the_server(served):
    client = served.client()
    # min_tokens keeps the request generating far longer than the test waits.
    stream = client.chat.completions.create(
        model="dense", messages=user("Go on."), max_tokens=1900, stream=True, extra_body={"min_tokens": 1800}
    )
    chunks = [next(stream), next(stream), next(stream)]
    stream.close()
    line = f"request '{chunks[0].id}' cancelled by its client"
    deadline = time.monotonic() + 30
    while line not in served.log.read_text(errors="replace"):
        assert time.monotonic() < deadline, f"the server log never said {line!r}"
        time.sleep(0.2)


def test_load_8_clients_20_requests_through_the_gateway(served):
    requests = [user("Describe.", jpeg(64, 64, seed=30)), user("Hi!"), user("Two.", *[jpeg(32, 64, seed=31)] * 2)]

    def ask(client, messages):
        return client.chat.completions.create(model="dense", messages=messages, max_tokens=4).choices[0].message.content

    expected = [ask(served.client(), m) for m in requests]

    def worker(w):
        client = served.client()
        return [(w, k) for k in range(20) if ask(client, requests[(w + k) % 3]) != expected[(w + k) % 3]]

    with ThreadPoolExecutor(8) as pool:
        failures = [f for fs in pool.map(worker, range(8)) for f in fs]
    assert failures == []


def test_triton_unreachable_is_503(served, tmp_path):
    port = free_port()
    dead = f"127.0.0.1:{free_port()}"
    args = ["openai", "--repo", str(served.repo), "--triton-url", dead, "--port", str(port)]
    args += ["--replica-ready-port", "0"]  # tritonserver's own readiness, over gRPC
    gateway = Gateway(args, port, tmp_path / "openai.log", ready_status=503, timeout_s=120)
    try:
        with pytest.raises(openai.APIStatusError) as raised:
            gateway.client().chat.completions.create(model="dense", messages=user("Hi."), max_tokens=4)
        assert raised.value.status_code == 503
        error = error_body(raised.value)
        assert error["type"] == "server_error" and "no replica is ready" in error["message"]
        assert dead not in error["message"]  # the address is the operator's: in the gateway's log
    finally:
        gateway.stop()
    assert dead in (tmp_path / "openai.log").read_text()


def test_the_gateway_alone_reads_the_deployment_from_the_server(served):
    port = free_port()
    args = ["openai", "--triton-url", served.grpc_url, "--port", str(port), "--served-model-name", "qwen3-vl"]
    args += ["--replica-ready-port", str(served.ready_port)]
    gateway = Gateway(args, port, served.log.parent / "openai-alone.log", timeout_s=120)
    try:
        alone = gateway.client().chat.completions.create(model="qwen3-vl", messages=user(PROMPT, PHOTO), max_tokens=8)
        beside = served.client().chat.completions.create(model="dense", messages=user(PROMPT, PHOTO), max_tokens=8)
        assert alone.choices[0].message.content == beside.choices[0].message.content
        assert alone.usage == beside.usage
    finally:
        gateway.stop()


def test_a_long_stream_has_the_text_ensembles_text_with_chunks_written_together_or_not(served):
    """The gateway decodes the tokens ensemble's ids itself (no python step per streamed token in the server) and
    writes a stream's chunks together at most every --stream-interval-ms: a long answer's chunks are the same with
    the default interval and with 0 (each as it comes), and their text is what the ensemble decoding in the server
    gives, streamed and whole, with the same usage and finish reason."""
    from qwen3vl_trt.serving.client import Client

    grpc = Client(served.grpc_url, timeout_s=120)
    try:
        expected = grpc.generate("Go on.", [], max_tokens=400, min_tokens=400)
    finally:
        grpc.close()
    assert len(expected.token_ids) == 400 and expected.text
    port = free_port()
    args = ["openai", "--triton-url", served.grpc_url, "--port", str(port), "--served-model-name", "dense"]
    args += ["--replica-ready-port", str(served.ready_port), "--stream-interval-ms", "0"]
    every_chunk = Gateway(args, port, served.log.parent / "openai-interval-0.log", timeout_s=120)
    try:
        streams = []
        for gateway in (served, every_chunk):
            chunks = list(
                gateway.client().chat.completions.create(
                    model="dense",
                    messages=user("Go on."),
                    max_tokens=400,
                    stream=True,
                    stream_options={"include_usage": True},
                    extra_body={"min_tokens": 400},
                )
            )
            streams.append(
                (
                    [c.choices[0].delta.content for c in chunks if c.choices],
                    [c.choices[0].finish_reason for c in chunks if c.choices],
                    chunks[-1].usage,
                )
            )
        assert streams[0] == streams[1]
        deltas, finish_reasons, usage = streams[0]
        assert "".join(d or "" for d in deltas) == expected.text
        assert len(deltas) > 100 and finish_reasons[-1] == "length" and usage.completion_tokens == 400
        whole = served.client().chat.completions.create(
            model="dense", messages=user("Go on."), max_tokens=400, extra_body={"min_tokens": 400}
        )
        assert whole.choices[0].message.content == expected.text and whole.usage == usage
    finally:
        every_chunk.stop()
