"""Who may call the gateway: API keys (`--api-key`, `--api-key-file`), which `/v1/*` requires as
`Authorization: Bearer <key>` as OpenAI's API and vLLM's and SGLang's servers do, and `/metrics` too unless
`--open-metrics`; `/health` stays open (probes). A request without a valid key gets 401 with an OpenAI error body
and `WWW-Authenticate: Bearer`.

Keys are kept only as SHA-256 digests, compared in constant time against every configured key (no early exit
that would tell which key came closest), and never logged, counted or repeated in an error message: logs and
metrics name a key by its id (key_id, a short prefix of its digest); what a key owns (its batches and files) is
keyed by its whole digest (key_owner), which no other key shares."""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
from collections.abc import Iterable, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client import Counter

from ...errors import Qwen3VLTrtError
from .admission import ASGIApp, Receive, Scope, Send, error_response
from .metrics import GatewayMetrics
from .protocol import APIError

API_KEY = "qwen3vl_trt.api_key"  # the scope key of an authenticated request's key id
KEY_OWNER = "qwen3vl_trt.key_owner"  # and of its key_owner
UNAUTHORIZED = "unauthorized"  # the refusals counter's reason for a 401
_BEARER = "bearer"  # schemes are case-insensitive (RFC 9110 11.1)


class APIKeyError(Qwen3VLTrtError):
    """An API key or key file that cannot be used (the message never holds a key)."""


def key_id(key: str) -> str:
    """The name logs and metrics give a key: "key-" and the first 8 hex digits of its SHA-256."""
    return _id(_digest(key))


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def _id(digest: bytes) -> str:
    return "key-" + digest.hex()[:8]


def key_owner(digest: bytes) -> str:
    """What a key's batches and files are kept under: "owner-" and a whole SHA-256 of its digest, so two keys
    sharing an id's 8 hex digits still own apart, and the batch store never holds the digest keys are checked
    against."""
    return "owner-" + hashlib.sha256(b"qwen3vl-trt batch owner\0" + digest).hexdigest()


def _check(key: str, where: str) -> str:
    """A key as given, or APIKeyError saying where the bad one is (not what it is)."""
    if not key:
        raise APIKeyError(f"{where}: an API key is empty")
    if not all("!" <= c <= "~" for c in key):
        raise APIKeyError(f"{where}: an API key must be printable ASCII without whitespace (it goes in an HTTP header)")
    return key


@dataclass(frozen=True)
class APIKeys:
    """The keys a gateway takes, as digests (none: the API is open). Its repr shows key ids only."""

    digests: tuple[bytes, ...] = field(default=(), repr=False)

    @classmethod
    def load(cls, keys: Iterable[str] = (), files: Iterable[str | Path] = ()) -> APIKeys:
        """Keys given, and those of key files: one a line, surrounding whitespace ignored, blank lines and lines
        starting with # skipped. A file with no key, a key with whitespace or a control character inside, or an
        unreadable file is an APIKeyError."""
        digests: dict[bytes, None] = {}  # in order, duplicates once
        for i, key in enumerate(keys, 1):
            digests[_digest(_check(key, f"--api-key #{i}"))] = None
        for path in files:
            try:
                text = Path(path).read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                reason = e.strerror if isinstance(e, OSError) else "not UTF-8 text"
                raise APIKeyError(f"cannot read the API key file {path}: {reason}") from None
            found = 0
            for number, line in enumerate(text.splitlines(), 1):
                line = line.strip()
                if not line or line.startswith("#"):
                    continue
                digests[_digest(_check(line, f"{path}, line {number}"))] = None
                found += 1
            if not found:
                raise APIKeyError(f"the API key file {path} holds no key (one a line; blank lines and # comments "
                                  "are skipped)")  # fmt: skip
        return cls(tuple(digests))

    @property
    def ids(self) -> tuple[str, ...]:
        return tuple(_id(d) for d in self.digests)

    def __bool__(self) -> bool:
        return bool(self.digests)

    def __repr__(self) -> str:
        return f"APIKeys({', '.join(self.ids)})"

    def match(self, authorization: str | bytes | None) -> bytes | None:
        """The digest of the key an Authorization header value carries as `Bearer <key>`, or None (no header,
        another scheme, an unknown key). Every configured key is compared, in constant time."""
        token = bearer_token(authorization)
        if token is None:
            return None
        presented = hashlib.sha256(token).digest()  # fixed length: the comparison says nothing of the key's
        found: bytes | None = None
        for digest in self.digests:
            if hmac.compare_digest(presented, digest):
                found = digest
        return found


