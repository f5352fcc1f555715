"""The visual-feature cache: an image's prompt-table rows, kept by what made them, so that an image seen
before is neither decoded nor encoded again.

Key: the image's digest (its encoded bytes and grid: `llm.inputs.image_digest`, which KV-cache block reuse's
`prompt_table_extra_ids` derive from too) within a scope, the digest of everything else that makes the
features (`FeatureScope`: the vision model's weights, graph contract, dtype and runner, the LLM's dtype, and
the preprocessing settings that change pixels). Value: one entry (`encode_entry`), a checked header then the
image's prompt-table rows ([(K+1) * tokens, D] in the LLM's dtype: its image_embeds and deepstack_embeds rows
interleaved as the LLM reads them). `decode_entry` rejects an entry whose header or checksum does not match
what this deployment would compute, so nothing in a store is trusted beyond its header.

Stores: `MemoryStore`, an LRU within a byte budget in the preprocessing process (the one process that looks
entries up and stores them); `RedisStore`, a Redis server shared by replicas (its byte budget is the server's
maxmemory, its eviction the server's policy; entries get a TTL). A store that fails is bypassed: `VisualCache`
counts the failure, logs a warning once per outage, answers every lookup with a miss and tries the store again
after a backoff. A request is never failed by its cache.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import queue
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, Protocol

import torch

from ...errors import LimitsError
from ..parameters import CACHE_MEMORY, CACHE_OFF, CACHE_TTL_S, check_cache_setting

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
_MAGIC = b"Q3VLFEAT"
# magic, format version, dtype code, grid t/h/w, rows, columns, scope digest, image digest, payload checksum
_HEADER = struct.Struct("<8sHH3I2I16s16s16s")
DIGEST_BYTES = 16

# The LLM dtypes an entry may hold, by their code in the header (never renumber: stored entries carry them).
_DTYPE_CODES = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3}
_CODE_DTYPES = {code: dtype for dtype, code in _DTYPE_CODES.items()}


class Event(Enum):
    """What the cache counts (stages.metrics declares a metric for each)."""

    HIT = "hit"
    MISS = "miss"
    STORE = "store"
    STORED_BYTES = "stored_bytes"
    EVICTION = "eviction"
    REJECTED = "rejected"
    BACKEND_ERROR = "backend_error"


Observer = Callable[[Event, int], None]


class RejectedEntry(Exception):
    """A stored entry that does not hold what this deployment would compute for the image."""


class StoreUnavailable(Exception):
    """The store did not answer (down, slow); `full` when it answered that it has no room."""

    def __init__(self, message: str, full: bool = False):
        super().__init__(message)
        self.full = full


@dataclass(frozen=True)
class FeatureScope:
    """Everything besides the image that decides its features, as one digest."""

    digest: bytes

    @classmethod
    def of(cls, parts: Mapping[str, Any]) -> FeatureScope:
        canonical = json.dumps({"format_version": FORMAT_VERSION, **parts}, sort_keys=True, default=str)
        return cls(hashlib.blake2b(canonical.encode(), digest_size=DIGEST_BYTES).digest())

    def key(self, image_digest: bytes) -> str:
        """The store's key of an image: the scope in it too, so deployments of other models or settings never
        even read each other's entries."""
        return f"qwen3vl:features:{self.digest.hex()}:{image_digest.hex()}"


def encode_entry(scope: FeatureScope, image_digest: bytes, grid: Sequence[int], table: torch.Tensor) -> bytes:
    """An image's entry: the header, then its prompt-table rows' bytes."""
    table = table.detach().to("cpu").contiguous()
    payload = table.view(torch.uint8).numpy().tobytes()
    rows, columns = table.shape
    header = _HEADER.pack(
        _MAGIC,
        FORMAT_VERSION,
        _DTYPE_CODES[table.dtype],
        *(int(g) for g in grid),
        rows,
        columns,
        scope.digest,
        image_digest,
        hashlib.blake2b(payload, digest_size=DIGEST_BYTES).digest(),
    )
    return header + payload


def decode_entry(
    data: bytes,
    scope: FeatureScope,
    image_digest: bytes,
    grid: Sequence[int],
    shape: tuple[int, int],
    dtype: torch.dtype,
) -> torch.Tensor:
    """The prompt-table rows of an entry, after checking that it is this scope's entry for this image, with the
    shape and dtype this deployment computes, and that its bytes are the ones written; RejectedEntry otherwise."""
    if len(data) < _HEADER.size:
        raise RejectedEntry(f"{len(data)} bytes, shorter than the header")
    magic, version, dtype_code, t, h, w, rows, columns, entry_scope, entry_image, checksum = _HEADER.unpack_from(data)
    payload = memoryview(data)[_HEADER.size :]
    expected_bytes = shape[0] * shape[1] * dtype.itemsize
    checks = (
        (magic == _MAGIC, "not a feature entry"),
        (version == FORMAT_VERSION, f"format version {version}, not {FORMAT_VERSION}"),
        (entry_scope == scope.digest, "written for another model or preprocessing setting"),
        (entry_image == image_digest, "written for another image"),
        ((t, h, w) == tuple(int(g) for g in grid), f"grid {(t, h, w)}, not {tuple(grid)}"),
        (_CODE_DTYPES.get(dtype_code) == dtype, f"dtype code {dtype_code}, not {dtype}"),
        ((rows, columns) == tuple(shape), f"shape {(rows, columns)}, not {tuple(shape)}"),
        (len(payload) == expected_bytes, f"{len(payload)} bytes of rows, not {expected_bytes}"),
    )
    for passed, reason in checks:
        if not passed:
            raise RejectedEntry(reason)
    if hashlib.blake2b(payload, digest_size=DIGEST_BYTES).digest() != checksum:
        raise RejectedEntry("its rows do not match their checksum")
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(dtype).reshape(shape)


