"""The gateway as a client of a fleet: two `serve` replicas of the CPU target on two loopback addresses, sharing
one redis-server (the visual-feature cache), behind `qwen3vl-trt openai` pointed at a DNS name that a real DNS
server (dnsmasq) resolves to both. Requests spread over both replicas (each replica's own Triton statistics
count them); one replica killed mid-load loses no request: those it had not answered are sent again to the
other, streams that had already sent text end with an error and are not sent again; restarted, it serves again.
"""

from __future__ import annotations

import base64
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
import tritonclient.grpc as grpcclient
from deployment import SERVE_SCRIPT, group_gone, http_status, port_flags, process_stacks
from images import jpeg
from qwen3vl_trt.qa.redis_server import RedisServer
from qwen3vl_trt.serving.interface import TOKENS_ENSEMBLE
from qwen3vl_trt.serving.ports import ServerPorts, free_ports

pytestmark = [pytest.mark.slow, pytest.mark.server]

NAME = "replicas.test"
V6_ONLY = "v6.replicas.test"
ADDRESSES = ("127.0.0.1", "127.0.0.2")
READY_S = 120.0  # two replicas loading side by side on two shared cores: 30-50 s
PHOTO = jpeg(96, 128, seed=7)
PROMPTS = ("Describe the image.", "What colour dominates?", "Count the shapes.")
LONG_TOKENS = 160  # a request long enough to be in flight when its replica is killed


def _free_udp_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Dnsmasq:
    """A real DNS server on loopback that answers `name` with every address given (as a Kubernetes headless
    Service answers with every ready pod)."""

    def __init__(self, workdir: Path, name: str, addresses: tuple[str, ...]):
        binary = shutil.which("dnsmasq") or "/usr/sbin/dnsmasq"
        if not os.access(binary, os.X_OK):
            pytest.fail("dnsmasq is not installed: apt-get install dnsmasq-base (scripts/bootstrap.sh does)")
        self.name = name
        self.hosts = workdir / "hosts"
        self.hosts.write_text(self._records(addresses))
        self.port = _free_udp_port()
        self.process = subprocess.Popen(
            [binary, "--keep-in-foreground", "--no-resolv", "--no-hosts", f"--addn-hosts={self.hosts}",
             "--local=/test/", "--bind-interfaces", "--listen-address=127.0.0.1", f"--port={self.port}",
             "--user=root", "--pid-file=", "--log-facility=-"],
            stdout=subprocess.DEVNULL, stderr=(workdir / "dnsmasq.log").open("w"),
        )  # fmt: skip

    def _records(self, addresses: tuple[str, ...]) -> str:
        # Each replica's name also has an IPv6 address, as a dual-stack Service's has; one that has only IPv6.
        return "".join(f"{address} {self.name}\n" for address in addresses) + f"::1 {self.name}\n::1 {V6_ONLY}\n"

    def answer(self, addresses: tuple[str, ...]) -> None:
        """From now on the name resolves to these addresses (dnsmasq reads its hosts files again on SIGHUP)."""
        self.hosts.write_text(self._records(addresses))
        self.process.send_signal(signal.SIGHUP)

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=10)


