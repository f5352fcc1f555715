"""The preprocessing model's scheduling without tritonserver: admission, joining an image another batch is
encoding, a failed encode failing only the requests that need it, one answer per request whatever raises, and
warm-up requests kept out of the metrics and the visual cache; a real component over the tiny checkpoint, a vision
encoder the test holds and fails at will."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import pytest
import torch
from deployment import LIMITS
from images import jpeg
from qwen3vl_trt.errors import StageError
from qwen3vl_trt.serving import interface
from qwen3vl_trt.serving.request import GenerationRequest
from qwen3vl_trt.serving.stages import metrics as stage_metrics
from qwen3vl_trt.serving.stages.preprocessing import Preprocessing
from qwen3vl_trt.serving.stages.scheduler import PreprocessingScheduler, Result
from qwen3vl_trt.serving.stages.visual_cache import Event, FeatureScope, MemoryStore, VisualCache

TABLE = interface.PROMPT_TABLE.name


@pytest.fixture(scope="module")
def component(checkpoints):
    return Preprocessing(checkpoints["dense"], LIMITS, torch.float32, 64)


class Request:
    def __init__(self, name: str, image: bytes | None = None, warm_up: bool = False):
        self.name = name
        self.warm_up = warm_up
        images = () if image is None else (image,)
        self.inputs: dict[str, Any] = GenerationRequest(
            prompt="What is it?", max_tokens=4, images=images
        ).named_inputs()


class Encoder:
    """The vision encoder: each call's prompt table is random rows, answered once the test opens the gate; the
    calls named in `fail` answer an error, or a table a row short, or raise."""

    def __init__(self, component: Preprocessing, fail: dict[int, str] | None = None):
        self.component = component
        self.fail = fail or {}
        self.calls: list[int] = []  # the visual tokens of each call
        self.warm_up: list[bool] = []  # whether each call was marked as warm-up requests' alone
        self.gate: asyncio.Event | None = None

    async def __call__(self, inputs: dict[str, Any], warm_up: bool) -> torch.Tensor | Exception:
        call = len(self.calls)
        self.calls.append(int(inputs[interface.VISUAL_TOKEN_COUNT.name][0]))
        self.warm_up.append(warm_up)
        if self.gate is not None:
            await self.gate.wait()
        rows = torch.randn(self.component.table.shape(self.calls[-1]), generator=torch.Generator().manual_seed(call))
        failure = self.fail.get(call)
        if failure == "error":
            return StageError("the vision encoder failed: out of memory")
        if failure == "rows":
            return rows[1:]
        if failure == "raise":
            raise RuntimeError("the transfer failed")
        return rows

    async def entered(self, calls: int) -> None:
        while len(self.calls) < calls:
            await asyncio.sleep(0)


class Observer:
    def __init__(self) -> None:
        self.added: Counter[str] = Counter()
        self.observed: Counter[str] = Counter()

    def add(self, metric: stage_metrics.Metric, value: float) -> None:
        self.added[metric.name] += value

    def observe(self, metric: stage_metrics.Metric, value: float) -> None:
        self.observed[metric.name] += 1


class Harness:
    """A scheduler over the component, with every answer recorded by request name; the requests named in
    `unreadable` cannot be read, the results (not errors) of those in `unsendable` cannot be sent."""

    def __init__(self, component: Preprocessing, encoder: Encoder, in_flight_limit: int | None = None):
        self.answers: list[tuple[str, Result]] = []
        self.metrics = Observer()
        self.published = 0
        self.unreadable: set[str] = set()
        self.unsendable: set[str] = set()
        self.scheduler = PreprocessingScheduler[Request](
            component,
            read=self._read,
            encode=encoder,
            answer=self._answer,
            metrics=self.metrics,
            published=self._published,
            in_flight_limit=in_flight_limit,
            warm_up=lambda request: request.warm_up,
        )

    def _read(self, request: Request) -> dict[str, Any]:
        if request.name in self.unreadable:
            raise KeyError("a tensor the config declares is missing")
        return request.inputs

    def _answer(self, request: Request, result: Result) -> None:
        if request.name in self.unsendable and not isinstance(result, Exception):
            raise TypeError("this result cannot be sent")
        self.answers.append((request.name, result))

    def _published(self) -> None:
        self.published += 1

    def answered(self) -> dict[str, Result]:
        """Each request's one answer."""
        names = Counter(name for name, _ in self.answers)
        assert all(count == 1 for count in names.values()), names
        return dict(self.answers)

    def assert_idle(self) -> None:
        """Nothing of a finished request stays with the scheduler."""
        assert self.scheduler.in_flight == 0 and self.scheduler.encoding == {}