class FeatureStore(Protocol):
    """Where entries are kept. get_many and put raise StoreUnavailable when the store does not answer."""

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]: ...

    def put(self, key: str, value: bytes) -> None: ...

    def delete(self, key: str) -> None: ...

    def close(self) -> None: ...


class MemoryStore:
    """Entries in this process, least recently used evicted first once their bytes exceed the budget."""

    def __init__(self, budget_bytes: int, on_evict: Callable[[int], None] | None = None):
        if budget_bytes < 1:
            raise LimitsError(f"the visual cache's byte budget must be positive, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self.on_evict = on_evict
        self._entries: OrderedDict[str, bytes] = OrderedDict()
        self.bytes = 0
        self._lock = threading.Lock()

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        with self._lock:
            found = []
            for key in keys:
                value = self._entries.get(key)
                if value is not None:
                    self._entries.move_to_end(key)
                found.append(value)
            return found

    def put(self, key: str, value: bytes) -> None:
        if len(value) > self.budget_bytes:
            return  # larger than the whole cache: keeping it would evict everything for one image
        evicted = 0
        with self._lock:
            old = self._entries.pop(key, None)
            self.bytes += len(value) - (len(old) if old is not None else 0)
            self._entries[key] = value
            while self.bytes > self.budget_bytes:
                _, dropped = self._entries.popitem(last=False)
                self.bytes -= len(dropped)
                evicted += 1
        if evicted and self.on_evict is not None:
            self.on_evict(evicted)

    def delete(self, key: str) -> None:
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.bytes -= len(old)

    def close(self) -> None:
        with self._lock:
            self._entries.clear()
            self.bytes = 0


# A cache must never slow a request down by much: Redis answers a loopback or in-cluster GET of a few MiB in
# milliseconds, so a store that takes longer than these is treated as down.
REDIS_TIMEOUT_S = 0.25
REDIS_CONNECT_TIMEOUT_S = 0.25


class RedisStore:
    """Entries in a Redis server (redis://HOST:PORT/DB), each with a TTL; shared by every replica."""

    def __init__(self, url: str, ttl_s: int = CACHE_TTL_S, timeout_s: float = REDIS_TIMEOUT_S):
        import redis

        self.url = url
        self.ttl_s = ttl_s
        self._errors = (redis.RedisError, OSError)
        self._out_of_memory = redis.exceptions.OutOfMemoryError
        self.client = redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=REDIS_CONNECT_TIMEOUT_S, retry_on_timeout=False
        )

    def _call(self, what: str, call: Callable[[], Any]) -> Any:
        try:
            return call()
        except self._out_of_memory as e:
            raise StoreUnavailable(f"Redis at {self.url} is full ({e})", full=True) from None
        except self._errors as e:
            raise StoreUnavailable(f"Redis at {self.url} did not answer {what} ({type(e).__name__}: {e})") from None

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        return list(self._call("a lookup", lambda: self.client.mget(list(keys)))) if keys else []

    def put(self, key: str, value: bytes) -> None:
        self._call("a store", lambda: self.client.set(key, value, ex=self.ttl_s))

    def delete(self, key: str) -> None:
        self._call("a delete", lambda: self.client.delete(key))

    def check_settings(self) -> None:
        """Warns when the server keeps entries without a byte budget, or refuses writes when full instead of
        evicting (docs/visual-cache.md); says nothing where CONFIG is not allowed (managed Redis services)."""
        try:
            raw = dict(self.client.config_get("maxmemory*"))
        except self._errors:
            return
        # Bytes unless the client decodes responses (this one does not: entries are binary).
        config = {_text(key): _text(value) for key, value in raw.items()}
        if config.get("maxmemory", "0") == "0":
            log.warning("visual cache: Redis at %s has no maxmemory; entries accumulate until they expire", self.url)
        policy = config.get("maxmemory-policy", "")
        if policy and not policy.startswith("allkeys-"):
            log.warning(
                "visual cache: Redis at %s evicts by %s; when full it refuses new entries (allkeys-lru evicts the "
                "least recently used instead)",
                self.url,
                policy,
            )

    def close(self) -> None:
        self.client.close()


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