class Replica:
    """`qwen3vl-trt serve` of the repository on one loopback address, in its own process group."""

    def __init__(self, repo: Path, address: str, ports: ServerPorts, cache_url: str, log: Path):
        self.repo, self.address, self.ports, self.cache_url, self.log = repo, address, ports, cache_url, log
        self.url = f"{address}:{ports.grpc}"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> Replica:
        flags = ["--repo", str(self.repo), "--address", self.address, *port_flags(self.ports)]
        flags += ["--visual-cache", self.cache_url, "--stop-grace", "5"]
        with self.log.open("a") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-c", SERVE_SCRIPT, *flags], stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        return self

    def wait_ready(self) -> None:
        """Until its serve says ready (warmed up: GET /ready), as the gateway asks it. A replica still loading after
        READY_S is killed and started once more, as a pod's liveness probe and restart policy would (tritonserver
        2.51's python backend now and then leaves a stub hung in its initialization on this machine); its
        processes' stacks go to its log first, and a second stall fails with them."""
        for attempt in (1, 2):
            deadline = time.monotonic() + READY_S
            while http_status(f"http://{self.address}:{self.ports.ready}/ready") != 200:
                assert self.process is not None and self.process.poll() is None, self.log.read_text()[-3000:]
                if time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            else:
                return
            stacks = process_stacks(self.process.pid)
            with self.log.open("a") as log:
                log.write(f"\n[test] not ready in {READY_S:g} s; the group's stacks:\n{stacks}\n")
            assert attempt == 1, f"{self.url} not ready in {READY_S:g} s twice:\n{self.log.read_text()[-6000:]}"
            warnings.warn(f"{self.url} not ready in {READY_S:g} s; started once more. Stacks:\n{stacks}", stacklevel=2)
            self.kill()
            self.start()

    def served(self) -> int:
        """Requests the gateway's ensemble (the tokens one) completed since this replica started (Triton's stats)."""
        client = grpcclient.InferenceServerClient(self.url)
        try:
            (stats,) = client.get_inference_statistics(TOKENS_ENSEMBLE).model_stats
            return int(stats.inference_stats.success.count)
        finally:
            client.close()

    def kill(self) -> None:
        """SIGKILL to the whole replica (serve, tritonserver, its stubs), as a lost node or an OOM kill would."""
        assert self.process is not None
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        assert group_gone(self.process.pid, within=15.0)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


class Gateway:
    """`qwen3vl-trt openai` in front of the fleet, by the DNS name."""

    def __init__(self, triton_url: str, repo: Path, log: Path, ready_port: int):
        self.port = free_ports().http
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        command = [sys.executable, "-m", "qwen3vl_trt.cli", "openai", "--triton-url", triton_url, "--repo", str(repo),
                   "--port", str(self.port), "--triton-refresh", "1",
                   "--replica-ready-port", str(ready_port)]  # fmt: skip
        with log.open("w") as out:
            self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while not self._ready():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"the gateway did not become ready; its output:\n{log.read_text()[-3000:]}")
            time.sleep(0.3)

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=5) as response:
                return response.status == 200
        except OSError:
            return False

    def metrics(self) -> dict[str, float]:
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as response:
            text = response.read().decode()
        values = {}
        for line in text.splitlines():
            match = re.match(r"^(qwen3vl_gateway_(?:replica_requests|retries|replicas_ready)\S*) (\S+)$", line)
            if match:
                values[match[1]] = float(match[2])
        return values

    def sent_to(self, replica: Replica) -> float:
        return self.metrics().get(f'qwen3vl_gateway_replica_requests_total{{replica="{replica.url}"}}', 0.0)

    def retries(self) -> float:
        return self.metrics().get("qwen3vl_gateway_retries_total", 0.0)

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=300)

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


@dataclass
class Outcome:
    text: str | None  # None: failed
    error: str = ""
    streamed_text_before_error: str = ""


def _messages(prompt: str) -> list[dict]:
    photo = base64.b64encode(PHOTO).decode()
    return [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": f"data:image/jpeg;base64,{photo}"}},
        {"type": "text", "text": prompt},
    ]}]  # fmt: skip


def _served_since(replicas, before: list[int], total: int) -> list[int]:
    """Each replica's requests served since `before`, once they add up to `total` (or after 10 s): Triton counts a
    request's success when it releases the request, which may come after its last response reached the client."""
    deadline = time.monotonic() + 10
    while True:
        spread = [replica.served() - b for replica, b in zip(replicas, before, strict=True)]
        if sum(spread) >= total or time.monotonic() > deadline:
            return spread
        time.sleep(0.1)


def _ask(gateway: Gateway, prompt: str, max_tokens: int, stream: bool = False) -> Outcome:
    client = gateway.client()
    try:
        if not stream:
            answer = client.chat.completions.create(
                model="dense", messages=_messages(prompt), max_tokens=max_tokens, temperature=0
            )
            return Outcome(answer.choices[0].message.content)
        text = ""
        try:
            for chunk in client.chat.completions.create(
                model="dense", messages=_messages(prompt), max_tokens=max_tokens, temperature=0, stream=True
            ):
                if chunk.choices and chunk.choices[0].delta.content:
                    text += chunk.choices[0].delta.content
        except openai.APIError as e:
            return Outcome(None, str(e), text)
        return Outcome(text)
    except openai.APIError as e:
        return Outcome(None, str(e))
    finally:
        client.close()