def _two_batches(harness: Harness, encoder: Encoder, first: list[Request], second: list[Request]) -> None:
    """Serves `first`, then `second` while first's encode is held, then lets the encodes answer."""

    async def run() -> None:
        encoder.gate = asyncio.Event()
        serving = asyncio.ensure_future(harness.scheduler.admit(first))
        await encoder.entered(1)
        joining = asyncio.ensure_future(harness.scheduler.admit(second))
        await asyncio.sleep(0)
        encoder.gate.set()
        await asyncio.gather(serving, joining)

    asyncio.run(run())


def test_admission_refuses_beyond_the_cap_at_once_and_admits_again_after_answers(component):
    harness = Harness(component, Encoder(component), in_flight_limit=2)
    serving = harness.scheduler.admit([Request("t1"), Request("t2"), Request("t3")])
    (refused,) = harness.answers  # before the batch is served: on the stub's thread
    assert refused[0] == "t3" and isinstance(refused[1], StageError) and interface.QUEUE_FULL in str(refused[1])
    assert harness.scheduler.in_flight == 2
    asyncio.run(harness.scheduler.admit([Request("t4")]))
    assert harness.answers[-1][0] == "t4" and isinstance(harness.answers[-1][1], StageError)
    asyncio.run(serving)
    answered = harness.answered()
    assert all(TABLE in answered[name] for name in ("t1", "t2"))
    harness.assert_idle()
    asyncio.run(harness.scheduler.admit([Request("t5")]))
    assert TABLE in harness.answered()["t5"]
    assert harness.metrics.added[stage_metrics.IMAGES_DECODED.name] == 0
    harness.assert_idle()


def test_an_image_another_batch_is_encoding_is_joined_not_encoded_again(component):
    encoder = Encoder(component)
    harness = Harness(component, encoder)
    image = jpeg(128, 128, seed=3)
    before = dict(vars(component))
    _two_batches(harness, encoder, [Request("first", image)], [Request("joining", image), Request("text")])
    answered = harness.answered()
    assert len(encoder.calls) == 1
    first, joining = answered["first"], answered["joining"]
    assert isinstance(first, dict) and isinstance(joining, dict) and TABLE in answered["text"]
    assert torch.equal(first[TABLE], joining[TABLE])
    assert harness.metrics.added[stage_metrics.IMAGES_DECODED.name] == 1
    assert harness.metrics.added[stage_metrics.ENCODES_JOINED.name] == 1
    assert harness.metrics.observed[stage_metrics.PREPROCESS_SECONDS.name] == 2 and harness.published == 4
    harness.assert_idle()
    assert [name for name, value in vars(component).items() if value is not before.get(name)] == []


@pytest.mark.parametrize("failure", ["error", "rows"])
def test_a_failed_encode_fails_only_the_requests_that_need_its_image(component, failure):
    encoder = Encoder(component, fail={0: failure})
    harness = Harness(component, encoder)
    failing, other = jpeg(128, 128, seed=4), jpeg(128, 96, seed=5)
    second = [Request("joining", failing), Request("other", other), Request("text")]
    _two_batches(harness, encoder, [Request("first", failing)], second)
    answered = harness.answered()
    assert len(encoder.calls) == 2  # the failing image once, the other image once
    assert isinstance(answered["first"], StageError) and str(answered["joining"]) == str(answered["first"])
    assert TABLE in answered["other"] and TABLE in answered["text"]
    harness.assert_idle()


@pytest.mark.parametrize(
    ("where", "succeeding"),
    [("read", {"first"}), ("encode", {"text"}), ("finish", set()), ("answer", {"first", "joining"})],
)
def test_whatever_raises_every_request_gets_exactly_one_answer(component, monkeypatch, where, succeeding):
    encoder = Encoder(component, fail={0: "raise"} if where == "encode" else None)
    harness = Harness(component, encoder)
    image = jpeg(128, 128, seed=6)
    if where == "read":
        harness.unreadable.add("text")  # its batch fails; the other goes on
    if where == "answer":
        harness.unsendable.add("text")  # it gets its error instead
    if where == "finish":

        def finish(*_: Any) -> None:
            raise RuntimeError("a bug")

        monkeypatch.setattr(component, "finish", finish)
    _two_batches(harness, encoder, [Request("first", image)], [Request("joining", image), Request("text")])
    answered = harness.answered()
    assert set(answered) == {"first", "joining", "text"}
    assert {name for name, result in answered.items() if not isinstance(result, Exception)} == succeeding
    harness.assert_idle()