# After a store fails, it is asked again this long after (doubling up to the most while it keeps failing).
FIRST_BACKOFF_S = 1.0
MOST_BACKOFF_S = 8.0
# Stores waiting for the writer thread; beyond this, new entries are not stored (the next miss stores them).
PENDING_STORES = 64


class VisualCache:
    """Looks images' entries up and stores new ones in a store, counting what happens (observer); a store
    that fails is bypassed and tried again after a backoff. Stores go through a writer thread when the store
    is remote (off the request's path) and directly into memory otherwise."""

    def __init__(
        self,
        store: FeatureStore,
        scope: FeatureScope,
        observer: Observer | None = None,
        background_stores: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.store = store
        self.scope = scope
        self.observer = observer or (lambda event, count: None)
        self.clock = clock
        self._retry_at = 0.0
        self._backoff_s = FIRST_BACKOFF_S
        self._outage: str | None = None
        self._lock = threading.Lock()
        self._pending: queue.Queue[tuple[str, bytes] | None] | None = None
        if background_stores:
            self._pending = queue.Queue(PENDING_STORES)
            self._writer = threading.Thread(target=self._write_pending, name="visual-cache-writer", daemon=True)
            self._writer.start()

    def lookup(
        self, images: Sequence[tuple[bytes, Sequence[int], tuple[int, int]]], dtype: torch.dtype
    ) -> list[torch.Tensor | None]:
        """Each image's prompt-table rows, or None (a miss): images as (digest, grid, rows' shape)."""
        if not images:
            return []
        keys = [self.scope.key(digest) for digest, _, _ in images]
        values = self._ask(lambda: self.store.get_many(keys))
        if values is None:
            values = [None] * len(images)
        found: list[torch.Tensor | None] = []
        for key, (digest, grid, shape), value in zip(keys, images, values, strict=True):
            rows = None
            if value is not None:
                try:
                    rows = decode_entry(value, self.scope, digest, grid, shape, dtype)
                except RejectedEntry as e:
                    log.warning("visual cache: dropped the entry %s: %s", key, e)
                    self.observer(Event.REJECTED, 1)
                    self._ask(functools.partial(self.store.delete, key))
            found.append(rows)
        hits = sum(rows is not None for rows in found)
        self.observer(Event.HIT, hits)
        self.observer(Event.MISS, len(found) - hits)
        return found

    def put(self, digest: bytes, grid: Sequence[int], table: torch.Tensor) -> None:
        """Keeps an image's prompt-table rows (a copy on the host)."""
        key, entry = self.scope.key(digest), encode_entry(self.scope, digest, grid, table)
        if self._pending is None:
            self._store(key, entry)
            return
        try:
            self._pending.put_nowait((key, entry))
        except queue.Full:
            pass  # the writer is behind (a slow store): this image is stored on its next miss

    def _write_pending(self) -> None:
        assert self._pending is not None
        while (item := self._pending.get()) is not None:
            self._store(*item)

    def _store(self, key: str, entry: bytes) -> None:
        if self._ask(lambda: self.store.put(key, entry), storing=True) is not None:
            self.observer(Event.STORE, 1)
            self.observer(Event.STORED_BYTES, len(entry))

    def _ask(self, call: Callable[[], Any], storing: bool = False) -> Any:
        """call()'s value (True for None), or None while the store is bypassed or when it fails."""
        if self.clock() < self._retry_at:
            return None
        try:
            value = call()
        except StoreUnavailable as e:
            self.observer(Event.BACKEND_ERROR, 1)
            if e.full and storing:
                log.warning("visual cache: %s; this entry is not stored", e)
                return None
            with self._lock:
                if self._outage is None:
                    log.warning("visual cache: %s; serving without it, trying again in %.0f s", e, self._backoff_s)
                self._outage = str(e)
                self._retry_at = self.clock() + self._backoff_s
                self._backoff_s = min(self._backoff_s * 2, MOST_BACKOFF_S)
            return None
        with self._lock:
            if self._outage is not None:
                log.warning("visual cache: the store answers again; using it")
                self._outage = None
            self._backoff_s = FIRST_BACKOFF_S
        return True if value is None else value

    @property
    def bypassed(self) -> bool:
        return self._outage is not None

    def close(self) -> None:
        if self._pending is not None:
            self._pending.put(None)
            self._writer.join(timeout=2.0)
        self.store.close()


def open_cache(
    setting: str,
    scope: FeatureScope,
    budget_bytes: int,
    ttl_s: int = CACHE_TTL_S,
    observer: Observer | None = None,
) -> VisualCache | None:
    """The cache a deployment's setting names: None for off, in memory, or on the Redis server of the URL."""
    check_cache_setting(setting)
    if setting == CACHE_OFF:
        return None
    observe = observer or (lambda event, count: None)
    if setting == CACHE_MEMORY:
        return VisualCache(MemoryStore(budget_bytes, lambda n: observe(Event.EVICTION, n)), scope, observe)
    store = RedisStore(setting, ttl_s)
    store.check_settings()
    return VisualCache(store, scope, observe, background_stores=True)
