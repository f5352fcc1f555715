"""Batch state and the work queue in a Redis of their own (never the visual cache's, which evicts): the server must
keep what it is given (append-only persistence, `noeviction`), which BatchStore.check asks of it at start.

Keys, under `qwen3vl:batch:`:
    file:{id}             hash: a file's FileObject fields and its owner (auth.key_owner of its API key)
    owner:{owner}:files   sorted set: the owner's files by creation time (and owner:{owner}:batches, its batches)
    batch:{id}            hash: a batch's Batch fields (JSON values), its owner, and the counts
    batch:{id}:results    hash: line index -> the line's output or error line, each written once (HSETNX)
    batch:{id}:lock       a lease (SET NX PX) on the batch's own work: validating it, finalizing it
    work                  stream: entries of lines to run ({batch, lines}), the consumer group `runners`
    active                set: the batches not ended yet, which every gateway's runner looks after

A line's result is recorded once whatever happens (record: HSETNX, and its count with it, in one script); a work
entry that a dead runner held is claimed by another after the claim timeout (XAUTOCLAIM), and its lines already
recorded are skipped. Redis restarted from its append-only file keeps all of it."""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Sequence
from typing import Any

from .records import Batch, BatchRequestCounts, FileObject

PREFIX = "qwen3vl:batch:"
# What a Redis must say to keep batches (BatchStore.check), and what is taken when CONFIG is refused.
_KEPT = {"appendonly": "yes", "appendfsync": "everysec", "maxmemory-policy": "noeviction"}
GROUP = "runners"
COUNTS = ("completed", "failed")

# KEYS: batch, work stream; ARGV: batch id, then each entry's lines. Once per batch: 1 when enqueued, 0 when it was.
_ENQUEUE = """
if redis.call('HSETNX', KEYS[1], 'enqueued', 1) == 0 then return 0 end
redis.call('HINCRBY', KEYS[1], 'entries_left', #ARGV - 1)
for i = 2, #ARGV do redis.call('XADD', KEYS[2], '*', 'batch', ARGV[1], 'lines', ARGV[i]) end
return 1
"""
# KEYS: results, batch; ARGV: index, line, counter field ("" counts nothing). 1 when recorded, 0 when it was already.
_RECORD = """
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 1 then
  if ARGV[3] ~= '' then redis.call('HINCRBY', KEYS[2], ARGV[3], 1) end
  return 1
end
return 0
"""
# KEYS: work stream, batch; ARGV: group, entry id. The entries left of the batch after this one, -1 if it was done.
_DONE = """
if redis.call('XACK', KEYS[1], ARGV[1], ARGV[2]) == 1 then
  redis.call('XDEL', KEYS[1], ARGV[2])
  return redis.call('HINCRBY', KEYS[2], 'entries_left', -1)
end
return -1
"""
# KEYS: batch; ARGV: the statuses it may be in (comma-separated), then field, value pairs. 1 when set.
_MOVE = """
local status = redis.call('HGET', KEYS[1], 'status')
if status == false then return 0 end
for allowed in string.gmatch(ARGV[1], '[^,]+') do
  if status == cjson.encode(allowed) then
    for i = 2, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
    return 1
  end
end
return 0
"""
# KEYS: lock; ARGV: token, lease ms. Renews a lease this token holds.
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def now() -> int:
    return int(time.time())


class BatchStoreError(Exception):
    """The batch store's Redis cannot be used (not reachable, or not keeping what it is given)."""