def test_warm_up_requests_stay_out_of_the_metrics_and_the_visual_cache(component, monkeypatch):
    """serve's warm-up requests (interface.is_warmup) run every step, but their images are neither looked up in nor
    stored into the visual cache, and the metrics count only the other requests of their batch."""
    events: Counter[Event] = Counter()
    cache = VisualCache(MemoryStore(1 << 24), FeatureScope.of({"test": "warm-up"}), lambda e, n: events.update({e: n}))
    monkeypatch.setattr(component, "cache", cache)
    encoder = Encoder(component)
    harness = Harness(component, encoder)
    warm, real = jpeg(128, 128, seed=7), jpeg(96, 128, seed=8)

    asyncio.run(harness.scheduler.admit([Request("warm", warm, warm_up=True), Request("real", real)]))
    assert all(TABLE in answer for answer in harness.answered().values())
    assert encoder.warm_up == [False]  # one encode of both images, not warm-up requests' alone
    assert harness.metrics.added[stage_metrics.IMAGES_DECODED.name] == 1  # the real request's image
    assert (events[Event.MISS], events[Event.STORE]) == (1, 1)  # the real image alone looked up, then stored
    assert harness.metrics.observed[stage_metrics.PREPROCESS_SECONDS.name] == 1

    asyncio.run(harness.scheduler.admit([Request("warm again", real, warm_up=True)]))
    assert TABLE in harness.answered()["warm again"]
    assert encoder.warm_up == [False, True]  # decoded and encoded again: the cache was not asked
    assert (events[Event.HIT], events[Event.MISS]) == (0, 1)
    assert harness.metrics.added[stage_metrics.IMAGES_DECODED.name] == 1
    assert harness.metrics.observed[stage_metrics.PREPROCESS_SECONDS.name] == 1

    asyncio.run(harness.scheduler.admit([Request("after", warm)]))
    assert TABLE in harness.answered()["after"]
    assert (events[Event.HIT], events[Event.MISS], events[Event.STORE]) == (0, 2, 2)  # the warm-up image was not kept
    harness.assert_idle()


class Pool:
    """A vision pool: answers each request's rows (random, as many as its images take), or the error it is told."""

    def __init__(self, component: Preprocessing, fallback: str, failure: Exception | None = None):
        self.component, self.fallback, self.failure = component, fallback, failure
        self.sent: list[GenerationRequest] = []

    async def table(self, request: GenerationRequest, warm_up: bool) -> torch.Tensor | Exception:
        self.sent.append(request)
        if self.failure is not None:
            return self.failure
        made = self.component.pre.batch([{"messages": request.chat()}])[0]
        tokens = sum(int(item.grid_thw.prod()) // 4 for item in made.visual)
        return torch.randn(self.component.table.shape(tokens))


@pytest.mark.parametrize("fallback", ["local", "fail"])
@pytest.mark.parametrize("answers", [True, False], ids=["pool answers", "pool down"])
def test_a_pooled_replica_sends_its_misses_to_the_pool_and_falls_back_as_told(checkpoints, answers, fallback):
    """With a vision pool, an image the cache does not hold is sent to the pool undecoded; a pool that does not
    answer makes the replica decode and encode it here (local), or fails the image's request alone (fail)."""
    pooled = Preprocessing(checkpoints["dense"], LIMITS, torch.float32, 64)
    pooled.pooled = True
    encoder = Encoder(pooled)
    harness = Harness(pooled, encoder)
    down = StageError("the vision pool pool-0:8101 did not answer: pool-0:8101 is unavailable")
    pool = Pool(pooled, fallback, None if answers else down)
    harness.scheduler.pool = pool  # type: ignore[assignment]
    asyncio.run(harness.scheduler.admit([Request("image", jpeg(96, 64, seed=5)), Request("text")]))
    answered = harness.answered()
    assert TABLE in answered["text"] and len(pool.sent) == 1 and len(pool.sent[0].images) == 1
    added = harness.metrics.added
    if answers:
        assert TABLE in answered["image"] and encoder.calls == []
        assert added[stage_metrics.VISION_POOL_ENCODES.name] == 1 and added[stage_metrics.IMAGES_DECODED.name] == 0
    elif fallback == "local":
        assert TABLE in answered["image"] and len(encoder.calls) == 1
        assert added[stage_metrics.VISION_POOL_FALLBACKS.name] == 1 and added[stage_metrics.IMAGES_DECODED.name] == 1
    else:
        assert answered["image"] is down and encoder.calls == []
    harness.assert_idle()
