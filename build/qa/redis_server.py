"""A real redis-server on a loopback port, for the visual cache's tests and benchmark: started with no
persistence, killed and started again on the same port (an outage), stopped at the end."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import redis

from ..errors import ServingError
from .ports import free_port


class RedisServer:
    def __init__(
        self,
        workdir: Path,
        maxmemory_bytes: int = 256 << 20,
        policy: str = "allkeys-lru",
        port: int | None = None,
        appendonly: bool = False,
    ):
        """maxmemory_bytes and policy: the server's byte budget and what it does when full (allkeys-lru evicts
        the least recently used entry; noeviction refuses writes). appendonly: every write logged to its
        append-only file in workdir (fsync every second), which a server started again there replays."""
        binary = shutil.which("redis-server")
        if binary is None:
            raise ServingError(
                "redis-server is not installed: apt-get install redis-server (scripts/bootstrap.sh does)"
            )
        self.binary = binary
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.maxmemory_bytes = maxmemory_bytes
        self.policy = policy
        self.appendonly = appendonly
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 20.0) -> RedisServer:
        args = [
            self.binary,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "yes" if self.appendonly else "no",
            "--dir", str(self.workdir),
            "--maxmemory", str(self.maxmemory_bytes),
            "--maxmemory-policy", self.policy,
        ]  # fmt: skip
        log = open(self.workdir / "redis.log", "ab")  # noqa: SIM115 (the server's own, closed with it)
        self.process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        log.close()
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=1.0)
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                try:
                    if client.ping():
                        return self
                except redis.RedisError:
                    pass
                if self.process.poll() is not None or time.monotonic() > deadline:
                    tail = (self.workdir / "redis.log").read_text(errors="replace")[-2000:]
                    raise ServingError(f"redis-server did not start on port {self.port}: {tail}")
                time.sleep(0.05)
        finally:
            client.close()

    def kill(self) -> None:
        """Ends the server at once (SIGKILL), as a crash would."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)
        self.process = None

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self.process = None

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=2.0)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
