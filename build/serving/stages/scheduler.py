"""The `preprocessing` model's scheduling, apart from Triton: admission, and each admitted batch's flow. A batch is
prepared by the component, its requests that need no vision encoder (all images in the visual cache, text only,
refused) are answered at once, and its images the cache did not hold go to the vision encoder as one encode (each
image once: a popular one may be in a batch twice before its first encode is cached). An image another batch is
encoding now is joined, not encoded again. While a batch waits for its encode, the next ones are prepared and
answered: a hit never waits for another request's miss.

The Triton adapter (triton_adapters.PreprocessingModel) injects how a request is read, encoded and answered and
where the counts go. Its stub runs the coroutine that admit returns on an event loop of its own and hands the
instance its next batch at once, with no bound on the coroutines (python_backend r24.10 and r26.04
src/pb_stub.cc ProcessRequests, RunCoroutine in background), so Triton's queue bound no longer holds requests back:
admit therefore runs on the stub's own thread and refuses a request beyond the cap at once with the dynamic
batcher's own message (interface.QUEUE_FULL). Each request gets exactly one answer whatever is raised: the stub
only logs an exception that a coroutine raises.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from typing import Any, Generic, TypeVar

import torch

from ...errors import Qwen3VLTrtError, StageError
from .. import interface
from . import metrics as stage_metrics
from .preprocessing import Arrays, Prepared, Preprocessing, VisualFeatures
from .vision_pool import VisionPool

Result = Mapping[str, Any] | Exception  # a request's output tensors, or the error to answer it with
Rows = torch.Tensor | Exception  # an image's prompt-table rows, or why it has none
R = TypeVar("R")  # the adapter's handle of a request
_log = logging.getLogger(__name__)


class PreprocessingScheduler(Generic[R]):
    """Admits and serves the batches of one preprocessing model instance (see the module's docstring)."""

    def __init__(
        self,
        component: Preprocessing,
        *,
        read: Callable[[R], Arrays],
        encode: Callable[[dict[str, Any], bool], Awaitable[Rows]],
        answer: Callable[[R, Result], None],
        metrics: stage_metrics.MetricSink,
        published: Callable[[], None],
        in_flight_limit: int | None,
        warm_up: Callable[[R], bool] = lambda _request: False,
        pool: VisionPool | None = None,
    ):
        """read: a request's input tensors. encode: the vision encoder's prompt table for one
        component.vision_request (told whether it holds warm-up requests' images alone), or the error it answered.
        answer: sends a request its one final response.
        published: called once a batch is prepared and once its encodes are answered, for the adapter to publish
        what it counts elsewhere (the visual cache's events). in_flight_limit: requests admitted and not yet
        answered at most (backpressure.BackPressure.preprocessing_in_flight); None admits every request. warm_up:
        whether a request is one of serve's warm-up requests (interface.is_warmup), which the metrics do not count and
        whose images the visual cache neither looks up nor keeps. pool: the vision pool that decodes and encodes the
        images and videos the component left undecoded for it (component.pooled), and whose fallback says what
        happens when it does not answer."""
        self.component = component
        self._read = read
        self._warm_up = warm_up
        self._encode_request = encode
        self._reply = answer
        self._metrics = metrics
        self._published = published
        self.in_flight_limit = in_flight_limit
        self.pool = pool
        # What outlives a request: the count admission reads, and the encodes later batches join.
        self.in_flight = 0  # requests admitted and not yet answered
        self._in_flight_lock = threading.Lock()  # admit runs on the stub's thread, the loop's thread answers
        # Images being encoded now, by digest: a later batch's request for one waits for it (on the loop's thread).
        self.encoding: dict[bytes, asyncio.Future[Rows]] = {}

    def admit(self, requests: Sequence[R]) -> Coroutine[Any, Any, None]:
        """On the stub's thread: refuses at once the requests beyond the cap; the coroutine that serves the others."""
        with self._in_flight_lock:
            room = len(requests) if self.in_flight_limit is None else max(0, self.in_flight_limit - self.in_flight)
            admitted = min(room, len(requests))
            self.in_flight += admitted
        refusal = StageError(f"{interface.QUEUE_FULL} of preprocessing: {self.in_flight_limit} requests in flight")
        for request in requests[admitted:]:
            self._answer(request, refusal)
        return self._serve(requests[:admitted])

    async def _serve(self, requests: Sequence[R]) -> None:
        answered: set[int] = set()

        def answer(i: int, result: Result) -> None:
            answered.add(i)
            self._answer(requests[i], result)
            with self._in_flight_lock:
                self.in_flight -= 1

        failure = StageError("preprocessing stopped before answering")  # cancelled: the stub is ending
        try:
            await self._batch(requests, answer)
        except Exception as e:  # a bug or a failed transfer: still one final response per request
            _log.exception("preprocessing failed a batch")
            failure = StageError(f"preprocessing failed: {type(e).__name__}: {e}")
        finally:
            for i in range(len(requests)):
                if i not in answered:
                    answer(i, failure)

    async def _batch(self, requests: Sequence[R], answer: Callable[[int, Result], None]) -> None:
        if self.component.pre.device.type == "cuda":
            # The event loop's thread: the component's CUDA work and BLS tensors' proxy streams go to the current
            # device, and the backend sets none (python_backend r26.04 src/stub_launcher.cc).
            torch.cuda.set_device(self.component.pre.device)
        started = time.perf_counter()
        warm_up = {i for i, r in enumerate(requests) if self._warm_up(r)}
        try:
            outcomes: list[Prepared | Exception] = self.component.execute(
                [self._read(r) for r in requests], encoding=self.encoding.keys(), uncached=warm_up
            )
        except Qwen3VLTrtError as e:
            outcomes = [e] * len(requests)
        if len(warm_up) < len(requests):
            self._metrics.observe(stage_metrics.PREPROCESS_SECONDS, time.perf_counter() - started)
        waiting: list[tuple[int, Prepared]] = []
        for i, outcome in enumerate(outcomes):
            if isinstance(outcome, Prepared) and outcome.pending:
                waiting.append((i, outcome))
            else:
                answer(i, outcome if isinstance(outcome, Exception) else self._finish(outcome, {}))
        self._published()
        if not waiting:
            return
        # No await since execute: the images it left to earlier batches are still in self.encoding.
        counted = [image for i, outcome in waiting if i not in warm_up for image in outcome.pending]
        rows = await self._rows(
            [image for _, outcome in waiting for image in outcome.pending], counted, len(warm_up) == len(requests)
        )
        encoded = {digest: r for digest, r in rows.items() if isinstance(r, torch.Tensor)}
        for i, outcome in waiting:
            failed = next((rows[image.digest] for image in outcome.pending if image.digest not in encoded), None)
            answer(i, failed if isinstance(failed, Exception) else self._finish(outcome, encoded))
        self._published()

    async def _rows(
        self, images: Sequence[VisualFeatures], counted: Sequence[VisualFeatures], warm_up: bool
    ) -> dict[bytes, Rows]:
        """The prompt-table rows of a batch's pending images, by digest: those it decoded go to the vision encoder
        as one encode, each image once; those an earlier batch is encoding now are waited for. `counted`: the images
        the metrics count (not warm-up requests'); `warm_up`: the batch is warm-up requests alone."""
        own = {image.digest: image for image in images if image.encodes}
        joined = {image.digest: self.encoding[image.digest] for image in images if image.digest not in own}
        decoded = Counter(image.kind for image in counted if image.vision_inputs is not None)
        self._metrics.add(stage_metrics.IMAGES_DECODED, decoded["image"])
        self._metrics.add(stage_metrics.VIDEOS_DECODED, decoded["video"])
        pooled = sum(1 for image in counted if image.source is not None)
        self._metrics.add(stage_metrics.ENCODES_JOINED, len(counted) - decoded.total() - pooled)
        loop = asyncio.get_running_loop()
        mine = {digest: loop.create_future() for digest in own}
        self.encoding.update(mine)
        try:
            if own:
                encoded = await self._encode(list(own.values()), warm_up)
                for digest, future in mine.items():
                    future.set_result(encoded if isinstance(encoded, Exception) else encoded[digest])
        finally:
            for digest, future in mine.items():
                del self.encoding[digest]
                if not future.done():
                    future.set_result(StageError("preprocessing failed while encoding this image"))
        return {digest: future.result() for digest, future in mine.items()} | {
            # Shielded: a joining batch cancelled (the stub ending) must not cancel the encode another batch owns.
            digest: await asyncio.shield(future)
            for digest, future in joined.items()
        }

    async def _encode(self, images: Sequence[VisualFeatures], warm_up: bool) -> dict[bytes, torch.Tensor] | Exception:
        """The images' prompt-table rows by digest: those decoded here from one vision encoder request, those left
        for the pool from one pool request (decoded here and encoded with the others when it does not answer and
        the fallback is local), or the first error answered."""
        local = [image for image in images if image.vision_inputs is not None]
        remote = [image for image in images if image.vision_inputs is None]
        rows: dict[bytes, torch.Tensor] = {}
        try:
            if remote:
                pooled = await self._pooled(remote, warm_up)
                if isinstance(pooled, Exception):
                    assert self.pool is not None
                    if self.pool.fallback != "local":
                        return pooled
                    _log.warning("%s; encoding %d images and videos here", pooled, len(remote))
                    local += self.component.decode(remote)
                    if not warm_up:
                        kinds = Counter(image.kind for image in remote)
                        self._metrics.add(stage_metrics.VISION_POOL_FALLBACKS, len(remote))
                        self._metrics.add(stage_metrics.IMAGES_DECODED, kinds["image"])
                        self._metrics.add(stage_metrics.VIDEOS_DECODED, kinds["video"])
                else:
                    rows.update(pooled)
            if local:
                table = await self._encode_request(self.component.vision_request(local), warm_up)
                if isinstance(table, Exception):
                    return table
                rows.update(self.component.split_rows(table, local))
        except Qwen3VLTrtError as e:
            return e
        return rows

    async def _pooled(self, images: Sequence[VisualFeatures], warm_up: bool) -> dict[bytes, torch.Tensor] | Exception:
        """The rows pool members answer for images left undecoded, by digest (their requests sent at once, each to
        a member of its own where there are several), or why one did not."""
        if self.pool is None:
            return StageError("images were left undecoded for a vision pool this replica does not have")
        pool = self.pool
        requests = self.component.pool_requests(images)
        tables = await asyncio.gather(*(pool.table(request, warm_up) for request, _ in requests))
        rows: dict[bytes, torch.Tensor] = {}
        for table, (_, ordered) in zip(tables, requests, strict=True):
            if isinstance(table, Exception):
                return table
            rows.update(self.component.split_rows(table.to(self.component.table.dtype), ordered))
        if not warm_up:
            self._metrics.add(stage_metrics.VISION_POOL_ENCODES, len(images))
        return rows

    def _finish(self, prepared: Prepared, rows: Mapping[bytes, torch.Tensor]) -> Result:
        try:
            return self.component.finish(prepared, rows)
        except Qwen3VLTrtError as e:
            return e

    def _answer(self, request: R, result: Result) -> None:
        """Sends a request its one final response; when a result cannot be sent (its conversion failed), its error
        instead; when that cannot be sent either, nothing more can be done for the request."""
        try:
            self._reply(request, result)
        except Exception as e:
            _log.exception("preprocessing could not answer a request")
            if not isinstance(result, Exception):
                self._answer(request, StageError(f"preprocessing could not answer: {type(e).__name__}: {e}"))