@dataclass
class Fleet:
    replicas: list[Replica]
    gateway: Gateway
    redis: RedisServer
    dns: Dnsmasq


@pytest.fixture(scope="module")
def fleet(cpu_repository, tmp_path_factory):
    root = tmp_path_factory.mktemp("fleet")
    repo = cpu_repository
    redis = RedisServer(root / "redis").start()
    dns = Dnsmasq(root, NAME, ADDRESSES)
    ports = free_ports()
    replicas = [Replica(repo, a, ports, redis.url, root / f"replica-{a}.log").start() for a in ADDRESSES]
    gateway = None
    try:
        for replica in replicas:
            replica.wait_ready()
        gateway = Gateway(f"dns://127.0.0.1:{dns.port}/{NAME}:{ports.grpc}", repo, root / "gateway.log", ports.ready)
        yield Fleet(replicas, gateway, redis, dns)
    finally:
        if gateway is not None:
            gateway.stop()
        for replica in replicas:
            replica.stop()
        dns.stop()
        redis.stop()


def _report(capsys, lines: list[str]) -> None:
    with capsys.disabled():
        print("\n" + "\n".join(f"  fleet: {line}" for line in lines))


def test_requests_spread_over_replicas_and_survive_one_killed(fleet, capsys):
    (first, second), gateway, redis = fleet.replicas, fleet.gateway, fleet.redis
    assert gateway.metrics()["qwen3vl_gateway_replicas_ready"] == 2
    expected = {prompt: _ask(gateway, prompt, 24).text for prompt in PROMPTS}
    expected_long = _ask(gateway, PROMPTS[0], LONG_TOKENS).text
    assert all(expected.values()) and expected_long

    # Spread: twelve requests at once, round robin over both replicas, each replica's answers the same.
    before, retries = [first.served(), second.served()], gateway.retries()
    with ThreadPoolExecutor(12) as pool:
        outcomes = list(pool.map(lambda i: _ask(gateway, PROMPTS[i % 3], 24), range(12)))
    assert [o.text for o in outcomes] == [expected[PROMPTS[i % 3]] for i in range(12)]
    # The twelve, and any the gateway sent again to the other replica (one whose replica seemed gone on this busy
    # machine, which may have answered it too): its retries count them.
    resent = int(gateway.retries() - retries)
    spread = _served_since((first, second), before, 12 + resent)
    assert 12 <= sum(spread) <= 12 + resent and min(spread) >= 4, (spread, resent)
    cached = len(list(redis.client().scan_iter(match="qwen3vl:features:*")))
    assert cached == 1, "the replicas share one visual-feature cache: one image, one entry"
    lines = [f"spread: 12 requests -> {first.url}: {spread[0]}, {second.url}: {spread[1]} (Triton statistics)"]

    # Kill: 16 requests (12 whole answers, 4 streamed), one replica SIGKILLed once it holds some of them.
    retries_before, sent_before, served_before = gateway.retries(), gateway.sent_to(first), first.served()
    with ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(_ask, gateway, PROMPTS[0], LONG_TOKENS, i >= 12) for i in range(16)]
        deadline = time.monotonic() + 60
        while gateway.sent_to(first) - sent_before < 4:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(0.3)  # generating
        finished_on_first = first.served() - served_before
        sent_to_first = gateway.sent_to(first) - sent_before
        first.kill()
        outcomes = [f.result() for f in futures]
    whole, streamed = outcomes[:12], outcomes[12:]
    assert [o.text for o in whole] == [expected_long] * 12, [o.error for o in whole if o.text is None]
    cut = [o for o in streamed if o.text is None]
    assert all(o.text == expected_long for o in streamed if o.text is not None)
    # A stream that had sent text when its replica died ends with an error and is not sent again.
    assert all(o.streamed_text_before_error and expected_long.startswith(o.streamed_text_before_error) for o in cut)
    retries = gateway.retries() - retries_before
    assert retries >= 1, "no request was in flight on the killed replica"
    log = gateway.log.read_text()
    assert f"replica {first.url}" in log and "taken out of the rotation" in log
    lines.append(
        f"kill: {first.url} SIGKILLed holding {sent_to_first - finished_on_first:g} of the 16 requests (12 whole "
        f"answers, 4 streamed); {12 + len(streamed) - len(cut)} completed, {retries:g} of them retried on "
        f"{second.url}; streams cut after sending text (never sent again): {len(cut)}; none unanswered"
    )

    # Back: the killed replica, started again, is in the rotation and serves.
    first.start().wait_ready()
    _wait_for(lambda: gateway.metrics()["qwen3vl_gateway_replicas_ready"] == 2, "the restarted replica's return")
    before = [first.served(), second.served()]
    with ThreadPoolExecutor(8) as pool:
        outcomes = list(pool.map(lambda i: _ask(gateway, PROMPTS[i % 3], 24), range(8)))
    assert [o.text for o in outcomes] == [expected[PROMPTS[i % 3]] for i in range(8)]
    spread = _served_since((first, second), before, 8)
    assert sum(spread) == 8 and spread[0] >= 2, spread
    lines.append(f"back: {first.url} restarted; 8 requests -> {first.url}: {spread[0]}, {second.url}: {spread[1]}")
    _report(capsys, lines)


