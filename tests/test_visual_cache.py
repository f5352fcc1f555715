"""The visual-feature cache: entries checked on read, the in-process LRU, a real redis-server shared by two
real tritonserver replicas, Redis killed and back, and entries overwritten with garbage or another model's.
Every served result is compared with an uncached deployment's (the same repository served with the cache off)."""

from __future__ import annotations

import time

import pytest
import torch
from deployment import LIMITS, build_cpu_repository
from images import jpeg
from qwen3vl_trt.llm.inputs import visual_digest
from qwen3vl_trt.preprocess import Preprocessor
from qwen3vl_trt.qa.redis_server import RedisServer
from qwen3vl_trt.serving import interface
from qwen3vl_trt.serving.client import Client
from qwen3vl_trt.serving.parameters import PreprocessingParameters
from qwen3vl_trt.serving.ports import free_ports
from qwen3vl_trt.serving.repository import model_config as serving_config
from qwen3vl_trt.serving.repository.settings import RepositorySettings
from qwen3vl_trt.serving.request import GenerationRequest
from qwen3vl_trt.serving.server.tritonserver import TritonServer
from qwen3vl_trt.serving.stages import metrics as stage_metrics
from qwen3vl_trt.serving.stages.preprocessing import Preprocessing
from qwen3vl_trt.serving.stages.visual_cache import (
    MOST_BACKOFF_S,
    REDIS_TIMEOUT_S,
    Event,
    FeatureScope,
    MemoryStore,
    RedisStore,
    RejectedEntry,
    VisualCache,
    decode_entry,
    encode_entry,
)
from videos import clip

SCOPE = FeatureScope.of({"model": "a"})
DIGEST = bytes(range(16))
GRID = (1, 4, 6)


def _rows(dtype: torch.dtype = torch.float32, rows: int = 24, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, 8, generator=torch.Generator().manual_seed(seed)).to(dtype)


class Counts:
    def __init__(self) -> None:
        self.events: dict[Event, int] = {}

    def __call__(self, event: Event, count: int) -> None:
        self.events[event] = self.events.get(event, 0) + count

    def __getitem__(self, event: Event) -> int:
        return self.events.get(event, 0)


# -- entries -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_an_entry_reads_back_bit_identical(dtype):
    rows = _rows(dtype)
    read = decode_entry(encode_entry(SCOPE, DIGEST, GRID, rows), SCOPE, DIGEST, GRID, tuple(rows.shape), dtype)
    assert read.dtype == dtype and torch.equal(read.view(torch.uint8), rows.view(torch.uint8))


def test_an_entry_that_is_not_this_deployments_is_rejected():
    rows = _rows()
    entry = encode_entry(SCOPE, DIGEST, GRID, rows)
    shape = tuple(rows.shape)
    flipped = bytearray(entry)
    flipped[-3] ^= 0x40
    cases = {
        "not a feature entry": b"garbage" * 40,
        "shorter than the header": entry[:20],
        "another model": entry,  # read with another scope below
        "another image": entry,
        "grid": entry,
        "dtype": entry,
        "checksum": bytes(flipped),
        "bytes of rows": entry[:-4],
    }
    reads = {
        "another model": dict(scope=FeatureScope.of({"model": "b"})),
        "another image": dict(digest=bytes(16)),
        "grid": dict(grid=(1, 6, 4)),
        "dtype": dict(dtype=torch.float16),
    }
    for reason, data in cases.items():
        read = {"scope": SCOPE, "digest": DIGEST, "grid": GRID, "dtype": torch.float32, **reads.get(reason, {})}
        with pytest.raises(RejectedEntry, match=reason):
            decode_entry(data, read["scope"], read["digest"], read["grid"], shape, read["dtype"])


# -- the in-process store ------------------------------------------------------------------------------------


def test_the_memory_store_evicts_the_least_recently_used_within_its_budget():
    counts = Counts()
    store = MemoryStore(budget_bytes=300, on_evict=lambda n: counts(Event.EVICTION, n))
    for key in "abc":
        store.put(key, bytes(100))
    assert store.get_many(["a"]) == [bytes(100)]  # a is now the most recent
    store.put("d", bytes(100))
    assert store.get_many(["a", "b", "c", "d"]) == [bytes(100), None, bytes(100), bytes(100)]
    assert store.bytes == 300 and counts[Event.EVICTION] == 1
    store.put("huge", bytes(301))  # larger than the whole budget: not kept, nothing evicted for it
    assert store.get_many(["huge"]) == [None] and counts[Event.EVICTION] == 1


