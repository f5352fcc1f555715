"""The Batch API's guarantees under faults, on real processes (one tritonserver of the CPU target, gateways started
with `qwen3vl-trt openai`, a redis-server with its append-only file): the gateway holding the work SIGKILLed
mid-batch and another started; the batch Redis killed and started again from its append-only file; two gateways
working one batch. In every case each custom_id is in the output exactly once and none is lost."""

from __future__ import annotations

import json
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest
from deployment import Gateway, build_cpu_repository
from qwen3vl_trt.qa.ports import free_port
from qwen3vl_trt.qa.redis_server import RedisServer
from qwen3vl_trt.serving.ports import free_ports
from qwen3vl_trt.serving.server.tritonserver import TritonServer

pytestmark = [pytest.mark.slow, pytest.mark.server]

CLAIM_S = 3  # a dead gateway's lines are another's after this long
LINES = 96


@dataclass
class Deployment:
    root: Path
    repo: Path
    server: TritonServer
    redis: RedisServer

    def gateway(self, name: str) -> Gateway:
        port = free_port()
        args = ["openai", "--triton-url", self.server.url, "--repo", str(self.repo), "--port", str(port)]
        args += ["--served-model-name", "dense", "--batch-redis", self.redis.url]
        args += ["--batch-dir", str(self.root / "files"), "--batch-claim-s", str(CLAIM_S), "--replica-ready-port", "0"]
        return Gateway(args, port, self.root / f"{name}.log")


@pytest.fixture(scope="module")
def deployment(checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("batch-faults")
    repo = build_cpu_repository(checkpoints["dense"], root)
    with RedisServer(root / "redis", policy="noeviction", appendonly=True) as redis:
        server = TritonServer(repo, free_ports(), log_path=root / "triton.log")
        with server:
            yield Deployment(root, repo, server, redis)


def _client(gateway: Gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=2, timeout=120)


def _submit(client: openai.OpenAI, tag: str) -> tuple[str, list[str]]:
    ids = [f"{tag}-{k}" for k in range(LINES)]
    body = lambda k: {"model": "dense", "messages": [{"role": "user", "content": f"Count from {k}."}],  # noqa: E731
                      "max_tokens": 24, "temperature": 0}  # fmt: skip
    lines = "".join(json.dumps({"custom_id": c, "method": "POST", "url": "/v1/chat/completions", "body": body(k)})
                    + "\n" for k, c in enumerate(ids))  # fmt: skip
    uploaded = client.files.create(file=(f"{tag}.jsonl", lines.encode()), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    return batch.id, ids


def _progress(client: openai.OpenAI, batch_id: str, at_least: int, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while client.batches.retrieve(batch_id).request_counts.completed < at_least:
        assert time.monotonic() < deadline, f"fewer than {at_least} lines done in {timeout_s:g} s"
        time.sleep(0.1)


def _exactly_once(client: openai.OpenAI, batch_id: str, ids: list[str], timeout_s: float = 300) -> Any:
    deadline = time.monotonic() + timeout_s
    while (batch := client.batches.retrieve(batch_id)).status != "completed":
        assert batch.status in ("validating", "in_progress", "finalizing"), batch
        assert time.monotonic() < deadline, batch
        time.sleep(0.5)
    outputs = [json.loads(line) for line in client.files.content(batch.output_file_id).text.splitlines()]
    assert [o["custom_id"] for o in outputs] == ids  # each once, none lost, in the input's order
    assert batch.error_file_id is None and batch.request_counts.completed == len(ids)
    return batch


def _completed(deployment: Deployment, batch_id: str) -> int:
    """The batch's lines recorded as completed, as the batch Redis holds them."""
    client = deployment.redis.client()
    try:
        return int(client.hget(f"qwen3vl:batch:batch:{batch_id}", "completed") or 0)
    finally:
        client.close()


def _ran(gateway: Gateway) -> float:
    with urllib.request.urlopen(f"{gateway.url}/metrics", timeout=10) as response:
        text = response.read().decode()
    return sum(float(line.rpartition(" ")[2]) for line in text.splitlines()
               if line.startswith('qwen3vl_gateway_batch_lines_total{outcome="completed"}'))  # fmt: skip


def test_a_gateway_killed_mid_batch_and_another_started(deployment):
    first = deployment.gateway("first")
    try:
        client = _client(first)
        batch_id, ids = _submit(client, "killed")
        _progress(client, batch_id, 8)
        first.process.kill()  # SIGKILL: its runners' lines are held by no one now
        first.process.wait(30)
        assert _completed(deployment, batch_id) < LINES  # work was left
    finally:
        first.stop()
    second = deployment.gateway("second")
    try:
        _exactly_once(_client(second), batch_id, ids)
    finally:
        second.stop()


def test_the_batch_redis_killed_and_started_again_from_its_append_only_file(deployment):
    gateway = deployment.gateway("redis-restart")
    try:
        client = _client(gateway)
        batch_id, ids = _submit(client, "restarted")
        _progress(client, batch_id, 8)
        deployment.redis.kill()
        time.sleep(1.0)  # the runners meet a Redis that is gone
        deployment.redis.start()
        assert _completed(deployment, batch_id) < LINES  # from its append-only file, with work left
        _exactly_once(client, batch_id, ids)
    finally:
        gateway.stop()


def test_two_gateways_work_one_batch(deployment):
    gateways = [deployment.gateway("one"), deployment.gateway("two")]
    try:
        before = [_ran(g) for g in gateways]
        client = _client(gateways[0])
        batch_id, ids = _submit(client, "shared")
        _exactly_once(client, batch_id, ids)
        ran = [_ran(g) - b for g, b in zip(gateways, before, strict=True)]
        assert sum(ran) >= len(ids) and min(ran) > 0, ran  # both took lines; a line run twice is recorded once
    finally:
        for gateway in gateways:
            gateway.stop()