def test_the_gateway_follows_the_name_as_replicas_come_and_go(fleet, capsys):
    """Scaled in, then out again: the name's addresses change in DNS (as a headless Service's do), and the
    gateway, resolving it every second here (--triton-refresh 1), sends requests only where it points."""
    (first, second), gateway = fleet.replicas, fleet.gateway
    try:
        fleet.dns.answer((second.address,))
        _wait_for(lambda: gateway.metrics()["qwen3vl_gateway_replicas_ready"] == 1, "the gateway to drop a replica")
        before = [first.served(), second.served()]
        with ThreadPoolExecutor(4) as pool:
            assert all(o.text for o in pool.map(lambda i: _ask(gateway, PROMPTS[i % 3], 8), range(4)))
        assert _served_since((first, second), before, 4) == [0, 4]
    finally:
        fleet.dns.answer(ADDRESSES)
    _wait_for(lambda: gateway.metrics()["qwen3vl_gateway_replicas_ready"] == 2, "the gateway to find the replica")
    before = [first.served(), second.served()]
    with ThreadPoolExecutor(4) as pool:
        assert all(o.text for o in pool.map(lambda i: _ask(gateway, PROMPTS[i % 3], 8), range(4)))
    assert _served_since((first, second), before, 4) == [2, 2]
    log = gateway.log.read_text()
    assert f"replica {first.url} no longer resolved" in log and f"replica {first.url} found" in log
    _report(capsys, [f"DNS: {first.url} left the name, then came back: 4 requests -> 0/4, then 2/2"])


def _wait_for(condition, what: str, within: float = 30.0) -> None:
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, f"waited {within:g} s for {what}"
        time.sleep(0.2)


def test_names_addresses_and_lists_resolve(fleet):
    from qwen3vl_trt.serving.targets import FleetTarget, FleetTargetError

    first, second = fleet.replicas
    port, dns_port = first.ports.grpc, fleet.dns.port
    # IPv4 where a name has any: a dual-stack replica is one replica.
    assert FleetTarget.parse(f"dns://127.0.0.1:{dns_port}/{NAME}:{port}").resolve() == [first.url, second.url]
    assert FleetTarget.parse(f"dns://127.0.0.1:{dns_port}/{V6_ONLY}:{port}").resolve() == [f"[::1]:{port}"]
    assert FleetTarget.parse(f"{second.url},{first.url},{first.url}").resolve() == [first.url, second.url]
    assert FleetTarget.parse(f"dns://127.0.0.1:{dns_port}/nothing.test:{port}").resolve() == []
    assert FleetTarget.parse("[::1]:8001").resolve() == ["[::1]:8001"]
    assert FleetTarget.parse("localhost:9").resolve()  # the system resolver (/etc/hosts)
    assert FleetTarget.parse("dns://[fd00::10]/name.:8001").nameserver.port == 53  # DNS's port by default
    for bad in ("", "host:notaport", "dns://dns.example/name:8001", "dns:/"):
        with pytest.raises(FleetTargetError):
            FleetTarget.parse(bad)
    assert [str(e) for e in FleetTarget.parse("a:1,b").endpoints] == ["a:1", "b:8001"]  # Triton's gRPC port