class BatchStore:
    def __init__(self, url: str):
        import redis.asyncio as redis

        self.url = url
        # Any: redis-py's annotations take a mapping's keys invariantly and type replies per RESP version.
        self.redis: Any = redis.Redis.from_url(url)
        self._enqueue = self.redis.register_script(_ENQUEUE)
        self._record = self.redis.register_script(_RECORD)
        self._done = self.redis.register_script(_DONE)
        self._move = self.redis.register_script(_MOVE)
        self._renew = self.redis.register_script(_RENEW)
        self.work = PREFIX + "work"
        self.active = PREFIX + "active"

    async def check(self) -> None:
        """Refuses a Redis that is not reachable or would lose batches: append-only persistence off or never synced
        (appendfsync no), or an eviction policy (a managed Redis that refuses CONFIG is taken as configured); then makes
        the work stream's consumer group, once."""
        from redis.exceptions import RedisError, ResponseError

        try:
            await self.redis.ping()
            config: dict[str, Any] = {}
            try:
                for name in ("appendonly", "appendfsync", "maxmemory-policy"):
                    config.update(await self.redis.config_get(name))
            except ResponseError:
                config = {}
            settings = {name: _text(config.get(name, ok)) for name, ok in _KEPT.items()}
            if (
                settings["appendonly"] != "yes"
                or settings["appendfsync"] == "no"
                or settings["maxmemory-policy"] != ("noeviction")
            ):
                found = ", ".join(f"{name} {value}" for name, value in settings.items())
                raise BatchStoreError(
                    f"the batch store {self.url} would lose batches ({found}): run a Redis of its own with "
                    "--appendonly yes --maxmemory-policy noeviction, not the visual cache's"
                )
            try:
                await self.redis.xgroup_create(self.work, GROUP, id="0", mkstream=True)
            except ResponseError as e:
                if "BUSYGROUP" not in str(e):
                    raise BatchStoreError(f"the batch store {self.url}: {e}") from None
        except RedisError as e:
            raise BatchStoreError(f"the batch store {self.url} cannot be reached: {e}") from None

    async def close(self) -> None:
        await self.redis.aclose()

    # -- files ----------------------------------------------------------------------------------------------

    def _file(self, file_id: str) -> str:
        return f"{PREFIX}file:{file_id}"

    def _owned(self, owner: str, kind: str) -> str:
        return f"{PREFIX}owner:{owner}:{kind}"

    async def add_file(self, owner: str, file: FileObject) -> None:
        fields = {**{k: json.dumps(v) for k, v in file.model_dump().items()}, "owner": owner}
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(self._file(file.id), mapping=fields)
            pipe.zadd(self._owned(owner, "files"), {file.id: file.created_at})
            await pipe.execute()

    async def file(self, owner: str, file_id: str) -> FileObject | None:
        """The owner's file (None: no such file, or another key's)."""
        fields = await self.redis.hgetall(self._file(file_id))
        if not fields or _text(fields.pop(b"owner")) != owner:
            return None
        return FileObject(**{_text(k): json.loads(v) for k, v in fields.items()})

    async def files(self, owner: str) -> list[str]:
        return [_text(i) for i in await self.redis.zrange(self._owned(owner, "files"), 0, -1)]

    async def delete_file(self, owner: str, file_id: str) -> None:
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(self._file(file_id))
            pipe.zrem(self._owned(owner, "files"), file_id)
            await pipe.execute()

    # -- batches --------------------------------------------------------------------------------------------

    def key(self, batch_id: str) -> str:
        return f"{PREFIX}batch:{batch_id}"

    def results(self, batch_id: str) -> str:
        return f"{PREFIX}batch:{batch_id}:results"

    async def add_batch(self, owner: str, batch: Batch) -> None:
        fields = {**_fields(batch), "owner": owner, "completed": 0, "failed": 0, "entries_left": 0}
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(self.key(batch.id), mapping=fields)
            pipe.zadd(self._owned(owner, "batches"), {batch.id: batch.created_at})
            pipe.sadd(self.active, batch.id)
            await pipe.execute()

    async def batch(self, batch_id: str, owner: str | None = None) -> tuple[Batch, str] | None:
        """A batch and its owner (None: no such batch, or another key's when `owner` is given)."""
        fields = {_text(k): v for k, v in (await self.redis.hgetall(self.key(batch_id))).items()}
        if not fields or (owner is not None and _text(fields["owner"]) != owner):
            return None
        counts = {name: int(fields.pop(name)) for name in COUNTS}
        holder = _text(fields.pop("owner"))
        fields.pop("entries_left")
        fields.pop("enqueued", None)
        values = {k: json.loads(v) for k, v in fields.items()}
        total = values.pop("total", 0)
        return Batch(**values, request_counts=BatchRequestCounts(total=total, **counts)), holder

    async def batches(self, owner: str) -> list[str]:
        """The owner's batches, newest first."""
        return [_text(i) for i in await self.redis.zrevrange(self._owned(owner, "batches"), 0, -1)]

    async def update(self, batch_id: str, **values: Any) -> None:
        await self.redis.hset(self.key(batch_id), mapping={k: json.dumps(v) for k, v in values.items()})

    async def move(self, batch_id: str, allowed: Sequence[str], **values: Any) -> bool:
        """Sets `values` (status among them) if the batch's status is one of `allowed`: whether it did."""
        pairs = [x for k, v in values.items() for x in (k, json.dumps(v))]
        return bool(await self._move(keys=[self.key(batch_id)], args=[",".join(allowed), *pairs]))

    async def entries_left(self, batch_id: str) -> int:
        """The batch's work entries not yet given back by a runner."""
        return int(await self.redis.hget(self.key(batch_id), "entries_left") or 0)

    async def entries_queued(self) -> int:
        """Work entries in the stream: not run yet, or running (an entry is deleted once run)."""
        return int(await self.redis.xlen(self.work))

    async def active_batches(self) -> list[str]:
        return [_text(i) for i in await self.redis.smembers(self.active)]

    async def active_inputs(self) -> set[str]:
        """The input files of the batches not ended."""
        inputs = set()
        for batch_id in await self.active_batches():
            value = await self.redis.hget(self.key(batch_id), "input_file_id")
            if value is not None:
                inputs.add(json.loads(value))
        return inputs

    async def ended(self, batch_id: str) -> None:
        await self.redis.srem(self.active, batch_id)

    # -- leases ---------------------------------------------------------------------------------------------

    async def lease(self, batch_id: str, lease_ms: int) -> str | None:
        """A lease on the batch's own work (validating, finalizing), or None while another holds it."""
        token = secrets.token_hex(8)
        taken = await self.redis.set(f"{self.key(batch_id)}:lock", token, nx=True, px=lease_ms)
        return token if taken else None

    async def renew(self, batch_id: str, token: str, lease_ms: int) -> bool:
        return bool(await self._renew(keys=[f"{self.key(batch_id)}:lock"], args=[token, lease_ms]))

    async def release(self, batch_id: str, token: str) -> None:
        await self._renew(keys=[f"{self.key(batch_id)}:lock"], args=[token, 1])

    # -- lines ----------------------------------------------------------------------------------------------

    async def enqueue(self, batch_id: str, entries: Sequence[Sequence[tuple[int, int, int]]]) -> None:
        """Work entries of a batch: each a group of lines (index, offset, length in the input file) run together;
        all at once, and once (a validation done again after a crash enqueues nothing more)."""
        args = [batch_id, *(json.dumps(lines) for lines in entries)]
        await self._enqueue(keys=[self.key(batch_id), self.work], args=args)

    async def take(self, consumer: str, claim_ms: int, block_ms: int) -> tuple[str, str, list[list[int]]] | None:
        """The next work entry for this consumer: one a dead consumer held past claim_ms first, else a new one
        (waiting up to block_ms): (entry id, batch id, lines)."""
        claimed: Any = await self.redis.xautoclaim(self.work, GROUP, consumer, claim_ms, "0-0", count=1)
        entries = claimed[1]
        if not entries:
            answer: Any = await self.redis.xreadgroup(GROUP, consumer, {self.work: ">"}, count=1, block=block_ms)
            entries = answer[0][1] if answer else []  # [[stream, entries]] (RESP2, redis-py's default)
        for entry_id, fields in entries:
            if fields:  # an entry deleted meanwhile comes back empty
                return _text(entry_id), _text(fields[b"batch"]), json.loads(fields[b"lines"])
        return None

    async def hold(self, consumer: str, entry_id: str) -> None:
        """Keeps an entry this consumer works on from being claimed (resets its idle time)."""
        await self.redis.xclaim(self.work, GROUP, consumer, 0, [entry_id], justid=True)

    async def done(self, batch_id: str, entry_id: str) -> None:
        await self._done(keys=[self.work, self.key(batch_id)], args=[GROUP, entry_id])

    async def recorded(self, batch_id: str, index: int) -> bool:
        return bool(await self.redis.hexists(self.results(batch_id), str(index)))

    async def record(self, batch_id: str, index: int, line: dict[str, Any], counted: str | None) -> bool:
        """The line's result, once: False when it was recorded already (by another runner, or before a crash)."""
        encoded = json.dumps(line, separators=(",", ":"))
        args = [str(index), encoded, counted or ""]
        return bool(await self._record(keys=[self.results(batch_id), self.key(batch_id)], args=args))

    async def result_lines(self, batch_id: str) -> dict[int, bytes]:
        found: dict[int, bytes] = {}
        async for index, line in self.redis.hscan_iter(self.results(batch_id), count=1000):
            found[int(index)] = line
        return found


def _fields(batch: Batch) -> dict[str, str]:
    values = batch.model_dump(exclude={"request_counts"})
    values["total"] = batch.request_counts.total
    return {k: json.dumps(v) for k, v in values.items()}


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
