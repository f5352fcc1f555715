"""Where a deployment's endpoints listen, and how long serve waits for it: plain values that the launcher, the
gateway and the command line share (no module here imports another serving module)."""

from __future__ import annotations

import socket
from dataclasses import dataclass


@dataclass(frozen=True)
class ServerPorts:
    """tritonserver's three endpoints, and `serve`'s own readiness endpoint (serving.server.readiness)."""

    grpc: int = 8001
    http: int = 8000
    metrics: int = 8002
    ready: int = 8003


DEFAULT_PORTS = ServerPorts()


def host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


# A deployment on this host, as clients reach it by default.
LOCAL_TRITON_URL = host_port("127.0.0.1", DEFAULT_PORTS.grpc)


def free_ports() -> ServerPorts:
    """A deployment's ports, each free on loopback now (tests run several servers side by side)."""
    sockets = [socket.socket() for _ in range(4)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        grpc, http, metrics, ready = (s.getsockname()[1] for s in sockets)
    finally:
        for s in sockets:
            s.close()
    return ServerPorts(grpc=grpc, http=http, metrics=metrics, ready=ready)


# serve's: how long every model may take to load (a large LLM engine takes minutes), and the grace between SIGTERM
# and SIGKILL for the requests in flight (tritonserver's own default).
READY_TIMEOUT_S = 300.0
STOP_GRACE_S = 30.0