def test_a_cache_counts_misses_stores_hits_and_drops_a_rejected_entry():
    counts = Counts()
    store = MemoryStore(1 << 20)
    cache = VisualCache(store, SCOPE, counts)
    rows = _rows()
    wanted = [(DIGEST, GRID, tuple(rows.shape))]
    assert cache.lookup(wanted, torch.float32) == [None]
    cache.put(DIGEST, GRID, rows)
    (hit,) = cache.lookup(wanted, torch.float32)
    assert hit is not None and torch.equal(hit, rows)
    store.put(SCOPE.key(DIGEST), b"garbage" * 40)
    assert cache.lookup(wanted, torch.float32) == [None]
    assert store.get_many([SCOPE.key(DIGEST)]) == [None]  # dropped
    assert (counts[Event.MISS], counts[Event.STORE], counts[Event.HIT], counts[Event.REJECTED]) == (2, 1, 1, 1)


# -- Redis ---------------------------------------------------------------------------------------------------


@pytest.fixture
def redis_server(tmp_path):
    with RedisServer(tmp_path / "redis") as server:
        yield server


def _wait_for(condition, within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_replicas_share_entries_through_redis_and_go_on_without_it(redis_server):
    rows = _rows(torch.bfloat16)
    wanted = [(DIGEST, GRID, tuple(rows.shape))]
    writer_counts, reader_counts = Counts(), Counts()
    writer = VisualCache(RedisStore(redis_server.url), SCOPE, writer_counts, background_stores=True)
    reader = VisualCache(RedisStore(redis_server.url), SCOPE, reader_counts)
    writer.put(DIGEST, GRID, rows)
    _wait_for(lambda: writer_counts[Event.STORE] == 1)  # stored by the writer thread
    (shared,) = reader.lookup(wanted, torch.bfloat16)
    assert shared is not None and torch.equal(shared.view(torch.uint8), rows.view(torch.uint8))
    assert redis_server.client().ttl(SCOPE.key(DIGEST)) > 0

    redis_server.kill()
    started = time.monotonic()
    assert reader.lookup(wanted, torch.bfloat16) == [None]  # a miss, not an error
    assert time.monotonic() - started < 4 * REDIS_TIMEOUT_S + 1.0
    assert reader_counts[Event.BACKEND_ERROR] == 1 and reader.bypassed
    started = time.monotonic()
    assert reader.lookup(wanted, torch.bfloat16) == [None]  # bypassed: Redis is not even asked
    assert time.monotonic() - started < 0.05 and reader_counts[Event.BACKEND_ERROR] == 1

    redis_server.start()  # back, empty
    deadline = time.monotonic() + MOST_BACKOFF_S + 5
    while reader.lookup(wanted, torch.bfloat16) == [None] and reader.bypassed:  # asked again after the backoff
        assert time.monotonic() < deadline, "the cache did not use Redis again"
        time.sleep(0.2)
    assert not reader.bypassed
    writer.put(DIGEST, GRID, rows)
    _wait_for(lambda: reader.lookup(wanted, torch.bfloat16)[0] is not None)
    writer.close()
    reader.close()


def test_a_full_redis_refuses_stores_and_still_answers_lookups(tmp_path):
    with RedisServer(tmp_path / "redis", maxmemory_bytes=2 << 20, policy="noeviction") as server:
        counts = Counts()
        cache = VisualCache(RedisStore(server.url), SCOPE, counts)
        rows = _rows(rows=64 * 1024)  # 2 MiB of float32 rows
        cache.put(DIGEST, GRID[:2] + (64 * 1024 // 4,), rows)
        assert counts[Event.BACKEND_ERROR] == 1 and counts[Event.STORE] == 0 and not cache.bypassed
        assert cache.lookup([(DIGEST, GRID, (24, 8))], torch.float32) == [None]
        assert counts[Event.BACKEND_ERROR] == 1 and counts[Event.MISS] == 1
        cache.close()


# -- served: real tritonservers ------------------------------------------------------------------------------

PROMPTS = ("Describe this picture.", "What colour is it mostly?")


@pytest.fixture(scope="module")
def repo(checkpoints, tmp_path_factory):
    """A repository as build writes it by default (the in-process cache)."""
    return build_cpu_repository(checkpoints["dense"], tmp_path_factory.mktemp("cache"), RepositorySettings())


def _server(repo, name: str, visual_cache: str | None = None) -> TritonServer:
    server = TritonServer(repo, free_ports(), log_path=repo.parent / f"{name}.log", visual_cache=visual_cache)
    server.start()
    server.wait_ready()
    return server


@pytest.fixture(scope="module")
def uncached(repo):
    server = _server(repo, "uncached", visual_cache="off")
    yield server
    server.stop()


def _answer(server: TritonServer, prompt: str, images: list[bytes], videos: list[bytes] = ()) -> list[int]:
    client = Client(server.url, timeout_s=120)
    try:
        return client.generate(prompt, images, max_tokens=6, videos=videos).token_ids
    finally:
        client.close()


def _vision_runs(server: TritonServer) -> int:
    client = Client(server.url)
    try:
        stats = client.grpc.get_inference_statistics(model_name=interface.VISION_ENCODER, as_json=True)
    finally:
        client.close()
    return int(stats["model_stats"][0].get("execution_count", 0))


class Observed:
    """A server's vision encoder executions (Triton's statistics) and preprocessing's metrics, before and after."""

    def __init__(self, server: TritonServer):
        self.server = server
        self.runs = _vision_runs(server)
        self.samples = stage_metrics.read(server.metrics_url)

    def vision_runs(self) -> int:
        return _vision_runs(self.server) - self.runs

    def counted(self, metric: stage_metrics.Metric) -> float:
        now = stage_metrics.read(self.server.metrics_url)
        key = (metric.name, interface.PREPROCESSING)
        return now.get(key, 0.0) - self.samples.get(key, 0.0)


@pytest.mark.slow
@pytest.mark.server
def test_a_repeated_image_is_neither_decoded_nor_encoded_and_answers_as_uncached(repo, uncached):
    cached = _server(repo, "memory")
    try:
        photo, other = jpeg(256, 320, seed=71), jpeg(224, 224, seed=72)
        first = _answer(cached, PROMPTS[0], [photo])
        seen = Observed(cached)
        again = _answer(cached, PROMPTS[1], [photo])  # another request, another prompt
        assert seen.vision_runs() == 0, "the vision encoder ran for an image the cache held"
        assert seen.counted(stage_metrics.IMAGES_DECODED) == 0
        assert seen.counted(stage_metrics.VISUAL_CACHE_HITS) == 1
        assert seen.counted(stage_metrics.VISUAL_CACHE_MISSES) == 0
        assert [first, again] == [_answer(uncached, prompt, [photo]) for prompt in PROMPTS]

        seen = Observed(cached)
        mixed = _answer(cached, "Compare them.", [other, photo])  # one new image, one held
        assert seen.vision_runs() == 1 and seen.counted(stage_metrics.IMAGES_DECODED) == 1
        assert seen.counted(stage_metrics.VISUAL_CACHE_HITS) == 1
        assert seen.counted(stage_metrics.VISUAL_CACHE_STORES) == 1
        assert mixed == _answer(uncached, "Compare them.", [other, photo])

        video = clip("h264 3 s 10 fps", seed=4)
        first = _answer(cached, PROMPTS[0], [], [video])
        seen = Observed(cached)
        again = _answer(cached, PROMPTS[1], [], [video])  # a video is keyed by its bytes and sampled grid too
        assert seen.vision_runs() == 0 and seen.counted(stage_metrics.VIDEOS_DECODED) == 0
        assert seen.counted(stage_metrics.VISUAL_CACHE_HITS) == 1
        assert [first, again] == [_answer(uncached, prompt, [], [video]) for prompt in PROMPTS]
    finally:
        cached.stop()


@pytest.fixture(scope="module")
def shared(repo, tmp_path_factory):
    """Two replicas of the repository sharing one redis-server (serve --visual-cache redis://...)."""
    redis_server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    replicas = [_server(repo, f"replica{i}", visual_cache=redis_server.url) for i in range(2)]
    yield redis_server, replicas
    for replica in replicas:
        replica.stop()
    redis_server.stop()


def _stored_keys(redis_server: RedisServer) -> set[bytes]:
    client = redis_server.client()
    try:
        return set(client.scan_iter(match="qwen3vl:features:*"))
    finally:
        client.close()


@pytest.mark.slow
@pytest.mark.server
def test_an_image_encoded_through_one_replica_is_a_hit_on_the_other(shared, uncached):
    redis_server, (first, second) = shared
    photo = jpeg(288, 256, seed=81)
    before = _stored_keys(redis_server)
    answer = _answer(first, PROMPTS[0], [photo])
    _wait_for(lambda: len(_stored_keys(redis_server) - before) == 1)  # stored off the request's path
    seen = Observed(second)
    assert _answer(second, PROMPTS[1], [photo]) == _answer(uncached, PROMPTS[1], [photo])
    assert seen.vision_runs() == 0 and seen.counted(stage_metrics.IMAGES_DECODED) == 0
    assert seen.counted(stage_metrics.VISUAL_CACHE_HITS) == 1
    assert answer == _answer(uncached, PROMPTS[0], [photo])


@pytest.mark.slow
@pytest.mark.server
def test_requests_succeed_while_redis_is_down_and_the_cache_resumes_after(shared, uncached):
    redis_server, (replica, _) = shared
    photos = [jpeg(256, 256, seed=90 + i) for i in range(3)]
    redis_server.kill()
    seen = Observed(replica)
    answers = [_answer(replica, PROMPTS[0], [photo]) for photo in photos]
    assert answers == [_answer(uncached, PROMPTS[0], [photo]) for photo in photos]
    assert seen.counted(stage_metrics.VISUAL_CACHE_BACKEND_ERRORS) >= 1
    assert seen.counted(stage_metrics.IMAGES_DECODED) == len(photos)

    redis_server.start()  # back, empty
    photo = photos[0]
    deadline = time.monotonic() + 4 * MOST_BACKOFF_S + 30
    while True:  # once the backoff is over, a miss is stored and the next request hits
        seen = Observed(replica)
        assert _answer(replica, PROMPTS[1], [photo]) == _answer(uncached, PROMPTS[1], [photo])
        if seen.counted(stage_metrics.VISUAL_CACHE_HITS) == 1:
            break
        assert time.monotonic() < deadline, "the cache did not resume after Redis came back"
        time.sleep(1.0)


@pytest.mark.slow
@pytest.mark.server
def test_garbage_or_another_models_entry_is_rejected_and_recomputed(shared, uncached, checkpoints):
    redis_server, (first, second) = shared
    photo = jpeg(256, 288, seed=101)
    before = _stored_keys(redis_server)
    expected = _answer(uncached, PROMPTS[0], [photo])
    assert _answer(first, PROMPTS[0], [photo]) == expected
    _wait_for(lambda: len(_stored_keys(redis_server) - before) == 1)
    (key,) = _stored_keys(redis_server) - before

    # The key is the deployment's scope and the image's digest, as a Preprocessing component computes them.
    params = PreprocessingParameters.from_model_config(serving_config.read(first.repo / interface.PREPROCESSING))
    hidden_size = params.llm_hidden_size
    component = Preprocessing(checkpoints["dense"], LIMITS, torch.float32, hidden_size)
    scope = component.feature_scope(first.repo.parent / "vision", None)
    grid = Preprocessor.from_pretrained(checkpoints["dense"])(
        prompt="<|vision_start|><|image_pad|><|vision_end|>", images=[photo]
    ).image_grid_thw
    digest = visual_digest(grid[0], photo)
    assert key.decode() == scope.key(digest)
    client = redis_server.client()
    entry = client.get(key)
    for bad in (b"\x00garbage" * 100, _rescoped(entry, scope, FeatureScope.of({"another": "model"}))):
        client.set(key, bad)
        seen = Observed(second)
        assert _answer(second, PROMPTS[1], [photo]) == _answer(uncached, PROMPTS[1], [photo])
        assert seen.counted(stage_metrics.VISUAL_CACHE_REJECTED) == 1
        assert seen.vision_runs() == 1  # recomputed
        _wait_for(lambda bad=bad: client.get(key) not in (None, bad))  # and stored again
    client.close()


def _rescoped(entry: bytes, scope: FeatureScope, other: FeatureScope) -> bytes:
    """The entry as another model's deployment would have written it (its scope in the header)."""
    assert entry.count(scope.digest) == 1
    return entry.replace(scope.digest, other.digest)


def test_the_scope_tells_models_and_settings_apart(repo, checkpoints):
    vision = repo.parent / "vision"

    def scope(model: str = "dense", dtype: torch.dtype = torch.float32, hidden: int = 64) -> FeatureScope:
        return Preprocessing(checkpoints[model], LIMITS, dtype, hidden).feature_scope(vision, None)

    assert scope() == scope()  # another process of the same deployment: the same keys
    assert len({scope(), scope(dtype=torch.float16), scope(hidden=32)}) == 3
    resized = Preprocessing(checkpoints["dense"], LIMITS, torch.float32, 64)
    resized.pre.normalize.backend = "pil"
    assert resized.feature_scope(vision, None) != scope()


def test_an_image_an_earlier_batch_is_encoding_is_neither_looked_up_nor_decoded(checkpoints):
    component = Preprocessing(checkpoints["dense"], LIMITS, torch.float32, 64)
    counts = Counts()
    component.cache = VisualCache(MemoryStore(1 << 20), SCOPE, counts)
    request = GenerationRequest(prompt="What is it?", max_tokens=4, images=(jpeg(256, 256, seed=5),)).named_inputs()
    (first,) = component.execute([request])
    (image,) = first.visual
    assert first.to_encode == [image] and counts[Event.MISS] == 1
    (joined,) = component.execute([request], encoding={image.digest})
    assert joined.to_encode == [] and [i.digest for i in joined.pending] == [image.digest]
    assert counts[Event.MISS] == 1 and counts[Event.HIT] == 0  # not even looked up
    rows = torch.randn(component.table.shape(image.tokens))
    table = component.finish(joined, {image.digest: rows})[interface.PROMPT_TABLE.name]
    assert torch.equal(table, rows) and counts[Event.STORE] == 0  # the batch that encodes it stores it
    component.finish(first, {image.digest: rows})
    assert counts[Event.STORE] == 1
