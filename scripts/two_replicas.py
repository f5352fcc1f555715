#!/usr/bin/env python3
"""Two `serve` replicas of one repository on one host, sharing a redis-server (the visual cache), stopped
together: the scenario repeated --rounds times on real tritonservers (the CPU target of a tiny checkpoint).

Each round starts a redis-server and two `qwen3vl-trt serve --visual-cache redis://...` on the same repository
(ports of their own), sends requests with images to both (the same photos, so the second replica hits what the
first stored), stops Redis, sends more, then SIGTERM to each serve's process group at once. Throughout, a watcher
per replica asks the server's readiness and every model's inference statistics. A round passes when:
- every request is answered (with Redis gone too: the cache is an optimisation);
- no model is reported unavailable while its server says ready, and no stage is reloaded (nothing crashed);
- each serve exits within its --stop-grace (plus STOP_SLACK_S), and nothing of either process group is left, nor
  any of their python stubs' shared memory.
One line per round (the stop times), a summary; exit status 1 if any round failed.

    .venv/bin/python scripts/two_replicas.py [--rounds 10] [--stop-grace 10] [--requests 4] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import tritonclient.grpc as grpcclient
from qwen3vl_trt.common.limits import EngineLimits
from qwen3vl_trt.pipeline.build import BuildOptions, build
from qwen3vl_trt.qa.redis_server import RedisServer
from qwen3vl_trt.qa.tiny import make_tiny_checkpoint, synthetic_jpeg
from qwen3vl_trt.serving.client import Client
from qwen3vl_trt.serving.ports import ServerPorts, free_ports
from qwen3vl_trt.serving.server.launch import repository_models
from qwen3vl_trt.serving.server.tritonserver import SHM_DIR, process_shm_prefix

LIMITS = EngineLimits(
    max_batch_size=8, max_input_len=1024, max_seq_len=2048, max_num_tokens=2048, max_visual_tokens=1024
)
READY_S = 240.0  # two replicas loading side by side on two shared cores
STOP_SLACK_S = 5.0  # serve's own work around the grace: signalling, reaping, closing its clients
LEFT_S = 5.0  # for killed processes to leave /proc
WATCH_S = 0.25
PROMPT = "Describe the image."
MAX_TOKENS = 4
# The supervisor's line when it takes a stage for crashed (build/serving/server/supervisor.py).
READY_LINE = "ready: gRPC"  # what serve prints once every model is loaded with its overrides
RELOAD = re.compile(r"stage '(\w+)' .*: unloading and loading it again")


def _quiet(*_args: object, **_kwargs: object) -> None:
    pass


def repository(work: Path) -> Path:
    """The CPU target of a tiny checkpoint, built under `work` (reused when present)."""
    repo = work / "build" / "triton_repo"
    if not repo.is_dir():
        model = make_tiny_checkpoint(work / "ckpt")
        build(model, work / "build", BuildOptions(llm_dtype="fp32", limits=LIMITS), target="cpu", log=_quiet)
    return repo


@dataclass
class Replica:
    """One `qwen3vl-trt serve`, in a process group of its own (as a process manager starts it)."""

    name: str
    repo: Path
    ports: ServerPorts
    cache_url: str
    stop_grace: float
    log: Path
    process: subprocess.Popen[bytes] | None = None
    tree: set[int] = field(default_factory=set)  # the process groups of serve and of the server under it

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.ports.grpc}"

    def start(self) -> None:
        command = [sys.executable, "-m", "qwen3vl_trt.cli", "serve", "--repo", str(self.repo),
                   "--grpc-port", str(self.ports.grpc), "--http-port", str(self.ports.http),
                   "--metrics-port", str(self.ports.metrics), "--ready-port", str(self.ports.ready),
                   "--visual-cache", self.cache_url,
                   "--stop-grace", f"{self.stop_grace:g}"]  # fmt: skip
        with self.log.open("wb") as out:
            self.process = subprocess.Popen(
                command, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )

    def wait_ready(self, deadline: float) -> None:
        assert self.process is not None
        while READY_LINE not in self.log.read_text(errors="replace"):  # serve's own word: overrides loaded too
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited before it was ready: {self._tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} was not ready in {READY_S:g} s: {self._tail()}")
            time.sleep(0.5)
        # serve's group, and the guard's below it that holds tritonserver and its stubs.
        self.tree = {self.process.pid, *(os.getpgid(p.pid) for p in _descendants(self.process.pid))}

    def _tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]

    def left(self) -> list[str]:
        """What of this replica's process groups still runs, after up to LEFT_S for killed ones to go, and the
        python-backend shared memory its servers left."""
        assert self.process is not None
        deadline = time.monotonic() + LEFT_S
        while True:
            alive = [f"{p.name()} (pid {p.pid})" for p in _group_members(self.tree)]
            if not alive or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        return alive + [f"/dev/shm/{p.name}" for p in SHM_DIR.glob(f"{process_shm_prefix(self.process.pid)}*")]

    def reloads(self) -> list[str]:
        return RELOAD.findall(self.log.read_text(errors="replace"))

    def kill(self) -> None:
        for group in self.tree or ({self.process.pid} if self.process else set()):
            try:
                os.killpg(group, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.process is not None:
            self.process.wait()


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _group_members(groups: set[int]) -> list[psutil.Process]:
    members = []
    for process in psutil.process_iter():
        try:
            if os.getpgid(process.pid) in groups and process.status() != psutil.STATUS_ZOMBIE:
                members.append(process)
        except (ProcessLookupError, psutil.NoSuchProcess):
            pass
    return members


class Watcher(threading.Thread):
    """Asks a replica's readiness and every model's inference statistics until stopped; records each model that
    the server called unavailable between two answers that it was ready."""

    def __init__(self, replica: Replica, models: list[str]):
        super().__init__(name=f"watch-{replica.name}", daemon=True)
        self.replica, self.models = replica, models
        self.unavailable: list[str] = []
        self.looks = 0
        self._stopping = threading.Event()

    def run(self) -> None:
        client = grpcclient.InferenceServerClient(self.replica.url)
        try:
            while not self._stopping.wait(WATCH_S):
                missing = []
                try:
                    ready = client.is_server_ready(client_timeout=5.0)
                    for model in self.models:
                        try:
                            client.get_inference_statistics(model, client_timeout=5.0)
                        except grpcclient.InferenceServerException as e:
                            missing.append(f"{model}: {e.message()}")
                    if missing and ready and client.is_server_ready(client_timeout=5.0):
                        self.unavailable += missing
                except grpcclient.InferenceServerException:
                    pass  # a busy server's timeout is no answer
                self.looks += 1
        finally:
            client.close()

    def stop(self) -> None:
        self._stopping.set()
        self.join()


def _ask(url: str, photo: bytes) -> str | None:
    """None when answered, else why not."""
    client = Client(url, timeout_s=120)
    try:
        client.generate(PROMPT, [photo], max_tokens=MAX_TOKENS)
        return None
    except Exception as e:  # the client's own error types, reported as the round's failure
        return f"{url}: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
    finally:
        client.close()


def _ask_all(replicas: list[Replica], photos: list[bytes]) -> list[str]:
    """Every photo to both replicas, the replicas side by side; the failures."""
    with ThreadPoolExecutor(len(replicas)) as pool:
        answers = pool.map(lambda r: [_ask(r.url, p) for p in photos], replicas)
        return [failure for per_replica in answers for failure in per_replica if failure]


@dataclass
class Round:
    number: int
    stops: list[float | None] = field(default_factory=list)  # None: not within the grace
    failures: list[str] = field(default_factory=list)

    def line(self) -> str:
        stops = ", ".join("no stop" if s is None else f"{s:.1f} s" for s in self.stops)
        verdict = "ok" if not self.failures else "FAILED: " + "; ".join(self.failures)
        return f"round {self.number}: stops {stops or '-'}; {verdict}"


def one_round(number: int, repo: Path, work: Path, args: argparse.Namespace) -> Round:
    result = Round(number)
    logs = work / f"round-{number}"
    logs.mkdir(parents=True, exist_ok=True)
    redis = RedisServer(logs / "redis").start()
    replicas = [
        Replica(f"replica{i}", repo, free_ports(), redis.url, args.stop_grace, logs / f"replica{i}.log")
        for i in range(2)
    ]
    watchers: list[Watcher] = []
    try:
        for replica in replicas:
            replica.start()
        deadline = time.monotonic() + READY_S
        for replica in replicas:
            replica.wait_ready(deadline)
        models = repository_models(repo)
        watchers = [Watcher(replica, models) for replica in replicas]
        for watcher in watchers:
            watcher.start()
        seed = 1000 * number
        photos = [synthetic_jpeg(64 + 32 * (i % 3), 96, seed=seed + i) for i in range(args.requests)]
        result.failures += _ask_all(replicas, photos)
        redis.stop()  # the cache's backend goes away mid-run
        result.failures += _ask_all(replicas, photos[: max(1, len(photos) // 2)] + [synthetic_jpeg(96, 96, seed)])
        time.sleep(3.0)  # watched a few seconds past the last request, where a false crash showed
        for watcher in watchers:
            watcher.stop()
            result.failures += [f"{watcher.replica.name} said ready but {what}" for what in watcher.unavailable]
        for replica in replicas:
            result.failures += [f"{replica.name} reloaded stage '{m}' (no stub had died)" for m in replica.reloads()]

        started = time.monotonic()
        for replica in replicas:
            assert replica.process is not None
            os.killpg(replica.process.pid, signal.SIGTERM)
        limit = args.stop_grace + STOP_SLACK_S
        for replica in replicas:
            assert replica.process is not None
            try:
                replica.process.wait(timeout=max(0.0, started + limit - time.monotonic()))
                result.stops.append(time.monotonic() - started)
            except subprocess.TimeoutExpired:
                result.stops.append(None)
                result.failures.append(f"{replica.name}'s serve had not exited {limit:g} s after SIGTERM")
        for replica in replicas:
            left = replica.left()
            if left:
                result.failures.append(f"{replica.name} left {', '.join(left)}")
    except RuntimeError as e:
        result.failures.append(str(e))
    finally:
        for watcher in watchers:
            if watcher.is_alive():
                watcher.stop()
        for replica in replicas:
            replica.kill()
        redis.stop()
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--stop-grace", type=float, default=10.0, help="serve --stop-grace of both replicas")
    p.add_argument("--requests", type=int, default=4, help="photos sent to each replica before Redis stops")
    p.add_argument("--workdir", type=Path, help="keep the checkpoint, build and logs here (reused when present)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="two-replicas-") as scratch:
        work = args.workdir or Path(scratch)
        repo = repository(work)
        rounds = []
        for number in range(1, args.rounds + 1):
            rounds.append(one_round(number, repo, work, args))
            print(rounds[-1].line(), flush=True)
        stops = [s for r in rounds for s in r.stops if s is not None]
        failed = [r.number for r in rounds if r.failures]
        print(
            f"{len(rounds) - len(failed)}/{len(rounds)} rounds passed; stops "
            + (f"{min(stops):.1f}-{max(stops):.1f} s (grace {args.stop_grace:g} s)" if stops else "none")
            + (f"; failed: rounds {', '.join(map(str, failed))} (logs in {work})" if failed and args.workdir else "")
        )
        return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