def bearer_token(authorization: str | bytes | None) -> bytes | None:
    """The credentials of a `Bearer <token>` Authorization header value; None for none or another scheme."""
    if authorization is None:
        return None
    value = authorization.encode("latin-1") if isinstance(authorization, str) else authorization
    scheme, _, token = value.strip().partition(b" ")
    if scheme.lower() != _BEARER.encode():
        return None
    token = token.strip()
    return token or None


NO_API_KEYS = APIKeys()


def _unauthorized(message: str) -> APIError:
    # As OpenAI's API answers an invalid key (type and code), with a message that never repeats the key.
    return APIError(401, message, code="invalid_api_key")


class APIKeyGuard:
    """ASGI middleware: requests to /v1/* (and /metrics unless open_metrics) need a valid API key, else 401.
    An accepted request's key id is in its scope (API_KEY, its owner under KEY_OWNER) and counted by key id;
    refusals are counted as refusals{reason="unauthorized"}. Without keys it passes everything through."""

    def __init__(self, app: ASGIApp, keys: APIKeys, open_metrics: bool = False, metrics: GatewayMetrics | None = None):
        self.app, self.keys, self.open_metrics, self.metrics = app, keys, open_metrics, metrics
        self.requests: Counter | None = None
        if metrics is not None and keys:
            self.requests = Counter(
                "qwen3vl_gateway_api_key_requests", "Requests that an API key let in, by the key's id", ["key"],
                registry=metrics.registry,
            )  # fmt: skip
            for name in keys.ids:
                self.requests.labels(name)

    def guards(self, path: str) -> bool:
        if path == "/v1" or path.startswith("/v1/"):
            return True
        return not self.open_metrics and path.rstrip("/") == "/metrics"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.keys or not self.guards(scope["path"]):
            await self.app(scope, receive, send)
            return
        header = _header(scope, b"authorization")
        digest = self.keys.match(header)
        if digest is None:
            if header is None:
                error = _unauthorized("no API key: send it in the header Authorization: Bearer <key>")
            elif bearer_token(header) is None:
                error = _unauthorized("the Authorization header is not Bearer <key>: send the API key that way")
            else:
                error = _unauthorized("the API key is not valid")
            if self.metrics is not None:
                self.metrics.refusals.labels(UNAUTHORIZED).inc()
            # Connection: close, so that the server drops a body it did not read.
            headers = {"WWW-Authenticate": "Bearer", "Connection": "close"}
            await error_response(error, headers)(scope, receive, send)
            return
        key = _id(digest)
        scope[API_KEY], scope[KEY_OWNER] = key, key_owner(digest)
        if self.requests is not None:
            self.requests.labels(key).inc()
        await self.app(scope, receive, send)


def _header(scope: MutableMapping[str, Any], name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return value
    return None


def is_loopback(host: str) -> bool:
    """Whether an address to bind reaches this host only (0.0.0.0 and :: are every interface)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: whatever it resolves to


def access_note(keys: APIKeys, open_metrics: bool, host: str, url: str) -> str | None:
    """What serve and openai print at start about who may call the API: the key ids it takes, or a warning
    that it is open when it binds beyond loopback without keys; None when it is open on loopback only."""
    if keys:
        guarded = "/v1/*" if open_metrics else "/v1/* and /metrics"
        return f"API keys required on {guarded} at {url}: {', '.join(keys.ids)}"
    if is_loopback(host):
        return None
    return (
        f"warning: the OpenAI API on {url} is open: anyone who reaches it may call it; give --api-key-file "
        "(keys, one a line) to require Authorization: Bearer <key>"
    )
