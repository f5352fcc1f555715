"""The Batch API on the CPU deployment, through the official `openai` client: a JSONL of 200+ lines (text, images
repeated across lines, a tool call, a json_schema, invalid lines) completes, every valid line's answer equals the same
request sent interactively (greedy), invalid lines are in the error file with their custom_ids, the counts add up;
cancel and a completion window that ends behave as OpenAI documents; another key's files and batches are 404; hostile
uploads (a 1 GB Content-Length, a file that is not JSONL, duplicate custom_ids) are refused."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from deployment import Gateway, build_cpu_repository, data_url, error_body, port_flags
from images import jpeg
from qwen3vl_trt.qa.ports import free_port
from qwen3vl_trt.qa.redis_server import RedisServer
from qwen3vl_trt.serving.ports import free_ports

pytestmark = [pytest.mark.slow, pytest.mark.server]

KEYS = ("sk-batch-owner-7Qx2", "sk-batch-other-9Lm4")
MODEL = "dense"
PHOTOS = [jpeg(64, 64 + 16 * k, seed=20 + k) for k in range(3)]
WEATHER = {
    "name": "get_weather",
    "description": "Current weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "count": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["name", "count"],
    "additionalProperties": False,
}


class Deployment:
    def __init__(self, gateway: Gateway, redis: RedisServer, root: Path):
        self.gateway, self.redis, self.root = gateway, redis, root

    def client(self, key: str = KEYS[0]) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.gateway.url}/v1", api_key=key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def deployment(checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("batch")
    repo = build_cpu_repository(checkpoints["dense"], root)
    keys = root / "keys"
    keys.write_text("\n".join(KEYS) + "\n")
    with RedisServer(root / "redis", policy="noeviction", appendonly=True) as redis:
        ports, port = free_ports(), free_port()
        args = ["serve", "--repo", str(repo), "--openai-port", str(port), *port_flags(ports)]
        args += ["--api-key-file", str(keys), "--served-model-name", MODEL]
        args += ["--batch-redis", redis.url, "--batch-dir", str(root / "files")]
        gateway = Gateway(args, port, root / "serve.log", ready_status=200)
        try:
            yield Deployment(gateway, redis, root)
        finally:
            gateway.stop()


def _chat(text: str, *images: bytes, max_tokens: int = 6, **extra: Any) -> dict[str, Any]:
    parts: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": data_url(i)}} for i in images]
    content: Any = [*parts, {"type": "text", "text": text}] if images else text
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, **extra}  # fmt: skip


def _line(custom_id: str, body: dict[str, Any], url: str = "/v1/chat/completions") -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def _jsonl(lines: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def _requests() -> tuple[list[dict[str, Any]], set[str]]:
    """200 valid lines (text, three photos each on many lines, a tool call, a json_schema) and invalid ones."""
    lines = []
    for k in range(200):
        if k % 4 == 0:
            body = _chat(f"Describe picture {k}.", PHOTOS[k % 3])
        elif k == 1:
            # One call: with parallel calls allowed, the random model may go on calling until max_tokens.
            body = _chat("Weather in Paris?", tools=[{"type": "function", "function": WEATHER}], tool_choice="required",
                         parallel_tool_calls=False, max_tokens=160)  # fmt: skip
        elif k == 2:
            schema = {"type": "json_schema", "json_schema": {"name": "item", "schema": SCHEMA, "strict": True}}
            body = _chat("Name a thing and a count.", response_format=schema, max_tokens=160)
        else:
            body = _chat(f"Say something about the number {k}.")
        lines.append(_line(f"request-{k}", body))
    invalid = {
        "wrong-endpoint": _line("wrong-endpoint", _chat("Hi."), url="/v1/completions"),
        "bad-image": _line("bad-image", _chat("What is it?", b"not a picture")),
        "messages-not-a-list": _line("messages-not-a-list", {"model": MODEL, "messages": "Hi."}),
        "too-many-tokens": _line("too-many-tokens", _chat("Hi.", max_tokens=10**7)),
        "streamed": _line("streamed", _chat("Hi.", stream=True)),
        "two-choices": _line("two-choices", _chat("Hi.", n=2)),
    }
    for n, line in enumerate(invalid.values()):
        lines.insert(17 + 31 * n, line)
    return lines, set(invalid)


def _await_end(client: openai.OpenAI, batch_id: str, timeout_s: float = 600) -> Any:
    deadline = time.monotonic() + timeout_s
    while (batch := client.batches.retrieve(batch_id)).status not in ("completed", "failed", "expired", "cancelled"):
        assert time.monotonic() < deadline, batch
        time.sleep(0.5)
    return batch


def _content(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


def _auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[0]}"}


def _metrics(deployment: Deployment) -> dict[str, float]:
    headers = {"Authorization": f"Bearer {KEYS[0]}"}
    request = urllib.request.Request(f"{deployment.gateway.url}/metrics", headers=headers)
    with urllib.request.urlopen(request, timeout=10) as response:
        text = response.read().decode()
    return {name: float(value) for name, _, value in
            (line.rpartition(" ") for line in text.splitlines() if line and not line.startswith("#"))}  # fmt: skip


def _answer(body: dict[str, Any]) -> tuple[Any, ...]:
    """What a greedy answer must repeat: each choice's message (content and tool calls, not their random ids) and its
    finish reason, and the usage."""
    choices = tuple(
        (c["message"].get("content"), [(t["function"]["name"], t["function"]["arguments"])
                                       for t in c["message"].get("tool_calls") or ()], c["finish_reason"])
        for c in body["choices"]
    )  # fmt: skip
    return choices, body["usage"]["prompt_tokens"], body["usage"]["completion_tokens"]


def test_a_batch_answers_every_line_as_the_interactive_api_does(deployment):
    client = deployment.client()
    lines, invalid = _requests()
    uploaded = client.files.create(file=("requests.jsonl", _jsonl(lines)), purpose="batch")
    assert (uploaded.purpose, uploaded.bytes, uploaded.filename) == ("batch", len(_jsonl(lines)), "requests.jsonl")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h", metadata={"job": "catalogue"})  # fmt: skip
    assert batch.status == "validating" and batch.metadata == {"job": "catalogue"}
    batch = _await_end(client, batch.id)
    assert batch.status == "completed" and batch.completed_at and batch.in_progress_at
    counts = batch.request_counts
    assert (counts.total, counts.completed, counts.failed) == (len(lines), len(lines) - len(invalid), len(invalid))

    outputs, errors = _content(client, batch.output_file_id), _content(client, batch.error_file_id)
    order = [line["custom_id"] for line in lines]
    # Each custom_id once, in the input's order.
    assert [o["custom_id"] for o in outputs] == [c for c in order if c not in invalid]
    assert [e["custom_id"] for e in errors] == [c for c in order if c in invalid]
    assert all(o["response"]["status_code"] == 200 and o["error"] is None for o in outputs)
    assert all(e["error"] is not None and e["response"] is None for e in errors)

    # This gateway ran them all (its runners' metrics), and nothing of the batch is left queued.
    metrics = _metrics(deployment)
    assert metrics['qwen3vl_gateway_batch_lines_total{outcome="completed"}'] == len(lines) - len(invalid)
    assert metrics["qwen3vl_gateway_batch_lines_running"] == 0

    # Every valid line as the same request sent interactively.
    bodies = {line["custom_id"]: line["body"] for line in lines}
    with ThreadPoolExecutor(4) as pool:
        interactive = list(pool.map(lambda o: client.chat.completions.create(**bodies[o["custom_id"]]), outputs))
    for output, answer in zip(outputs, interactive, strict=True):
        assert _answer(output["response"]["body"]) == _answer(answer.model_dump()), output["custom_id"]
    tool = next(o for o in outputs if o["custom_id"] == "request-1")["response"]["body"]["choices"][0]
    assert tool["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert tool["message"]["content"] is None  # the body as the interactive API sends it, nulls included
    typed = next(o for o in outputs if o["custom_id"] == "request-2")["response"]["body"]["choices"][0]
    assert set(json.loads(typed["message"]["content"])) == {"name", "count"}

    # The files and the batch are the key's own: another key's client sees none of them.
    other = deployment.client(KEYS[1])
    for call in (lambda: other.batches.retrieve(batch.id), lambda: other.files.retrieve(uploaded.id),
                 lambda: other.files.content(batch.output_file_id)):  # fmt: skip
        with pytest.raises(openai.NotFoundError):
            call()
    assert batch.id not in [b.id for b in other.batches.list().data]
    assert batch.id in [b.id for b in client.batches.list().data]
    with pytest.raises(openai.ConflictError):  # a batch that completed cannot be cancelled
        client.batches.cancel(batch.id)


def test_cancel_and_an_ended_window_keep_what_finished_and_report_the_rest(deployment):
    client = deployment.client()
    lines = [_line(f"long-{k}", _chat(f"Count from {k}.", max_tokens=48)) for k in range(40)]
    uploaded = client.files.create(file=("long.jsonl", _jsonl(lines)), purpose="batch")

    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    deadline = time.monotonic() + 120
    while client.batches.retrieve(batch.id).request_counts.completed < 2:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    with pytest.raises(openai.ConflictError):  # the input of a batch that has not ended stays
        client.files.delete(uploaded.id)
    assert client.batches.cancel(batch.id).status in ("cancelling", "cancelled")
    batch = _await_end(client, batch.id)
    assert batch.status == "cancelled" and batch.cancelled_at and batch.cancelling_at
    _ends_with_what_finished(client, batch, lines, "batch_cancelled")
    assert client.batches.cancel(batch.id).status == "cancelled"  # again: as it is

    # A window that ends before the work does (several times more of it than the window).
    many = [_line(f"more-{k}", _chat(f"Count from {k}.", max_tokens=48)) for k in range(160)]
    uploaded = client.files.create(file=("many.jsonl", _jsonl(many)), purpose="batch")
    window = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                   completion_window="2s")  # fmt: skip
    window = _await_end(client, window.id)
    assert window.status == "expired" and window.expired_at
    _ends_with_what_finished(client, window, many, "batch_expired")


def _ends_with_what_finished(client: openai.OpenAI, batch: Any, lines: list[dict[str, Any]], code: str) -> None:
    outputs, errors = _content(client, batch.output_file_id), _content(client, batch.error_file_id)
    counts = batch.request_counts
    assert len(outputs) == counts.completed and counts.failed == 0 and counts.total == len(lines)
    # Every custom_id once: what finished in the output, the rest in the error file with the reason.
    assert sorted(o["custom_id"] for o in outputs + errors) == sorted(line["custom_id"] for line in lines)
    assert errors and all(e["error"]["code"] == code for e in errors)


def test_a_batch_whose_input_file_is_lost_fails_saying_so(deployment):
    client = deployment.client()
    lines = [_line(f"lost-{k}", _chat(f"Count from {k}.", max_tokens=48)) for k in range(40)]
    uploaded = client.files.create(file=("lost.jsonl", _jsonl(lines)), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    (deployment.root / "files" / "files" / uploaded.id).unlink()  # the storage lost it
    batch = _await_end(client, batch.id, timeout_s=120)
    assert batch.status == "failed" and batch.failed_at and batch.errors.data[0].code == "invalid_file"


def test_hostile_inputs_are_refused(deployment):
    client = deployment.client()
    # A 1 GB upload: refused from its Content-Length, before any of the body is sent.
    host, port = deployment.gateway.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as conn:
        conn.sendall(
            f"POST /v1/files HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEYS[0]}\r\n"
            f"Content-Type: multipart/form-data; boundary=x\r\nContent-Length: {2**30}\r\n\r\n".encode()
        )
        status = conn.recv(4096).split(b"\r\n", 1)[0]
    assert b" 413 " in status, status
    # Not JSONL.
    with pytest.raises(openai.BadRequestError) as refused:
        client.files.create(file=("notes.jsonl", b'{"custom_id": "a"}\nthis is not json\n'), purpose="batch")
    assert "line 2 is not a JSON object" in error_body(refused.value)["message"]
    # Duplicate custom_ids: the batch is refused.
    twice = _jsonl([_line("same", _chat("Hi.")), _line("same", _chat("Hello."))])
    uploaded = client.files.create(file=("twice.jsonl", twice), purpose="batch")
    with pytest.raises(openai.BadRequestError) as refused:
        client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert error_body(refused.value)["code"] == "duplicate_custom_id"
    # Two files in one form; a body that is not multipart.
    two = [("file", ("a.jsonl", twice)), ("file", ("b.jsonl", twice)), ("purpose", (None, "batch"))]
    answer = httpx.post(f"{deployment.gateway.url}/v1/files", files=two, headers=_auth(), timeout=30)
    assert answer.status_code == 400 and "more than one file" in answer.json()["error"]["message"]
    answer = httpx.post(f"{deployment.gateway.url}/v1/files", content=b"--x\r\nnonsense", timeout=30,
                        headers={**_auth(), "Content-Type": "multipart/form-data; boundary=x"})  # fmt: skip
    assert answer.status_code == 400, answer.text
    # Another endpoint than the API's, another purpose.
    with pytest.raises(openai.BadRequestError):
        client.batches.create(input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h")
    with pytest.raises(openai.BadRequestError):
        client.files.create(file=("x.jsonl", twice), purpose="fine-tune")


def test_the_batch_command_submits_watches_and_fetches(deployment, tmp_path):
    """`qwen3vl-trt batch submit --wait` for people who do not write code: a progress bar, then the files."""
    lines = [_line(f"cli-{k}", _chat(f"Name colour {k}.")) for k in range(6)] + [
        _line("cli-bad", _chat("Hi."), url="/v1/completions")
    ]
    requests, output, key = tmp_path / "requests.jsonl", tmp_path / "answers.jsonl", tmp_path / "key"
    requests.write_bytes(_jsonl(lines))
    key.write_text(KEYS[0] + "\n")
    common = ["--url", deployment.gateway.url, "--api-key-file", str(key)]
    run = subprocess.run(
        [sys.executable, "-m", "qwen3vl_trt.cli", "batch", "submit", str(requests), *common, "--wait",
         "--output", str(output)], capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "completed, 6 completed, 1 failed of 7" in run.stdout and "request" in run.stderr  # the bar
    assert [json.loads(line)["custom_id"] for line in output.read_text().splitlines()] == [f"cli-{k}" for k in range(6)]
    errors = output.with_suffix(".errors.jsonl")
    assert [json.loads(line)["custom_id"] for line in errors.read_text().splitlines()] == ["cli-bad"]
    batch_id = run.stdout.split()[1].rstrip(":")
    refetched = tmp_path / "again.jsonl"
    run = subprocess.run([sys.executable, "-m", "qwen3vl_trt.cli", "batch", "fetch", batch_id, *common, "--output",
                          str(refetched)], capture_output=True, text=True, timeout=60)  # fmt: skip
    assert run.returncode == 0 and refetched.read_bytes() == output.read_bytes(), run.stderr
    run = subprocess.run([sys.executable, "-m", "qwen3vl_trt.cli", "batch", "watch", batch_id, "--url",
                          deployment.gateway.url], capture_output=True, text=True, timeout=60)  # fmt: skip
    assert run.returncode != 0 and "401: no API key" in run.stderr  # no key: refused, said so
