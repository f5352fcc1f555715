"""The batch store on a real redis-server: a Redis that would lose batches is refused; a line's result is recorded
once however many runners race for it; an entry a dead runner held is claimed by another after the claim timeout,
and not before while its holder holds it; a Redis killed and started again from its append-only file keeps the
batches, the results and the work."""

from __future__ import annotations

import asyncio

import pytest
from qwen3vl_trt.qa.redis_server import RedisServer
from qwen3vl_trt.serving.gateway.batch.records import Batch, BatchRequestCounts
from qwen3vl_trt.serving.gateway.batch.store import BatchStore, BatchStoreError, now


def _batch(batch_id: str = "batch_1", total: int = 3) -> Batch:
    return Batch(id=batch_id, endpoint="/v1/chat/completions", input_file_id="file_1", completion_window="24h",
                 status="in_progress", created_at=now(), request_counts=BatchRequestCounts(total=total))  # fmt: skip


def test_a_redis_that_would_lose_batches_is_refused(tmp_path):
    async def check(url: str) -> None:
        store = BatchStore(url)
        try:
            await store.check()
        finally:
            await store.close()

    with RedisServer(tmp_path / "lru") as lru:
        for _ in range(2):  # and again: a refused start leaves nothing that lets the next one through
            lost = "appendonly no, appendfsync everysec, maxmemory-policy allkeys-lru"
            with pytest.raises(BatchStoreError, match=lost):
                asyncio.run(check(lru.url))
    with RedisServer(tmp_path / "kept", policy="noeviction", appendonly=True) as kept:
        asyncio.run(check(kept.url))
    with pytest.raises(BatchStoreError, match="cannot be reached"):
        asyncio.run(check("redis://127.0.0.1:1/0"))


def test_results_once_entries_claimed_from_the_dead_and_all_of_it_kept_across_a_restart(tmp_path):
    server = RedisServer(tmp_path / "redis", policy="noeviction", appendonly=True).start()
    try:

        async def before_restart() -> None:
            store = BatchStore(server.url)
            await store.check()
            await store.add_batch("key-a", _batch())
            # Ten runners race to record line 0: one wins, the count goes up once.
            won = await asyncio.gather(*(store.record("batch_1", 0, {"n": n}, "completed") for n in range(10)))
            assert sum(won) == 1
            await store.record("batch_1", 1, {"n": 0}, "failed")
            await store.enqueue("batch_1", [[(2, 0, 10)], [(3, 10, 10)]])
            await store.enqueue("batch_1", [[(2, 0, 10)], [(3, 10, 10)]])  # a validation done again: nothing more
            taken = await store.take("runner-a", claim_ms=60_000, block_ms=100)
            assert taken is not None and taken[2] == [[2, 0, 10]]
            # Held by runner-a: another runner gets the next entry, not this one.
            other = await store.take("runner-b", claim_ms=200, block_ms=100)
            assert other is not None and other[2] == [[3, 10, 10]]
            await store.done("batch_1", other[0])
            await store.hold("runner-a", taken[0])
            assert await store.take("runner-b", claim_ms=60_000, block_ms=100) is None
            await store.close()

        asyncio.run(before_restart())
        server.kill()  # as a crash: what the append-only file holds is what comes back
        server.start()

        async def after_restart() -> None:
            store = BatchStore(server.url)
            await store.check()
            found = await store.batch("batch_1", "key-a")
            assert found is not None
            counts = found[0].request_counts
            assert (counts.total, counts.completed, counts.failed) == (3, 1, 1)
            assert await store.batch("batch_1", "key-b") is None  # another key's
            assert set(await store.result_lines("batch_1")) == {0, 1}
            assert not await store.record("batch_1", 0, {"n": "again"}, "completed")
            assert await store.entries_left("batch_1") == 1
            # runner-a died holding its entry: another runner claims it once it has been idle past the timeout.
            await asyncio.sleep(0.3)
            claimed = await store.take("runner-c", claim_ms=200, block_ms=100)
            assert claimed is not None and claimed[2] == [[2, 0, 10]]
            await store.done("batch_1", claimed[0])
            assert await store.entries_left("batch_1") == 0
            await store.done("batch_1", claimed[0])  # given back twice: counted once
            assert await store.entries_left("batch_1") == 0
            await store.close()

        asyncio.run(after_restart())
    finally:
        server.stop()
