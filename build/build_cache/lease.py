"""The lease one builder of a key holds while the others wait, on a shared POSIX directory (NFS, EFS, Filestore,
CephFS) with no lock service: exclusive file creation (O_CREAT|O_EXCL, atomic on NFSv3 and later) of numbered
generations, and a heartbeat the holder rewrites.

A waiter judges a lease expired when its heartbeat has not changed for `lease_s` seconds by the waiter's own
monotonic clock, so no two hosts' clocks are compared; it then takes the next generation, which only one of the
waiters can create. A builder that dies stops beating and its lease expires; a builder that releases removes its
generation. A holder that stalled past its lease may find a successor: both may build, and the cache's atomic
publish keeps one result (store.BuildCache), so the lease saves work and never decides correctness.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

_GENERATION = re.compile(r"lease-(\d{6})\.json")


@dataclass(frozen=True)
class Holder:
    """What a lease file says: who holds it (host, pid, token) and its heartbeat count."""

    host: str
    pid: int
    token: str
    beat: int

    def describe(self) -> str:
        return f"pid {self.pid} on {self.host}"


def _generations(directory: Path) -> list[tuple[int, Path]]:
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    return sorted((int(m.group(1)), directory / n) for n in names if (m := _GENERATION.fullmatch(n)))


def read_holder(path: Path) -> Holder | None:
    try:
        raw = json.loads(path.read_text())
        return Holder(str(raw["host"]), int(raw["pid"]), str(raw["token"]), int(raw["beat"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None  # gone, or being replaced: the next look sees it


class Lease:
    """A lease this process holds on `directory` (one per key), renewed every lease_s / 4 by a daemon thread until
    released. Use `Lease.try_take`."""

    def __init__(self, path: Path, lease_s: float) -> None:
        self.path = path
        self.lease_s = lease_s
        self.token = secrets.token_hex(8)
        self._beat = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew, name=f"lease {path.name}", daemon=True)

    def _write(self, flags: int) -> None:
        content = json.dumps(
            {"host": socket.gethostname(), "pid": os.getpid(), "token": self.token, "beat": self._beat}
        )
        if flags & os.O_EXCL:
            fd = os.open(self.path, flags, 0o644)
            with os.fdopen(fd, "w") as f:
                f.write(content)
            return
        # A waiter reads the old beat or the new one, never a torn file.
        tmp = self.path.with_name(f".{self.path.name}.{self.token}.tmp")
        tmp.write_text(content)
        os.replace(tmp, self.path)

    @classmethod
    def try_take(cls, directory: Path, lease_s: float, after: int) -> Lease | None:
        """The lease as generation after + 1, or None if another process created that generation first."""
        directory.mkdir(parents=True, exist_ok=True)
        lease = cls(directory / f"lease-{after + 1:06d}.json", lease_s)
        try:
            lease._write(os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        except FileExistsError:
            return None
        for number, older in _generations(directory):
            if number <= after:  # expired: their holders are gone or will find they lost the key
                older.unlink(missing_ok=True)
        lease._thread.start()
        return lease

    def _renew(self) -> None:
        while not self._stop.wait(self.lease_s / 4):
            self._beat += 1
            try:
                self._write(os.O_WRONLY)
            except OSError:
                pass  # a storage hiccup: the next beat tries again, and a lease that lapses only costs a rebuild

    def release(self) -> None:
        self._stop.set()
        self._thread.join()
        self.path.unlink(missing_ok=True)


class LeaseWatch:
    """A waiter's view of a key's lease: which generation is newest and when (monotonic) its heartbeat last changed."""

    def __init__(self, directory: Path, lease_s: float) -> None:
        self.directory = directory
        self.lease_s = lease_s
        self._seen: tuple[int, Holder | None] | None = None
        self._changed = time.monotonic()

    def look(self) -> tuple[int, Holder | None, bool]:
        """(newest generation number (0: none), its holder, whether it is live): a generation is live until its
        heartbeat has been still for lease_s of this process's clock."""
        generations = _generations(self.directory)
        if not generations:
            self._seen = None
            return 0, None, False
        number, path = generations[-1]
        holder = read_holder(path)
        state = (number, holder)
        if state != self._seen:
            self._seen = state
            self._changed = time.monotonic()
        return number, holder, time.monotonic() - self._changed < self.lease_s

    def still_for(self) -> float:
        return time.monotonic() - self._changed


def live_tokens(directory: Path) -> set[str]:
    """The tokens of the generations present (a builder's staging directory is named by its token)."""
    return {holder.token for _, path in _generations(directory) if (holder := read_holder(path)) is not None}
