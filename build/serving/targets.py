"""Where a deployment's gRPC endpoints are: what `openai --triton-url` (the replicas) and `serve --vision-pool` (the
vision pool's members) name, in one syntax (gateway.fleet's docstring shows it), resolved again as members come and
go. Shared by the gateway and the preprocessing stage."""

from __future__ import annotations

import ipaddress
import re
import socket
from dataclasses import dataclass

from ..errors import ServingError
from .ports import DEFAULT_PORTS, host_port

DNS_TIMEOUT_S = 5.0


class FleetTargetError(ServingError):
    """A target cannot be read."""


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int

    def __str__(self) -> str:
        return host_port(self.host, self.port)


_HOST_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?\.?")  # a fully qualified name may end in "."


def _endpoint(text: str, whole: str, default_port: int = DEFAULT_PORTS.grpc) -> Endpoint:
    text = text.strip()
    if text.startswith("["):  # [IPv6]:port
        host, _, rest = text[1:].partition("]")
        port_text = rest[1:] if rest.startswith(":") else ""
    elif text.count(":") > 1:  # a bare IPv6 address
        host, port_text = text, ""
    else:
        host, _, port_text = text.partition(":")
    try:
        port = int(port_text) if port_text else default_port
    except ValueError:
        port = 0
    if not (_is_ip(host) or _HOST_NAME.fullmatch(host)) or not 1 <= port <= 65535:
        raise FleetTargetError(
            f"{whole!r}: {text!r} is not HOST:PORT; a target is HOST:PORT, a comma-separated list of them, or "
            "dns://[DNS_SERVER:PORT]/NAME:PORT"
        )
    return Endpoint(host, port)


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class FleetTarget:
    """What a target names (--triton-url, --vision-pool): endpoints whose hosts are IP addresses or names, and the
    DNS server to ask for the names (None: the system's resolver, which also reads /etc/hosts)."""

    text: str
    endpoints: tuple[Endpoint, ...]
    nameserver: Endpoint | None = None

    @classmethod
    def parse(cls, text: str) -> FleetTarget:
        if text.startswith("dns:"):
            rest = text[len("dns:") :]
            if rest.startswith("//"):
                authority, slash, name = rest[2:].partition("/")
                if not slash:
                    raise FleetTargetError(f"{text!r}: expected dns:///NAME:PORT or dns://DNS_SERVER:PORT/NAME:PORT")
            else:
                authority, name = "", rest
            nameserver = None
            if authority:
                nameserver = _endpoint(authority, text, default_port=53)
                if not _is_ip(nameserver.host):
                    raise FleetTargetError(f"{text!r}: the DNS server must be an IP address, not {nameserver.host!r}")
            return cls(text, (_endpoint(name, text),), nameserver)
        entries = [e for e in text.split(",") if e.strip()]
        if not entries:
            raise FleetTargetError("the target is empty")
        return cls(text, tuple(_endpoint(e, text) for e in entries))

    def resolve(self) -> list[str]:
        """The replicas' addresses now ("ip:port", sorted, without repeats); names without an address are
        left out (a headless Service with no ready pod has none). Raises when a resolver fails."""
        found: set[str] = set()
        for endpoint in self.endpoints:
            for ip in self._addresses(endpoint.host):
                found.add(str(Endpoint(ip, endpoint.port)))
        return sorted(found)

    def _addresses(self, host: str) -> list[str]:
        """The host's addresses of one family, IPv4 where it has any: a dual-stack replica (a pod of a dual-stack
        cluster, `localhost`) is one replica, not two, so a retry never lands on the server that failed."""
        if _is_ip(host):
            return [host]
        if self.nameserver is not None:
            return _ask_nameserver(host, self.nameserver)
        try:
            infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
        except socket.gaierror as e:
            if e.errno in _NO_ADDRESS:
                return []
            raise  # the resolver failed (EAI_AGAIN...): the caller keeps what it knew
        addresses = [str(info[4][0]) for info in infos]
        ipv4 = [a for a in addresses if ipaddress.ip_address(a).version == 4]
        return ipv4 or addresses


# getaddrinfo's answers for a name without addresses, as opposed to a resolver that failed.
_NO_ADDRESS = {socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)}


def _ask_nameserver(name: str, server: Endpoint) -> list[str]:
    import dns.exception
    import dns.resolver

    resolver = dns.resolver.Resolver(configure=False)
    resolver.nameservers = [server.host]
    resolver.port = server.port
    resolver.lifetime = DNS_TIMEOUT_S
    failure: dns.exception.DNSException | None = None
    for kind in ("A", "AAAA"):  # IPv4 where the name has any (see FleetTarget._addresses)
        try:
            return [record.to_text() for record in resolver.resolve(name, kind)]
        except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):  # no address of this kind
            pass
        except dns.exception.DNSException as e:  # a timeout, or a server that failed or refused this kind
            failure = failure or e
    if failure is not None:  # no address, and a query failed: the caller keeps what it knew
        raise failure
    return []
