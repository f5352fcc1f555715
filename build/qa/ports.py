"""A free loopback port, for the tests and benchmarks that start servers of their own (Redis, the gateway)."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port free on loopback now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
